"""Labelled token files: CoNLL-U (UD treebanks) and CoNLL-2003 style columns.

Both give sentences of (token, label) pairs with the file's own tokenization:
- CoNLL-U: ten tab-separated columns; multiword-token lines (`1-2`) and empty nodes (`1.1`) are
  skipped, so the tokens are the syntactic words that carry UPOS. The label is a column name:
  upos (default), xpos, deprel, lemma, feats.
- CoNLL-2003: whitespace-separated columns, the token first; `-DOCSTART-` lines and blank lines
  end sentences. The label is a column index (default -1, the last: NER in CoNLL-2003).
Files are paths or fsspec URLs; .gz/.bz2/.xz/.zst are decompressed by extension.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

from elmo_pipeline.corpus.inputs import open_input

FORMATS = ("auto", "conllu", "conll2003")
CONLLU_COLUMNS = {"form": 1, "lemma": 2, "upos": 3, "xpos": 4, "feats": 5, "deprel": 7}


class ConllError(ValueError):
    pass


@dataclass(frozen=True)
class LabelledSentence:
    tokens: tuple[str, ...]
    labels: tuple[str, ...]
    sent_id: str | None = None  # the `# sent_id = ...` comment of CoNLL-U, when present


def detect_format(url: str) -> str:
    """conllu for `.conllu` files or when the first token line has ten tab-separated fields
    with an integer id; conll2003 otherwise."""
    name = url.rsplit("/", 1)[-1]
    for ext in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(ext)
    if name.endswith(".conllu"):
        return "conllu"
    with open_input(url) as raw:
        for line in io.TextIOWrapper(raw, encoding="utf-8-sig"):
            line = line.rstrip("\r\n")
            if not line or line.startswith(("#", "-DOCSTART-")):
                continue
            fields = line.split("\t")
            return "conllu" if len(fields) == 10 and fields[0].split("-")[0].split(".")[0].isdigit() else "conll2003"
    return "conll2003"


def read_labelled(url: str, fmt: str = "auto", label: str | int | None = None) -> Iterator[LabelledSentence]:
    """The sentences of one file, in order. `label`: a CoNLL-U column name or a CoNLL-2003 column index."""
    if fmt not in FORMATS:
        raise ConllError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "auto":
        fmt = detect_format(url)
    if fmt == "conllu":
        return read_conllu(url, "upos" if label is None else str(label))
    return read_conll2003(url, -1 if label is None else int(label))


def _lines(url: str) -> Iterator[tuple[int, str]]:
    with open_input(url) as raw:
        for number, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8-sig", newline=""), start=1):
            yield number, line.rstrip("\r\n")


def read_conllu(url: str, label: str = "upos") -> Iterator[LabelledSentence]:
    if label not in CONLLU_COLUMNS:
        raise ConllError(f"CoNLL-U label must be one of {sorted(CONLLU_COLUMNS)}, got {label!r}")
    column = CONLLU_COLUMNS[label]
    tokens: list[str] = []
    labels: list[str] = []
    sent_id = None
    for number, line in _lines(url):
        if not line.strip():
            if tokens:
                yield LabelledSentence(tuple(tokens), tuple(labels), sent_id)
            tokens, labels, sent_id = [], [], None
            continue
        if line.startswith("#"):
            key, sep, value = line[1:].partition("=")
            if sep and key.strip() == "sent_id":
                sent_id = value.strip()
            continue
        fields = line.split("\t")
        if len(fields) != 10:
            raise ConllError(f"{url}:{number}: expected 10 tab-separated fields, got {len(fields)}")
        if "-" in fields[0] or "." in fields[0]:  # multiword token or empty node
            continue
        if not fields[1]:
            raise ConllError(f"{url}:{number}: empty FORM")
        tokens.append(fields[1])
        labels.append(fields[column])
    if tokens:
        yield LabelledSentence(tuple(tokens), tuple(labels), sent_id)


def read_conll2003(url: str, label: int = -1) -> Iterator[LabelledSentence]:
    tokens: list[str] = []
    labels: list[str] = []
    for number, line in _lines(url):
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            if tokens:
                yield LabelledSentence(tuple(tokens), tuple(labels))
            tokens, labels = [], []
            continue
        try:
            value = fields[label]
        except IndexError:
            raise ConllError(f"{url}:{number}: no column {label} in {len(fields)} columns") from None
        if len(fields) < 2:
            raise ConllError(f"{url}:{number}: expected a token and at least one label column")
        tokens.append(fields[0])
        labels.append(value)
    if tokens:
        yield LabelledSentence(tuple(tokens), tuple(labels))
