"""The extract job's Beam counters: one namespace and one name per count, so the transforms that
count and `pipelines.extract.summarize`, which adds them up and reconciles them, cannot drift apart."""

from __future__ import annotations

from apache_beam.metrics import Metrics

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
