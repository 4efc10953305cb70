"""The records that flow between pipeline stages. Plain NamedTuples: cheap to pickle, no Beam.

A document becomes sentences, a sentence becomes one embedded sentence; per-token data stays
in numpy arrays so that no stage builds a Python object per token.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from elmo_pipeline.strict import has_lone_surrogate  # Parquet strings are UTF-8


def doc_id_problem(doc_id: str) -> str | None:
    """Why the string `doc_id` cannot key the output's rows; None when it can."""
    if has_lone_surrogate(doc_id):
        return "holds a lone surrogate, which UTF-8 cannot encode"
    if "\x00" in doc_id:
        return "contains a NUL character, which key stores refuse"
    return None


class Document(NamedTuple):
    doc_id: str  # the id field when given, else "<url>:<line>" (line numbers start at 1)
    text: str
    source: str  # the file it came from
    line: int  # 1-based line of the record (1 for a document-per-file input)
    timestamp: str | None = None  # optional event time (ISO 8601), carried to the output


class ErrorRecord(NamedTuple):
    source: str
    line: int | None  # None when the whole file failed
    reason: str
    stage: str  # "read", "tokenize", or "ids" (a document id used twice)
    doc_id: str | None = None

    def to_json_dict(self) -> dict:
        # a caller's Document may number its line with numpy (a pandas index) or name its source
        # with a pathlib.Path, which JSON cannot write: the errors file failed the whole job on it
        line = int(self.line) if isinstance(self.line, np.integer) else self.line
        source = os.fspath(self.source) if isinstance(self.source, os.PathLike) else self.source
        return {**self._asdict(), "line": line, "source": source}


class Sentence(NamedTuple):
    doc_id: str
    sentence_index: int  # position of the sentence in its document
    window_index: int  # 0 unless the sentence was longer than the token limit and cut
    tokens: tuple[str, ...]
    char_starts: np.ndarray  # (n,) int64 offsets into the document text
    char_ends: np.ndarray  # (n,) int64, exclusive
    timestamp: str | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.doc_id, self.sentence_index, self.window_index)


class EmbeddedSentence(NamedTuple):
    sentence: Sentence
    layers: np.ndarray  # (L+1, n, 2P) float32
    mixes: dict[str, np.ndarray]  # name -> (n, 2P) float32
