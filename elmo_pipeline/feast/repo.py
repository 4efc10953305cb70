"""A Feast feature repository over the Parquet files of `elmo-pipeline extract`.

Beam has no Feast sink; the route is: the extracted token Parquet files are the offline source
(a Feast `FileSource`), `feast apply` registers the definitions, `feast materialize` copies the
latest vector of every token into the online store, and `get_online_features` serves them.

What the files must hold, checked here before anything is written:

- the token layout (`--layout token`): one row per token keyed by the stable `token_id`;
- an `event_timestamp` column (`--event-time run` or `--event-time field --timestamp-field F`),
  which Feast needs for point-in-time joins and materialization;
- float32 vectors (`--dtype float32`): Feast has no float16 value type, so float16 columns are
  refused instead of being silently widened by some stores and rejected by others.

Only the Parquet footers are read (schemas, row counts, timestamp statistics), never the vectors;
a row group whose footer lacks the time statistics has its time column read.
Feast itself is not needed to generate the repository; it is needed to use it (`pip install
'elmo-pipeline[feast]'`).
"""

from __future__ import annotations

import ast
import contextlib
import glob
import json
import os
import keyword
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_pipeline.filesystems import local_folder, partial_name, shown, without_userinfo
from elmo_pipeline.strict import dumps_strict, parse_json_strict
from elmo_pipeline.corpus.schema import (PARQUET_SHARD, mix_differences, model_difference, read_metadata,
                                         shard_set_problems)
from elmo_pipeline.corpus.input_files import hidden_by_wildcard

ENTITY_KEY = "token_id"
TIMESTAMP_FIELD = "event_timestamp"
DEFINITIONS_FILE = "features.py"
CONFIG_FILE = "feature_store.yaml"
VECTOR_COLUMN = re.compile(r"^(layer_\d+|mix_[A-Za-z][A-Za-z0-9_]*)$")
_FEAST_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_OPTION_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GLOB_CHARS = set("*?[")
_DEFINITION_IMPORTS = frozenset({"timedelta", "Entity", "FeatureService", "FeatureView", "Field", "FileSource",
                                 "ValueType", "Array", "Float32", "String"})
_DEFAULT_ONLINE = {"sqlite": {"path": "data/online_store.db"}}
# the whole microseconds of pandas' datetime64[ns] (pd.Timestamp.min and .max), in which Feast's
# file offline store sorts the source's times
_PANDAS_TIMES = (datetime(1677, 9, 21, 0, 12, 43, 145225, tzinfo=timezone.utc),
                 datetime(2262, 4, 11, 23, 47, 16, 854775, tzinfo=timezone.utc))


class FeatureFilesError(ValueError):
    """The features cannot be served by Feast as they are; the message says how to re-extract."""


@dataclass(frozen=True)
class FeatureFiles:
    """What a features folder holds, from the Parquet footers."""

    # what the FileSource reads: a local absolute path or a URL (without its user:password@, which
    # features.py, a file of a repository kept and shared, would hold), possibly a glob
    source_path: str
    files: tuple[str, ...]
    schema: pa.Schema
    vector_columns: tuple[str, ...]
    width: int
    num_rows: int
    null_timestamps: int
    min_timestamp: datetime | None
    max_timestamp: datetime | None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    runs: tuple[str, ...] = ()  # the `started` of each extract run whose files these are, as their metadata say


@dataclass(frozen=True)
class RepoOptions:
    """The choices in the generated repository; defaults give a local repo (SQLite online store)."""

    project: str = "elmo"
    entity: str = "token"
    feature_view: str = "elmo_tokens"
    feature_service: str = "elmo_vectors"
    columns: tuple[str, ...] = ()  # vector columns to serve; empty: all in the files
    ttl: timedelta = timedelta(0)  # 0: vectors never expire (Feast's convention)
    provider: str = "local"
    registry: str = "data/registry.db"
    offline_store: str = "file"
    offline_options: Mapping[str, Any] = field(default_factory=dict)
    online_store: str = "sqlite"
    online_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what in ("project", "entity", "feature_view", "feature_service"):
            value = getattr(self, what)
            if not _FEAST_NAME.fullmatch(value):
                raise ValueError(f"{what.replace('_', ' ')} {value!r}: use a letter, then letters, digits or '_'")
        variables = [self.entity, self.feature_view, f"{self.feature_view}_source", self.feature_service]
        taken = [v for v in variables if keyword.iskeyword(v) or v in _DEFINITION_IMPORTS]
        if taken or len(set(variables)) < len(variables):
            raise ValueError(f"entity, feature view and feature service names must differ from each other and from "
                             f"{sorted(_DEFINITION_IMPORTS)} (they name variables in {DEFINITIONS_FILE}); got "
                             f"{variables}")
        if self.ttl < timedelta(0):
            raise ValueError("ttl must not be negative")
        for what in ("provider", "registry", "offline_store", "online_store"):
            value = getattr(self, what)
            if not value.strip():  # written as "", `feast apply` failed with a traceback (registry "": the repo folder)
                raise ValueError(f"{what.replace('_', ' ')} {value!r} is empty; give one or leave the option out")


# ------------------------------------------------------------------ reading the files


def _resolve_files(features: str) -> tuple[fsspec.AbstractFileSystem, str, list[str]]:
    """(filesystem, pattern, files): a folder means its token shards, `tokens-*.parquet`. A folder
    or file that exists is that one, whatever its name holds (`f[1]`): its name is escaped in the
    pattern, which the FileSource's reader globs as well; only a path that is not there is a glob."""
    try:
        fs, root = fsspec.core.url_to_fs(features)
    except FileNotFoundError:  # a chain's archive that is not there: the OS's "[Errno 2] ..." named it alone
        raise FileNotFoundError(f"{features}: no such file or folder") from None
    if fs.isdir(root):
        root = glob.escape(root.rstrip("/"))
        pattern = f"{root}/tokens-*.parquet"
        if not fs.glob(pattern):
            if fs.glob(f"{root}/sentences-*.parquet"):
                raise FeatureFilesError(
                    f"{features} holds sentence-layout features (sentences-*.parquet); Feast serves one row "
                    "per entity, so re-run extract with --layout token")
            pattern = f"{root}/[!.]*.parquet"  # not macOS's `._NAME.parquet`: the FileSource's reader globs it too
    elif fs.exists(root):
        pattern = glob.escape(root)
    elif _GLOB_CHARS & set(root):
        pattern = root
    else:
        raise FileNotFoundError(f"{features}: no such file or folder")
    files = sorted(p for p in fs.glob(pattern) if not fs.isdir(p))
    hidden = [p for p in files if hidden_by_wildcard(pattern, p)]
    if hidden:  # macOS's `._NAME.parquet`, say: skipped here, it would still stop the FileSource's reader
        raise FeatureFilesError(f"{features}: {shown(fs, pattern)} also matches the hidden file "
                                f"{shown(fs, hidden[0])}, which Feast's reader would read as Parquet; give the "
                                "folder, or a pattern that does not match it")
    if not files:
        raise FileNotFoundError(f"{features}: no Parquet files (looked for {pattern})")
    return fs, pattern, files


def check_schema(schema: pa.Schema, where: str = "the features") -> tuple[list[str], int]:
    """The vector columns and their width; raises FeatureFilesError saying how to re-extract."""
    names = schema.names
    if ENTITY_KEY not in names:
        if "sentence_id" in names:
            raise FeatureFilesError(f"{where}: sentence-layout features (sentence_id, list columns) cannot be "
                                    "served row per token; re-run extract with --layout token")
        raise FeatureFilesError(f"{where}: no {ENTITY_KEY} column; these are not token features of "
                                "`elmo-pipeline extract`")
    if not pa.types.is_string(schema.field(ENTITY_KEY).type) and \
            not pa.types.is_large_string(schema.field(ENTITY_KEY).type):
        raise FeatureFilesError(f"{where}: {ENTITY_KEY} is {schema.field(ENTITY_KEY).type}, expected string")
    if TIMESTAMP_FIELD not in names:
        raise FeatureFilesError(
            f"{where}: no {TIMESTAMP_FIELD} column; Feast needs an event time per row. Re-run extract with "
            "--event-time run (the run's start time) or --event-time field --timestamp-field FIELD "
            "(a time carried by each document)")
    if not pa.types.is_timestamp(schema.field(TIMESTAMP_FIELD).type):
        raise FeatureFilesError(f"{where}: {TIMESTAMP_FIELD} is {schema.field(TIMESTAMP_FIELD).type}, "
                                "expected a timestamp")
    vectors, widths, half = [], set(), []
    for f in schema:
        if not VECTOR_COLUMN.fullmatch(f.name):
            continue
        t = f.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):  # its width, in the definitions, is unknown
            raise FeatureFilesError(f"{where}: column {f.name} is {t}, but extract writes fixed-size lists of one "
                                    "width; files re-written by another tool (pandas makes vectors variable-size "
                                    "lists) need their vector columns cast back to fixed-size lists")
        if not pa.types.is_fixed_size_list(t):
            raise FeatureFilesError(f"{where}: column {f.name} is {t}, expected a list of float32")
        if pa.types.is_float16(t.value_type):
            half.append(f.name)
            continue
        if not pa.types.is_float32(t.value_type):
            raise FeatureFilesError(f"{where}: column {f.name} holds {t.value_type}, expected float32")
        vectors.append(f.name)
        widths.add(t.list_size)
    if half:
        raise FeatureFilesError(
            f"{where}: {', '.join(half)} {'is' if len(half) == 1 else 'are'} float16, and Feast has no float16 "
            "type (its vectors are Array(Float32)); re-run extract with --dtype float32")
    if not vectors:
        raise FeatureFilesError(f"{where}: no vector columns (layer_J, mix_NAME); re-run extract with --layers "
                                "all|top or a --mix")
    if len(widths) > 1:
        raise FeatureFilesError(f"{where}: vector columns of different widths {sorted(widths)}")
    return vectors, widths.pop()


def _event_times(fs: fsspec.AbstractFileSystem, path: str, meta: pq.FileMetaData
                 ) -> tuple[int, list[tuple[datetime, datetime]]]:
    """(null times, the (earliest, latest) spans of its times) of one file, from its row groups'
    statistics. The row groups written without them (by another tool, or pyarrow's
    write_statistics=False) have their time column read, so that their times count in the
    materialize range printed and their nulls are counted. An empty row group (pyarrow writes an
    empty table as one, without statistics) has nothing to read."""
    column = next(i for i in range(meta.num_columns) if meta.schema.column(i).path == TIMESTAMP_FIELD)
    nulls, spans, unread = 0, [], []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        stats = group.column(column).statistics
        if group.num_rows == 0:
            continue
        if stats is None or not stats.has_null_count or (not stats.has_min_max and stats.null_count < group.num_rows):
            unread.append(g)
            continue
        nulls += stats.null_count
        if stats.has_min_max:
            spans.append((stats.min, stats.max))
    if unread:  # the footer already read is given; one column needs no pool of CPU threads
        with fs.open(path, "rb") as f:
            times = pq.ParquetFile(f, metadata=meta).read_row_groups(unread, columns=[TIMESTAMP_FIELD],
                                                                     use_threads=False).column(0)
        nulls += times.null_count
        span = pc.min_max(times).as_py()
        if span["min"] is not None:
            spans.append((span["min"], span["max"]))
    return nulls, spans


def inspect_features(features: str) -> FeatureFiles:
    """Read and check the footers of every Parquet file of a features folder, file, or glob (path or URL)."""
    fs, pattern, files = _resolve_files(features)
    first_schema: pa.Schema | None = None
    metadata: dict[str, Any] = {}  # the first file's
    vectors: list[str] = []
    width = rows = nulls = 0
    spans: list[tuple[datetime, datetime]] = []  # every file's event times, as (earliest, latest)
    runs: set[str] = set()
    for path in files:
        where = shown(fs, path)
        try:
            with fs.open(path, "rb") as f:
                meta = pq.read_metadata(f)
        except pa.ArrowException as exc:  # truncated, or not Parquet at all
            raise FeatureFilesError(f"{where}: not a readable Parquet file ({exc})") from None
        schema = meta.schema.to_arrow_schema()
        file_metadata = read_metadata(schema, where)
        if first_schema is None:
            first_schema, metadata = schema, file_metadata
            vectors, width = check_schema(schema, where)
        elif not schema.equals(first_schema, check_metadata=False):
            raise FeatureFilesError(f"{where}: its schema differs from {files[0]}'s; the files are not one run's "
                                    "output (re-run extract into an empty folder, or point at one run's files)")
        elif other := model_difference(file_metadata, metadata):
            raise FeatureFilesError(f"{where}: its vectors are of another model than {files[0]}'s ({other} in their "
                                    "metadata); the files are not one run's output (re-run extract into an empty "
                                    "folder, or point at one run's files)")
        elif mixes := mix_differences(file_metadata, metadata, vectors):
            raise FeatureFilesError(f"{where}: its {', '.join(mixes)} hold another mix than {files[0]}'s (the "
                                    "weights, gamma or layer norm in their metadata differ), and Feast would serve "
                                    "either vector for a token; the files are not one run's output (re-run extract "
                                    "into an empty folder, or point at one run's files)")
        if isinstance(file_metadata.get("started"), str):
            runs.add(file_metadata["started"])
        rows += meta.num_rows
        file_nulls, file_spans = _event_times(fs, path, meta)
        nulls += file_nulls
        spans += file_spans
    assert first_schema is not None
    return FeatureFiles(source_path=without_userinfo(shown(fs, pattern)), files=tuple(shown(fs, p) for p in files),
                        schema=first_schema, vector_columns=tuple(vectors), width=width, num_rows=rows,
                        null_timestamps=nulls,
                        min_timestamp=min((lo for lo, _ in spans), default=None),
                        max_timestamp=max((hi for _, hi in spans), default=None), metadata=metadata,
                        runs=tuple(sorted(runs)))


# ------------------------------------------------------------------ writing the repository


def parse_ttl(text: str) -> timedelta:
    """`0` (never expire), or a number with s, m, h, d or w: `3600s`, `90d`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise ValueError(f"ttl {text!r}: expected 0 or a number with s, m, h, d or w (e.g. 90d)")
    value, unit = float(match.group(1)), match.group(2) or "s"
    try:
        ttl = timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}[unit]: value})
    except OverflowError:
        raise ValueError(f"ttl {text!r}: more than Python's longest duration ({timedelta.max.days} days); "
                         "use 0 for vectors that never expire") from None
    if value and not ttl:  # rounded to 0, Feast's "never expire": the opposite of what was asked
        raise ValueError(f"ttl {text!r}: shorter than a microsecond, which Feast would read as 0 (never expire)")
    return ttl


def parse_options(items: Sequence[str], what: str) -> dict[str, Any]:
    """`KEY=VALUE` pairs; a VALUE that reads as JSON (numbers, true, null, quoted, objects) is taken
    as such, strictly (no NaN, no key twice). A KEY given twice, or `type` (the store's own option
    chooses it), is refused: one of the values would be dropped."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: expected KEY=VALUE")
        if not _OPTION_KEY.fullmatch(key):  # written into YAML as it is: anything else could break or add keys
            raise ValueError(f"{what} {item!r}: KEY must be letters, digits and underscores (a store's setting)")
        if key in out:
            raise ValueError(f"{what} {key}= is given twice ({out[key]!r} and {value!r}): give it once")
        if key == "type":
            raise ValueError(f"{what} {item!r}: the store's type is its --offline-store / --online-store option")
        try:
            json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a plain string
            continue
        out[key] = parse_json_strict(value, f"{what} {item!r}")
    return out


def _yaml(config: Mapping[str, Any]) -> list[str]:
    """Our config as YAML: a store's section as a block of its settings. Every value is written in
    JSON form, which YAML reads as the same value; an object a user gave stays one JSON object, so
    its keys cannot become keys of the file."""
    lines = []
    for key, item in config.items():
        if isinstance(item, Mapping):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_yaml_value(v, f'{key}.{k}')}" for k, v in item.items()]
        else:
            lines.append(f"{key}: {_yaml_value(item, key)}")
    return lines


def _yaml_value(value: Any, where: str) -> str:
    """A value in JSON form with every character past `~` as YAML's escape of it (DEL too, which
    YAML refuses raw). JSON's own escape of a character past U+FFFF is a surrogate pair, which YAML
    reads as two lone surrogates (a registry path holding U+20000 made `feast apply` fail:
    UnicodeEncodeError)."""
    return "".join(c if c <= "~" else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"
                   for c in dumps_strict(value, where, ensure_ascii=False))


def feature_store_yaml(options: RepoOptions) -> str:
    online = {"type": options.online_store, **_DEFAULT_ONLINE.get(options.online_store, {}),
              **options.online_options}
    offline = {"type": options.offline_store, **options.offline_options}
    config = {"project": options.project, "provider": options.provider, "registry": options.registry,
              "offline_store": offline, "online_store": online, "entity_key_serialization_version": 3}
    return ("# Written by `elmo-pipeline feast-repo`. Relative paths are relative to this folder.\n"
            "# Other stores: https://docs.feast.dev/reference/online-stores, .../offline-stores\n"
            + "\n".join(_yaml(config)) + "\n")


def _column_description(name: str, metadata: Mapping[str, Any]) -> str:
    if name.startswith("mix_"):
        mix = (metadata.get("mixes") or {}).get(name[4:])
        return f"ELMo task mix {name[4:]}" + (f": {dumps_strict(mix, name, sort_keys=True)}" if mix else "")
    return (metadata.get("layers") or {}).get(name, f"biLM {name}")


def _tags(files: FeatureFiles) -> dict[str, str]:
    """The feature view's tags: where its vectors come from."""
    model = files.metadata.get("model") or {}
    return {"produced_by": "elmo-pipeline", "package_version": str(files.metadata.get("package_version", "")),
            "model": str(model.get("name", "")), "model_sha256": str(model.get("sha256", "")),
            "width": str(files.width), "extract_started": str(files.metadata.get("started", ""))}


def definitions_py(files: FeatureFiles, options: RepoOptions) -> str:
    """The Python definitions: entity, FileSource, FeatureView with Array(Float32) fields, FeatureService."""
    columns = list(options.columns) or list(files.vector_columns)
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:  # Feast applies it, then fails at retrieval: duplicate feature names
        raise ValueError(f"columns {twice} are given more than once")
    missing = [c for c in columns if c not in files.vector_columns]
    if missing:
        raise ValueError(f"columns {missing} are not in the features (they hold {list(files.vector_columns)})")
    tags = _tags(files)
    fields = "\n".join(
        f"        Field(name={c!r}, dtype=Array(Float32), description={_column_description(c, files.metadata)!r}),"
        for c in columns)
    tag_lines = "\n".join(f"        {k!r}: {v!r}," for k, v in tags.items())
    ttl = options.ttl.total_seconds()
    ttl_text = f"timedelta(seconds={int(ttl) if ttl == int(ttl) else ttl!r})"
    ttl_note = ("0: the vectors never expire" if ttl == 0 else
                f"{_duration(ttl)}: historical retrieval leaves out a vector older than this at the entity row's "
                "time; online, Feast serves what was materialized, whatever its age")
    view, entity = options.feature_view, options.entity
    return f'''"""Feast definitions for ELMo token vectors written by `elmo-pipeline extract`.

Generated by `elmo-pipeline feast-repo` from the files the FileSource below reads
({len(files.files)} files, {files.num_rows} rows, vectors float32 x {files.width}).
Edit freely; re-generating overwrites this file.
"""

from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Array, Float32, String

{entity} = Entity(
    name={entity!r},
    join_keys=[{ENTITY_KEY!r}],
    value_type=ValueType.STRING,
    description='a token occurrence: <doc_id>:<sentence_index>:<window_index>:<token_index>',
)

{view}_source = FileSource(
    name={view + "_source"!r},
    path={files.source_path!r},
    timestamp_field={TIMESTAMP_FIELD!r},
    description='token Parquet files of elmo-pipeline extract',
)

{view} = FeatureView(
    name={view!r},
    entities=[{entity}],
    ttl={ttl_text},  # {ttl_note}
    schema=[
        Field(name={ENTITY_KEY!r}, dtype=String),
{fields}
    ],
    source={view}_source,
    online=True,
    tags={{
{tag_lines}
    }},
)

{options.feature_service} = FeatureService(
    name={options.feature_service!r},
    features=[{view}],
)
'''


# what an extract run's summary.json says of its output, each false when something went wrong
_RUN_CHECKS = ("documents_reconcile", "tokens_reconcile", "files_reconcile", "errors_reconcile", "ids_unique",
               "vectors_finite")


def run_warnings(features: str, files: FeatureFiles) -> list[str]:
    """What speaks against serving the features: their files (those the FileSource reads) of more
    than one extract run, as their metadata say, or of no row; the summary.json of the folder that holds them
    saying that checks failed (counts not reconciled, ids not unique, vectors not finite). For a
    folder given, also its files not one run's complete set of shards, and its summary.json
    missing (a run that did not finish writes it last) or counting other rows than the files
    hold; a glob or file may choose some of a run's shards. The repository is written anyway:
    the user decides."""
    warnings = []
    if without_userinfo(features) != features:
        warnings.append(f"{files.source_path}: features.py names it without the user and password of --features, "
                        "so Feast reads it without them: give Feast's file system the credentials another way")
    if files.num_rows == 0:  # a run over empty documents, or a glob of the wrong shards: a view of nothing
        warnings.append(f"{files.source_path}: its files hold no rows ({', '.join(files.files)}): the feature view "
                        "would serve no token")
    if len(files.runs) > 1:  # a glob over run folders, say: nothing else tells
        warnings.append(f"{files.source_path}: its files are of {len(files.runs)} extract runs (started "
                        f"{', '.join(files.runs)}): a token_id in more than one is served from the run of the later "
                        "event_timestamp, and at equal times (the same documents' own times) from either run; point "
                        "at one run's files, or give each run its own --feature-view")
    fs, root = fsspec.core.url_to_fs(features)
    whole = fs.isdir(root)
    if whole:
        folder = root.rstrip("/")
        names = [name.rsplit("/", 1)[-1] for name in files.files]
        shards = any(PARQUET_SHARD.fullmatch(name) for name in names)  # else a folder of the user's own files
        warnings += [f"{files.source_path}: {problem}; Feast would serve these files as they are"
                     for problem in (shard_set_problems(names) if shards else [])]
    else:  # a glob or file: a run failed its checks whatever shards of it are chosen
        folders = {fsspec.core.url_to_fs(name)[1].rsplit("/", 1)[0] for name in files.files}
        if len(folders) > 1:
            return warnings
        folder = folders.pop()
    path = folder + "/summary.json"
    if not fs.exists(path):
        return warnings + ([f"{features} has no summary.json: the extract run that wrote it may not have finished"]
                           if whole else [])
    try:
        with fs.open(path, "rb") as f:
            summary = parse_json_strict(f.read(), shown(fs, path))
    except ValueError as exc:
        return warnings + [f"{exc}: cannot tell whether its run succeeded"]
    if not isinstance(summary, dict):
        return warnings + [f"{shown(fs, path)} is not a JSON object: cannot tell whether its run succeeded"]
    failed = [k for k in _RUN_CHECKS if summary.get(k) is False]
    if failed:
        warnings.append(f"{shown(fs, path)} says {', '.join(f'{k}: false' for k in failed)}: the run that wrote "
                        "these features failed its checks (see its errors-*.jsonl)")
    written = summary.get("rows_in_files")
    if whole and isinstance(written, int) and written != files.num_rows:
        warnings.append(f"{shown(fs, path)} says its run wrote {written} rows, and the files hold {files.num_rows}: "
                        "files were lost, added or changed since")
    return warnings


def time_warnings(files: FeatureFiles, options: RepoOptions) -> list[str]:
    """Event times that Feast's file offline store cannot sort: over two files, its materialize
    stopped with pandas' OutOfBoundsDatetime on a time of 1500 or 2300 (so did historical retrieval
    on 1500; one file read whole passed), and nothing was served online. Times without a time zone
    (another tool's rewrite; extract writes UTC): over two files, its historical retrieval stopped on
    a TypeError comparing them with UTC times (materialize too, in Dask, beside an empty shard); one
    file passed."""
    if options.offline_store != "file":
        return []
    kind = files.schema.field(TIMESTAMP_FIELD).type
    if kind.tz is None:
        return [f"{files.source_path}: its {TIMESTAMP_FIELD} is {kind}, without a time zone, which Feast's file "
                "offline store cannot compare with its own UTC times: over more than one file its historical "
                "retrieval stops (a TypeError), as may its materialize; cast the column to a UTC timestamp, or "
                "choose another --offline-store"]
    lo, hi = files.min_timestamp, files.max_timestamp
    if lo is None or hi is None:
        return []
    if _PANDAS_TIMES[0] <= lo and hi <= _PANDAS_TIMES[1]:
        return []
    return [f"{files.source_path}: event times from {lo.isoformat()} to {hi.isoformat()}, and Feast's file offline "
            "store sorts times as pandas' nanoseconds, which run from 1677-09-21 to 2262-04-11: over more than one "
            "file its materialize stops on a time outside them (OutOfBoundsDatetime), as may historical "
            "retrieval; give the documents times inside that range, or choose another --offline-store"]


def _duration(seconds: float) -> str:
    """A TTL in the largest unit that --ttl takes and that divides it: 7776000 -> 90d."""
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds) if seconds == int(seconds) else seconds}s"


def materialize_command(files: FeatureFiles) -> str:
    """`feast materialize START END` covering every event time in the files (Feast's range is inclusive)."""
    if files.min_timestamp is None or files.max_timestamp is None:
        return "feast materialize-incremental $(date -u +%Y-%m-%dT%H:%M:%S)"
    start = files.min_timestamp.replace(microsecond=0, tzinfo=None)
    last = files.max_timestamp.replace(microsecond=0, tzinfo=None)
    # the second after the last time; in the calendar's last second (9999-12-31T23:59:59) there is
    # none, and adding it was an OverflowError once the repository was written: its last microsecond
    end = last + timedelta(seconds=1) if last < datetime.max.replace(microsecond=0) else datetime.max
    return f"feast materialize {start.isoformat()} {end.isoformat()}"


def next_steps(output: str, files: FeatureFiles) -> list[str]:
    """The commands that follow, as a shell reads them: the folder quoted, so that they can be pasted
    for a path with spaces or quotes."""
    return [f"cd {shlex.quote(output)}", "feast apply", materialize_command(files)]


def local_repo(output: str) -> Path:
    """The repository folder for `output`: a local path (or file:// URL). Feast runs in that folder
    (`feast apply`), so a URL of another file system is refused rather than taken as a relative
    path (`memory://r` would make a folder `memory:`)."""
    return Path(local_folder(output, "--output", "the Feast repository is a local folder (feast apply runs in it; "
                                                 "the features themselves may be a URL)"))


@dataclass(frozen=True)
class Served:
    """What a repository's feature view served, read back from the files feast-repo wrote."""

    project: str | None
    feature_view: str
    path: str
    extract_started: str


def _literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError):  # not a literal: a definition the user rewrote
        return None


def served_by(output: str) -> Served | None:
    """What the repository in `output` serves, as its features.py names it (the FileSource's path, the
    feature view and its extract_started tag) and its feature_store.yaml its project; read without
    running either. None where there is no such repository or its definitions are not ours to read."""
    repo = local_repo(output)
    try:
        tree = ast.parse((repo / DEFINITIONS_FILE).read_text(encoding="utf-8"))
        config = (repo / CONFIG_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, SyntaxError, ValueError):
        return None
    calls: dict[str, dict[str | None, ast.expr]] = {}  # the first call of each name: ours make one
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls.setdefault(node.func.id, {k.arg: k.value for k in node.keywords})
    view, path = _literal(calls.get("FeatureView", {}).get("name")), _literal(calls.get("FileSource", {}).get("path"))
    tags = _literal(calls.get("FeatureView", {}).get("tags"))
    if not (isinstance(view, str) and isinstance(path, str)):
        return None
    project = next((line.partition(": ")[2] for line in config if line.startswith("project: ")), None)
    with contextlib.suppress(ValueError):  # written as JSON; a user's own YAML may differ
        project = json.loads(project) if project is not None else None
    started = tags.get("extract_started") if isinstance(tags, dict) else None
    return Served(project, view, path, started if isinstance(started, str) else "")


def replaced_warnings(before: Served | None, output: str, files: FeatureFiles, options: RepoOptions) -> list[str]:
    """A repository rewritten over other features under the same feature view: materializing writes
    the new features' token_ids into the view's online table, and every row materialized before
    for another token_id stays and is served (Feast's online stores keep a row per entity). The
    same run's files at another path (its folder copied, moved or linked) are not other features."""
    if before is None or (before.project, before.feature_view) != (options.project, options.feature_view):
        return []  # a new view or project is a new online table
    if before.extract_started and files.runs == (before.extract_started,):
        return []
    if (before.path, before.extract_started) == (files.source_path, _tags(files)["extract_started"]):
        return []
    run = f" (extract started {before.extract_started})" if before.extract_started else ""
    return [f"{local_repo(output) / DEFINITIONS_FILE} served {before.path}{run} under the feature view "
            f"{options.feature_view}: an online store materialized from those keeps their vectors, and serves them "
            "for every token_id these features lack; give these features a new --feature-view, or empty the "
            "online store before materializing (the default SQLite one: remove data/online_store.db)"]


def write_repo(features: str, output: str, options: RepoOptions | None = None, overwrite: bool = False
               ) -> tuple[FeatureFiles, list[str]]:
    """Check the features and write `feature_store.yaml` and `features.py` into `output` (a local folder).

    Returns what was found and the paths written. Raises FeatureFilesError (with the extract option that
    fixes it) for features Feast cannot serve, FileExistsError for an existing repo without `overwrite`,
    ValueError for an `output` that is a URL of another file system.
    """
    options = options or RepoOptions()
    repo = local_repo(output)
    files = inspect_features(features)
    targets = [repo / CONFIG_FILE, repo / DEFINITIONS_FILE]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} already exist; use --overwrite to replace them")
    config, definitions = feature_store_yaml(options), definitions_py(files, options)
    if repo.exists() and not repo.is_dir():
        raise ValueError(f"--output {output} is an existing file; it must name a folder")
    folders = [str(t) for t in targets if t.is_dir()]
    if folders:  # found before either file is written: the repo is written whole or not at all
        raise ValueError(f"{', '.join(folders)} is a folder; the repository's file cannot replace it")
    repo.mkdir(parents=True, exist_ok=True)
    _write_both(list(zip(targets, (config, definitions))))
    return files, [str(t) for t in targets]


def _write_both(files: list[tuple[Path, str]]) -> None:
    """Each text to a temporary name beside its file, then the renames: a write that fails (a full
    disk) or Ctrl-C or SIGTERM before the renames leaves the repository as it was, not a whole
    feature_store.yaml beside an empty features.py, which `feast apply` took as a project without
    features."""
    written: list[tuple[str, Path]] = []
    try:
        for target, text in files:
            written.append((partial_name(str(target)), target))
            Path(written[-1][0]).write_text(text, encoding="utf-8")
        for partial, target in written:
            os.replace(partial, target)
    except BaseException as exc:  # Ctrl-C and SIGTERM (commands.Terminated) too: they left both
        for partial, _ in written:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"cannot write {target}: {exc.strerror or exc}") from exc
        raise
