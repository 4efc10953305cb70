"""The library side of `prepare`: tokenizing for training, counting, the vocabulary, shards.

The Beam pipeline (`elmo_pipeline.pipelines.prepare`) calls these functions inside its
transforms; `prepare_in_process` runs the same steps in one process for small corpora and
tests, and writes byte-identical output.

WikiText's `<unk>`: WikiText is already tokenized and has replaced its rare words by the
literal token `<unk>`. With `unk_alias="<unk>"` that token *is* our unknown token: its count
goes to `<UNK>` (id 2), it never gets an entry of its own, and the vocabulary is exactly
WikiText's word types plus `<S>` and `</S>` (`<UNK>` stands in for `<unk>`). The shards keep
the literal `<unk>` string for the char CNN, so a model sees the same characters that
WikiText shows.
"""

from __future__ import annotations

import argparse
import collections
import math
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from elmo_pipeline.corpus.input_files import READ_ERRORS, expand_patterns
from elmo_pipeline.corpus.options import DEFAULT_MAX_SENTENCE_TOKENS, add_input_args, add_tokenization_args
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import bounded_lines, undecodable_reason
from elmo_pipeline.corpus.records import Document, Sentence
from elmo_pipeline.filesystems import failure_text
from elmo_pipeline.formats.atomic import write_url_atomically
from elmo_pipeline.formats.files import join_url
from elmo_pipeline.model.vocabulary import SPECIALS, UNKNOWN, Vocabulary
from elmo_pipeline.training.shards import (MANIFEST_FILE, VOCAB_FILE, Manifest, ShardInfo, shard_of, shard_table,
                     vocab_digest, write_shard)

TOKENIZERS = ("spacy", "whitespace")
DEFAULT_SHARD_TOKENS = 1_000_000


def windows(n: int, max_tokens: int) -> list[tuple[int, int]]:
    """[start, end) spans cutting n tokens into windows of at most max_tokens."""
    return [(s, min(n, s + max_tokens)) for s in range(0, n, max_tokens)]


def whitespace_sentences(doc: Document, max_tokens: int = DEFAULT_MAX_SENTENCE_TOKENS) -> list[Sentence]:
    """Already-tokenized text: every non-empty line is one sentence, its tokens split at whitespace.

    Long lines are cut into windows of at most `max_tokens`. Character offsets point into
    `doc.text` as the spaCy path's do.
    """
    out: list[Sentence] = []
    line_start = 0
    sentence_index = 0
    for line in doc.text.split("\n"):  # only "\n" ends a line, as for every reader; "\r" is whitespace
        starts, ends, tokens = [], [], []
        pos = 0
        for token in line.split():
            pos = line.index(token, pos)
            starts.append(line_start + pos)
            ends.append(line_start + pos + len(token))
            tokens.append(token)
            pos += len(token)
        line_start += len(line) + 1
        if not tokens:
            continue
        for window_index, (a, b) in enumerate(windows(len(tokens), max_tokens)):
            out.append(Sentence(doc.doc_id, sentence_index, window_index, tuple(tokens[a:b]),
                                np.asarray(starts[a:b], np.int64), np.asarray(ends[a:b], np.int64),
                                doc.timestamp))
        sentence_index += 1
    return out


def count_tokens(sentences: Iterable[Sequence[str]]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for tokens in sentences:
        counts.update(tokens)
    return counts


def build_vocabulary(counts: Mapping[str, int], n_sentences: int, min_count: int = 1,
                     max_size: int | None = None, unk_alias: str | None = None) -> Vocabulary:
    """`<S>`, `</S>`, `<UNK>` then tokens by count (ties by token).

    `<S>` and `</S>` are counted once per sentence, plus the tokens of the text that spell them
    (the shards give those their ids); `<UNK>` counts the tokens it replaces (those under
    `min_count`, past `max_size`, `unk_alias`, and its own spelling). So the counts add up to the
    tokens plus two per sentence.
    """
    counts = dict(counts)
    unk = counts.pop(UNKNOWN, 0)
    if unk_alias is not None:
        unk += counts.pop(unk_alias, 0)
    start, end = (n_sentences + counts.pop(special, 0) for special in SPECIALS[:2])
    vocab = Vocabulary.from_counts(counts, min_count=min_count, max_size=max_size)
    kept = set(vocab.tokens)
    unk += sum(c for t, c in counts.items() if t not in kept)
    return Vocabulary(vocab.tokens, [start, end, unk, *(vocab.counts or [])[3:]])


def n_shards_for(total_tokens: int, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> int:
    return max(1, math.ceil(total_tokens / max(1, shard_tokens)))


def manifest_for(shards: list[ShardInfo], vocab: Vocabulary, tokenizer: str, lang: str,
                 max_sentence_tokens: int, min_count: int, max_size: int | None,
                 unk_alias: str | None, segmentation: dict[str, str] | None = None) -> Manifest:
    return Manifest(shards=sorted(shards, key=lambda s: s.file), vocab_size=len(vocab), tokenizer=tokenizer,
                    lang=lang, max_sentence_tokens=max_sentence_tokens, min_count=min_count,
                    max_vocab_size=max_size, unk_alias=unk_alias, vocab_sha256=vocab_digest(vocab),
                    segmentation=segmentation or {})


def write_metadata(output: str, manifest: Manifest, vocab: Vocabulary) -> None:
    """vocab.json first, manifest.json last: a folder with a manifest is complete."""
    write_url_atomically(join_url(output, VOCAB_FILE), vocab.to_json().encode("utf-8", "surrogatepass"))
    write_url_atomically(join_url(output, MANIFEST_FILE), manifest.to_json().encode("utf-8", "surrogatepass"))


def prepare_in_process(sentences: Iterable[Sentence], output: str, *, tokenizer: str, lang: str,
                       max_sentence_tokens: int, min_count: int = 1, max_size: int | None = None,
                       unk_alias: str | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Manifest:
    """The whole of `prepare` in one process (holds the corpus in memory: small inputs only)."""
    rows = [(s.key, s.tokens) for s in sentences]
    counts = count_tokens(tokens for _, tokens in rows)
    vocab = build_vocabulary(counts, len(rows), min_count, max_size, unk_alias)
    total = sum(len(tokens) for _, tokens in rows)
    n = n_shards_for(total, shard_tokens)
    buckets: dict[int, list] = collections.defaultdict(list)
    for row in rows:
        buckets[shard_of(row[0], n)].append(row)
    infos = [write_shard(output, i, n, shard_table(buckets.get(i, []), vocab, unk_alias)) for i in range(n)]
    manifest = manifest_for(infos, vocab, tokenizer, lang, max_sentence_tokens, min_count, max_size, unk_alias)
    write_metadata(output, manifest, vocab)
    return manifest


# -- plain text for evaluation --------------------------------------------------------------
def whitespace_text_sentences(patterns: str | Sequence[str], max_tokens: int = DEFAULT_MAX_SENTENCE_TOKENS,
                              max_document_mb: float | None = None) -> Iterator[list[str]]:
    """Stream the token lists of already-tokenized text files, found as every command finds its
    input (`expand_patterns`), as `prepare --tokenizer whitespace` reads them: decompressed by extension (.gz, .bz2, .xz, .zst), a UTF-8 BOM at the start of a
    line dropped, and every non-empty line (only "\n" ends one) one sentence. A line that is not
    UTF-8 or holds NUL (a binary or UTF-16 file) raises ValueError naming it, as `prepare` sets
    it aside; so does a line of more than `max_document_mb` (evaluate's --max-document-mb; None:
    the default bound, for pretrain's --valid), never held whole."""
    if max_tokens < 1:
        raise ValueError(f"--max-sentence-tokens must be >= 1, got {max_tokens}")
    options = ReadOptions() if max_document_mb is None else ReadOptions(max_document_mb=max_document_mb)
    for url in expand_patterns(patterns):
        for number, raw in _text_file_lines(url, options.max_document_bytes):
            if raw is None:
                raise ValueError(f"{url}, line {number}: {options.too_large('line', named=max_document_mb is not None)}")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                why = undecodable_reason(raw, exc)
                raise ValueError(f"{url}: line {number} is not UTF-8 ({why} at byte {exc.start}); "
                                 "evaluation reads UTF-8 text (`prepare` sets such lines aside)") from None
            if "\x00" in text:
                raise ValueError(f"{url}: line {number} holds NUL characters (a binary or UTF-16 file?); "
                                 "evaluation reads UTF-8 text (`prepare` sets such lines aside)")
            tokens = text.split()
            for a, b in windows(len(tokens), max_tokens):
                yield tokens[a:b]


def _text_file_lines(url: str, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """`bounded_lines` of the file `url` (None for a line of more than `max_bytes`). A file that
    cannot be read or decompressed (a `.gz` that is not gzip, a truncated `.xz`) raises ValueError
    naming it."""
    try:
        yield from bounded_lines(url, max_bytes)
    except READ_ERRORS as exc:
        raise ValueError(f"{url}: cannot read it ({failure_text(exc)}); evaluation reads text files, "
                         "plain or compressed by their extension (.gz, .bz2, .xz, .zst)") from None


def add_prepare_args(parser: argparse.ArgumentParser) -> None:
    add_input_args(parser, output_help="folder (path or URL) for shards, vocab.json, manifest.json",
                   overwrite_help="replace an earlier prepared corpus in --output")
    tok = add_tokenization_args(parser)
    tok.add_argument("--tokenizer", default="spacy", choices=TOKENIZERS,
                     help="spacy (as extract), or whitespace for already-tokenized text: one sentence per "
                          "non-empty line, tokens split at whitespace (WikiText), which takes no --lang, "
                          "--spacy-model or --doc-per file")
    voc = parser.add_argument_group("vocabulary and shards")
    voc.add_argument("--min-count", type=int, default=1, help="words seen fewer times become <UNK>")
    voc.add_argument("--max-vocab", type=int, default=None, help="at most this many entries, specials included")
    voc.add_argument("--unk-token", default=None,
                     help="a token of the input that means 'unknown' (WikiText: '<unk>', with --tokenizer "
                          "whitespace); it counts as <UNK>; one the tokenizer would split is refused")
    voc.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard (about)")
