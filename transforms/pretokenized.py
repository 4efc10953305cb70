"""Pre-tokenized input: sentences whose tokens are given (a treebank, a CoNLL file) become
`Sentence` records without spaCy, so the biLM sees exactly the file's tokens.

A sentence's text is its tokens joined by single spaces; `char_starts`/`char_ends` point into that
text, so `" ".join(tokens)[start:end] == token`. Long sentences are cut into windows of
`max_sentence_tokens` as `TokenizeWithSpacy` does (window w holds tokens [w*max, (w+1)*max)).
The records then go through the same `EmbedSentences -> MixLayers -> WriteParquet` stages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import apache_beam as beam
import numpy as np

from elmo_pipeline.downstream.conll import FORMATS, read_labelled
from elmo_pipeline.corpus.input_files import expand_patterns
from elmo_pipeline.corpus.readers import timestamp_problem
from elmo_pipeline.corpus.records import Sentence, doc_id_problem, has_lone_surrogate
from elmo_pipeline.strict import check_ints
from elmo_pipeline.transforms.checks import check_collection, check_root
from elmo_pipeline.transforms.metrics import SENTENCES, TOKENS, WINDOWS_CUT, BundleCounts


class TokenizedText(NamedTuple):
    """One sentence of PretokenizedSentences' input: `doc_id` and `sentence_index` (an int >= 0)
    are its key in the output, `tokens` its tokens, `timestamp` an ISO 8601 event time or None."""

    doc_id: str
    sentence_index: int
    tokens: tuple[str, ...]
    timestamp: str | None = None


def _check_doc_id(doc_id: object) -> None:
    """Raises for a doc_id that the Parquet files (and key stores) cannot hold."""
    if not isinstance(doc_id, str):
        raise TypeError(f"doc_id {doc_id!r:.80} is {type(doc_id).__name__}, not a str")
    if problem := doc_id_problem(doc_id):
        raise ValueError(f"doc_id {doc_id!r} {problem}")


def _tokenized_text(item: object) -> TokenizedText:
    """An element of PretokenizedSentences as a TokenizedText whose key and time the Parquet files
    can hold; anything else is refused here, naming it, rather than by the writer after the
    model ran (a lone surrogate or an int id failed the whole job there, naming no sentence)."""
    if not isinstance(item, TokenizedText) and isinstance(item, (tuple, list)) and len(item) in (3, 4):
        item = TokenizedText(*item)
    if not isinstance(item, TokenizedText):
        raise TypeError(f"an element of PretokenizedSentences is a TokenizedText or (doc_id, sentence_index, "
                        f"tokens[, timestamp]), not {type(item).__name__}: {item!r:.80}")
    doc_id, index = item.doc_id, item.sentence_index
    _check_doc_id(doc_id)
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise TypeError(f"{doc_id}: sentence_index {index!r:.80} is not an int >= 0")
    if item.timestamp is not None and not isinstance(item.timestamp, str):  # the writer parses text only
        raise TypeError(f"{doc_id}:{index}: timestamp {item.timestamp!r:.80} is a {type(item.timestamp).__name__}, "
                        "not an ISO 8601 str")
    if item.timestamp is not None and (problem := timestamp_problem(item.timestamp)):
        raise ValueError(f"{doc_id}:{index}: timestamp {item.timestamp!r:.80} {problem}")
    return item._replace(sentence_index=int(index))


def pretokenized_sentences(item: TokenizedText | tuple | list, max_sentence_tokens: int | None = None,
                           ) -> list[Sentence]:
    """One Sentence per window of `item`, a TokenizedText or (doc_id, sentence_index, tokens[,
    timestamp]) (one window unless it is longer than `max_sentence_tokens`)."""
    item = _tokenized_text(item)
    if isinstance(item.tokens, (str, bytes)):  # tuple() would make it one token per character
        raise TypeError(f"{item.doc_id}:{item.sentence_index}: tokens is a {type(item.tokens).__name__}, not a "
                        "sequence of token strings")
    if max_sentence_tokens is not None and max_sentence_tokens < 1:
        raise ValueError(f"max_sentence_tokens must be >= 1, got {max_sentence_tokens}")
    tokens = tuple(item.tokens)
    if not tokens:
        return []
    if any(not isinstance(t, str) or not t.strip() for t in tokens):
        raise ValueError(f"{item.doc_id}:{item.sentence_index}: tokens must be strings with a character that is "
                         "not whitespace")
    if any(has_lone_surrogate(t) for t in tokens):
        raise ValueError(f"{item.doc_id}:{item.sentence_index}: a token holds a lone surrogate, which UTF-8 (and "
                         "so the output) cannot encode")
    lengths = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
    ends = starts + lengths
    size = max_sentence_tokens or len(tokens)
    return [Sentence(item.doc_id, item.sentence_index, window, tokens[lo:lo + size],
                     starts[lo:lo + size], ends[lo:lo + size], item.timestamp)
            for window, lo in enumerate(range(0, len(tokens), size))]


class _ToSentencesFn(beam.DoFn):
    """Counts once per bundle (BundleCounts), however often a failed bundle is retried."""

    def __init__(self, max_sentence_tokens: int | None) -> None:
        self.max_sentence_tokens = max_sentence_tokens

    def start_bundle(self) -> None:
        self._counts = BundleCounts()

    def process(self, item):
        for sentence in pretokenized_sentences(item, self.max_sentence_tokens):
            self._counts.add(SENTENCES)
            self._counts.add(TOKENS, len(sentence.tokens))
            self._counts.add(WINDOWS_CUT, sentence.window_index == 1)
            yield sentence

    def finish_bundle(self) -> None:
        self._counts.commit()


class PretokenizedSentences(beam.PTransform):
    """PCollection[TokenizedText | (doc_id, sentence_index, tokens)] -> PCollection[Sentence].

    A sentence of more than `max_sentence_tokens` tokens is cut into windows of that many (None:
    never). Counters (namespace "elmo_pipeline"): sentences, tokens, windows_cut, as TokenizeWithSpacy."""

    def __init__(self, max_sentence_tokens: int | None = None) -> None:
        super().__init__()
        if max_sentence_tokens is not None:
            check_ints(max_sentence_tokens=max_sentence_tokens)
            if max_sentence_tokens < 1:
                raise ValueError(f"max_sentence_tokens must be >= 1, got {max_sentence_tokens}")
        self.max_sentence_tokens = max_sentence_tokens

    def expand(self, items: beam.PCollection) -> beam.PCollection:
        check_collection(self.label, items)
        return items | beam.ParDo(_ToSentencesFn(self.max_sentence_tokens))


def _read_file(url: str, doc_id: str, fmt: str) -> Iterable[TokenizedText]:
    for index, sentence in enumerate(read_labelled(url, fmt)):
        yield TokenizedText(doc_id, index, sentence.tokens)


class ReadTokenizedFiles(beam.PTransform):
    """Labelled token files (CoNLL-U, CoNLL-2003) -> PCollection[TokenizedText], labels left out.

    `files` maps a doc_id to one file URL, of the format `fmt` ("conllu", "conll2003", or "auto":
    told by each file's name or first token line); sentence_index is the sentence's position in its file,
    so `(doc_id, sentence_index)` finds the sentence again (and its labels) after extraction.
    The sentences are redistributed after reading so that embedding runs in parallel."""

    def __init__(self, files: Mapping[str, str], fmt: str = "auto") -> None:
        super().__init__()
        # checked here: a worker found a bad format or doc_id only after the reading began
        if not isinstance(files, Mapping):  # a list failed on "'list' object has no attribute 'items'"
            raise TypeError(f"files maps each doc_id to one file, got a {type(files).__name__} ({files!r:.80})")
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        self.files = {}
        for doc_id, url in files.items():
            _check_doc_id(doc_id)
            found = expand_patterns([url])
            if len(found) != 1:
                raise ValueError(f"{url!r} matches {len(found)} files; give one file per doc_id")
            self.files[doc_id] = found[0]
        self.fmt = fmt

    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection:
        check_root(self.label, pbegin)
        fmt = self.fmt
        return (
            pbegin
            | "Files" >> beam.Create(sorted(self.files.items()))
            | "Read" >> beam.FlatMapTuple(lambda doc_id, url: _read_file(url, doc_id, fmt))
            | "Redistribute" >> beam.Reshuffle()
        )
