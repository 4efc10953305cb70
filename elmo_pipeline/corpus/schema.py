"""The Parquet output: schema, file metadata and column-wise table building (no per-row dicts).

Token layout, a row per token:
    token_id        string   "<doc_id>:<sentence_index>:<window_index>:<token_index>", stable
    doc_id          string
    sentence_index  int32    sentence position in its document
    window_index    int32    0 unless a long sentence was cut into windows
    token_index     int32    position in its window
    token           string
    char_start      int64    offsets into the document text, end exclusive
    char_end        int64
    event_timestamp timestamp[us, UTC]   only when asked for
    layer_0..layer_L  fixed_size_list<float16|float32, 2P>   per --layers
    mix_<name>        fixed_size_list<float16|float32, 2P>   one per mix
Sentence layout: the same keys once per sentence (`sentence_id` instead of `token_id`) and
list columns (`tokens`, `char_starts`, `char_ends`, `layer_j`, `mix_<name>`).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Iterable
from typing import Any, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_pipeline.strict import ConfigError, check_bools, dumps_strict, parse_json_strict
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence

LAYOUTS = ("token", "sentence")
LAYER_CHOICES = ("all", "top", "none")
DTYPES = ("float16", "float32")
METADATA_KEY = b"elmo_pipeline"
_MIX_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
# The names extract's Parquet sinks give its shards: Beam writes the numbers with at least 5 digits.
PARQUET_SHARD = re.compile(r"(tokens|sentences)-(\d{5,})-of-(\d{5,})\.parquet")


def check_mix_name(name: str) -> str:
    if not _MIX_NAME.fullmatch(name):  # match() took "a\n": $ matches before a last newline
        raise ValueError(f"mix name {name!r}: use a letter, then letters, digits or '_' (at most 64)")
    return name


def check_mix_names(names: Iterable[str], what: str = "mix") -> None:
    """Each name one a column can take, and no two alike, even but for case: a file of two `mix_a`
    columns is one pyarrow cannot read ("Multiple matches"), and DuckDB, Spark and BigQuery match
    column names without case (DuckDB's `mix_a` was `mix_A`'s vectors). `what` names the names
    in the message ("--mix" for the flag's)."""
    seen: dict[str, str] = {}
    for name in names:
        check_mix_name(name)
        other = seen.get(name.lower())
        if other is not None:
            alike = "is named twice" if other == name else f"and {other!r} differ only in case"
            raise ValueError(f"{what} {name!r} {alike}: each needs a column name of its own, also to readers that "
                             "ignore case (DuckDB, Spark, BigQuery)")
        seen[name.lower()] = name


@dataclass(frozen=True)
class OutputSpec:
    """What the Parquet files hold; fixed for a run, so every shard has the same schema."""

    n_layers: int  # L + 1
    width: int  # 2P
    layout: str = "token"
    layers: str = "all"
    dtype: str = "float16"
    mix_names: tuple[str, ...] = ()
    with_timestamp: bool = False
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name, value, choices in (("layout", self.layout, LAYOUTS), ("layers", self.layers, LAYER_CHOICES),
                                     ("dtype", self.dtype, DTYPES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        # checked here, where the pipeline is built: each failed in the writer once the model had run
        for name, value in (("n_layers", self.n_layers), ("width", self.width)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_bools(with_timestamp=self.with_timestamp)  # "no" was taken for True: a column of null times
        if isinstance(self.mix_names, str):  # "avg" was read as the mixes "a", "v" and "g"
            raise TypeError(f"mix_names is a tuple of names, not the str {self.mix_names!r}: "
                            f"write ({self.mix_names!r},)")
        check_mix_names(self.mix_names)

    @property
    def layer_indices(self) -> list[int]:
        return {"all": list(range(self.n_layers)), "top": [self.n_layers - 1], "none": []}[self.layers]

    @property
    def vector_columns(self) -> list[str]:
        return [f"layer_{j}" for j in self.layer_indices] + [f"mix_{m}" for m in self.mix_names]

    def schema(self) -> pa.Schema:
        vector = pa.list_(pa.float16() if self.dtype == "float16" else pa.float32(), self.width)
        if self.layout == "token":
            fields = [("token_id", pa.string()), ("doc_id", pa.string()), ("sentence_index", pa.int32()),
                      ("window_index", pa.int32()), ("token_index", pa.int32()), ("token", pa.string()),
                      ("char_start", pa.int64()), ("char_end", pa.int64())]
        else:
            fields = [("sentence_id", pa.string()), ("doc_id", pa.string()), ("sentence_index", pa.int32()),
                      ("window_index", pa.int32()), ("tokens", pa.list_(pa.string())),
                      ("char_starts", pa.list_(pa.int64())), ("char_ends", pa.list_(pa.int64()))]
            vector = pa.list_(vector)
        if self.with_timestamp:
            fields.append(("event_timestamp", pa.timestamp("us", tz="UTC")))
        fields += [(name, vector) for name in self.vector_columns]
        meta = ({METADATA_KEY: dumps_strict(self.metadata, "Parquet metadata", sort_keys=True).encode()}
                if self.metadata else None)
        return pa.schema(fields, metadata=meta)


def sentence_id(doc_id: str, sentence_index: int, window_index: int) -> str:
    return f"{doc_id}:{sentence_index}:{window_index}"


def parse_timestamp(value: str | None) -> datetime | None:
    """ISO 8601 (a trailing Z or z, as RFC 3339 allows); naive times are taken as UTC."""
    if value is None:
        return None
    parsed = datetime.fromisoformat(value[:-1] + "+00:00" if value[-1:] in ("Z", "z") else value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class OutputRows(NamedTuple):
    """One sentence as it is written: only the vector columns of the output, as float32 copies;
    `table_of_rows` converts a whole chunk of them to the output dtype at once.

    A buffer of row groups holds these rather than EmbeddedSentences, whose every layer is float32
    and a view of its whole batch: with `--layers top` that is 3 layers of a batch per sentence.
    """

    sentence: Sentence
    vectors: dict[str, np.ndarray]  # column name -> (n, 2P) float32


def output_rows(item: EmbeddedSentence, spec: OutputSpec) -> OutputRows:
    sentence = item.sentence
    if isinstance(sentence.tokens, (str, bytes)):  # its characters would be written as tokens
        raise TypeError(f"sentence {sentence.key}: tokens is a {type(sentence.tokens).__name__}, not a sequence of "
                        "token strings")
    n_layers, rows, width = item.layers.shape
    if (n_layers, width) != (spec.n_layers, spec.width):  # else the top layer could be left out unnoticed
        raise ValueError(f"the output spec says {spec.n_layers} layers of width {spec.width}; the model gives "
                         f"{n_layers} of width {width} (OutputSpec(n_layers=model.config.n_output_layers, "
                         "width=model.config.output_dim))")
    # else the rows of a sentence with too many would be written against the next one's tokens
    shapes = {"layers": rows, **{f"mix {m!r}": len(v) for m, v in item.mixes.items()}}
    wrong = {what: n for what, n in shapes.items() if n != len(sentence.tokens)}
    if wrong:
        raise ValueError(f"sentence {sentence.key} has {len(sentence.tokens)} tokens but vector rows "
                         f"{wrong} (cut a batch's padding off: layers[:, i, :n])")
    missing = [m for m in spec.mix_names if m not in item.mixes]
    if missing:
        raise ValueError(f"the output spec names mixes {missing} that MixLayers did not compute "
                         f"(it computed {sorted(item.mixes)})")
    # copies: a view would keep the item's whole batch of (L+1, B, T, 2P) alive
    vectors = {f"layer_{j}": np.array(item.layers[j], np.float32) for j in spec.layer_indices}
    vectors.update((f"mix_{m}", np.array(item.mixes[m], np.float32)) for m in spec.mix_names)
    return OutputRows(item.sentence, vectors)


def _vectors(blocks: Sequence[np.ndarray], width: int, dtype: str) -> pa.FixedSizeListArray:
    flat = np.concatenate(blocks).reshape(-1) if blocks else np.zeros(0, np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(_converted(flat, dtype)), width)


def _converted(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> `dtype`, rounding to nearest even as numpy does; float16 through torch, whose
    vectorised conversion gives the same bits about three times faster (docs/design-measurements.md).
    Imported here: the rest of this module, and what imports it (feast/), needs no torch."""
    if dtype == "float32":
        return values
    import torch

    return torch.from_numpy(values).to(getattr(torch, dtype)).numpy()


def build_table(items: Sequence[EmbeddedSentence], spec: OutputSpec) -> pa.Table:
    """One Arrow table for a group of embedded sentences, built column by column."""
    return table_of_rows([output_rows(e, spec) for e in items], spec)


def table_of_rows(rows: Sequence[OutputRows], spec: OutputSpec) -> pa.Table:
    schema = spec.schema()
    if spec.layout == "token":
        return _token_table(rows, spec, schema)
    return _sentence_table(rows, spec, schema)


def _vector_columns(rows: Sequence[OutputRows], spec: OutputSpec) -> dict[str, pa.FixedSizeListArray]:
    return {name: _vectors([r.vectors[name] for r in rows], spec.width, spec.dtype) for name in spec.vector_columns}


def _token_table(rows: Sequence[OutputRows], spec: OutputSpec, schema: pa.Schema) -> pa.Table:
    counts = np.array([len(r.sentence.tokens) for r in rows], dtype=np.int64)
    sentences = [r.sentence for r in rows]
    doc_ids = np.repeat(np.array([s.doc_id for s in sentences], dtype=object), counts)
    sent_idx = np.repeat(np.array([s.sentence_index for s in sentences], dtype=np.int32), counts)
    win_idx = np.repeat(np.array([s.window_index for s in sentences], dtype=np.int32), counts)
    tok_idx = np.concatenate([np.arange(n, dtype=np.int32) for n in counts]) if len(rows) else np.zeros(0, np.int32)
    prefixes = np.repeat(np.array([sentence_id(s.doc_id, s.sentence_index, s.window_index) + ":" for s in sentences],
                                  dtype=object), counts)
    columns: dict[str, Any] = {
        "token_id": pc.binary_join_element_wise(pa.array(prefixes, pa.string()),
                                                pc.cast(pa.array(tok_idx), pa.string()), ""),
        "doc_id": pa.array(doc_ids, pa.string()),
        "sentence_index": pa.array(sent_idx),
        "window_index": pa.array(win_idx),
        "token_index": pa.array(tok_idx),
        "token": pa.array([t for s in sentences for t in s.tokens], pa.string()),
        "char_start": pa.array(_concat([s.char_starts for s in sentences])),
        "char_end": pa.array(_concat([s.char_ends for s in sentences])),
    }
    if spec.with_timestamp:
        stamps = np.repeat(np.array([parse_timestamp(s.timestamp) for s in sentences], dtype=object), counts)
        columns["event_timestamp"] = pa.array(stamps, pa.timestamp("us", tz="UTC"))
    columns.update(_vector_columns(rows, spec))
    return pa.Table.from_pydict(columns, schema=schema)


def _sentence_table(rows: Sequence[OutputRows], spec: OutputSpec, schema: pa.Schema) -> pa.Table:
    sentences = [r.sentence for r in rows]
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(s.tokens) for s in sentences])]).astype(np.int32))
    columns: dict[str, Any] = {
        "sentence_id": pa.array([sentence_id(s.doc_id, s.sentence_index, s.window_index) for s in sentences]),
        "doc_id": pa.array([s.doc_id for s in sentences], pa.string()),
        "sentence_index": pa.array([s.sentence_index for s in sentences], pa.int32()),
        "window_index": pa.array([s.window_index for s in sentences], pa.int32()),
        "tokens": pa.ListArray.from_arrays(offsets, pa.array([t for s in sentences for t in s.tokens], pa.string())),
        "char_starts": pa.ListArray.from_arrays(offsets, pa.array(_concat([s.char_starts for s in sentences]))),
        "char_ends": pa.ListArray.from_arrays(offsets, pa.array(_concat([s.char_ends for s in sentences]))),
    }
    if spec.with_timestamp:
        columns["event_timestamp"] = pa.array([parse_timestamp(s.timestamp) for s in sentences],
                                              pa.timestamp("us", tz="UTC"))
    for name, vectors in _vector_columns(rows, spec).items():
        columns[name] = pa.ListArray.from_arrays(offsets, vectors)
    return pa.Table.from_pydict(columns, schema=schema)


def nonfinite_values(table: pa.Table, spec: OutputSpec) -> dict[str, int]:
    """Per vector column of `table` (as `table_of_rows` built it), the values that are not finite
    in the stored dtype: inf where a mix's gamma takes a value past float16's 65504, NaN or inf
    from a broken model. Columns without any are left out. Counted after the conversion, since
    a float32 value far inside its own range can still overflow float16."""
    counts = {}
    for name in spec.vector_columns:
        values = table.column(name)
        while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
            values = pc.list_flatten(values)
        n = sum(_count_nonfinite(chunk.to_numpy(zero_copy_only=False)) for chunk in values.chunks)
        if n:
            counts[name] = n
    return counts


# inf and NaN are the values whose exponent bits are all set: one pass over the bits as integers
# takes a quarter of np.isfinite's time on float16, which numpy converts value by value.
_EXPONENT_BITS = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000)}


def _count_nonfinite(values: np.ndarray) -> int:
    as_int, exponent = _EXPONENT_BITS[values.dtype]
    return int(np.count_nonzero((values.view(as_int) & exponent) == exponent))


def _concat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)


_COMPLIANT_NESTED = False  # lists as WriteToParquetBatched wrote them: "tokens.list.item"


def open_parquet(f: Any) -> pq.ParquetFile:
    """A Python file object `f` as Parquet, to be read with `use_threads=False`. Buffers read from
    a Python file are freed under the GIL, and one that an Arrow thread (pre-buffering on its I/O
    pool, decoding on its CPU pool) frees after the interpreter began to exit aborts the process:
    "terminate called without an active exception", exit 134 after the work was done, in about
    one run in ten here (apache/arrow#34314). In the calling thread, none outlives the read."""
    return pq.ParquetFile(f, pre_buffer=False)


def parquet_writer(sink: Any, spec: OutputSpec) -> pq.ParquetWriter:
    """The writer of every output file: zstd, with dictionary encoding and min/max statistics for
    the key and token columns only. A vector column gains nothing from a dictionary (a float16
    dictionary's indices are as wide as the values; float32 falls back to plain) while its pages
    waited in memory for the column chunk's end, and its statistics (one min/max over all the
    floats of a page) serve no query while computing them took 40% of the write. Figures in
    docs/design-measurements.md."""
    schema = spec.schema()
    keys = [path for path in _leaf_paths(schema) if path.split(".")[0] not in spec.vector_columns]
    return pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=keys, write_statistics=keys,
                            use_compliant_nested_type=_COMPLIANT_NESTED)


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """The Parquet column paths of `schema` ("tokens.list.item"), which per-column writer options name."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink, use_compliant_nested_type=_COMPLIANT_NESTED)
    parquet_schema = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    return [parquet_schema.column(i).path for i in range(len(parquet_schema))]


def read_metadata(schema: pa.Schema, where: str = "the Parquet file") -> dict[str, Any]:
    """The run's metadata from a file's schema (model, config, mixes, tokenizer, layer meanings),
    read as strictly as it was written; a value that is not a JSON object is refused."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if not raw:
        return {}
    where = f"{where}: metadata {METADATA_KEY.decode()}"
    metadata = parse_json_strict(raw, where)
    if not isinstance(metadata, dict):
        raise ConfigError(f"{where} is a JSON {type(metadata).__name__}, not an object")
    return metadata


def model_difference(metadata: dict[str, Any], first: dict[str, Any]) -> str | None:
    """How the model whose vectors a file holds differs from `first`'s, both as their metadata
    record them (None: the same). Their layers' digests (`layers_sha256`) are compared where both
    files have one: the same model read from its original files and from its `import-allennlp`
    folder has files of other sha256s, and the same layers, so the same vectors. Files written
    before the digest was recorded are compared by the model's sha256."""
    def model(meta: dict[str, Any]) -> dict[str, Any]:
        recorded = meta.get("model")
        return recorded if isinstance(recorded, dict) else {}

    ours, theirs = model(metadata), model(first)
    key = "layers_sha256" if ours.get("layers_sha256") and theirs.get("layers_sha256") else "sha256"
    if ours.get(key) == theirs.get(key):
        return None
    return f"{key} {str(ours.get(key))[:12]} against {str(theirs.get(key))[:12]}"


def mix_differences(metadata: dict[str, Any], first: dict[str, Any], columns: Iterable[str]) -> list[str]:
    """The `mix_<name>` columns among `columns` whose mix spec (weights, gamma, layer norm) in
    `metadata` is not the one in `first`: one column name, but other vectors, so files of two
    runs with different `--mix` files under one name cannot be read as one column."""
    def spec(meta: dict[str, Any], column: str) -> Any:
        mixes = meta.get("mixes")
        return mixes.get(column[len("mix_"):]) if isinstance(mixes, dict) else None

    return [c for c in columns if c.startswith("mix_") and spec(metadata, c) != spec(first, c)]


def shard_set_problems(names: Iterable[str]) -> list[str]:
    """What keeps the files named `names` (base names) from being one run's whole Parquet output:
    a name no shard has, two layouts or shard counts (shards of two runs), a shard missing. A run
    writes `<layout>s-SSSSS-of-NNNNN.parquet` for every S below N; empty when the names are that."""
    problems, found, strays = [], [], []
    for name in sorted(names):
        match = PARQUET_SHARD.fullmatch(name)
        if match is None or int(match.group(2)) >= int(match.group(3)):
            strays.append(name)
        else:
            found.append((match.group(1), int(match.group(2)), int(match.group(3))))
    if strays:
        problems.append(f"{_some(strays)} {'is' if len(strays) == 1 else 'are'} not named as extract names its shards")
    sets = sorted({(layout, count) for layout, _, count in found})
    if len(sets) > 1:
        problems.append("shards of more than one run: " + ", ".join(f"{layout}-*-of-{count:05d}"
                                                                   for layout, count in sets))
    for layout, count in sets:
        have = {index for lay, index, n in found if (lay, n) == (layout, count)}
        missing = [i for i in range(count) if i not in have]
        if missing:
            problems.append(f"{len(missing)} of the {count} shards missing: "
                            + _some([f"{layout}-{i:05d}-of-{count:05d}.parquet" for i in missing]))
    return problems


def _some(names: Sequence[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def layer_meanings(n_layers: int) -> dict[str, str]:
    meanings = {"layer_0": "context-free token representation (char CNN/word encoder), duplicated: [x ; x]"}
    for j in range(1, n_layers):
        meanings[f"layer_{j}"] = f"biLSTM layer {j}: [forward ; backward]"
    return meanings
