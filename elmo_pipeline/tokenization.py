"""Documents to sentences of tokens with spaCy (no Beam here).

Each sentence keeps its tokens' texts and character offsets into the document text, so that
`document.text[start:end] == token`. Whitespace-only tokens (spaCy's SPACE tokens: runs of
newlines, tabs, ideographic spaces...) are dropped: the biLM has no use for them. Sentences left
with no token are dropped too, and `sentence_index` numbers the remaining sentences 0, 1, 2...
A sentence longer than `max_sentence_tokens` is cut into consecutive windows (window_index 0, 1,
2...); no token is lost.
"""

from __future__ import annotations

import importlib.util
import logging
from itertools import islice
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import spacy
from spacy.language import Language
from spacy.tokens import Doc

from .records import Document, ErrorRecord, Sentence

logger = logging.getLogger(__name__)


def build_nlp(lang: str = "en", model: str | None = None) -> Language:
    """A spaCy pipeline that tokenizes and sets sentence boundaries.

    `model` (an installed package name or a path) is loaded with `spacy.load` and keeps its own
    sentence boundaries; a rule-based sentencizer is added only when none of its components sets
    them. Without a model: `spacy.blank(lang)` plus the sentencizer. Chinese ("zh") is segmented
    into words with jieba when it is installed, else into single characters.
    """
    if model is not None:
        nlp = spacy.load(model)
    elif lang == "zh":
        nlp = _blank_chinese()
    else:
        nlp = spacy.blank(lang)
    if not _sets_sentence_boundaries(nlp):
        nlp.add_pipe("sentencizer")
    return nlp


def _blank_chinese() -> Language:
    if importlib.util.find_spec("jieba") is not None:
        logger.info("Chinese word segmentation with jieba")
        return spacy.blank("zh", config={"nlp": {"tokenizer": {"segmenter": "jieba"}}})
    logger.warning("jieba is not installed: Chinese is segmented into single characters")
    return spacy.blank("zh")


def _sets_sentence_boundaries(nlp: Language) -> bool:
    return any("token.is_sent_start" in nlp.get_pipe_meta(name).assigns for name in nlp.pipe_names)


def sentences_from_docs(
    nlp: Language, docs: Iterable[Document], max_sentence_tokens: int = 256, batch_size: int = 256,
) -> Iterator[Sentence | ErrorRecord]:
    """The sentences of `docs` in order, tokenized `batch_size` documents at a time.

    A document without tokens yields nothing; a document that cannot be tokenized yields one
    ErrorRecord (stage "tokenize"). Use `tokenize_documents` to see one result per document.
    """
    docs = iter(docs)
    while batch := list(islice(docs, batch_size)):
        for result in tokenize_documents(nlp, batch, max_sentence_tokens):
            if isinstance(result, ErrorRecord):
                yield result
            else:
                yield from result


def tokenize_documents(
    nlp: Language, docs: Sequence[Document], max_sentence_tokens: int = 256,
) -> list[list[Sentence] | ErrorRecord]:
    """One result per document, in order: its sentences (an empty list when it has no token), or
    an ErrorRecord when it is longer than `nlp.max_length` or spaCy fails on it."""
    if max_sentence_tokens < 1:
        raise ValueError(f"max_sentence_tokens must be >= 1, got {max_sentence_tokens}")
    results: list[list[Sentence] | ErrorRecord | None] = [
        _error(doc, f"document has {len(doc.text)} characters, more than nlp.max_length={nlp.max_length}")
        if len(doc.text) > nlp.max_length else None
        for doc in docs
    ]
    todo = [i for i, result in enumerate(results) if result is None]
    for i, parsed in zip(todo, _parse(nlp, [docs[i] for i in todo])):
        if isinstance(parsed, ErrorRecord):
            results[i] = parsed
        elif parsed.text != docs[i].text:  # offsets would not point into the document's text
            results[i] = _error(docs[i], "the tokenizer changed the text")
        else:
            results[i] = _sentences(docs[i], parsed, max_sentence_tokens)
    return results


def _parse(nlp: Language, docs: list[Document]) -> list[Doc | ErrorRecord]:
    try:
        return list(nlp.pipe((doc.text for doc in docs), batch_size=max(len(docs), 1)))
    except Exception:  # noqa: BLE001 - one bad document must not fail the batch: find it alone
        return [_parse_one(nlp, doc) for doc in docs]


def _parse_one(nlp: Language, doc: Document) -> Doc | ErrorRecord:
    try:
        return nlp(doc.text)
    except Exception as e:  # noqa: BLE001 - reported as this document's error record
        return _error(doc, f"spaCy failed: {type(e).__name__}: {e}")


def _error(doc: Document, reason: str) -> ErrorRecord:
    return ErrorRecord(doc.source, doc.line, reason, "tokenize", doc.doc_id)


def _sentences(doc: Document, parsed: Doc, max_tokens: int) -> list[Sentence]:
    sentences: list[Sentence] = []
    index = 0
    for span in parsed.sents:
        tokens = [token for token in span if not token.is_space]
        if not tokens:
            continue
        texts = tuple(token.text for token in tokens)
        starts = np.fromiter((token.idx for token in tokens), np.int64, len(tokens))
        ends = starts + np.fromiter((len(text) for text in texts), np.int64, len(texts))
        for window, lo in enumerate(range(0, len(texts), max_tokens)):
            hi = lo + max_tokens
            sentences.append(
                Sentence(doc.doc_id, index, window, texts[lo:hi], starts[lo:hi], ends[lo:hi], doc.timestamp)
            )
        index += 1
    return sentences
