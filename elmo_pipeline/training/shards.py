"""Training shards: Parquet files of tokenized sentences plus a manifest JSON. Nothing pickles.

A prepared corpus is a folder (local or any fsspec URL):
    manifest.json          format, counts, how it was tokenized, and the list of shards
    vocab.json             the vocabulary with counts (`Vocabulary.to_json`)
    shard-00000-of-00004.parquet ...

Each shard holds one row per sentence (a window when a long sentence was cut):
    doc_id string, sentence_index int32, window_index int32,
    tokens list<string>   the words as tokenized (the char CNN reads these),
    ids    list<int32>    their ids in `vocab.json` (`<UNK>` = 2 for unknown words).
Rows inside a shard are sorted by (doc_id, sentence_index, window_index) and a sentence's
shard is a stable hash of that key, so the same input gives byte-identical shards whatever
the runner or the number of workers. Training reads one shard at a time.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_pipeline.filesystems import open_url, split_http_query, url_to_fs
from elmo_pipeline.formats.atomic import write_url_atomically
from elmo_pipeline.formats.files import CheckpointError, join_url, read_bytes
from elmo_pipeline.strict import ConfigError, dumps_strict, parse_json_strict
from elmo_pipeline.corpus.schema import open_parquet
from elmo_pipeline.model.vocabulary import Vocabulary

MANIFEST_FILE, VOCAB_FILE = "manifest.json", "vocab.json"
SHARDS_FORMAT, SHARDS_VERSION = "elmo-pipeline-shards", 1

SHARD_SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("sentence_index", pa.int32()),
    ("window_index", pa.int32()),
    ("tokens", pa.list_(pa.string())),
    ("ids", pa.list_(pa.int32())),
])


SHARD_NAME = re.compile(r"shard-\d{5,}-of-\d{5,}\.parquet")  # the names shard_name gives


def shard_name(index: int, count: int) -> str:
    """Five digits, or as many as `count` has: past 99,999 shards the names still sort by index and
    match SHARD_NAME (which --overwrite and a failed job's cleanup take a run's shards by)."""
    width = max(5, len(str(count)))
    return f"shard-{index:0{width}d}-of-{count:0{width}d}.parquet"


def shard_of(key: tuple[str, int, int], n_shards: int) -> int:
    """A stable shard for a sentence key (Python's hash() changes between processes)."""
    digest = hashlib.blake2b(f"{key[0]}\x00{key[1]}\x00{key[2]}".encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % n_shards


@dataclass
class ShardInfo:
    file: str
    sentences: int
    tokens: int


@dataclass
class Manifest:
    shards: list[ShardInfo]
    vocab_size: int
    tokenizer: str
    lang: str
    max_sentence_tokens: int
    min_count: int
    max_vocab_size: int | None
    unk_alias: str | None = None
    vocab_sha256: str = ""
    # how a blank Chinese pipeline segmented words (`describe_segmenter`); empty for any other
    segmentation: dict[str, str] = field(default_factory=dict)

    @property
    def sentences(self) -> int:
        return sum(s.sentences for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> str:
        return dumps_strict({
            "format": SHARDS_FORMAT, "format_version": SHARDS_VERSION,
            "sentences": self.sentences, "tokens": self.tokens, "vocab_size": self.vocab_size,
            "vocab_sha256": self.vocab_sha256, "tokenizer": self.tokenizer, "lang": self.lang,
            "max_sentence_tokens": self.max_sentence_tokens, "min_count": self.min_count,
            "max_vocab_size": self.max_vocab_size, "unk_alias": self.unk_alias, "segmentation": self.segmentation,
            "shards": [{"file": s.file, "sentences": s.sentences, "tokens": s.tokens} for s in self.shards],
        }, MANIFEST_FILE, indent=2, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "Manifest":
        raw = parse_json_strict(text, where)
        if not isinstance(raw, dict) or raw.get("format") != SHARDS_FORMAT:
            raise ConfigError(f"{where}: not an {SHARDS_FORMAT} manifest")
        if raw.get("format_version") != SHARDS_VERSION:
            raise ConfigError(f"{where}: format_version {raw.get('format_version')!r} is not supported")
        try:
            shards = [ShardInfo(str(s["file"]), int(s["sentences"]), int(s["tokens"])) for s in raw["shards"]]
            for s in shards:
                if "/" in s.file or s.file.startswith("."):
                    raise ConfigError(f"{where}: shard file {s.file!r} must be a plain name in the folder")
            return cls(
                shards=shards, vocab_size=int(raw["vocab_size"]), tokenizer=str(raw["tokenizer"]),
                lang=str(raw["lang"]), max_sentence_tokens=int(raw["max_sentence_tokens"]),
                min_count=int(raw["min_count"]), max_vocab_size=raw.get("max_vocab_size"),
                unk_alias=raw.get("unk_alias"), vocab_sha256=str(raw.get("vocab_sha256", "")),
                segmentation={str(k): str(v) for k, v in dict(raw.get("segmentation", {})).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{where}: malformed manifest ({exc!r})") from exc


def vocab_digest(vocab: Vocabulary) -> str:
    return hashlib.sha256("\n".join(vocab.tokens).encode("utf-8", "surrogatepass")).hexdigest()


# -- writing --------------------------------------------------------------------------------
def shard_table(rows: Iterable[tuple[tuple[str, int, int], Sequence[str]]], vocab: Vocabulary,
                unk_alias: str | None = None) -> pa.Table:
    """A shard's table from (key, tokens) rows, sorted by key, and rows of one key (documents that
    share an id) by their tokens, so that the bytes never follow the order the rows came in; ids
    from `vocab`."""
    ordered = sorted(rows, key=lambda r: (r[0], tuple(r[1])))
    token_lists = [list(tokens) for _, tokens in ordered]
    get = vocab.index.get
    ids = [[vocab.unk_id if (unk_alias is not None and t == unk_alias) else get(t, vocab.unk_id) for t in toks]
           for toks in token_lists]
    return pa.table({
        "doc_id": pa.array([k[0] for k, _ in ordered], pa.string()),
        "sentence_index": pa.array([k[1] for k, _ in ordered], pa.int32()),
        "window_index": pa.array([k[2] for k, _ in ordered], pa.int32()),
        "tokens": pa.array(token_lists, pa.list_(pa.string())),
        "ids": pa.array(ids, pa.list_(pa.int32())),
    }, schema=SHARD_SCHEMA)


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=16384)
    return sink.getvalue().to_pybytes()


def write_shard(directory: str, index: int, count: int, table: pa.Table) -> ShardInfo:
    name = shard_name(index, count)
    write_url_atomically(join_url(directory, name), table_bytes(table))
    n_tokens = int(pc.sum(pc.list_value_length(table.column("tokens"))).as_py() or 0)
    return ShardInfo(name, table.num_rows, n_tokens)


# -- reading --------------------------------------------------------------------------------
class PreparedCorpus:
    """A prepared folder: the manifest, the vocabulary, and shard-at-a-time reading."""

    def __init__(self, directory: str) -> None:
        directory = str(directory)
        self.directory = directory = _manifest_folder(directory) or directory
        where = join_url(directory, MANIFEST_FILE)
        try:  # bounded, and a device or FIFO unread: a folder to train on may come from anyone
            text = read_bytes(where, what="a manifest")
        except CheckpointError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise ConfigError(str(exc)) from None
            try:
                fs, path = url_to_fs(directory)
                folder = fs.isdir(path)
            except FileNotFoundError:  # a chain's archive that is not there
                folder = False
            found = f"is not a prepared folder (it has no {MANIFEST_FILE})" if folder else "does not exist"
            raise ConfigError(f"{directory} {found}: training reads the folder that `elmo-pipeline prepare "
                              "--input TEXT --output FOLDER` writes; run that first and pass its FOLDER") from None
        self.manifest = Manifest.from_json(text, where)
        vocab_url = join_url(directory, VOCAB_FILE)
        self.vocab = Vocabulary.from_json(read_bytes(vocab_url, what="a vocabulary"), vocab_url)
        if len(self.vocab) != self.manifest.vocab_size:
            raise ConfigError(f"{vocab_url}: {len(self.vocab)} tokens, the manifest says {self.manifest.vocab_size}")
        # the shards' ids number the vocabulary prepare wrote: one edited or copied in (a token
        # blanked, another run's of the same size) trained each row under another word, silently
        if self.manifest.vocab_sha256 and vocab_digest(self.vocab) != self.manifest.vocab_sha256:
            raise ConfigError(f"{vocab_url}: not the vocabulary the manifest records (its tokens' sha256 is "
                              f"{vocab_digest(self.vocab)}, the manifest's {self.manifest.vocab_sha256}), so the "
                              "shards' ids would name other words; run `prepare` again")
        self._check_shards_present()

    def _check_shards_present(self) -> None:
        """Every shard the manifest lists is in the folder: a missing one (a copy cut short) was
        found only when training reached it, after every shard read before it. One listing of the
        folder; a name it lacks is looked up on its own (a file system that lists nothing, HTTP)."""
        fs, path = url_to_fs(self.directory)
        try:
            listed = {posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)}
        except (OSError, NotImplementedError):
            listed = set()
        missing = [s.file for s in self.manifest.shards
                   if s.file not in listed and not fs.exists(join_url(path, s.file))]
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise ConfigError(f"{self.directory}: {len(missing)} of the {self.n_shards} shards its manifest lists "
                              f"are missing ({shown}); copy the folder whole, or run `prepare` again")

    @property
    def n_shards(self) -> int:
        return len(self.manifest.shards)

    def _read_columns(self, index: int, columns: list[str]) -> tuple[str, pa.Table]:
        info = self.manifest.shards[index]
        url = join_url(self.directory, info.file)
        try:
            with open_url(url) as f:
                table = open_parquet(f).read(columns=columns, use_threads=False)
        except (pa.ArrowException, KeyError, OSError) as exc:  # truncated, not Parquet, columns missing, damaged
            raise ConfigError(f"{url}: not a readable training shard ({exc}); run `prepare` again") from None
        if table.num_rows != info.sentences:
            raise ConfigError(f"{url}: {table.num_rows} sentences, the manifest says {info.sentences}; the folder "
                              "mixes files of different `prepare` runs")
        return url, table

    def shard_lengths(self, index: int) -> list[int]:
        """Each sentence's token count of one shard, in file order: its ids column alone (counting a
        run's batches read every token as a Python str before)."""
        _, table = self._read_columns(index, ["ids"])
        return np.diff(table.column("ids").combine_chunks().offsets.to_numpy()).tolist()

    def read_shard(self, index: int) -> tuple[list[list[str]], list[np.ndarray]]:
        """(token lists, id arrays) of one shard, in file order."""
        url, table = self._read_columns(index, ["tokens", "ids"])
        tokens = table.column("tokens").to_pylist()
        ids_col = table.column("ids").combine_chunks()
        offsets = ids_col.offsets.to_numpy()
        flat = ids_col.values.to_numpy(zero_copy_only=False).astype(np.int64)
        # bytes damaged past the checksums Parquet has not, or a shard of another vocabulary: the
        # softmax would fail on the id with a traceback (or skip -100, its ignore index, silently)
        outside = (flat < 0) | (flat >= len(self.vocab))
        if outside.any():
            raise ConfigError(f"{url}: token id {int(flat[outside][0])} is outside the vocabulary of "
                              f"{len(self.vocab)}; the shard is damaged or of another `prepare` run: run it again")
        if not np.array_equal(np.diff(offsets), [len(t) for t in tokens]):
            raise ConfigError(f"{url}: a sentence has another number of ids than of tokens; the shard is damaged: "
                              "run `prepare` again")
        ids = [flat[offsets[i] : offsets[i + 1]] for i in range(len(tokens))]
        return tokens, ids


def _manifest_folder(location: str) -> str | None:
    """The folder whose manifest `location` names, or None: `p/manifest.json` is `p`, and an HTTP
    URL's query stays the folder's (`https://h/p/manifest.json?t=1` is `https://h/p?t=1`, whose
    files join_url names `https://h/p/vocab.json?t=1`); a signed manifest's URL was read as text."""
    head, sep, tail = location.partition("://")
    path, query = split_http_query(head, tail)  # without "://", tail and both parts are ""
    named = f"{head}{sep}{path}"
    if not named.endswith(MANIFEST_FILE):
        return None
    return (named[: -len(MANIFEST_FILE)].rstrip("/") or ".") + query


def is_prepared(location: str) -> bool:
    location = str(location)
    if _manifest_folder(location) is not None:
        return True
    try:
        fs, path = url_to_fs(location)
    except FileNotFoundError:  # a chain's archive that is not there: no folder, and the text reader names it
        return False
    # joined to the file system's path, as a folder's files are read: an HTTP URL's query (a signed
    # URL's) was taken into the path, `valid.txt?token=t/manifest.json`, which a server answered with
    # valid.txt (text taken for a folder); and joined to the whole URL, a chain's archive took the
    # name, `zip://valid.txt::v.zip/manifest.json` (text in an archive refused: "Not a directory")
    return fs.exists(join_url(path, MANIFEST_FILE))
