"""`elmo-pipeline prepare`: a corpus to training shards of token ids, on any Beam runner.

    python -m elmo_pipeline.pipelines.prepare --input 'corpus/*.txt' --output prepared/ \
        [--tokenizer spacy|whitespace] [--min-count 1] [--max-vocab N] [--runner ...]

Reads the same inputs as `extract` (ReadDocuments), tokenizes with the same
TokenizeWithSpacy (or, for already-tokenized text such as WikiText, splits every line at
whitespace), counts the words (partial counts per bundle, then a combine per word), builds
the vocabulary (`<S>`, `</S>`, `<UNK>`, then by count; `--min-count`, `--max-vocab`), and
writes Parquet shards of about `--shard-tokens` tokens each plus `vocab.json` and
`manifest.json` (see `elmo_pipeline.training.shards`). A sentence's shard is a stable hash of
its key and rows are sorted inside a shard, so the output does not depend on the runner or
on how the work was split. The vocabulary step collects the distinct words with their counts
in one place (a few million words at most for very large corpora).
Without `--runner` the job runs locally on Beam's FnApiRunner, which downloads nothing.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any, Iterable, Sequence

import apache_beam as beam
import fsspec

from elmo_pipeline.training.prepare import (add_prepare_args, build_vocabulary, manifest_for, n_shards_for, whitespace_sentences,
                                            write_metadata)
from elmo_pipeline.corpus.options import check_input_args
from elmo_pipeline.corpus.tokenization import check_nlp, describe_segmenter, make_doc, planned_segmenter
from elmo_pipeline.filesystems import written_for
from elmo_pipeline.formats.atomic import check_output_folder
from elmo_pipeline.formats.files import join_url
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.commands import job_main
from elmo_pipeline.corpus.input_files import check_inputs_outside, expand_patterns
from elmo_pipeline.pipelines.beam_options import check_beam_args, worker_layout
from elmo_pipeline.pipelines.earlier_run import ASIDE_PREFIX
from elmo_pipeline.pipelines.paths import check_beam_writable, make_paths_absolute, output_claimed
from elmo_pipeline.pipelines.runner import run_pipeline
from elmo_pipeline.training.shards import (MANIFEST_FILE, SHARD_NAME, VOCAB_FILE, PreparedCorpus, ShardInfo,
                                           shard_of, shard_table, write_shard)
from elmo_pipeline.transforms import metrics as m
from elmo_pipeline.transforms.write import ERRORS_STEM, error_line
from elmo_pipeline.model.vocabulary import SPECIALS, Vocabulary

ERRORS_FILE = f"{ERRORS_STEM}.jsonl"  # prepare's one errors file


class _PartialCounts(beam.DoFn):
    """Word counts per bundle: one (word, count) per distinct word, not one element per token."""

    def start_bundle(self) -> None:
        self._counts: collections.Counter = collections.Counter()

    def process(self, row):
        self._counts.update(row[1])

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        for word, count in self._counts.items():
            yield WindowedValue((word, count), 0, [GlobalWindow()])
        self._counts = collections.Counter()


def _vocabulary_json(pairs: Iterable[tuple[str, int]], n_sentences: int, min_count: int, max_size: int | None,
                     unk_alias: str | None) -> str:
    return build_vocabulary(dict(pairs), n_sentences, min_count, max_size, unk_alias).to_json()


class _WriteShard(beam.DoFn):
    def __init__(self, output: str, shard_tokens: int, unk_alias: str | None) -> None:
        self._output, self._shard_tokens, self._unk_alias = output, shard_tokens, unk_alias
        self._vocab_key: str | None = None
        self._vocab: Vocabulary | None = None

    def process(self, keyed, vocab_json: str, total_tokens: int):
        index, rows = keyed
        if self._vocab_key != vocab_json:  # the side input is the same object for the whole job
            self._vocab, self._vocab_key = Vocabulary.from_json(vocab_json), vocab_json
        n = n_shards_for(total_tokens, self._shard_tokens)
        info = write_shard(self._output, index, n, shard_table(rows, self._vocab, self._unk_alias))
        yield (index, info.file, info.sentences, info.tokens)


def _finish(written: list, vocab_json: str, total_tokens: int, job: argparse.Namespace) -> dict[str, Any]:
    vocab = Vocabulary.from_json(vocab_json)
    n = n_shards_for(total_tokens, job.shard_tokens)
    infos = {index: ShardInfo(file, sentences, tokens) for index, file, sentences, tokens in written}
    for index in range(n):  # a shard no sentence hashed to is still written, empty
        if index not in infos:
            infos[index] = write_shard(job.output, index, n, shard_table([], vocab, job.unk_token))
    manifest = manifest_for(list(infos.values()), vocab, job.tokenizer, job.lang, job.max_sentence_tokens,
                            job.min_count, job.max_vocab, job.unk_token, describe_segmenter(job.segmenter))
    write_metadata(job.output, manifest, vocab)
    return {"sentences": manifest.sentences, "tokens": manifest.tokens, "shards": len(manifest.shards),
            "vocab_size": len(vocab)}


def build(p: beam.Pipeline, job: argparse.Namespace) -> None:
    from elmo_pipeline.transforms.read import ReadDocuments

    read = p | "Read" >> ReadDocuments(job.input, input_format=job.input_format, doc_per=job.doc_per,
                                       text_field=job.text_field, id_field=job.id_field,
                                       split_bytes=max(1, int(job.split_mb * 2**20)),
                                       min_splits=worker_layout(p.options).workers,
                                       max_document_mb=job.max_document_mb)
    errors = [read["errors"]]
    if job.tokenizer == "whitespace":
        sentences = read["documents"] | "SplitWhitespace" >> beam.FlatMap(
            whitespace_sentences, max_tokens=job.max_sentence_tokens)
    else:
        from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

        tok = read["documents"] | "Tokenize" >> TokenizeWithSpacy(
            lang=job.lang, model=job.spacy_model, max_sentence_tokens=job.max_sentence_tokens, segmenter=job.segmenter)
        sentences = tok["sentences"]
        errors.append(tok["errors"])
    rows = sentences | "Rows" >> beam.Map(lambda s: (tuple(s.key), tuple(s.tokens)))
    n_sentences = rows | "CountSentences" >> beam.combiners.Count.Globally()
    n_tokens = (rows | "Lengths" >> beam.Map(lambda r: len(r[1]))
                | "CountTokens" >> beam.CombineGlobally(sum).without_defaults()
                | "ZeroTokens" >> beam.Map(int))
    total = beam.pvalue.AsSingleton(n_tokens, default_value=0)
    vocab_json = (
        rows
        | "PartialCounts" >> beam.ParDo(_PartialCounts())
        | "CountWords" >> beam.CombinePerKey(sum)
        | "AllWords" >> beam.combiners.ToList()
        | "Vocabulary" >> beam.Map(_vocabulary_json, beam.pvalue.AsSingleton(n_sentences), job.min_count,
                                   job.max_vocab, job.unk_token)
    )
    vocab_side = beam.pvalue.AsSingleton(vocab_json)
    written = (
        rows
        | "AssignShard" >> beam.Map(lambda r, t: (shard_of(r[0], n_shards_for(t, job.shard_tokens)), r), total)
        | "ByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.ParDo(_WriteShard(job.output, job.shard_tokens, job.unk_token), vocab_side, total)
    )
    _ = (
        written
        | "AllShards" >> beam.combiners.ToList()
        | "Manifest" >> beam.Map(_finish, vocab_side, total, job)
    )
    _ = (
        errors | "AllErrors" >> beam.Flatten()
        | "ErrorJson" >> beam.Map(error_line)
        | "WriteErrors" >> beam.io.WriteToText(join_url(job.output, ERRORS_STEM), file_name_suffix=".jsonl",
                                               num_shards=1, shard_name_template="")
    )


def _check_output(output: str, overwrite: bool, inputs: Sequence[str]) -> list[str]:
    """Refuses a folder that is not empty unless `overwrite`; the earlier run's entries there, which
    the job replaces once it succeeded (`run_pipeline`'s `earlier`)."""
    check_beam_writable(output)  # the errors file is written by a Beam sink
    check_output_folder(output)
    fs, path = fsspec.core.url_to_fs(output)
    if not fs.exists(path):
        return []
    existing = fs.ls(path, detail=False)
    ours = [entry for entry in existing if _is_run_output(entry.rstrip("/").rsplit("/", 1)[-1])]
    check_inputs_outside(inputs, ours, output)
    if existing and not overwrite:
        raise FileExistsError(f"{output} is not empty; pass --overwrite to replace it")
    return ours


def _is_run_output(name: str) -> bool:
    # by exact names: a shard-notes.txt is the user's; a write's partial file (a thread's when a
    # signal ended the job, any when it was killed outright) by the name it was written for
    name = written_for(name)
    return (name in (MANIFEST_FILE, VOCAB_FILE, ERRORS_FILE) or SHARD_NAME.fullmatch(name) is not None
            or name.startswith(ASIDE_PREFIX))  # a run killed outright left the one before it set aside


def _check_tokenizer_args(args: argparse.Namespace) -> tuple[str, str | None]:
    """Raises ValueError for a tokenization option the chosen --tokenizer does not read, and for
    an --unk-token it can never give as one token (the alias would then match nothing). Called
    before --overwrite clears anything, and here rather than as a traceback from every worker.
    Returns the language as spaCy names it (`zho` is `zh`) and the Chinese segmenter planned
    here for every worker (as `extract` plans it: a worker without jieba then fails rather than
    cut its documents into characters while the others cut words)."""
    if args.tokenizer == "whitespace":
        _check_whitespace_args(args)
        return args.lang, None
    segmenter = planned_segmenter(args.lang, args.spacy_model)
    nlp = check_nlp(args.lang, args.spacy_model, segmenter)
    if args.unk_token is None:
        return nlp.lang, segmenter
    tokens = [token.text for token in make_doc(nlp, args.unk_token) if not token.is_space]
    if tokens != [args.unk_token]:
        pipeline = f"--spacy-model {args.spacy_model}" if args.spacy_model else f"--lang {args.lang}"
        raise ValueError(f"--unk-token {args.unk_token!r}: spaCy ({pipeline}) tokenizes it as {tokens}, not as one "
                         "token, so it would never match; for already-tokenized text (WikiText's '<unk>') give "
                         "--tokenizer whitespace, else leave --unk-token out")
    return nlp.lang, segmenter


def _check_whitespace_args(args: argparse.Namespace) -> None:
    """`--tokenizer whitespace` splits every non-empty line at whitespace, with no spaCy: its
    --lang, --spacy-model and --doc-per file would change nothing (a file read whole gives the
    same lines as sentences; it would only set a whole file aside for one line that is not UTF-8)."""
    spacy_only = ("is spaCy's, and --tokenizer whitespace splits lines at whitespace: leave it out, or give "
                  "--tokenizer spacy")
    unread = [(args.lang != _prepare_default("lang"), f"--lang {args.lang} {spacy_only}"),
              (args.spacy_model is not None, f"--spacy-model {args.spacy_model} {spacy_only}"),
              (args.doc_per != _prepare_default("doc_per"),
               f"--doc-per {args.doc_per} changes no sentence with --tokenizer whitespace, which makes every "
               "non-empty line a sentence whatever the document (a file read whole would only be set aside whole "
               "for one line that is not UTF-8): leave it out")]
    for given, message in unread:
        if given:
            raise ValueError(message)
    if args.unk_token is not None and args.unk_token.split() != [args.unk_token]:
        raise ValueError(f"--unk-token {args.unk_token!r} is empty or holds whitespace, and --tokenizer whitespace "
                         "cuts tokens at whitespace, so it would never match a token: give the token itself")


def _prepare_default(name: str) -> Any:
    """The value `prepare` gives option `name` (its dest) when the command line does not."""
    parser = argparse.ArgumentParser(add_help=False)
    add_prepare_args(parser)
    return parser.get_default(name)


def run(args: argparse.Namespace, beam_args: Sequence[str]) -> dict[str, Any]:
    check_beam_args(beam_args, add_prepare_args)
    make_paths_absolute(args)
    for option, value in (("--max-sentence-tokens", args.max_sentence_tokens), ("--shard-tokens", args.shard_tokens),
                          ("--min-count", args.min_count)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if args.max_vocab is not None and args.max_vocab < 3:
        raise ValueError(f"--max-vocab must leave room for <S>, </S> and <UNK> (>= 3), got {args.max_vocab}")
    if args.unk_token in SPECIALS[:2]:  # the char CNN and the id lookups read it as that boundary
        raise ValueError(f"--unk-token {args.unk_token}: that token marks a sentence boundary, and a model reads "
                         "it as one (its characters and its id), never as an unknown word; give the input's own "
                         "unknown token (WikiText: '<unk>')")
    check_input_args(args)
    inputs = expand_patterns(args.input)  # a glob matching nothing, or a folder, fails before --overwrite clears
    args.lang, args.segmenter = _check_tokenizer_args(args)
    with output_claimed(args.output):
        earlier = _check_output(args.output, args.overwrite, inputs)
        start = time.monotonic()
        result = run_pipeline(lambda p: build(p, args), beam_args, "prepare", args.output, earlier,
                              writes=_is_run_output)
    corpus = PreparedCorpus(args.output)
    manifest = corpus.manifest
    errors = 0
    fs, errors_path = fsspec.core.url_to_fs(join_url(args.output, ERRORS_FILE))
    if fs.exists(errors_path):
        with fs.open(errors_path, "rb") as f:
            errors = sum(1 for line in f if line.strip())
    return {"output": args.output, "sentences": manifest.sentences, "tokens": manifest.tokens,
            "shards": len(manifest.shards), "vocab_size": manifest.vocab_size, "errors": errors,
            **_reconciled(result, errors, corpus), "seconds": round(time.monotonic() - start, 2)}


def _reconciled(result: Any, errors: int, corpus: PreparedCorpus) -> dict[str, Any]:
    """Whether the files hold what the job counted on its way: the records of errors.jsonl against
    the read and tokenize errors (None where the runner reports no counters), and the vocabulary's
    counts, taken from the sentences before they were grouped by shard, against the shards'
    tokens plus two a sentence. A record or sentence lost or doubled after it was counted (a
    runner's fault) would otherwise leave a run that passes."""
    counters, reason = m.job_counters(result)
    counted = sum(value for name, value in counters if name in (m.READ_ERRORS, m.TOKENIZE_ERRORS))
    manifest = corpus.manifest
    return {"errors_counted": counted if reason is None else None,
            "errors_reconcile": errors == counted if reason is None else None,
            "counts_reconcile": sum(corpus.vocab.counts or []) == manifest.tokens + 2 * manifest.sentences}


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("prepare", __doc__, add_prepare_args, run_and_print, argv)


def run_and_print(args: argparse.Namespace) -> int:
    """The job for parsed options (Beam's in `args.beam_args`), its summary printed as JSON. The
    exit status is 1 when no sentence was written (a corpus `pretrain` refuses), or when the files
    do not hold what the job counted (`_reconciled`), with a line on stderr saying why; the errors
    file is written all the same."""
    summary = run(args, args.beam_args)
    print(dumps_strict(summary, "summary", indent=2))
    if summary["errors_reconcile"] is False:
        print(f"elmo-pipeline prepare: {ERRORS_FILE} holds {summary['errors']} records, but the job counted "
              f"{summary['errors_counted']} rejected ones: records were lost or doubled on their way to it",
              file=sys.stderr)
    if not summary["counts_reconcile"]:
        print("elmo-pipeline prepare: the vocabulary's counts are not the shards' tokens plus two a sentence: "
              "sentences were lost or doubled after they were counted; run it again", file=sys.stderr)
    if summary["errors_reconcile"] is False or not summary["counts_reconcile"]:
        return 1
    if summary["sentences"] == 0:
        print(f"elmo-pipeline prepare: {_why_no_sentence(summary)}", file=sys.stderr)
        return 1
    return 0


def _why_no_sentence(summary: dict[str, Any]) -> str:
    errors = join_url(summary["output"], ERRORS_FILE)
    if summary["errors"]:
        return (f"no sentence was written: {summary['errors']} records were rejected ({errors} says why) and no "
                "other held text; pretrain refuses a corpus without tokens")
    return "no sentence was written: the input holds no text (empty or blank lines only); pretrain refuses it"


if __name__ == "__main__":
    sys.exit(main())
