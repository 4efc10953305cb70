"""The input and tokenization options that `extract` and `prepare` share: both read corpora
through `corpus/readers.py` and tokenize them through `corpus/tokenization.py`.

Numbers are checked as they are parsed (`int_in`, `mib`), so a bad value stops the command with
argparse's message naming the option, before the output folder is touched or any work starts."""

from __future__ import annotations

import argparse
from typing import Callable

DEFAULT_MAX_SENTENCE_TOKENS = 256
DEFAULT_LANG = "en"  # --lang when none is given
# A document (a line, a file read whole, a Parquet text value) larger than this is an error record,
# not read: a line of 3 GiB without a newline was held whole and took the job down with it.
DEFAULT_MAX_DOCUMENT_MB = 64.0
MAX_MIB = 2**20  # 1 TiB: larger sizes mean nothing here, and their byte counts would overflow a float


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer from `low` to `high` (no upper bound when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text}")
        return value

    return parse


MIB_RULE = f"a finite number of MiB above 0 and at most {MAX_MIB}"


def is_mib(value: float) -> bool:
    """Whether `value` is a size in MiB (MIB_RULE): for the flags and for the Python API alike."""
    # no math.isfinite: it raised OverflowError on an int past a float (10**400), which this
    # refuses as it does nan (no comparison holds) and inf
    return 0 < value <= MAX_MIB


def mib(text: str) -> float:
    """An argparse `type`: a size in MiB, a finite number above 0 and at most MAX_MIB (nan, inf,
    0 and negative sizes would cut a file into ranges of one byte, or fail to convert to bytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not is_mib(value):
        raise argparse.ArgumentTypeError(f"must be {MIB_RULE}, got {text}")
    return value


def add_input_args(parser: argparse.ArgumentParser, output_help: str, overwrite_help: str) -> argparse._ArgumentGroup:
    """The "input and output" group; the command adds its own options to the group returned."""
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", action="extend", nargs="+", required=True, metavar="GLOB",
                    help="fsspec URLs or globs of input files: several after one --input (as a shell expands "
                         "a glob) and --input repeated are all read; .gz/.bz2/.xz/.zst by extension or first bytes")
    io.add_argument("--output", required=True, help=output_help)
    io.add_argument("--overwrite", action="store_true", help=overwrite_help)
    io.add_argument("--format", dest="input_format", default="text", choices=("text", "jsonl", "parquet"),
                    help="input records: text lines (or files), JSONL records or Parquet rows")
    io.add_argument("--doc-per", default="line", choices=("line", "file"),
                    help="text format: a document per line or per file")
    io.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    io.add_argument("--id-field", default=None, help="JSONL field / Parquet column holding the document id")
    io.add_argument("--split-mb", type=mib, default=64.0,
                    help="split large uncompressed files into ranges of at most this many MiB; with several local "
                         "workers a file of at least 64 KiB per worker is cut into at least one range per worker")
    add_max_document_mb(io, "a line (a file with --doc-per file, a Parquet text value) of more MiB is an error "
                            "record, not read, and reading goes on")
    return io


def mib_shown(value: float) -> str:
    """A count of MiB as given, to the last digit (:g keeps six: the largest bound read 1.04858e+06)."""
    return repr(float(value)).removesuffix(".0")


def add_max_document_mb(group: argparse._ActionsContainer, help_text: str,
                        default: float | None = DEFAULT_MAX_DOCUMENT_MB) -> None:
    """--max-document-mb, for every command that reads lines of a corpus: one default and rule
    (None where a command must tell whether it was given)."""
    group.add_argument("--max-document-mb", type=mib, default=default, help=help_text)


def check_input_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the options that do not go together: field options need a format
    with fields. Called before any work (and before --overwrite clears anything)."""
    if args.doc_per == "file" and args.input_format != "text":
        raise ValueError(f"--doc-per file needs --format text, not --format {args.input_format}")
    if args.input_format != "text":
        return
    given = {"--id-field": args.id_field, "--timestamp-field": getattr(args, "timestamp_field", None),
             "--text-field": None if args.text_field == "text" else args.text_field}
    named = [option for option, value in given.items() if value is not None]
    if named:  # else every line would be rejected for a field it cannot have
        verb = "needs" if len(named) == 1 else "need"
        raise ValueError(f"{' and '.join(named)} {verb} --format jsonl or parquet: lines of text have no fields")


def add_tokenization_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "tokenization" group (spaCy); the command adds its own options to the group returned."""
    tok = parser.add_argument_group("tokenization")
    tok.add_argument("--lang", default=DEFAULT_LANG,
                     help="spaCy language code of the blank pipeline (en, zh, de, ...); a --spacy-model has its own")
    tok.add_argument("--spacy-model", default=None, help="an installed spaCy pipeline to use instead of a blank one")
    tok.add_argument("--max-sentence-tokens", type=int_in(1), default=DEFAULT_MAX_SENTENCE_TOKENS,
                     help="longer sentences are cut into windows")
    return tok
