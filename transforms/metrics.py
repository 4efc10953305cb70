"""The jobs' Beam counters: one namespace and one name per count, so the transforms that count
and `pipelines.extract.summarize` (and prepare's check of its errors), which add them up and
reconcile them, cannot drift apart."""

from __future__ import annotations

from typing import Any

from apache_beam.metrics import Metrics, MetricsFilter

NAMESPACE = "elmo_pipeline"

# read.py
INPUT_FILES = "input_files"
DOCUMENTS_READ = "documents_read"
READ_ERRORS = "read_errors"
BYTES_READ = "bytes_read"
DUPLICATE_DOC_IDS = "duplicate_doc_ids"
# tokenize.py (SENTENCES, TOKENS and WINDOWS_CUT also by pretokenized.py)
DOCUMENTS_TOKENIZED = "documents_tokenized"
EMPTY_DOCUMENTS = "empty_documents"
TOKENIZE_ERRORS = "tokenize_errors"
SENTENCES = "sentences"
TOKENS = "tokens"
WINDOWS_CUT = "windows_cut"
LONG_TOKENS = "long_tokens"  # tokens of LONG_RUN_CHARS or more characters: runs spaCy did not split
ZH_CHAR_FALLBACK_DOCUMENTS = "zh_char_fallback_documents"
# embed.py
BATCHES = "batches"
BATCH_TOKENS = "batch_tokens"
BATCH_PADDED_TOKENS = "batch_padded_tokens"
OOM_SPLITS = "oom_splits"
# + "<device type>/<kernel>": the tokens each worker embedded, counted by what it embedded them with
EMBEDDED_ON = "tokens_embedded_on:"
# write.py
TOKEN_ROWS_WRITTEN = "token_rows_written"
SENTENCES_WRITTEN = "sentences_written"
NONFINITE_VALUES = "nonfinite_values"  # vector values written that are not finite in the output dtype
# + "<column>": those of one vector column
NONFINITE_IN = "nonfinite_values:"

# what an extract summary reports, in its order
COUNTERS = (INPUT_FILES, DOCUMENTS_READ, READ_ERRORS, DOCUMENTS_TOKENIZED, EMPTY_DOCUMENTS, TOKENIZE_ERRORS,
            SENTENCES, TOKENS, WINDOWS_CUT, LONG_TOKENS, BATCHES, BATCH_TOKENS, BATCH_PADDED_TOKENS, OOM_SPLITS,
            TOKEN_ROWS_WRITTEN, SENTENCES_WRITTEN, NONFINITE_VALUES, DUPLICATE_DOC_IDS, ZH_CHAR_FALLBACK_DOCUMENTS)


def job_counters(result: Any) -> tuple[list[tuple[str, int]], str | None]:
    """(name, value) of each of the job's counters in our namespace as the finished job `result`
    reports them (committed where the runner has them), and None; or no counters and why not."""
    try:
        counters = result.metrics().query(MetricsFilter())["counters"]
    except Exception as exc:  # noqa: BLE001 - whatever a runner raises here, its counts are unknown
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return [], f"the runner cannot report metrics ({detail})"
    return [(c.key.metric.name, (c.committed if c.committed is not None else c.attempted) or 0)
            for c in counters if c.key.metric.namespace == NAMESPACE], None


def counter(name: str) -> Metrics.DelegatingCounter:
    """The job's counter `name`."""
    return Metrics.counter(NAMESPACE, name)


class BundleCounts:
    """A DoFn's counts over one bundle, added to the job's counters when the bundle finishes
    (`commit`, the last thing `finish_bundle` does): a bundle that fails is retried whole, and a
    runner may keep what its failed attempt incremented (the BundleBasedDirectRunner does)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, name: str, value: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + value

    def commit(self) -> None:
        counts, self._counts = self._counts, {}
        for name, value in counts.items():
            if value:
                counter(name).inc(value)
