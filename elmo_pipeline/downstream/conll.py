"""Labelled token files: CoNLL-U (UD treebanks) and CoNLL-2003 style columns.

Both give sentences of (token, label) pairs with the file's own tokenization:
- CoNLL-U: ten tab-separated columns; multiword-token lines (`1-2`) and empty nodes (`1.1`) are
  skipped, so the tokens are the syntactic words that carry UPOS. The label is a column name:
  upos (default), xpos, deprel, lemma, feats. `_` there means "unspecified": such a token keeps
  its place in the sentence (it is embedded) with the label None, so it is neither trained on
  nor scored. An ID that is not a word (`1`), a range (`1-2`) or an empty node (`1.1`), a FORM
  that is empty, blank, holds NUL or has whitespace at its ends, a value of a label column that is
  empty or has whitespace at its ends, and words not numbered 1, 2, ... in their sentence, are
  errors naming the file and line.
- CoNLL-2003: whitespace-separated columns, the token first; `-DOCSTART-` lines and blank lines
  end sentences. The label is a column index (default -1, the last: NER in CoNLL-2003). The
  format gives `_` no meaning, so it is a label like any other there.
Files are paths or fsspec URLs; .gz/.bz2/.xz/.zst are decompressed by extension. Lines are read as
`extract` reads text (only `\n` ends a line, a BOM is dropped); a line that is not UTF-8 is an
error naming the file and line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from elmo_pipeline.corpus.readers import read_text_lines
from elmo_pipeline.corpus.records import ErrorRecord

FORMATS = ("auto", "conllu", "conll2003")
CONLLU_COLUMNS = {"form": 1, "lemma": 2, "upos": 3, "xpos": 4, "feats": 5, "deprel": 7}
UNSPECIFIED = "_"  # CoNLL-U's value for a field that is not given
# The IDs the UD validator accepts: a word, a multiword-token range, an empty node.
_WORD_ID = re.compile(r"[1-9][0-9]*")
_SKIPPED_ID = re.compile(r"[1-9][0-9]*-[1-9][0-9]*|(?:0|[1-9][0-9]*)\.[1-9][0-9]*")


class ConllError(ValueError):
    pass


@dataclass(frozen=True)
class LabelledSentence:
    tokens: tuple[str, ...]
    labels: tuple[str | None, ...]  # None: unspecified in the file (CoNLL-U `_`), not a label
    sent_id: str | None = None  # the `# sent_id = ...` comment of CoNLL-U, when present


def detect_format(url: str) -> str:
    """conllu for `.conllu` files or when the first token line has ten tab-separated fields
    with an integer id; conll2003 otherwise."""
    return _detected_format(url) or "conll2003"


def _detected_format(url: str) -> str | None:
    """detect_format's answer, None for a file that is not named .conllu and has no token line: it
    tells neither. A line of whitespace alone ends a sentence in both formats, so it is no token line."""
    name = url.rsplit("/", 1)[-1]
    for ext in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(ext)
    if name.endswith(".conllu"):
        return "conllu"
    for _, line in _lines(url):
        if not line.strip() or line.startswith(("#", "-DOCSTART-")):
            continue
        fields = line.split("\t")
        return "conllu" if len(fields) == 10 and fields[0].split("-")[0].split(".")[0].isdigit() else "conll2003"
    return None


def common_format(files: Mapping[str, str]) -> str:
    """The format detected in every one of `files` (split -> URL), or a ConllError naming each
    file's. Read in the train file's format, a CoNLL-U dev file beside CoNLL-2003 train was taken
    for CoNLL-2003: its IDs as the tokens, its last column (MISC) as the labels, scored 0%. A file
    without a token line takes no part (it is refused later as holding no labelled token)."""
    found = {split: fmt for split, url in files.items() if (fmt := _detected_format(url)) is not None}
    if len(set(found.values())) > 1:
        each = ", ".join(f"{split} file {files[split]} reads as {fmt}" for split, fmt in found.items())
        raise ConllError(f"the labelled files are not of one format ({each}): give them in one format")
    return next(iter(found.values()), "conll2003")


def read_labelled(url: str, fmt: str = "auto", label: str | int | None = None) -> Iterator[LabelledSentence]:
    """The sentences of one file, in order. `label`: a CoNLL-U column name or a CoNLL-2003 column index."""
    if fmt not in FORMATS:
        raise ConllError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "auto":
        fmt = detect_format(url)
    if fmt == "conllu":
        return read_conllu(url, "upos" if label is None else str(label))
    return read_conll2003(url, -1 if label is None else _column_index(url, label))


def _column_index(url: str, label: str | int) -> int:
    """A CoNLL-2003 label column as the index it must be; a column name (`upos`) is CoNLL-U's."""
    try:
        return int(label)
    except ValueError:
        raise ConllError(f"--label {label!r}: {url} is read as CoNLL-2003, whose label is a column index (1 for "
                         "the second column, -1 for the last); column names such as upos are for CoNLL-U "
                         "(--format conllu)") from None


def _lines(url: str) -> Iterator[tuple[int, str]]:
    """(line number, text) as `extract` reads a text file; a line it would reject (not UTF-8, NUL)
    is an error naming the file and line, not a decoder's message without either (a file that
    cannot be decompressed is `read_text_lines`' OSError naming it)."""
    for number, text in read_text_lines(url):
        if isinstance(text, ErrorRecord):
            raise ConllError(f"{url}:{number}: {text.reason}")
        yield number, text


def read_conllu(url: str, label: str = "upos") -> Iterator[LabelledSentence]:
    if label not in CONLLU_COLUMNS:
        raise ConllError(f"--label {label!r}: a CoNLL-U label is one of the columns {sorted(CONLLU_COLUMNS)} "
                         f"({url} is read as CoNLL-U)")
    tokens: list[str] = []
    labels: list[str | None] = []
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
        if _is_skipped(url, number, fields[0]):
            continue
        if int(fields[0]) != len(tokens) + 1:  # two sentences run together, or a word lost, would go unseen
            raise ConllError(f"{url}:{number}: word ID {fields[0]} where {len(tokens) + 1} was expected (a sentence's "
                             "words are numbered 1, 2, ...; a blank line ends a sentence)")
        tokens.append(_form(url, number, fields[1]))
        _check_label_values(url, number, fields)
        labels.append(_label(fields, label))
    if tokens:
        yield LabelledSentence(tuple(tokens), tuple(labels), sent_id)


def _is_skipped(url: str, number: int, token_id: str) -> bool:
    """Whether a line is a multiword token or an empty node, which carry no word of the sentence;
    an ID of neither kind nor a word's (`abc`, `1-`) is refused rather than read as a word."""
    if _WORD_ID.fullmatch(token_id):
        return False
    if _SKIPPED_ID.fullmatch(token_id):
        return True
    raise ConllError(f"{url}:{number}: ID {token_id!r} is not a word (1), a multiword token (1-2) or an empty node "
                     "(1.1)")


def _form(url: str, number: int, form: str) -> str:
    """A word's FORM, which is embedded as a token: one of no text would be a vector of nothing.
    (A NUL in it stopped `_lines` already: extract refuses such text.) Whitespace at its ends, which
    CoNLL-U does not allow, would be embedded: ' cat' is another token and vector than 'cat'."""
    if not form.strip():
        raise ConllError(f"{url}:{number}: FORM {form!r} is empty or blank")
    if form != form.strip():
        raise ConllError(f"{url}:{number}: FORM {form!r} has whitespace at its start or end, which CoNLL-U does not "
                         f"allow (embedded so, it is another token than {form.strip()!r})")
    return form


def _check_label_values(url: str, number: int, fields: list[str]) -> None:
    """Refuses an empty value, or one with whitespace at its ends, in a column that can be the label:
    CoNLL-U allows neither (it writes `_` for a value not given), and read as it was, '' or 'NOUN '
    was a label of its own beside 'NOUN'. Every such column is checked, whichever is the label, so
    that the extraction's own read of the file (which takes no label) refuses what this one does."""
    for name, column in CONLLU_COLUMNS.items():
        value = fields[column]
        if name != "form" and (not value or value != value.strip()):
            raise ConllError(f"{url}:{number}: {name.upper()} {value!r} is empty or has whitespace at its start or "
                             "end, which CoNLL-U does not allow (it writes _ for a value not given); read so, it "
                             "would be a label of its own")


def _label(fields: list[str], label: str) -> str | None:
    """The `label` column's value, None where CoNLL-U leaves it unspecified. A LEMMA `_` of the FORM
    `_` is that word's lemma, not a gap."""
    value = fields[CONLLU_COLUMNS[label]]
    if value == UNSPECIFIED and not (label == "lemma" and fields[1] == UNSPECIFIED):
        return None
    return value


def read_conll2003(url: str, label: int = -1) -> Iterator[LabelledSentence]:
    """Every token line has the columns of the first: with a column missing, `label` (-1 above
    all) would name another column of that line, a chunk tag taken for an NER tag."""
    tokens: list[str] = []
    labels: list[str] = []
    first: tuple[int, int] | None = None  # (line number, columns) of the first token line
    for number, line in _lines(url):
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            if tokens:
                yield LabelledSentence(tuple(tokens), tuple(labels))
            tokens, labels = [], []
            continue
        if first is None:
            first = (number, len(fields))
            _check_label_column(url, number, label, len(fields))
        elif len(fields) != first[1]:
            raise ConllError(f"{url}:{number}: {len(fields)} columns, but line {first[0]} has {first[1]}; every "
                             "token line needs the same columns (a missing one would move the label)")
        tokens.append(fields[0])
        labels.append(fields[label])
    if tokens:
        yield LabelledSentence(tuple(tokens), tuple(labels))


def _check_label_column(url: str, number: int, label: int, columns: int) -> None:
    if columns < 2:
        raise ConllError(f"{url}:{number}: expected a token and at least one label column")
    if not -columns <= label < columns:
        raise ConllError(f"{url}:{number}: no column {label} in {columns} columns")
    if label % columns == 0:
        raise ConllError(f"{url}:{number}: column {label} is the token itself, not a label; give a label column "
                         f"(1 to {columns - 1}, or -1 for the last)")
