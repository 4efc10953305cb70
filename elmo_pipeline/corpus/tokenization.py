"""Documents to sentences of tokens with spaCy (no Beam here).

Each sentence keeps its tokens' texts and character offsets into the document text, so that
`document.text[start:end] == token`. Whitespace-only tokens (spaCy's SPACE tokens: runs of
newlines, tabs, ideographic spaces...) are dropped: the biLM has no use for them. Sentences left
with no token are dropped too, and `sentence_index` numbers the remaining sentences 0, 1, 2...
A sentence longer than `max_sentence_tokens` is cut into consecutive windows (window_index 0, 1,
2...); no token is lost. No token boundary falls inside a grapheme cluster (`make_doc`): spaCy's
affix rules cut emoji sequences and flags apart, and the Chinese segmenters combining marks from
their letters; those pieces are joined again before the sentence boundaries are set.

Hostile shapes stay linear and bounded:
- A document longer than `PIECE_CHARS` characters (or spaCy's `nlp.max_length`, when that is
  smaller) is tokenized in pieces of at most that length, cut at a newline or other whitespace
  (a longer run without any is cut where the limit falls), and the offsets are shifted back
  into the document. spaCy's memory grows with the text it parses at once, so a huge document
  costs what a piece costs. Each piece but the last gives back its last
  sentence, which is tokenized again at the start of the next piece, and a sentence that fills a
  whole piece runs on into the next (from its last word on, which is tokenized again), so with
  the rule-based sentencizer sentences and windows are those of the whole text (tested; only a
  run of characters cut at the limit becomes two tokens). The sentences are produced lazily,
  piece by piece, never all at once. A loaded pipeline whose parser sets sentence boundaries
  sees each piece without the text before it, so its boundaries may differ near a cut.
- spaCy keeps every new string it meets (its StringStore and a lexeme for each), which grows
  without end over a corpus of billions of tokens (numbers, names, typos: about 400 bytes each).
  Each batch, and each piece of a long document, is parsed in a spaCy memory zone, which lets
  the batch's new strings go at its end; a Sentence holds Python copies of its tokens. The chunk
  cache is filled before the zone, so what it keeps stays (bounded: see chunk_cache).
- A run of `LONG_RUN_CHARS` or more characters without whitespace is one token: spaCy's prefix
  and suffix splitting is quadratic in a run's length (a run of 8,000 "(" takes ~15 s, 100,000
  would take ~40 min). The model reads only the first 48 bytes of a token anyway.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import pkgutil
import re
import threading
import unicodedata
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from itertools import islice
from typing import Union

import numpy as np
import spacy
import spacy.lang
from spacy.language import Language
from spacy.pipeline import Sentencizer
from spacy.attrs import IDX, IS_SPACE, LENGTH, NORM, SPACY
from spacy.tokenizer import Tokenizer
from spacy.tokens import Doc, Span

from elmo_pipeline.corpus.chunk_cache import fill_chunk_cache
from elmo_pipeline.corpus.graphemes import (cluster_start, code_points, extender_class, inside_clusters,
                                            may_cut_clusters)
from elmo_pipeline.corpus.options import DEFAULT_LANG
from elmo_pipeline.corpus.readers import timestamp_problem
from elmo_pipeline.corpus.records import Document, ErrorRecord, Sentence, doc_id_problem, has_lone_surrogate

logger = logging.getLogger(__name__)

LONG_RUN_CHARS = 1000
# What ends a sentence: spaCy's sentencizer's list, and Khmer's khan and bariyoosan, which it lacks
SENTENCE_ENDS = [*Sentencizer.default_punct_chars, "\u17d4", "\u17d5"]
# A longer document is tokenized in pieces of at most this many characters: small enough that
# spaCy's share is nothing beside the model's, large enough that the sentence each piece gives
# back to the next (see _long_document) costs nothing.
PIECE_CHARS = 2**17
# the last whitespace character of a span; spaCy's tokenizer splits at every one (U+2028, U+202F, ...)
_LAST_WHITESPACE = re.compile(r"\s(?=\S*\Z)")
# Invisible characters that part words but are not whitespace to str.isspace, nor so to spaCy: the
# zero-width space (the word break of Khmer, Lao, Thai and Burmese text) and the bidi controls
# (marks, embeddings, isolates) that right-to-left text carries. spaCy kept them in the token beside
# them ("\u202bمرحبا", and "بالعالم\u202c." with the sentence's period, whose end was missed): an
# invisible mark made another word, another vector. So did a byte-order mark inside a text (a JSON
# field or Parquet cell of a file read without dropping its own BOM, files joined with cat), as
# "\ufeffHello": its use as a zero-width no-break space is Unicode's deprecated one (U+2060 took
# it). The tokenizer reads each as a space (one character for one, so the offsets hold).
_INVISIBLE_SEPARATORS = re.compile("[\u200b\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069\ufeff]")

# What tokenize_documents gives for one document: its sentences, or why it could not be tokenized.
# A document longer than piece_chars(nlp) gives a lazy iterator instead of a list (see _long_document).
DocumentResult = Union[list[Sentence], Iterator[Union[Sentence, ErrorRecord]], ErrorRecord]  # noqa: UP007


def build_nlp(lang: str = DEFAULT_LANG, model: str | None = None, segmenter: str | None = None) -> Language:
    """A spaCy pipeline that tokenizes and sets sentence boundaries.

    `model` (an installed package name or a path) is loaded with `spacy.load` and keeps its own
    sentence boundaries; a rule-based sentencizer is added only when none of its components sets
    them. Without a model: `spacy.blank(lang)` plus the sentencizer. Chinese ("zh") is segmented
    by `segmenter`: "jieba" (words; an error when jieba cannot be imported here) or "char"
    (single characters); None picks `chinese_segmenter()`.
    """
    lang = spacy_lang(lang)
    check_segmenter(lang, model, segmenter)
    if model is not None:
        nlp = spacy.load(model)
    elif lang == "zh":
        nlp = _blank_chinese(segmenter or chinese_segmenter())
    else:
        nlp = spacy.blank(language_class(lang).lang)
    if not _sets_sentence_boundaries(nlp):
        nlp.add_pipe("sentencizer", config={"punct_chars": SENTENCE_ENDS})
    _one_token_per_long_run(nlp)
    _split_sentence_ends(nlp)
    _BUILT_LANGUAGES[(lang, model)] = nlp.lang
    return nlp


# The language of each pipeline that build_nlp built in this process, by (spaCy code, model): a
# transform built after its command's own check (TokenizeWithSpacy in extract) built the same
# pipeline again (0.16 to 0.35 s) only to learn that it loads.
_BUILT_LANGUAGES: dict[tuple[str, str | None], str] = {}


def pipeline_language(lang: str = DEFAULT_LANG, model: str | None = None) -> str:
    """The language of `build_nlp(lang, model)`'s pipeline; built (its errors raised) unless this
    process has built it already."""
    built = _BUILT_LANGUAGES.get((spacy_lang(lang), model))
    return built if built is not None else build_nlp(lang, model).lang


def check_segmenter(lang: str, model: str | None, segmenter: str | None) -> None:
    """Raises ValueError for a `segmenter` other than None that `build_nlp(lang, model)` cannot use:
    one other than "jieba" or "char", or any for a pipeline that is not blank Chinese."""
    if segmenter is None:
        return
    if spacy_lang(lang) != "zh" or model is not None:
        raise ValueError(f"segmenter {segmenter!r} is for a blank Chinese pipeline, not lang={lang!r} model={model!r}")
    if segmenter not in ("jieba", "char"):
        raise ValueError(f"Chinese segmenter must be 'jieba' or 'char', got {segmenter!r}")


def check_nlp(lang: str = DEFAULT_LANG, model: str | None = None, segmenter: str | None = None) -> Language:
    """`build_nlp`, with a language spaCy does not have (`--lang`) or a pipeline it cannot load
    (`--spacy-model`) as a ValueError naming the option. Commands call it where they are launched,
    before any work: on a worker the same mistake is a traceback per worker, after the output
    folder was cleared. A `--spacy-model` must therefore be installed where the job is launched too."""
    if model is None and not lang.strip():  # spaCy's message named the language "" and module "spacy.lang."
        raise ValueError(f"--lang {lang!r} is empty: give a spaCy language code (en, zh, de, ...)")
    try:
        nlp = build_nlp(lang, model, segmenter)
    except (ImportError, OSError) as exc:  # spaCy's E048 (no such language), E050/E053 (no such pipeline)
        option = f"--lang {lang}" if model is None else f"--spacy-model {model}"
        raise ValueError(f"{option}: spaCy cannot load it: {exc}{load_failure_hint(lang, model, exc)}") from exc
    if language_beside_pipeline(lang, model, nlp.lang):
        raise ValueError(f"--lang {lang} is not the language of --spacy-model {model} ({nlp.lang}), which is the "
                         "one used: leave --lang out")
    return nlp


def language_beside_pipeline(lang: str, model: str | None, pipeline_lang: str) -> bool:
    """Whether `lang` names another language than `pipeline_lang`, that of the pipeline loaded from
    `model`, which is the one used (the default language names none): given beside a German
    pipeline, `lang="fr"` would be ignored."""
    return model is not None and spacy_lang(lang) not in (DEFAULT_LANG, pipeline_lang)


def load_failure_hint(lang: str, model: str | None, error: ImportError | OSError) -> str:
    """What to add to spaCy's message `error` when `build_nlp(lang, model)` could not load: for a
    pipeline spaCy found none of or could not read (an OSError), those installed here and how to
    add one; for a tag whose language spaCy takes by another code, that code; for a code spaCy has
    no language of, the languages it has; else "" (a language or pipeline whose tokenizer lacks a
    package, an ImportError: spaCy's message names the package, and the pipeline is there)."""
    if model is not None:
        if isinstance(error, ImportError):
            return ""
        installed = ", ".join(sorted(spacy.util.get_installed_models())) or "none"
        return (f" (pipelines installed here: {installed}; install one with `python -m spacy download NAME` "
                "where the job is launched and on the workers, or give a pipeline's folder)")
    code = _code_hint(lang)
    if code:
        return code
    try:
        language_class(lang)
    except ImportError:
        return f" (spaCy's languages: {', '.join(spacy_languages())}; xx, its multi-language rules, takes any other)"
    return ""


def spacy_languages() -> list[str]:
    """The codes of the languages spaCy has here: its own (the packages of spacy.lang) and those that
    installed packages register."""
    own = {module.name for module in pkgutil.iter_modules(spacy.lang.__path__) if module.ispkg}
    return sorted(own | set(spacy.util.registry.languages.get_all()))


def _code_hint(lang: str) -> str:
    """For a tag spaCy does not take whose language part it does (`EN`, `en-US`, `pt_BR`: spaCy's
    codes are lowercase, without a region or script), the code to give instead; else ""."""
    base = re.split("[-_]", lang.strip(), maxsplit=1)[0].lower()
    if not base or base == lang:
        return ""
    try:
        return f" (spaCy's code for it is {language_class(base).lang!r})"
    except ImportError:
        return ""


def spacy_lang(lang: str) -> str:
    """The code spaCy knows `lang` by: spaCy also takes other codes it can match (`zho` and `chi`
    for `zh`, `deu` for `de`), and only by its own code is Chinese given our word segmenter (jieba)
    instead of spaCy's single characters. A language spaCy does not have is returned as it is,
    for `check_nlp` to name."""
    try:
        return language_class(lang).lang
    except ImportError:
        return lang


def language_class(lang: str) -> type[Language]:
    """spaCy's Language class for `lang`, or an ImportError when spaCy has no such language. A
    module of spacy.lang that is no language (`punctuation`, `en.stop_words`) is one too: spaCy
    imports it, then failed with an AttributeError, a traceback where an unknown code is a line."""
    try:
        return spacy.util.get_lang_class(lang)
    except AttributeError as exc:
        raise ImportError(f"{lang!r} is a module of spacy.lang, not a language") from exc


def absolute_spacy_model(model: str | None) -> str | None:
    """A `--spacy-model` that names a pipeline folder here, as an absolute path (workers run in a
    folder of their own); an installed package's name as it is (spaCy prefers the package)."""
    if model is None or spacy.util.is_package(model) or not os.path.exists(model):
        return model
    return os.path.abspath(model)


def _one_token_per_long_run(nlp: Language) -> None:
    """Makes a whitespace-free run of LONG_RUN_CHARS or more characters a single token, in
    linear time, by way of spaCy's `token_match` (kept for shorter runs)."""
    tokenizer = nlp.tokenizer
    if not isinstance(tokenizer, Tokenizer):  # e.g. the Chinese segmenters: no affix splitting
        return
    previous = tokenizer.token_match

    def token_match(run: str):
        return len(run) >= LONG_RUN_CHARS or (previous is not None and previous(run))

    tokenizer.token_match = token_match


def _split_sentence_ends(nlp: Language) -> None:
    """Splits off the end of a word what ends a sentence where spaCy's suffix rules did not:
    - a period after a mark, a variation selector or a skin tone (spaCy's rule splits it after a
      letter, digit or punctuation only: "❤️.", "👍🏽." and "café\u0301." were one token);
    - a sentence end of another script (Burmese ။, Ethiopic ።, Khmer ។, ...), which spaCy's
      sentencizer knows but only some languages' suffix rules split off: under `xx` no Burmese
      sentence ended.
    Both are then a token of their own, where the sentencizer ends the sentence."""
    tokenizer = nlp.tokenizer
    if not isinstance(tokenizer, Tokenizer) or tokenizer.suffix_search is None:
        return
    # the period first, then a look back at the character before it: cheap at every other place
    period = f"\\.(?<={extender_class()}\\.)$"
    # ASCII ones are left to spaCy's own rules ("U.S." keeps its period)
    others = "[" + "".join(re.escape(char) for char in SENTENCE_ENDS if not char.isascii()) + "]$"
    tokenizer.suffix_search = re.compile(f"{tokenizer.suffix_search.__self__.pattern}|{period}|{others}").search


def chinese_segmenter() -> str:
    """How a blank Chinese pipeline built here segments words: "jieba" when jieba can be imported,
    else "char" (spaCy's single characters). The import is tried, not looked up: a jieba that is
    installed but cannot be imported (broken, or blocked) is absent."""
    try:
        jieba = importlib.import_module("jieba")
    except ImportError:
        return "char"
    # jieba logs its dictionary's loading at DEBUG to stderr through a handler of its own, once
    # per process: every worker would add lines to the command's output
    logging.getLogger(jieba.__name__).setLevel(logging.WARNING)
    return "jieba"


def planned_segmenter(lang: str, model: str | None) -> str | None:
    """The Chinese segmenter a job launched here plans for every worker ("jieba" or "char", by
    `chinese_segmenter()`), for a blank Chinese pipeline; None for any other."""
    return chinese_segmenter() if spacy_lang(lang) == "zh" and model is None else None


def describe_segmenter(segmenter: str | None) -> dict[str, str]:
    """What the output metadata says about Chinese segmentation (nothing when it does not apply)."""
    if segmenter is None:
        return {}
    if segmenter == "jieba":
        return {"segmenter": "jieba", "jieba_version": importlib.metadata.version("jieba")}
    return {"segmenter": "char", "fallback": "jieba could not be imported: single characters"}


def _blank_chinese(segmenter: str) -> Language:
    if segmenter == "jieba":
        if chinese_segmenter() != "jieba":
            raise RuntimeError("Chinese segmentation with jieba was planned for this job (jieba was importable where "
                               "it was launched), but jieba cannot be imported here: install it on every worker "
                               "(pip install 'elmo-pipeline[zh]')")
        logger.info("Chinese word segmentation with jieba")
        return spacy.blank("zh", config={"nlp": {"tokenizer": {"segmenter": "jieba"}}})
    logger.warning("Chinese is segmented into single characters (jieba could not be imported where that was chosen)")
    return spacy.blank("zh", config={"nlp": {"tokenizer": {"segmenter": "char"}}})


def piece_chars(nlp: Language) -> int:
    """The most characters spaCy parses at once: a longer document is tokenized in pieces."""
    return min(PIECE_CHARS, nlp.max_length)


def _sets_sentence_boundaries(nlp: Language) -> bool:
    return any("token.is_sent_start" in nlp.get_pipe_meta(name).assigns for name in nlp.pipe_names)


def sentences_from_docs(
    nlp: Language, docs: Iterable[Document], max_sentence_tokens: int = 256, batch_size: int = 256,
) -> Iterator[Sentence | ErrorRecord]:
    """The sentences of `docs` in order, tokenized `batch_size` documents at a time.

    A document without tokens yields nothing; a document that cannot be tokenized yields one
    ErrorRecord (stage "tokenize"). Use `tokenize_documents` to see one result per document.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")  # when called, not when read
    return _batched_sentences(nlp, iter(docs), max_sentence_tokens, batch_size)


def _batched_sentences(nlp: Language, docs: Iterator[Document], max_sentence_tokens: int,
                       batch_size: int) -> Iterator[Sentence | ErrorRecord]:
    while batch := list(islice(docs, batch_size)):
        for result in tokenize_documents(nlp, batch, max_sentence_tokens):
            if isinstance(result, ErrorRecord):
                yield result
            else:
                yield from result


def tokenize_documents(
    nlp: Language, docs: Sequence[Document], max_sentence_tokens: int = 256,
) -> list[DocumentResult]:
    """One result per document, in order: its sentences (an empty list when it has no token), or
    an ErrorRecord when spaCy fails on it.

    A document longer than `piece_chars(nlp)` gives instead an iterator that tokenizes it piece by
    piece as it is consumed (see the module docstring); if spaCy fails on a piece, it yields an
    ErrorRecord after the sentences of the pieces before and stops.
    """
    if max_sentence_tokens < 1:
        raise ValueError(f"max_sentence_tokens must be >= 1, got {max_sentence_tokens}")
    results: list[DocumentResult | None] = [
        _unusable(doc) or (_long_document(nlp, doc, max_sentence_tokens) if len(doc.text) > piece_chars(nlp) else None)
        for doc in docs
    ]
    todo = [i for i, result in enumerate(results) if result is None]
    with ExitStack() as zone:  # the Docs die in its memory zone: _sentences copies what it keeps
        zone.enter_context(pipeline_lock(nlp))
        for i, parsed in zip(todo, _parse(nlp, [docs[i] for i in todo], zone)):
            if isinstance(parsed, ErrorRecord):
                results[i] = parsed
            elif parsed.text != tokenizer_text(docs[i].text):  # offsets would not point into the document's text
                results[i] = _error(docs[i], "the tokenizer changed the text")
            else:
                results[i] = _sentences(docs[i], parsed, max_sentence_tokens)
    return results


# spaCy's vocabulary is not safe under threads adding strings at once (4 threads sharing one
# pipeline, tokenizing new words: KeyError E018 "Can't retrieve string for hash" and "the tokenizer
# changed the text" records), and a memory zone opened by one thread would take in another's
# strings and let them go under its Docs: one thread at a time works in a pipeline
_PIPELINE_LOCKS: weakref.WeakKeyDictionary[Language, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def pipeline_lock(nlp: Language) -> AbstractContextManager:
    """The lock that `nlp`'s users in this module hold while they tokenize with it (one per
    pipeline, re-entrant); nothing for an object that only acts as a pipeline."""
    if not isinstance(nlp, Language):
        return nullcontext()
    with _LOCKS_LOCK:
        lock = _PIPELINE_LOCKS.get(nlp)
        if lock is None:
            lock = _PIPELINE_LOCKS[nlp] = threading.RLock()
    return lock


@contextmanager
def transient_strings(nlp: Language) -> Iterator[None]:
    """A spaCy memory zone: the strings and lexemes `nlp` meets inside are let go at its end (see
    the module docstring), so no spaCy object made inside may be used after it. Inside a zone
    already open (a caller's own), or for an object that only acts as a pipeline, nothing is done:
    spaCy's zones do not nest (the inner one's end let go of the outer one's strings)."""
    vocab = getattr(nlp, "vocab", None)
    if not isinstance(nlp, Language) or getattr(vocab, "in_memory_zone", True):
        yield
        return
    with nlp.memory_zone():
        yield


def _piece_end(text: str, start: int, limit: int) -> int:
    """Where a piece of at most `limit` characters from `start` ends: after the last newline in
    it, else after its last other whitespace, else at the limit, or before it where a grapheme
    cluster would be cut (the run of characters is cut in two tokens there)."""
    hi = start + limit
    if hi >= len(text):
        return len(text)
    cut = text.rfind("\n", start, hi)
    if cut < start:
        last = _LAST_WHITESPACE.search(text, start, hi)
        cut = last.start() if last else -1
    return cut + 1 if cut >= start else cluster_start(text, hi, start)


class _OpenSentence:
    """The tokens of a sentence not yet written out: a sentence can run on into the next piece."""

    def __init__(self, doc: Document, index: int, max_tokens: int) -> None:
        self.doc, self.index, self.max_tokens = doc, index, max_tokens
        self.window = 0
        self.texts: list[str] = []
        self.starts: list[int] = []

    def add(self, span: Span, offset: int, until: int) -> None:
        for token in span:
            if token.idx >= until:
                break
            if not token.is_space:
                self.texts.append(token.text)
                self.starts.append(token.idx + offset)

    def windows(self, final: bool) -> Iterator[Sentence]:
        """The full windows so far, and the last partial one when the sentence is `final`."""
        while len(self.texts) >= self.max_tokens or (final and self.texts):
            texts = tuple(self.texts[: self.max_tokens])
            starts = np.array(self.starts[: self.max_tokens], np.int64)
            ends = starts + np.fromiter((len(t) for t in texts), np.int64, len(texts))
            del self.texts[: self.max_tokens], self.starts[: self.max_tokens]
            yield Sentence(self.doc.doc_id, self.index, self.window, texts, starts, ends, self.doc.timestamp)
            self.window += 1


def _run_on_point(parsed: Doc) -> int:
    """Where a piece holding one unfinished sentence is cut so that the next piece starts in the same
    state: at a whitespace boundary after a word (not punctuation, which may end a sentence
    depending on what follows). 0 when there is no such point."""
    text = parsed.text
    previous = None  # the token after the candidate, walking backwards
    for token in reversed(parsed):
        if token.is_space:
            continue
        if previous is not None and not token.is_punct and text[previous.idx - 1].isspace():
            return previous.idx
        previous = token
    return 0


def _long_document(nlp: Language, doc: Document, max_tokens: int) -> Iterator[Sentence | ErrorRecord]:
    text, limit = doc.text, piece_chars(nlp)
    start, index = 0, 0
    sentence: _OpenSentence | None = None  # the sentence the last piece ended in, when it may go on
    while start < len(text):
        end = _piece_end(text, start, limit)
        piece = text[start:end]
        done: list[Sentence] = []  # the piece's windows, given out once its zone has ended
        with ExitStack() as zone:  # no yield inside: a generator left there would keep the zone open
            zone.enter_context(pipeline_lock(nlp))
            try:
                fill_chunk_cache(nlp, (piece,))  # before the zone, in which spaCy stores no split
                zone.enter_context(transient_strings(nlp))
                parsed = nlp(make_doc(nlp, piece))
            except Exception as e:  # noqa: BLE001 - reported as this document's error record
                failure = _error(doc, f"spaCy failed on characters {start}:{end} of {len(text)} (the sentences "
                                      f"before were kept): {type(e).__name__}: {e}")
            else:
                failure = (None if parsed.text == tokenizer_text(piece)
                           else _error(doc, f"the tokenizer changed the text of characters {start}:{end}"))
            if failure is None:
                spans = list(parsed.sents)
                runs_on = end < len(text) and len(spans) == 1  # one sentence fills the piece: it goes on
                until = len(piece)
                if end < len(text) and len(spans) > 1:  # the last sentence may go on: tokenize it again next time
                    end = start + spans[-1].start_char
                    spans.pop()
                elif runs_on:  # its tail is tokenized again next time, where the words after it are seen
                    until = _run_on_point(parsed) or until
                    end = start + until
                for k, span in enumerate(spans):
                    if k > 0 or sentence is None:  # a new sentence
                        if sentence is not None:
                            done += sentence.windows(final=True)
                            index += sentence.window > 0
                        sentence = _OpenSentence(doc, index, max_tokens)
                    sentence.add(span, start, until)
                    done += sentence.windows(final=False)
                del parsed, spans
        if failure is not None:
            yield failure
            return
        yield from done
        if not runs_on and sentence is not None:
            yield from sentence.windows(final=True)
            index += sentence.window > 0
            sentence = None
        start = end


def tokenizer_text(text: str) -> str:
    """`text` as the tokenizer reads it: the zero-width spaces and bidi controls as spaces (see
    _INVISIBLE_SEPARATORS); every other character, and so every offset, as it is."""
    return text if text.isascii() else _INVISIBLE_SEPARATORS.sub(" ", text)


def make_doc(nlp: Language, text: str) -> Doc:
    """What `nlp`'s tokenizer makes of `tokenizer_text(text)`, with the tokens it cut apart inside a grapheme
    cluster joined again (`corpus/graphemes.py`): an emoji and its skin tone, a flag, a letter and
    its combining mark are one character to a reader, and one token here. `nlp` (or `nlp.pipe`)
    then runs its components on it. Done here rather than as a component, where the text would
    have to be joined again from the tokens: for text without any cluster of two characters or
    more (any text of ASCII only) it costs a look at each character."""
    text = tokenizer_text(text)
    doc = nlp.make_doc(text)
    # jieba cuts words of other scripts apart only where the text has some: most Chinese text holds
    # none, and the look at every cut cost as much as a third of jieba's own time
    other_words = getattr(nlp.tokenizer, "segmenter", None) == "jieba" and _has_other_words(text)
    if len(doc) < 2 or not (other_words or may_cut_clusters(text)):
        return doc
    starts, lengths, spaced, norms, blank = doc.to_array([IDX, LENGTH, SPACY, NORM, IS_SPACE]).T
    starts = starts.astype(np.int64)
    # the tokens that follow a word without a space: a space and a mark after it are one cluster
    # to Unicode, but the space parts words (and a token of whitespace is dropped)
    follows = np.flatnonzero((spaced[:-1] == 0) & (blank[:-1] == 0)) + 1
    inside = inside_clusters(text, starts[follows])
    if other_words:
        inside |= _inside_other_words(text, starts[follows])
    joins = follows[inside]
    if not len(joins):
        return doc
    # a new Doc rather than spaCy's retokenizer, whose merges each cost time in the length of the
    # document: 150,000 of them (Chinese by characters, 300,000 decomposed letters) took 130 s
    firsts = np.ones(len(doc), bool)
    firsts[joins] = False
    heads = np.flatnonzero(firsts)  # the first token of each new one
    lasts = np.append(heads[1:], len(doc)) - 1
    ends = (starts[lasts] + lengths[lasts].astype(np.int64)).tolist()
    joined = Doc(doc.vocab, words=[text[a:b] for a, b in zip(starts[heads].tolist(), ends)],
                 spaces=(spaced[lasts] != 0).tolist())
    # a token left whole keeps its norm (a tokenizer exception's: "n't" is "not"), which the
    # components of a loaded pipeline read
    whole = heads == lasts
    joined_norms = joined.to_array([NORM])
    joined_norms[whole] = norms[heads[whole]]
    joined.from_array([NORM], joined_norms)
    return joined


# CJK ideographs (the unified blocks, their extensions and compatibility forms): jieba's to segment
_IDEOGRAPHS = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x323AF))


def _not_ideographs(codes: np.ndarray) -> np.ndarray:
    """Which of the code points `codes` lie outside every block of `_IDEOGRAPHS`."""
    outside = np.ones(len(codes), bool)
    for low, high in _IDEOGRAPHS:
        outside &= (codes < low) | (codes > high)
    return outside


def _has_other_words(text: str) -> bool:
    """Whether `text` holds a letter, digit or mark outside ASCII that is not an ideograph: where
    jieba may cut a word (`_inside_other_words`). Each distinct such character is looked at once."""
    if text.isascii():
        return False
    codes = code_points(text)
    others = codes[(codes >= 0x80) & _not_ideographs(codes)]
    return any(_word_character(chr(code)) for code in set(others.tolist()))


def _inside_other_words(text: str, cuts: np.ndarray) -> np.ndarray:
    """Which of jieba's cuts (int64 indices from 1 to len(text) - 1) fall inside a word of letters,
    digits and marks that are not ideographs: jieba keeps runs of ideographs and ASCII letters
    together and cuts at every other character, so "Müller" was "M", "ü", "ller" and "café" "caf", "é"."""
    codes = code_points(text)
    before, after = codes[cuts - 1], codes[cuts]
    maybe = (before >= 0x80) | (after >= 0x80)  # jieba keeps a run of ASCII letters and digits whole
    maybe &= _not_ideographs(before) & _not_ideographs(after)  # jieba's own cut, between words of Chinese
    inside = np.zeros(len(cuts), bool)
    inside[maybe] = [_word_character(text[i - 1]) and _word_character(text[i]) for i in cuts[maybe].tolist()]
    return inside


def _word_character(char: str) -> bool:
    return char.isalnum() or unicodedata.category(char)[0] == "M"


def _parse(nlp: Language, docs: list[Document], zone: ExitStack) -> list[Doc | ErrorRecord]:
    """`docs` parsed in a memory zone (transient_strings) entered on `zone` once the chunk cache
    is filled: spaCy stores no split inside one."""
    texts = [doc.text for doc in docs]
    try:
        fill_chunk_cache(nlp, texts)
        zone.enter_context(transient_strings(nlp))
        return list(nlp.pipe([make_doc(nlp, text) for text in texts], batch_size=max(len(docs), 1)))
    except Exception:  # noqa: BLE001 - one bad document must not fail the batch: find it alone
        zone.enter_context(transient_strings(nlp))  # nothing more when the zone is open already
        return [_parse_one(nlp, doc) for doc in docs]


def _parse_one(nlp: Language, doc: Document) -> Doc | ErrorRecord:
    try:
        return nlp(make_doc(nlp, doc.text))
    except Exception as e:  # noqa: BLE001 - reported as this document's error record
        return _error(doc, f"spaCy failed: {type(e).__name__}: {e}")


def _unusable(doc: Document) -> ErrorRecord | None:
    """An ErrorRecord for a Document (built by a caller, not read by us) whose text or id cannot be
    used: spaCy takes bytes for a serialised Doc, and an id of None would key rows "None:0:0:0"."""
    if not isinstance(doc, Document):
        raise TypeError(f"documents to tokenize are Documents, got a {type(doc).__name__} ({doc!r:.80})")
    if not isinstance(doc.text, str):
        return _error(doc, f"the text is a {type(doc.text).__name__}, not a str")
    if not isinstance(doc.doc_id, str):
        return _error(doc, f"the doc_id is a {type(doc.doc_id).__name__}, not a str")
    if has_lone_surrogate(doc.text):  # spaCy failed on it ("surrogates not allowed"), after its whole batch did
        return _error(doc, "the text holds a lone surrogate, which UTF-8 cannot encode (bytes that were not UTF-8, "
                           "decoded with errors='surrogateescape'?)")
    # what the Parquet writer (or a key store) cannot take: refused here, naming the document,
    # rather than failing the whole job in the writer after the model ran; the record leaves the
    # id out (as the readers do), since the errors file cannot hold it either
    if problem := doc_id_problem(doc.doc_id):
        return ErrorRecord(doc.source, doc.line, f"the doc_id {doc.doc_id!r:.80} {problem}", "tokenize", None)
    if doc.timestamp is not None and not isinstance(doc.timestamp, str):  # the writer parses text only
        return _error(doc, f"the timestamp is a {type(doc.timestamp).__name__}, not an ISO 8601 str")
    if doc.timestamp is not None and (problem := timestamp_problem(doc.timestamp)):
        return _error(doc, f"the timestamp {doc.timestamp!r:.80} {problem}")
    return None


def _error(doc: Document, reason: str) -> ErrorRecord:
    return ErrorRecord(doc.source, doc.line, reason, "tokenize", doc.doc_id)


def _sentences(doc: Document, parsed: Doc, max_tokens: int) -> list[Sentence]:
    sentences: list[Sentence] = []
    index = 0
    for span in parsed.sents:
        windows = _span_sentences(doc, span, index, max_tokens)
        if windows:
            index += 1
            sentences += windows
    return sentences


def _span_sentences(doc: Document, span: Span, index: int, max_tokens: int) -> list[Sentence]:
    """The windows of one spaCy sentence as sentence `index` (none when it has no token)."""
    tokens = [token for token in span if not token.is_space]
    if not tokens:
        return []
    texts = tuple(token.text for token in tokens)
    starts = np.fromiter((token.idx for token in tokens), np.int64, len(tokens))
    ends = starts + np.fromiter((len(text) for text in texts), np.int64, len(texts))
    return [
        Sentence(doc.doc_id, index, window, texts[lo:lo + max_tokens], starts[lo:lo + max_tokens],
                 ends[lo:lo + max_tokens], doc.timestamp)
        for window, lo in enumerate(range(0, len(texts), max_tokens))
    ]
