"""`elmo-pipeline probe` and `elmo-pipeline similarity`: downstream use of the features."""

from __future__ import annotations

import argparse
from typing import NamedTuple

from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.corpus.options import int_in
from elmo_pipeline.embedding.options import add_whole_sentence_bound
from elmo_pipeline.runtime_choices import AUTO, KERNELS


def _probe(args: argparse.Namespace) -> int:
    from elmo_pipeline.pipelines.probe import run_and_print

    return run_and_print(args)


class SenseFile(NamedTuple):
    texts: list[str]
    senses: list[str] | None  # None: the file gives no senses
    lines: list[int]  # each sentence's line number (1-based), for messages


def too_many_sentences(source: str, n: int, max_sentences: int) -> str:
    """Why `n` sentences (of `source`: "--file F holds", "given:") are refused under --max-sentences."""
    return (f"{source} {n:,} sentences, more than --max-sentences {max_sentences} (every pair is compared, and its "
            "cosines held and written by --json); raise --max-sentences")


def read_sense_file(path: str, max_sentences: int | None = None) -> SenseFile:
    """Lines `SENSE<TAB>sentence` (or just `sentence`); blank lines and `#` comments are skipped.
    Read as `extract` reads text (.gz/.bz2/.xz/.zst by extension, a BOM dropped: kept, it would
    make the first sense another one); a line that is not UTF-8 or holds NUL is refused, naming it.
    More than `max_sentences` sentences are a ValueError once every line is read and checked: those
    past it are counted, not held: a file of any size is refused holding at most `max_sentences`.
    A file that cannot be read or decompressed is an OSError naming it (`read_text_lines`)."""
    from elmo_pipeline.corpus.readers import read_text_lines
    from elmo_pipeline.corpus.records import ErrorRecord

    texts, senses, lines = [], [], []
    count = with_sense = 0
    for number, line in read_text_lines(path):
        if isinstance(line, ErrorRecord):
            raise ValueError(f"{path}, line {number}: {line.reason}")
        if not line.strip() or line.startswith("#"):
            continue
        sense, tab, text = line.partition("\t")
        if tab and not sense.strip():
            raise ValueError(f"{path}, line {number}: the sense before the tab is empty or blank")
        count, with_sense = count + 1, with_sense + bool(tab)
        if max_sentences is None or count <= max_sentences:
            texts.append(text if tab else sense)
            senses.append(sense.strip() if tab else None)  # "fruit " and "fruit" are one sense, as in --senses
            lines.append(number)
    if with_sense < count:
        if with_sense:
            raise ValueError(f"{path}: give a sense on every line or on none")
        senses = None
    if max_sentences is not None and count > max_sentences:
        raise ValueError(too_many_sentences(f"--file {path} holds", count, max_sentences))
    return SenseFile(texts, senses, lines)


def tokenize_texts(texts: list[str], lang: str, pretokenized: bool) -> list[list[str]]:
    if pretokenized:
        return [t.split() for t in texts]
    from elmo_pipeline.corpus.tokenization import check_nlp, make_doc

    nlp = check_nlp(lang)  # an unknown --lang is one line naming it, not an ImportError's traceback
    return [[tok.text for tok in doc if not tok.is_space] for doc in nlp.pipe(make_doc(nlp, text) for text in texts)]


def _similarity(args: argparse.Namespace) -> int:
    from elmo_pipeline.formats.atomic import check_output_file
    from elmo_pipeline.formats.files import model_shown
    from elmo_pipeline.formats.pretrained import model_files
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.downstream.similarity import find_word, word_similarity
    from elmo_pipeline.embedding import too_long
    from elmo_pipeline.corpus.records import has_lone_surrogate
    from elmo_pipeline.runtime import resolve_device

    for option, value in (("--json", args.json), ("--file", args.file)):
        if value is not None and not value.strip():  # an unset variable: taken for unset, the option was dropped
            raise ValueError(f"{option} {value!r} names no file; give a path or URL")
    if not args.word.strip():  # an unset variable: said to be no token of the first sentence
        raise ValueError(f"--word {args.word!r} is empty or blank; give the word to compare")
    if args.json is not None:  # before the model runs: a folder there would take the file inside it, under
        # another name, and the sentence file or the model's weights would be replaced by the JSON
        reads = [("the --file of sentences", args.file)] if args.file is not None else []
        check_output_file(args.json, reads + [(f"the model's file {f}", f) for f in model_files(args.model)])
    texts, senses = list(args.sentence), None
    where = [f"sentence s{i}" for i in range(len(texts))]  # how a message names each sentence, as the output does
    for what, text in [("--word", args.word)] + list(zip(where, texts)):
        if has_lone_surrogate(text) or "\x00" in text:  # bytes that are not UTF-8, as the shell passed them
            raise ValueError(f"{what} {text!r} is not UTF-8 text (or holds NUL); give it in UTF-8")
    if args.file is not None:
        if texts:  # taking one and dropping the other would change the result unnoticed
            raise ValueError(f"give the sentences as arguments or in --file, not both ({len(texts)} given with "
                             f"--file {args.file})")
        texts, senses, lines = read_sense_file(args.file, args.max_sentences)
        where = [f"--file {args.file}, line {number} (s{i})" for i, number in enumerate(lines)]
    if len(texts) < 2:  # said after the model loaded, naming neither the file nor what it held
        if args.file is not None:
            raise ValueError(f"--file {args.file} holds {len(texts)} sentences (blank lines and lines starting "
                             "with # are skipped); give at least two")
        raise ValueError(f"give at least two sentences ({len(texts)} given)")
    if len(texts) > args.max_sentences:  # every pair is compared: memory grows with the square of the count
        raise ValueError(too_many_sentences("given:", len(texts), args.max_sentences))  # a --file's: counted as read
    if args.senses is not None:
        if senses is not None:  # the file's own would be dropped unnoticed
            raise ValueError(f"--file {args.file} gives a sense on each line: leave --senses out, or give a file "
                             "of sentences only")
        # "fruit, fruit, company": the space after a comma is not part of a label (" fruit" was a
        # second sense, so the two fruit sentences counted as a cross-sense pair)
        senses = [sense.strip() for sense in args.senses.split(",")]
        if not all(senses):  # ",a": a sentence of no sense, grouped with others
            raise ValueError(f"--senses {args.senses!r}: a sense label is empty or blank; give one per sentence, "
                             "comma-separated")
    if args.pretokenized and args.lang is not None:
        raise ValueError(f"--lang {args.lang} chooses spaCy's tokenizer, and --pretokenized sentences are not "
                         "tokenized: give one of them")
    if senses is not None and len(senses) != len(texts):
        raise ValueError(f"--senses gives {len(senses)} senses for {len(texts)} sentences; give one per sentence")
    # an empty --lang (an unset variable) was taken for none given: English
    sentences = tokenize_texts(texts, "en" if args.lang is None else args.lang, args.pretokenized)
    for named, tokens in zip(where, sentences):  # before the model loads, naming the line, not an index
        try:
            find_word(tokens, args.word, args.ignore_case)
        except ValueError as exc:
            raise ValueError(f"{named}: {exc}") from None
        why = too_long(len(tokens), args.max_sentence_tokens)  # else torch's allocator failed, naming none
        if why is not None:
            raise ValueError(f"{named}: {why}")
    model = BiLM.load(args.model, kernel=args.kernel).to(resolve_device(args.device)).eval()
    result = word_similarity(model, sentences, args.word, senses, args.ignore_case)
    print(result.format(matrices=args.matrix))
    if args.json is not None:
        _write_json(args.json, {**result.to_dict(), "model": model_shown(args.model)})
    return 0


def _write_json(url: str, result: dict) -> None:
    """Serialized before anything is written, then written whole or not at all: a value that
    cannot be written leaves no empty or partial file behind."""
    from elmo_pipeline.formats.atomic import write_url_atomically

    text = dumps_strict(result, url, indent=2, ensure_ascii=False)
    write_url_atomically(url, text.encode("utf-8"))


def register(subparsers: argparse._SubParsersAction) -> None:
    from elmo_pipeline.downstream.options import add_probe_args

    p = subparsers.add_parser(
        "probe", help="linear probes per layer and a learned mix on a labelled token file (CoNLL-U, CoNLL-2003)",
        description="Extracts features for the file's own tokens with the extract stages (Beam), trains a linear "
                    "probe on each layer and on a learned mix, and writes report.json, probe.png and mix.json "
                    "(for extract --mix NAME=mix.json). Beam options pass through to the extraction; an argument "
                    "that neither probe nor Beam knows is an error.")
    add_probe_args(p)
    p.set_defaults(func=_probe, accepts_beam_args=True)

    p = subparsers.add_parser(
        "similarity", help="cosine similarity per layer of one word in several sentences (polysemy)",
        description="For WORD in each sentence (its first occurrence), the cosine similarity of its vectors per "
                    "layer, averaged over same-sense and cross-sense pairs when senses are given.")
    p.add_argument("--word", required=True, help="the word, as a token of every sentence")
    p.add_argument("sentence", nargs="*", help="sentences (or use --file)")
    p.add_argument("--file", default=None, help="a file of lines SENSE<TAB>sentence (or just sentences)")
    p.add_argument("--senses", default=None, help="comma-separated sense labels, one per sentence")
    p.add_argument("--lang", default=None,
                   help="spaCy tokenizer language (default en; zh: jieba word segmentation)")
    p.add_argument("--pretokenized", action="store_true", help="sentences are tokens separated by spaces")
    p.add_argument("--ignore-case", action="store_true", help="match the word without regard to case")
    p.add_argument("--matrix", action="store_true", help="also print the cosine matrix of each layer")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.add_argument("--max-sentences", type=int_in(2), default=2000,
                   help="more sentences are refused before the model loads: every pair is compared, so memory "
                        "grows with the square of the count (default: %(default)s)")
    add_whole_sentence_bound(p, "a sentence", "before the model loads")
    p.add_argument("--model", default=None,
                   help="model folder or URL, or OPTIONS.json,WEIGHTS.hdf5 (default: the embedded model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kernel", default=AUTO, choices=KERNELS,
                   help="LSTM kernel: exact (clips; batch-invariant on CPU), fused (no clips), auto (exact on CPU)")
    p.set_defaults(func=_similarity)
