"""How input files are parsed into documents: the format, a document per line or per file, and
the fields that hold the text, the id and the event time. Checked when made, so that a bad
combination is refused before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from elmo_pipeline.corpus.input_files import InputError
from elmo_pipeline.corpus.options import DEFAULT_MAX_DOCUMENT_MB, MIB_RULE, is_mib, mib_shown
from elmo_pipeline.strict import check_bools

FORMATS = ("text", "jsonl", "parquet")
DOC_PER = ("line", "file")


@dataclass(frozen=True)
class ReadOptions:
    """How files are parsed into documents."""

    input_format: str = "text"  # "text", "jsonl" or "parquet"
    doc_per: str = "line"  # "line" or "file" (a document per file; text format only)
    text_field: str = "text"  # JSONL field or Parquet column holding the text
    id_field: str | None = None  # field/column of the document id; None: "<url>:<line>"
    timestamp_field: str | None = None  # optional field/column of an ISO 8601 event time
    timestamp_required: bool = False  # a record without a time (missing or null) is an error, as without an id
    max_document_mb: float = DEFAULT_MAX_DOCUMENT_MB  # a larger line, file or text value is an error record

    @property
    def max_document_bytes(self) -> int:
        return max(1, int(self.max_document_mb * 2**20))  # a bound of 1e-9 MiB is still a byte

    def too_large(self, what: str, named: bool = True) -> str:
        """The reason of the error record of a `what` ("line", "file", ...) past the bound; `named`:
        the flag that sets it is named (False for a command without --max-document-mb)."""
        bound = mib_shown(self.max_document_mb)
        flag = f" (--max-document-mb {bound})" if named else ""
        return f"{what} of more than {bound} MiB{flag}: not read"

    def __post_init__(self) -> None:
        for name, value in (("text_field", self.text_field), ("id_field", self.id_field),
                            ("timestamp_field", self.timestamp_field)):
            # None or an int as the text field failed the job in its readers ("KeyError: None"); "" is a
            # name (a Parquet column or JSON key may have it). A TypeError, as a count of the wrong type is
            if (value is not None or name == "text_field") and not isinstance(value, str):
                raise TypeError(f"{name} {value!r} is not a str: give the name of a JSONL field or Parquet column")
        # "no" was taken for True: records without a time rejected
        check_bools(timestamp_required=self.timestamp_required)
        bound = self.max_document_mb
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            raise TypeError(f"max_document_mb must be a number of MiB, got {bound!r}")
        if not is_mib(bound):  # nan or 0 would reject every document
            raise InputError(f"max_document_mb must be {MIB_RULE}, got {bound!r}")
        if self.input_format not in FORMATS:
            raise InputError(f"input format must be one of {FORMATS}, got {self.input_format!r}")
        if self.doc_per not in DOC_PER:
            raise InputError(f"doc_per must be one of {DOC_PER}, got {self.doc_per!r}")
        if self.doc_per == "file" and self.input_format != "text":
            raise InputError(f"doc_per='file' needs the text format, got {self.input_format!r}")
        if self.input_format == "text" and (self.id_field is not None or self.timestamp_field is not None):
            raise InputError("id_field and timestamp_field need the jsonl or parquet format: text has no fields")
        if self.timestamp_required and self.timestamp_field is None:
            raise InputError("timestamp_required needs a timestamp_field")
