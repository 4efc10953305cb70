"""Stream the Parquet features of `extract` into PyTorch, a row group at a time.

    ds = ParquetFeatureDataset("gs://bucket/features", columns=["layer_0", "layer_1", "layer_2"],
                               batch_sentences=32, shuffle_buffer=4096, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in loader:  # FeatureBatch: features (K, B, T, D), mask (B, T), ids
            ...

Sources are files, globs or folders, local or any fsspec URL (a folder means the shards `extract`
wrote there, which must be one run's complete set, or, holding none, its `*.parquet` files); every
file must come from the same model, with vectors of one width. Both layouts of `extract` are read
(`token`: a row per token, `sentence`: a row per sentence). Ranks (`rank`/`world_size`, for
distributed training) share the files, and a rank's DataLoader workers share its files; where there
are fewer files than ranks, or a rank has fewer files than workers, they share row groups instead,
so one large file still feeds every reader. A token-layout sentence cut across row groups is read,
whole, by the reader of the group it starts in (a group in which none starts is no share). Within a
file the row groups are read in order, one at a time. Shares are whole files or row groups, so ranks
may yield different numbers of batches: under DistributedDataParallel end each epoch together
(torch.distributed.algorithms.Join) or stop every rank at the fewest batches; a world_size above the
number of row groups in which a sentence starts is refused.

Memory: one row group being split into sentences, plus the shuffle buffer (`shuffle_buffer`
sentences and at most `shuffle_tokens` tokens, copied out of their row group so that no row group
stays alive because one of its sentences waits in the buffer), plus one batch. The data set is never loaded whole.
With `shuffle_buffer=0` sentences come in file order (the files themselves in sorted order).
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing.connection
import multiprocessing.util
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from elmo_pipeline.corpus.input_files import InputError, expand_patterns
from elmo_pipeline.filesystems import open_url, url_to_fs
from elmo_pipeline.strict import check_bools
from elmo_pipeline.corpus.schema import (PARQUET_SHARD, mix_differences, model_difference, open_parquet, read_metadata,
                                         shard_set_problems)

Source = Union[str, "os.PathLike[str]"]  # a path (str or pathlib.Path), glob or fsspec URL


class FeatureBatch(NamedTuple):
    """A padded batch of sentences. Positions past a sentence's end are zero in `features`."""

    features: torch.Tensor  # (K, B, T, D) float32, K = len(columns), in the order of `columns`
    mask: torch.Tensor  # (B, T) bool
    lengths: torch.Tensor  # (B,) int64
    sentence_ids: list[str]  # "<doc_id>:<sentence_index>:<window_index>", as in the Parquet files
    doc_ids: list[str]
    sentence_index: torch.Tensor  # (B,) int64
    window_index: torch.Tensor  # (B,) int64
    tokens: list[tuple[str, ...]] | None  # only with `with_tokens=True`
    columns: tuple[str, ...]

    def to(self, device: torch.device | str) -> FeatureBatch:
        """The batch with `features` and `mask` on `device`; the rest stays where it is."""
        return self._replace(features=self.features.to(device), mask=self.mask.to(device))


class _Unit(NamedTuple):
    """A reader's share: a whole file, or one row group of it."""

    url: str
    group: int | None = None


def _in_order(units: list[_Unit], rng: np.random.Generator | None) -> list[_Unit]:
    """The units in the epoch's shuffled order, or as given without shuffling."""
    return units if rng is None else [units[i] for i in rng.permutation(len(units))]


class _Item(NamedTuple):
    doc_id: str
    sentence_index: int
    window_index: int
    tokens: tuple[str, ...] | None
    vectors: np.ndarray  # (K, n, D)


@dataclass
class StreamStats:
    """What the last iteration (in this process) read and held at most."""

    files: int = 0
    row_groups: int = 0
    sentences: int = 0
    tokens: int = 0
    batches: int = 0
    peak_buffered_sentences: int = 0
    peak_buffered_tokens: int = 0
    peak_row_group_rows: int = 0


def expand_sources(sources: Source | Sequence[Source]) -> list[str]:
    """Files for files, globs and folders (str or pathlib.Path), sorted, without duplicates. A folder
    is the shards extract wrote there (a file of the user's beside them is not read), refused unless
    they are one run's complete set; a folder without shards is its `*.parquet`."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:  # else the first file's schema was read from an empty list: an IndexError
        raise ValueError("no sources given: name Parquet files, globs or folders")
    found: dict[str, None] = {}
    for source in map(os.fspath, sources):
        if not source:  # an unset variable: read as a folder, it was the root's /*.parquet
            raise ValueError("a source is empty: name Parquet files, globs or folders")
        fs, path = url_to_fs(source)
        # the folder's own name is taken literally: `[1]` in it read as a glob matched no file
        pattern = glob.escape(source.rstrip("/")) + "/*.parquet" if fs.isdir(path) else source
        try:
            files = expand_patterns([pattern])
        except InputError as exc:
            raise FileNotFoundError(f"no Parquet files at {source!r} ({exc})") from exc
        if fs.isdir(path):
            files = _folder_shards(source, files)
        found.update(dict.fromkeys(files))
    # sorted whatever order the sources came in: their order was the file order, so the same files
    # and seed gave another shuffle, and other files to each worker, for sources given the other way
    return sorted(found)


def _folder_shards(folder: str, files: list[str]) -> list[str]:
    named = {f: f.rsplit("/", 1)[-1] for f in files}
    shards = [f for f, name in named.items() if PARQUET_SHARD.fullmatch(name)]
    if not shards:
        return files
    problems = shard_set_problems(named[f] for f in shards)
    if problems:  # read as it is, a lost shard's sentences would be missing, another run's repeated
        raise ValueError(f"{folder}: its shards are not one run's whole output: {'; '.join(problems)}. Name the "
                         "files (or a glob) to read them anyway")
    return shards


def _parquet_file(f: object, url: str) -> pq.ParquetFile:
    """`f` read as Parquet; one that is not (empty, truncated, another format matched by a glob) is
    named: Arrow's own message ("Parquet magic bytes not found") names no file. A damaged footer is
    a plain OSError from Arrow ("Couldn't deserialize thrift")."""
    try:
        return open_parquet(f)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{url}: not a readable Parquet file ({exc})") from None


def _row_group(pf: pq.ParquetFile, group: int, columns: list[str], url: str, rows: int | None = None) -> pa.Table:
    """The columns of one row group (or its first `rows` rows, decoding no more), read in this
    thread. One that cannot be read (a damaged page, vectors Arrow cannot decode) is named by file
    and row group: Arrow's own message ("Couldn't deserialize thrift: ... Deserializing page header
    failed") named neither, in a folder of shards."""
    try:
        if rows is None:
            return pf.read_row_group(group, columns=columns, use_threads=False)
        head, held = [], 0
        for batch in pf.iter_batches(batch_size=rows, row_groups=[group], columns=columns, use_threads=False):
            head.append(batch)
            held += batch.num_rows
            if held >= rows:
                break
        return pa.Table.from_batches(head).slice(0, rows)
    except (pa.ArrowException, OSError) as exc:  # Arrow's message runs over lines: one line, all of it
        raise ValueError(f"{url} row group {group}: cannot be read ({' '.join(str(exc).split())})") from exc


def _row_groups(units: Sequence[_Unit]) -> list[_Unit]:
    """The row groups of these units' files that give a reader sentences, each a unit of its own (a
    file's footer read). A group of no row, or a token-layout group in which no sentence starts (its
    rows are read by the reader of the group the sentence starts in), is left out: a rank given only
    such groups would read nothing. A file's first group holding rows stays, to refuse rows before
    its first sentence's start (_group_items)."""
    groups = []
    for unit in units:
        if unit.group is not None:
            groups.append(unit)
            continue
        with open_url(unit.url) as f:
            pf = _parquet_file(f, unit.url)
            meta = pf.metadata
            first = _first_group_of_rows(meta)
            for g in range(meta.num_row_groups):
                if meta.row_group(g).num_rows and (g == first or _starts_a_sentence(pf, g, unit.url)):
                    groups.append(_Unit(unit.url, g))
    return groups


def _first_group_of_rows(meta: pq.FileMetaData) -> int | None:
    """A file's first row group that holds a row (row groups of 0 rows count for none); None if none does."""
    return next((g for g in range(meta.num_row_groups) if meta.row_group(g).num_rows), None)


def _starts_a_sentence(pf: pq.ParquetFile, group: int, url: str) -> bool:
    """Whether a sentence starts in a row group of rows: any in the sentence layout; in the token
    layout, where its token_index is 0 at some row (the footer's minimum, else the column read)."""
    if "token_index" not in pf.schema_arrow.names:
        return True
    meta = pf.metadata.row_group(group)
    column = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "token_index")
    stats = column.statistics
    if stats is not None and stats.has_min_max:
        return stats.min == 0
    return bool(len(_sentence_starts(pf, group, url)))


def _sentence_starts(pf: pq.ParquetFile, group: int, url: str) -> np.ndarray:
    """The rows of a token-layout row group where a sentence starts (token_index 0), its key column alone read."""
    return np.flatnonzero(_row_group(pf, group, ["token_index"], url).column(0).to_numpy() == 0)


def _vectors_of_fixed(array: pa.Array, width: int) -> np.ndarray:
    """FixedSizeList<float, width> -> (rows, width) numpy (float16 stays float16)."""
    return array.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def _vector_width(schema: pa.Schema, column: str, layout: str, where: str) -> int:
    written = vector_type = schema.field(column).type
    if layout == "sentence" and pa.types.is_list(vector_type):
        vector_type = vector_type.value_type
    if not pa.types.is_fixed_size_list(vector_type) or not pa.types.is_floating(vector_type.value_type):
        expected = "fixed_size_list<float, 2P>" + (" in a list" if layout == "sentence" else "")
        raise ValueError(f"{where}: column {column} is {written}, but extract writes {expected}; files re-written "
                         "by another tool (pandas makes vectors variable-size lists) need their vector columns "
                         "cast back to fixed-size lists")
    return vector_type.list_size


def _check_no_nulls(array: pa.Array, column: str, where: str) -> None:
    """Refuses a null at any level of a vector column (a sentence's vectors, a vector, a value),
    which extract never writes: read as it was, a null sentence was left out unseen and a null value
    became a NaN in the features."""
    nulls, level = 0, array
    while True:
        nulls += level.null_count
        if not (pa.types.is_list(level.type) or pa.types.is_fixed_size_list(level.type)):
            break
        level = level.values
    if nulls:
        raise ValueError(f"{where}: column {column} holds {nulls} null(s) (vectors or values missing), which extract "
                         "never writes: the file was changed since")


_MAX_EPOCH = 2**63 - 1  # what the shared int64 holds


# A DataLoader worker hands its tensors over by a socket that multiprocessing binds in its own folder
# of the temp folder (torch's file_descriptor sharing, Linux's default); an AF_UNIX path holds at
# most 107 bytes on Linux.
_MAX_SOCKET_PATH = 107


def socket_name() -> str:
    """The name multiprocessing gives that socket in this Python, asked of it: listener-XXXXXXXX up
    to CPython 3.13, sock-XXXXXXXX from 3.14 (a name assumed was 4 bytes off there). It makes the
    process's multiprocessing temp folder, as a worker's first batch does."""
    return os.path.basename(multiprocessing.connection.arbitrary_address("AF_UNIX"))


def _check_socket_room(worker: int, folder: str | None = None, name: str | None = None) -> None:
    """Refuses, in DataLoader worker `worker`, a temp folder too long for that socket: its bind fails
    in the worker's queue thread, the batch is never handed over, and the loader waits for good.
    `folder`: where the socket would go; by default the worker's own (made now, else at its first batch).
    `name`: the socket's name, by default `socket_name()`."""
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    folder = folder or multiprocessing.util.get_temp_dir()
    name = name or socket_name()
    over = len(os.fsencode(os.path.join(folder, name))) - _MAX_SOCKET_PATH
    if over > 0:
        temp = tempfile.gettempdir()
        room = len(os.fsencode(temp)) - over
        shown = name.rpartition("-")[0]  # the random part after the last "-" (mktemp's names have no "-")
        raise OSError(f"DataLoader worker {worker}: the temp folder {temp} ({len(os.fsencode(temp))} bytes) leaves no "
                      f"room for the socket by which a worker hands its batches over ({folder}{os.sep}{shown}-..., "
                      f"and a socket's path may have {_MAX_SOCKET_PATH} bytes): set TMPDIR to a folder of at most "
                      f"{room} bytes, or use num_workers=0")


def _check_count(name: str, value: object, least: int = 0) -> None:
    """An integer option checked when given. `seed` and `epoch` seed numpy's generator, which takes
    integers >= 0 only (its own "expected non-negative integer" came at the first batch, in a
    DataLoader worker, and named neither); a batch size or buffer of 2.5 was taken (batches of 3
    sentences), and True as 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


class ParquetFeatureDataset(IterableDataset):
    """Padded sentence batches from the Parquet output of `extract`; see the module docstring.

    sources: the feature files, globs or folders (str or pathlib.Path; see `expand_sources`).
    columns: vector columns to stack into `features`, a name or a list of them (default: every
    `layer_j`, in order of j).
    batch_sentences / batch_tokens: at most this many sentences / padded tokens (B * T) per batch (a
    sentence longer than batch_tokens is a batch of its own).
    drop_last: leave out the last batch when it could still take a sentence (it has fewer than
    batch_sentences, and a sentence more would stay within batch_tokens), as a partial one.
    shuffle_buffer: sentences held for shuffling (0: no shuffling, file order).
    shuffle_tokens: tokens held for shuffling (None: no bound): at most this many, or one sentence,
    once a sentence coming in has taken its place (it may exceed them by itself while it does).
    seed: the shuffle's, with the epoch (`set_epoch`).
    with_tokens: each batch carries its sentences' tokens (`FeatureBatch.tokens`).
    rank / world_size: this process's share of the data in distributed training, one of
    `world_size` (see the module docstring).
    """

    def __init__(
        self, sources: Source | Sequence[Source], columns: str | Sequence[str] | None = None, batch_sentences: int = 32,
        batch_tokens: int | None = None, shuffle_buffer: int = 0, seed: int = 0, drop_last: bool = False,
        with_tokens: bool = False, rank: int = 0, world_size: int = 1, shuffle_tokens: int | None = None,
    ) -> None:
        super().__init__()
        _check_count("batch_sentences", batch_sentences, 1)
        if batch_tokens is not None:
            _check_count("batch_tokens", batch_tokens, 1)
        _check_count("shuffle_buffer", shuffle_buffer)
        if shuffle_tokens is not None:
            _check_count("shuffle_tokens", shuffle_tokens, 1)
        _check_count("seed", seed)
        _check_count("rank", rank)
        _check_count("world_size", world_size, 1)
        if not rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        check_bools(drop_last=drop_last, with_tokens=with_tokens)  # drop_last="no" was true: a last batch left out
        self.files = expand_sources(sources)
        if world_size > len(self.files):  # the ranks share row groups
            groups = len(_row_groups([_Unit(url) for url in self.files]))
            # a rank of no sentence ends its epoch at once, and a DDP step of the others waits for it
            if world_size > groups:
                raise ValueError(f"world_size {world_size} is more than the {groups} row group(s) of the "
                                 f"{len(self.files)} file(s) to read: {world_size - groups} rank(s) would read nothing"
                                 " (a row group counts where a sentence starts in it); write more shards (extract "
                                 "--num-shards) or smaller row groups (--row-group-mb), or run fewer ranks")
        self.batch_sentences = batch_sentences
        self.batch_tokens = batch_tokens
        self.shuffle_buffer = shuffle_buffer
        self.shuffle_tokens = shuffle_tokens
        self.seed = seed
        self.drop_last = drop_last
        self.with_tokens = with_tokens
        self.rank, self.world_size = rank, world_size
        # in shared memory: persistent DataLoader workers keep the copy of the data set they were
        # started with, and read a plain attribute's epoch 0 in every epoch (the same shuffle)
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.stats = StreamStats()
        schema = self._schema(self.files[0])
        names = schema.names
        if "token_id" in names:
            self.layout = "token"
        elif "sentence_id" in names:
            self.layout = "sentence"
        else:
            raise ValueError(f"{self.files[0]}: not a feature file of extract (no token_id or sentence_id column)")
        self.metadata = read_metadata(schema, self.files[0])
        given = columns is not None
        if columns is None:
            columns = sorted((n for n in names if n.startswith("layer_")), key=lambda n: int(n.split("_")[1]))
        elif isinstance(columns, str):  # one name, not its characters ("no column(s) ['m', 'i', 'x', ...]")
            columns = [columns]
        self.columns = tuple(columns)
        if not self.columns and given:  # else said to be an output of `--layers none`, its layers listed or not
            vectors = [n for n in names if n.startswith(("layer_", "mix_"))]
            raise ValueError(f"columns is empty: name the vector columns to read ({self.files[0]} has {vectors})")
        if not self.columns:  # by default the layers, which an output of `--layers none` lacks
            mixes = [n for n in names if n.startswith("mix_")]
            hint = f": it has no layer_J column (extract --layers none); name its mixes, columns={mixes}"
            raise ValueError(f"{self.files[0]}: no vector columns to read" + (hint if mixes else ""))
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ValueError(f"{self.files[0]}: no column(s) {missing}; it has {names}")
        self.width = _vector_width(schema, self.columns[0], self.layout, self.files[0])

    @staticmethod
    def _schema(url: str) -> pa.Schema:
        with open_url(url) as f:
            return _parquet_file(f, url).schema_arrow

    def check_files(self) -> None:
        """Checks every file's footer as iterating does (layout, model, vector width), before any
        data is read: sources that mix models fail here rather than part way through an epoch."""
        for url in self.files[1:]:
            self._check_like_the_first(url, self._schema(url))

    def set_epoch(self, epoch: int) -> None:
        """A new shuffle (file order and buffer) for each epoch; the same for the same seed and epoch."""
        _check_count("epoch", epoch)
        if epoch > _MAX_EPOCH:
            raise ValueError(f"epoch must be at most {_MAX_EPOCH}, got {epoch}")
        self._epoch.fill_(int(epoch))

    @property
    def epoch(self) -> int:
        """The epoch `set_epoch` set last (0 at first)."""
        return int(self._epoch)

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[FeatureBatch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if info is not None:
            _check_socket_room(worker)
        self.stats = StreamStats()
        items = self._items(self._share(workers, worker))
        if self.shuffle_buffer:
            part = self.rank * workers + worker
            items = self._shuffled(items, np.random.default_rng([self.seed, self.epoch, part]))
        yield from self._batches(items)

    def _share(self, workers: int, worker: int) -> list[_Unit]:
        """This reader's files or row groups: the ranks' shares first, then the rank's workers'. Cut
        the other way (every reader of every rank in one round), 3 files for 2 ranks of 4 workers
        all went to rank 0's workers and rank 1 read nothing. Every rank and every worker of a rank
        computes the same list (the epoch's shuffle, footers), so the shares never overlap."""
        rng = np.random.default_rng([self.seed, self.epoch]) if self.shuffle_buffer else None
        units = [_Unit(url) for url in self.files]
        if len(units) < self.world_size:
            units = _row_groups(units)
        units = _in_order(units, rng)[self.rank::self.world_size]
        if len(units) < workers:
            units = _in_order(_row_groups(units), rng)
        return units[worker::workers]

    def _items(self, units: Sequence[_Unit]) -> Iterator[_Item]:
        needed = ["doc_id", "sentence_index", "window_index"]
        if self.layout == "token":
            needed.append("token_index")
        if self.with_tokens:
            needed.append("token" if self.layout == "token" else "tokens")
        needed += list(self.columns)
        opened: set[str] = set()  # a file shared by row groups is one file read, however many of them
        with contextlib.ExitStack() as open_file:
            current: str | None = None
            for url, group in units:
                # a file's row groups one after another (a rank's share of one file): opened and its
                # footer read once, not once a group (200 groups of a 236 kB footer: 1.4 ms each)
                if url != current:
                    open_file.close()
                    pf = _parquet_file(open_file.enter_context(open_url(url)), url)
                    current = url
                    self._check_like_the_first(url, pf.schema_arrow)
                    missing = [c for c in needed if c not in pf.schema_arrow.names]
                    if missing:
                        raise ValueError(f"{url}: no column(s) {missing}")
                    self.stats.files += url not in opened
                    opened.add(url)
                if group is None:
                    yield from self._file_items(pf, url, needed)
                else:
                    yield from self._group_items(pf, url, group, needed)

    def _read_group(self, pf: pq.ParquetFile, url: str, group: int, needed: list[str]) -> pa.Table:
        table = _row_group(pf, group, needed, url)
        self.stats.row_groups += 1
        self.stats.peak_row_group_rows = max(self.stats.peak_row_group_rows, table.num_rows)
        return table

    def _file_items(self, pf: pq.ParquetFile, url: str, needed: list[str]) -> Iterator[_Item]:
        carry: _Item | None = None
        for group in range(pf.num_row_groups):
            table = self._read_group(pf, url, group, needed)
            if self.layout == "sentence":
                yield from self._sentence_rows(table, f"{url} row group {group}")
            else:
                carry = yield from self._token_rows(table, carry, f"{url} row group {group}")
            del table
        if carry is not None:
            yield carry

    def _group_items(self, pf: pq.ParquetFile, url: str, group: int, needed: list[str]) -> Iterator[_Item]:
        """The sentences that start in one row group, whole: rows before its first sentence's start
        belong to the reader of an earlier group, and its last sentence is read on into the next
        groups, as far as it goes."""
        table = self._read_group(pf, url, group, needed)
        where = f"{url} row group {group}"
        if self.layout == "sentence":
            yield from self._sentence_rows(table, where)
            return
        begun = np.flatnonzero(table.column("token_index").to_numpy() == 0)
        # the file's first rows: no reader began the sentence
        if group == _first_group_of_rows(pf.metadata) and not (len(begun) and begun[0] == 0):
            raise ValueError(f"{where}: starts inside a sentence that the previous row group did not begin")
        if not len(begun):
            return
        carry = yield from self._token_rows(table.slice(int(begun[0])), None, where)
        for later in range(group + 1, pf.num_row_groups):
            if carry is None:
                break
            # how far the sentence goes into this group: its key column alone, then those rows only
            begun = _sentence_starts(pf, later, url)
            rest = int(begun[0]) if len(begun) else pf.metadata.row_group(later).num_rows
            if rest:
                head = _row_group(pf, later, needed, url, rows=rest)
                carry = yield from self._token_rows(head, carry, f"{url} row group {later}")
            if len(begun):
                break
        if carry is not None:
            yield carry

    def _check_like_the_first(self, url: str, schema: pa.Schema) -> None:
        """Every file of the layout, vector width, model and mixes of the first: outputs of another
        model, layout or mix would be read as they come, mixed with the first one's vectors."""
        layout = "token" if "token_id" in schema.names else "sentence"
        if layout != self.layout:
            raise ValueError(f"{url}: {layout} layout, but {self.files[0]} has the {self.layout} layout")
        metadata = read_metadata(schema, url)
        model = model_difference(metadata, self.metadata)
        if model:
            raise ValueError(f"{url}: vectors of another model than {self.files[0]}'s ({model}): the sources are "
                             "outputs of different models")
        mixes = mix_differences(metadata, self.metadata, self.columns)
        if mixes:
            raise ValueError(f"{url}: {', '.join(mixes)} hold another mix than {self.files[0]}'s (the weights, gamma "
                             "or layer norm in their metadata differ): the sources are outputs of different --mix "
                             "specs under one name")
        widths = {c: _vector_width(schema, c, layout, url) for c in self.columns if c in schema.names}
        wrong = {c: w for c, w in widths.items() if w != self.width}
        if wrong:
            raise ValueError(f"{url}: vectors of width {wrong}, but {self.files[0]} has width {self.width}: the "
                             "sources are outputs of different models")

    def _sentence_rows(self, table: pa.Table, where: str) -> Iterator[_Item]:
        doc_ids = table.column("doc_id").to_pylist()
        sent = table.column("sentence_index").to_numpy()
        win = table.column("window_index").to_numpy()
        tokens = table.column("tokens").to_pylist() if self.with_tokens else None
        offsets = None
        blocks = []
        for name in self.columns:
            array = table.column(name).combine_chunks()
            _check_no_nulls(array, name, where)
            if offsets is None:
                offsets = array.offsets.to_numpy()
            elif not np.array_equal(array.offsets.to_numpy(), offsets):  # each column is cut at the first's
                raise ValueError(f"{where}: column {name} holds other numbers of vectors per sentence than "
                                 f"{self.columns[0]}")
            blocks.append(_vectors_of_fixed(array.values, self.width))
        vectors = np.stack(blocks)  # (K, rows of the child arrays, D)
        for i in range(table.num_rows):
            lo, hi = offsets[i], offsets[i + 1]
            if hi > lo:
                yield _Item(doc_ids[i], int(sent[i]), int(win[i]), tuple(tokens[i]) if tokens else None,
                            vectors[:, lo:hi])

    def _token_rows(self, table: pa.Table, carry: _Item | None, where: str):
        """Yields the complete sentences of a token-layout row group; returns its last sentence,
        which may go on in the next row group."""
        n = table.num_rows
        if n == 0:
            return carry
        token_index = table.column("token_index").to_numpy()
        sent = table.column("sentence_index").to_numpy()
        win = table.column("window_index").to_numpy()
        doc_ids = table.column("doc_id")
        tokens = table.column("token").to_pylist() if self.with_tokens else None
        arrays = [table.column(c).combine_chunks() for c in self.columns]
        for name, array in zip(self.columns, arrays):
            _check_no_nulls(array, name, where)
        vectors = np.stack([_vectors_of_fixed(array, self.width) for array in arrays])
        starts = np.flatnonzero(token_index == 0)
        follows = np.ones(n, bool)
        follows[starts] = False
        in_order = (token_index[1:] == token_index[:-1] + 1) & (sent[1:] == sent[:-1]) & (win[1:] == win[:-1])
        if not np.all(in_order[follows[1:]]):
            raise ValueError(f"{where}: the rows of a sentence are not contiguous and in token order")
        first = int(starts[0]) if len(starts) else n
        if first > 0:  # rows that continue the previous row group's last sentence
            if (carry is None or token_index[0] != carry.vectors.shape[1]
                    or (carry.sentence_index, carry.window_index) != (int(sent[0]), int(win[0]))):
                raise ValueError(f"{where}: starts inside a sentence that the previous row group did not begin")
            carry = carry._replace(
                vectors=np.concatenate([carry.vectors, vectors[:, :first]], axis=1),
                tokens=carry.tokens + tuple(tokens[:first]) if tokens is not None else None)
            if first == n:
                return carry
        if carry is not None:
            yield carry
        bounds = list(starts) + [n]
        for lo, hi in pairwise(bounds[:-1]):
            yield _Item(doc_ids[lo].as_py(), int(sent[lo]), int(win[lo]),
                        tuple(tokens[lo:hi]) if tokens is not None else None, vectors[:, lo:hi])
        lo = bounds[-2]  # the last sentence: copied, since it may wait for the next row group
        return _Item(doc_ids[lo].as_py(), int(sent[lo]), int(win[lo]),
                     tuple(tokens[lo:]) if tokens is not None else None, vectors[:, lo:].copy())

    def _shuffled(self, items: Iterator[_Item], rng: np.random.Generator) -> Iterator[_Item]:
        buffer: list[_Item] = []
        buffered_tokens = 0
        bound = self.shuffle_tokens
        for item in items:
            item = item._replace(vectors=item.vectors.copy())  # frees its row group once that is consumed
            n = item.vectors.shape[1]
            if len(buffer) < self.shuffle_buffer and (not buffer or bound is None or buffered_tokens + n <= bound):
                buffer.append(item)
                buffered_tokens += n
                self._note_buffer(len(buffer), buffered_tokens)
                continue
            # full: a sentence drawn at random leaves for it. Within the token bound, as ordinary data
            # always is, these are the draws of a buffer bounded by sentences alone (the same order)
            j = int(rng.integers(len(buffer)))
            out, buffer[j] = buffer[j], item
            buffered_tokens += n - out.vectors.shape[1]
            self._note_buffer(len(buffer), buffered_tokens)
            yield out
            # a sentence longer than the one it replaced: more leave, at random, until within the bound
            while bound is not None and buffered_tokens > bound and len(buffer) > 1:
                j = int(rng.integers(len(buffer)))
                buffer[j], buffer[-1] = buffer[-1], buffer[j]
                out = buffer.pop()
                buffered_tokens -= out.vectors.shape[1]
                yield out
        for j in rng.permutation(len(buffer)):
            yield buffer[j]

    def _note_buffer(self, sentences: int, tokens: int) -> None:
        self.stats.peak_buffered_sentences = max(self.stats.peak_buffered_sentences, sentences)
        self.stats.peak_buffered_tokens = max(self.stats.peak_buffered_tokens, tokens)

    def _batches(self, items: Iterator[_Item]) -> Iterator[FeatureBatch]:
        batch: list[_Item] = []
        longest = 0
        for item in items:
            n = item.vectors.shape[1]
            self.stats.sentences += 1
            self.stats.tokens += n
            if batch and not self._room_for_another(len(batch), max(longest, n)):
                yield self._collate(batch)
                batch, longest = [], 0
            batch.append(item)
            longest = max(longest, n)
        if batch and not (self.drop_last and self._room_for_another(len(batch), longest)):
            yield self._collate(batch)

    def _room_for_another(self, sentences: int, longest: int) -> bool:
        """Whether a batch of `sentences` could take one more sentence, all padded to `longest` tokens:
        a batch is full when it cannot, and drop_last leaves out a last batch that can only. Counted
        in sentences alone, a last batch that batch_tokens had filled, as it had the others, was
        dropped (10 sentences of 100, each batch holding 10 sentences of 10 tokens under
        batch_tokens=100)."""
        return sentences < self.batch_sentences and (
            self.batch_tokens is None or (sentences + 1) * longest <= self.batch_tokens)

    def _collate(self, batch: list[_Item]) -> FeatureBatch:
        self.stats.batches += 1
        lengths = [item.vectors.shape[1] for item in batch]
        # filled in the stored dtype (plain copies), then converted in one contiguous pass: a strided
        # float16 -> float32 assignment per row is several times slower. Sources may mix float16 and
        # float32 files: the wider one is kept (the first item's float16 rounded the float32 rows)
        stored = np.result_type(*{item.vectors.dtype for item in batch})
        features = np.zeros((len(self.columns), len(batch), max(lengths), self.width), stored)
        for row, item in enumerate(batch):
            features[:, row, : lengths[row]] = item.vectors
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        return FeatureBatch(
            features=torch.from_numpy(features).float(),
            mask=torch.arange(max(lengths)).unsqueeze(0) < lengths_t.unsqueeze(1),
            lengths=lengths_t,
            sentence_ids=[f"{i.doc_id}:{i.sentence_index}:{i.window_index}" for i in batch],
            doc_ids=[i.doc_id for i in batch],
            sentence_index=torch.tensor([i.sentence_index for i in batch], dtype=torch.int64),
            window_index=torch.tensor([i.window_index for i in batch], dtype=torch.int64),
            tokens=[i.tokens for i in batch] if self.with_tokens else None,
            columns=self.columns,
        )
