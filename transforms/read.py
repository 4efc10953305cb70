"""`ReadDocuments`: files matched by fsspec globs to Documents, with byte-range splitting.

The byte ranges are planned in `elmo_pipeline.corpus.byte_ranges` and the parsing lives in
`elmo_pipeline.corpus.readers`; this module only distributes the work.
"""

from __future__ import annotations

from collections.abc import Sequence

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.transforms import window
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils.timestamp import Timestamp

from elmo_pipeline.corpus.byte_ranges import WorkItem, number_ranges, plan_work, range_newlines
from elmo_pipeline.corpus.input_files import InputError, expand_patterns
from elmo_pipeline.corpus.options import DEFAULT_MAX_DOCUMENT_MB
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import ReadStats, read_work_item
from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.strict import check_ints
from elmo_pipeline.transforms.checks import check_collection, check_element, check_root
from elmo_pipeline.transforms.metrics import (BYTES_READ, DOCUMENTS_READ, DUPLICATE_DOC_IDS, INPUT_FILES, READ_ERRORS,
                                              BundleCounts)

# places named in a duplicate-id error: enough to find the culprits, bounded per id
_DUPLICATE_EXAMPLES = 3


class ReadDocuments(beam.PTransform):
    """Reads documents from the files matched by `patterns`; applied to the pipeline root.
    `input_format` is "text", "jsonl" or "parquet"; `text_field` and `id_field` name the JSONL field
    or Parquet column of the text and of the document id (None: ids are `<file>:<line>`).

    Globs are expanded at construction, so a pattern matching nothing raises `InputError` before
    the pipeline runs. Large uncompressed line-based files are cut into ranges of `split_bytes`
    (see `elmo_pipeline.corpus.byte_ranges` for how line numbers stay exact), and into at least `min_splits`
    ranges when large enough (`plan_ranges`): give the number of workers so that one big file
    spreads over all of them; the ranges are reshuffled, so they reach different workers.
    `timestamp_required`: a record without a `timestamp_field` value is an error, as one without
    an id. `max_document_mb`: a line (a file with `doc_per="file"`, a Parquet text value) of more
    MiB is an error record, not read: it is never held whole.
    Returns `{"documents": PCollection[Document], "errors": PCollection[ErrorRecord]}`.
    Counters (namespace "elmo_pipeline"): input_files (files planned: the number matched, which a
    runner that reports metrics must give back), documents_read (every record read: a Document or
    an ErrorRecord, a file that cannot be read counting once), read_errors (the ErrorRecords),
    bytes_read; so documents_read = Documents + read_errors.
    Not Beam's ReadFromText: it gives no line numbers (document ids are `<file>:<line>`) and reads no
    JSONL fields, Parquet columns or multi-frame zstd.
    """

    def __init__(
        self,
        patterns: Sequence[str],
        input_format: str = "text",
        doc_per: str = "line",
        text_field: str = "text",
        id_field: str | None = None,
        timestamp_field: str | None = None,
        split_bytes: int = 64 * 2**20,
        min_splits: int = 1,
        timestamp_required: bool = False,
        max_document_mb: float = DEFAULT_MAX_DOCUMENT_MB,
    ) -> None:
        super().__init__()
        self._options = ReadOptions(input_format, doc_per, text_field, id_field, timestamp_field, timestamp_required,
                                    max_document_mb)
        check_ints(split_bytes=split_bytes, min_splits=min_splits)
        if split_bytes < 1 or min_splits < 1:
            raise InputError(f"split_bytes and min_splits must be >= 1, got {split_bytes} and {min_splits}")
        self._split_bytes = split_bytes
        self.min_splits = min_splits
        self._urls = expand_patterns(patterns)

    @property
    def urls(self) -> list[str]:
        """The files the patterns matched, which the transform reads."""
        return list(self._urls)

    def expand(self, root: beam.pvalue.PBegin) -> dict[str, beam.PCollection]:
        check_root(self.label, root)
        work = (
            root
            | "Files" >> beam.Create(self._urls)
            | "Plan" >> beam.ParDo(_PlanFn(self._options, self._split_bytes, self.min_splits))
            | "SpreadCounting" >> beam.Reshuffle()
            | "CountNewlines" >> beam.Map(lambda item: (item.url, (item, range_newlines(item))))
            | "ByFile" >> beam.GroupByKey()
            | "NumberRanges" >> beam.FlatMap(lambda url_counted: number_ranges(url_counted[1]))
            | "SpreadReading" >> beam.Reshuffle()
        )
        results = work | "Read" >> beam.ParDo(_ReadFn(self._options)).with_outputs("errors", main="documents")
        return {"documents": results.documents, "errors": results.errors}


class _PlanFn(beam.DoFn):
    """A file's work items (byte ranges); counts the files planned once per bundle (BundleCounts)."""

    def __init__(self, options: ReadOptions, split_bytes: int, min_splits: int) -> None:
        self._options, self._split_bytes, self._min_splits = options, split_bytes, min_splits

    def start_bundle(self) -> None:
        self._counts = BundleCounts()

    def process(self, url: str):
        self._counts.add(INPUT_FILES)
        yield from plan_work(url, self._options, self._split_bytes, self._min_splits)

    def finish_bundle(self) -> None:
        self._counts.commit()


class _ReadFn(beam.DoFn):
    """Counters are incremented when a bundle finishes, so a bundle that fails and is retried counts once.
    A rejected record counts as read too: summary.json's documents read = tokenized + rejected."""

    def __init__(self, options: ReadOptions) -> None:
        self._options = options

    def start_bundle(self) -> None:
        self._counts = BundleCounts()

    def process(self, item: WorkItem):
        stats = ReadStats()
        for record in read_work_item(item, self._options, stats):
            self._counts.add(DOCUMENTS_READ)
            if isinstance(record, Document):
                yield record
            else:
                self._counts.add(READ_ERRORS)
                yield pvalue.TaggedOutput("errors", record)
        self._counts.add(BYTES_READ, stats.bytes_read)

    def finish_bundle(self) -> None:
        self._counts.commit()


class _IdUses(beam.CombineFn):
    """(count, the first few (source, line, timestamp in microseconds) in sorted order): the same
    result whatever the order or grouping of the inputs. Not Count.PerKey: the error names where
    the first uses are."""

    def create_accumulator(self) -> tuple[int, list]:
        return 0, []

    def add_input(self, acc: tuple[int, list], place: tuple[str, int, int]) -> tuple[int, list]:
        return acc[0] + 1, sorted(acc[1] + [place])[:_DUPLICATE_EXAMPLES]

    def merge_accumulators(self, accs) -> tuple[int, list]:
        total, places = 0, []
        for count, some in accs:
            total += count
            places = sorted(places + some)[:_DUPLICATE_EXAMPLES]
        return total, places

    def extract_output(self, acc: tuple[int, list]) -> tuple[int, list]:
        return acc


def _duplicate_error(doc_id: str, uses: tuple[int, list]) -> ErrorRecord:
    count, places = uses
    shown = ", ".join(f"{source}:{line}" for source, line, _ in places)
    return ErrorRecord(places[0][0], places[0][1],
                       f"document id {doc_id!r} is used by {count} documents (first: {shown}); "
                       "their token_ids are not unique", "ids", doc_id)


@beam.typehints.with_input_types(Document)
class FindDuplicateIds(beam.PTransform):
    """PCollection[Document] -> one ErrorRecord (stage "ids") per document id used more than once.

    The documents themselves go on unchanged: this only reports that their `token_id`s collide,
    which a feature store keyed on `token_id` cannot tell apart. Costs one shuffle of the ids.
    Windowed documents are checked as one collection (the writers put every window in the same
    files), and an id's error goes in the window of the first document it names; those of an
    unbounded collection (a streaming source), which has no end, window by window.
    Counter: duplicate_doc_ids (ids used more than once)."""

    def expand(self, documents: beam.PCollection) -> beam.PCollection:
        check_collection(self.label, documents)
        windowing = documents.windowing
        if not documents.is_bounded or isinstance(windowing.windowfn, GlobalWindows):
            # an unbounded collection (a streaming source) has no end at which the global window
            # could be counted: there each window is checked on its own
            return self._report(documents)
        # counted per window, an id used in two windows was not found
        documents = documents | "GlobalWindows" >> beam.WindowInto(GlobalWindows())
        # back in the input's windows: a Flatten with the tokenizer's errors, in those windows, failed
        # to decode its input once the job ran
        return self._report(documents) | "InTheirWindows" >> beam.WindowInto(windowing.windowfn)

    @staticmethod
    def _report(documents: beam.PCollection) -> beam.PCollection:
        return (
            documents
            | "IdPlaces" >> beam.Map(_id_place)
            | "CountIds" >> beam.CombinePerKey(_IdUses())
            | "Duplicated" >> beam.ParDo(_ReportDuplicates())
        )


def _id_place(document: Document, at: Timestamp = beam.DoFn.TimestampParam) -> tuple[str, tuple[str, int, int]]:
    check_element("FindDuplicateIds", document, Document)
    return document.doc_id, (document.source, document.line, at.micros)


class _ReportDuplicates(beam.DoFn):
    """An ErrorRecord per id used more than once, at the time of the first document it names;
    counted when the bundle finishes: extract checks the error records in its files against this
    count, which a retried bundle must not inflate."""

    def start_bundle(self) -> None:
        self._counts = BundleCounts()

    def process(self, item: tuple[str, tuple[int, list]]):
        doc_id, uses = item
        if uses[0] > 1:
            self._counts.add(DUPLICATE_DOC_IDS)
            yield window.TimestampedValue(_duplicate_error(doc_id, uses), Timestamp(micros=uses[1][0][2]))

    def finish_bundle(self) -> None:
        self._counts.commit()
