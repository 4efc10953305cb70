"""WriteParquet and WriteErrors: Beam's file sinks, so retried bundles never leave duplicates.

Each shard is written under a temporary directory and renamed at finalize. Shards are named
`<layout>s-SSSSS-of-NNNNN.parquet` and `errors-SSSSS-of-NNNNN.jsonl` in the output folder
(`SHARD_FILE`; the temporary folders match `TEMP_FOLDER`). Vector values that are not finite in
the output dtype are written as they are and counted (nonfinite_values).
That temporary-then-rename is Beam's own, not `formats.atomic`'s: only the sink knows which of a
retried bundle's attempts to keep, and it renames the winners once, at finalize.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import weakref

import apache_beam as beam
import pyarrow as pa
from apache_beam.io import filebasedsink
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.transforms.window import GlobalWindow, GlobalWindows, SlidingWindows
from apache_beam.utils.windowed_value import WindowedValue

from elmo_pipeline.formats.files import absolute_local, join_url
from elmo_pipeline.strict import check_ints, dumps_strict
from elmo_pipeline.corpus.records import EmbeddedSentence, ErrorRecord
from elmo_pipeline.corpus.schema import (PARQUET_SHARD, OutputRows, OutputSpec, nonfinite_values, output_rows,
                                         parquet_writer, table_of_rows)
from elmo_pipeline.transforms.checks import check_collection, check_element
from elmo_pipeline.transforms.metrics import (NONFINITE_IN, NONFINITE_VALUES, SENTENCES_WRITTEN, TOKEN_ROWS_WRITTEN,
                                              BundleCounts)

SHARD_TEMPLATE = "-SSSSS-of-NNNNN"
# The names these sinks give, and nothing else: Beam writes the template's numbers with at least as
# many digits as letters ("%05d"), and a sink's temporary folder is "beam-temp-<prefix>-<uuid1 hex>".
ERRORS_SHARD = re.compile(r"errors-\d{5,}-of-\d{5,}\.jsonl")
SHARD_FILE = re.compile(rf"(?:{PARQUET_SHARD.pattern}|{ERRORS_SHARD.pattern})")
TEMP_FOLDER = re.compile(r"beam-temp-(?:tokens|sentences|errors)-[0-9a-f]{32}")


# Arrow's Parquet writer turns a whole chunk of a float16 column into 2-byte fixed-length values at
# once, with about 15 bytes of temporaries per value (457 MiB for one chunk of 116k rows 256 wide,
# the 64 MiB row group of `--layers top`); a row group built of chunks of this size keeps that to a
# few MiB and is still written as one row group.
CHUNK_MB = 2.0


class ToArrowTables(beam.DoFn):
    """Groups embedded sentences of a bundle into Arrow tables of `spec`'s columns, of about
    `rows_per_group` token rows; each table becomes one Parquet row group. A sentence is cut down to the columns written
    (`output_rows`) as it arrives, and every `rows_per_chunk` rows become an Arrow chunk of the
    row group, in the output dtype, so the buffer holds about one row group's bytes. Counters are
    incremented when the bundle finishes, so a bundle that fails and is retried counts once."""

    def __init__(self, spec: OutputSpec, rows_per_group: int, rows_per_chunk: int) -> None:
        self.spec = spec
        self.rows_per_group = rows_per_group
        self.rows_per_chunk = rows_per_chunk

    def start_bundle(self) -> None:
        self.pending: list[OutputRows] = []  # sentences of the chunk being filled
        self.pending_rows = 0
        self.chunks: list[pa.Table] = []
        self.rows = 0  # in the chunks and pending
        self.counts = BundleCounts()

    def process(self, item: EmbeddedSentence):
        check_element("WriteParquet", item, EmbeddedSentence)
        self.pending.append(output_rows(item, self.spec))
        self.pending_rows += len(item.sentence.tokens)
        self.rows += len(item.sentence.tokens)
        if self.pending_rows >= self.rows_per_chunk:
            self._close_chunk()
        if self.rows >= self.rows_per_group:
            yield self._flush()

    def finish_bundle(self):
        if self.rows or self.pending:
            yield WindowedValue(self._flush(), GlobalWindow().max_timestamp(), [GlobalWindow()])
        self.counts.commit()

    def _close_chunk(self) -> None:
        chunk = table_of_rows(self.pending, self.spec)
        for column, n in nonfinite_values(chunk, self.spec).items():  # written all the same: extract exits 1
            self.counts.add(NONFINITE_VALUES, n)
            self.counts.add(f"{NONFINITE_IN}{column}", n)
        self.chunks.append(chunk)
        self.counts.add(SENTENCES_WRITTEN, len(self.pending))
        self.pending, self.pending_rows = [], 0

    def _flush(self) -> pa.Table:
        if self.pending:
            self._close_chunk()
        table = pa.concat_tables(self.chunks)
        self.counts.add(TOKEN_ROWS_WRITTEN, self.rows)
        self.chunks, self.rows = [], 0
        return table


class ArrowTableCoder(beam.coders.Coder):
    """Arrow tables between stages, as Arrow IPC streams (schema metadata included).

    Beam samples the elements of every PCollection for their size, always the first ten: with its
    default coder that pickled each whole row group (64 MiB) only to measure it, a transient copy
    on the first ten flushes. Here the size is the table's own count of bytes."""

    def encode(self, table: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    def decode(self, encoded: bytes) -> pa.Table:
        return pa.ipc.open_stream(encoded).read_all()

    def estimate_size(self, table: pa.Table) -> int:
        return table.nbytes

    def is_deterministic(self) -> bool:
        return False


beam.coders.registry.register_coder(pa.Table, ArrowTableCoder)


def output_url(output: str | os.PathLike) -> str:
    """The output folder as the str the sinks take (a pathlib.Path failed in them); ValueError for
    one that is empty ("", an unset variable, wrote the shards into the current folder, as
    `extract` refuses to) or neither a str nor a path."""
    if isinstance(output, os.PathLike):
        output = os.fspath(output)
    if not isinstance(output, str) or not output:
        raise ValueError(f"the output folder must be a non-empty path or URL, got {output!r}")
    return output


# each pipeline's file prefixes that our sinks write, and the label of the one that writes each: two
# sinks of one prefix give the same shard names, and the second's files replaced the first's
# (measured: two WriteParquet into one folder kept one input's rows, two WriteErrors one's records)
_PIPELINE_PREFIXES: weakref.WeakKeyDictionary[beam.Pipeline, dict[str, str]] = weakref.WeakKeyDictionary()


def check_bounded(collection: beam.PCollection, label: str) -> None:
    """Raises ValueError, when the pipeline is built, for an unbounded `collection` (a streaming
    source): Beam's sinks then write each window's files under names of their own
    (`errors-[0.0, 60.0)-00000-of-00001.jsonl`, no shard of ours) or, in the global window, refuse it
    naming `triggering_frequency`, which our sinks do not take."""
    if not collection.is_bounded:
        raise ValueError(f"{label} writes bounded collections only (its shards are named and renamed into place "
                         "once the input has ended); this one is unbounded (a streaming source)")


def check_windows_partition(collection: beam.PCollection, label: str, record: str) -> None:
    """Raises ValueError, when the pipeline is built, for SlidingWindows whose period is not their
    size: overlapping, each window's copy of a record was written (a sentence's token_ids twice or
    more, an error line twice); with gaps between them, the records in a gap are in no window,
    dropped without a word. Windows of a period equal to their size are fixed windows."""
    windowfn = collection.windowing.windowfn
    if isinstance(windowfn, SlidingWindows) and windowfn.period != windowfn.size:
        raise ValueError(f"{label}: SlidingWindows of a period other than their size put a {record} in several "
                         "windows, each copy written, or in none (dropped); use FixedWindows or Sessions")


def claim_prefix(pipeline: beam.Pipeline, prefix: str, label: str) -> None:
    """Records that the sink `label` of `pipeline` writes the files `prefix`-SSSSS-of-NNNNN; raises
    ValueError, when the pipeline is built, if another sink of it writes them already."""
    claimed = _PIPELINE_PREFIXES.setdefault(pipeline, {})
    key = absolute_local(prefix)
    if key in claimed:
        raise ValueError(f"{label} would write {key}{SHARD_TEMPLATE}.* as {claimed[key]} of this pipeline "
                         "does: one's files would replace the other's; give each its own output folder, or "
                         "Flatten the collections into one sink")
    claimed[key] = label


def check_sink_input(collection: beam.PCollection, label: str, record: str, prefix: str) -> None:
    """The checks both sinks make when built, in this order: one PCollection, bounded, windows that
    put each `record` in exactly one, and the files `prefix`-SSSSS-of-NNNNN no other sink of the
    pipeline writes (which it then claims)."""
    check_collection(label, collection)
    check_bounded(collection, label)
    check_windows_partition(collection, label, record)
    claim_prefix(collection.pipeline, prefix, label)


def rows_per_group(spec: OutputSpec, row_group_mb: float) -> int:
    """Token rows that fill about `row_group_mb` MiB of uncompressed vectors."""
    bytes_per_row = len(spec.vector_columns) * spec.width * (2 if spec.dtype == "float16" else 4) + 64
    return max(1, int(row_group_mb * 2**20 / bytes_per_row))


class _ParquetSink(filebasedsink.FileBasedSink):
    """WriteToParquetBatched's sink with our own Parquet writer settings (`parquet_writer`)."""

    def __init__(self, prefix: str, spec: OutputSpec, num_shards: int) -> None:
        super().__init__(prefix, coder=None, file_name_suffix=".parquet", num_shards=num_shards,
                         shard_name_template=SHARD_TEMPLATE, mime_type="application/x-parquet",
                         compression_type=CompressionTypes.UNCOMPRESSED)
        self._spec = spec

    def open(self, temp_path: str):
        handle = super().open(temp_path)
        return handle, parquet_writer(handle, self._spec)

    def write_record(self, opened, table: pa.Table) -> None:
        opened[1].write_table(table)

    def close(self, opened) -> None:
        handle, writer = opened
        writer.close()
        handle.close()


@beam.typehints.with_input_types(EmbeddedSentence)
class WriteParquet(beam.PTransform):
    """PCollection[EmbeddedSentence] -> zstd Parquet shards with `spec`'s schema and metadata, in
    the folder `output` (a path or URL): `num_shards` of them (0: the runner decides), of row
    groups of about `row_group_mb` MiB of vectors."""

    def __init__(self, output: str | os.PathLike, spec: OutputSpec, num_shards: int = 0,
                 row_group_mb: float = 64.0) -> None:
        super().__init__()
        output = output_url(output)
        if not isinstance(spec, OutputSpec):  # None failed on "'NoneType' object has no attribute 'vector_columns'"
            raise TypeError(f"spec must be an OutputSpec, got {type(spec).__name__} ({spec!r:.80})")
        # checked here, as `extract` checks its options: -1 shards meant "the runner decides" without a
        # word, a negative size gave a row group per sentence, and nan failed naming no option
        check_ints(num_shards=num_shards)
        if num_shards < 0:
            raise ValueError(f"num_shards must be an int >= 0 (0: the runner decides), got {num_shards!r}")
        if (isinstance(row_group_mb, bool) or not isinstance(row_group_mb, numbers.Real)
                or not math.isfinite(row_group_mb) or row_group_mb <= 0):
            raise ValueError(f"row_group_mb must be a finite number of MiB above 0, got {row_group_mb!r}")
        self.output, self.spec = output, spec
        self.num_shards = num_shards
        self.rows_per_group = rows_per_group(spec, row_group_mb)

    def expand(self, embedded: beam.PCollection) -> beam.pvalue.PDone:
        prefix = join_url(self.output, f"{self.spec.layout}s")
        check_sink_input(embedded, self.label, "sentence", prefix)
        if not isinstance(embedded.windowing.windowfn, GlobalWindows):
            # a windowed input (EmbedSentences keeps its windows) goes to files as one: the tables
            # a bundle ends with are emitted in the global window
            embedded = embedded | "GlobalWindows" >> beam.WindowInto(GlobalWindows())
        return (
            embedded
            | "ToArrowTables" >> beam.ParDo(ToArrowTables(self.spec, self.rows_per_group,
                                                      min(self.rows_per_group, rows_per_group(self.spec, CHUNK_MB))))
            .with_output_types(pa.Table)
            | "WriteToParquet" >> beam.io.Write(
                _ParquetSink(prefix, self.spec, self.num_shards))
        )


ERRORS_STEM = "errors"  # the rejected records, one JSON object a line: errors*.jsonl beside the output


# line breaks to Python's str.splitlines (and some editors) that JSON writes raw in a string: a
# record holding one (an id, a file name) was cut in two by a reader splitting the file by lines
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def error_line(record: ErrorRecord) -> str:
    """`record` as one line of errors-*.jsonl: strict JSON, its keys sorted, no line break inside."""
    check_element("WriteErrors", record, ErrorRecord)
    text = dumps_strict(record.to_json_dict(), "error record", ensure_ascii=False, sort_keys=True)
    return text.translate(_UNICODE_LINE_BREAKS)


@beam.typehints.with_input_types(ErrorRecord)
class WriteErrors(beam.PTransform):
    """PCollection[ErrorRecord] -> errors-*.jsonl beside the output: source, line, stage, reason."""

    def __init__(self, output: str | os.PathLike) -> None:
        super().__init__()
        self.output = output_url(output)

    def expand(self, errors: beam.PCollection) -> beam.pvalue.PDone:
        prefix = join_url(self.output, ERRORS_STEM)
        check_sink_input(errors, self.label, "record", prefix)
        return (
            errors
            | "ToJson" >> beam.Map(error_line)
            | "WriteErrors" >> beam.io.WriteToText(prefix, file_name_suffix=".jsonl", shard_name_template=SHARD_TEMPLATE)
        )
