"""The input and tokenization options that `extract` and `prepare` share: both read corpora
through `corpus/inputs.py` and tokenize them through `corpus/tokenization.py`."""

from __future__ import annotations

import argparse

DEFAULT_MAX_SENTENCE_TOKENS = 256


def add_input_args(parser: argparse.ArgumentParser, output_help: str, overwrite_help: str) -> argparse._ArgumentGroup:
    """The "input and output" group; the command adds its own options to the group returned."""
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", action="extend", nargs="+", required=True, metavar="GLOB",
                    help="fsspec URLs or globs of input files: several after one --input (as a shell expands "
                         "a glob) and --input repeated are all read; .gz/.bz2/.xz/.zst by extension")
    io.add_argument("--output", required=True, help=output_help)
    io.add_argument("--overwrite", action="store_true", help=overwrite_help)
    io.add_argument("--format", dest="input_format", default="text", choices=("text", "jsonl", "parquet"))
    io.add_argument("--doc-per", default="line", choices=("line", "file"), help="text format: a document per line or per file")
    io.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    io.add_argument("--id-field", default=None, help="JSONL field / Parquet column holding the document id")
    io.add_argument("--split-mb", type=float, default=64.0,
                    help="split large uncompressed files into ranges of at most this size; with several local "
                         "workers a file of at least 64 KiB per worker is cut into at least one range per worker")
    return io


def add_tokenization_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "tokenization" group (spaCy); the command adds its own options to the group returned."""
    tok = parser.add_argument_group("tokenization")
    tok.add_argument("--lang", default="en", help="spaCy language code of the blank pipeline (en, zh, de, ...)")
    tok.add_argument("--spacy-model", default=None, help="an installed spaCy pipeline to use instead of a blank one")
    tok.add_argument("--max-sentence-tokens", type=int, default=DEFAULT_MAX_SENTENCE_TOKENS,
                     help="longer sentences are cut into windows")
    return tok
