"""`TokenizeWithSpacy`: Documents to Sentences; the work is in `elmo_pipeline.corpus.tokenization`."""

from __future__ import annotations

import apache_beam as beam
from apache_beam import pvalue

from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.corpus.tokenization import (LONG_RUN_CHARS, build_nlp, check_segmenter, chinese_segmenter,
                                              language_beside_pipeline, load_failure_hint, pipeline_language,
                                              spacy_lang, tokenize_documents)
from elmo_pipeline.strict import check_ints
from elmo_pipeline.transforms.checks import check_collection, check_element
from elmo_pipeline.transforms.metrics import (DOCUMENTS_TOKENIZED, EMPTY_DOCUMENTS, LONG_TOKENS, SENTENCES,
                                              TOKENIZE_ERRORS, TOKENS, WINDOWS_CUT, ZH_CHAR_FALLBACK_DOCUMENTS,
                                              BundleCounts)


@beam.typehints.with_input_types(Document)
class TokenizeWithSpacy(beam.PTransform):
    """PCollection[Document] -> `{"sentences": PCollection[Sentence], "errors": PCollection[ErrorRecord]}`.

    Documents are batched (within a bundle) for `nlp.pipe`: at most `batch_size` documents and
    about `batch_size` * 4096 characters, a longer document alone (one longer than 131,072
    characters is tokenized piece by piece, see `elmo_pipeline.corpus.tokenization`). The spaCy pipeline is
    built once per DoFn instance (`build_nlp(lang, model)`). Counters (namespace
    "elmo_pipeline"): documents_tokenized (documents that tokenized, with or without tokens),
    empty_documents (those without tokens: they give no sentence), tokenize_errors,
    sentences (Sentence records, a cut sentence counting once per window), tokens, and
    windows_cut (sentences longer than `max_sentence_tokens`, cut into windows), long_tokens
    (tokens of LONG_RUN_CHARS or more characters: whitespace-free runs kept whole, which spaCy's
    affix splitting would take quadratic time over), and zh_char_fallback_documents (documents
    of a blank Chinese pipeline segmented into single characters because jieba could not be
    imported). Every document read is either tokenized or
    in `errors`: documents_tokenized + tokenize_errors = inputs.

    `segmenter` ("jieba" or "char", for a blank Chinese pipeline) is what the job planned, and
    every worker uses it (a worker without jieba fails rather than segment differently); None:
    each worker's `chinese_segmenter()`.
    Counters are incremented when a bundle finishes, so a bundle that fails and is retried
    counts once.
    """

    def __init__(self, lang: str = "en", model: str | None = None, max_sentence_tokens: int = 256,
                 batch_size: int = 256, segmenter: str | None = None) -> None:
        super().__init__()
        check_ints(max_sentence_tokens=max_sentence_tokens, batch_size=batch_size)
        if max_sentence_tokens < 1 or batch_size < 1:
            raise ValueError(f"max_sentence_tokens ({max_sentence_tokens}) and batch_size ({batch_size}) must be >= 1")
        self._lang = spacy_lang(lang)  # `zho` is Chinese too, and segmented as `zh` is
        if model is not None or self._lang != "zh":  # blank Chinese needs no package (its segmenter: below)
            # built here, when the job is, not on every worker once it runs: an unknown code, a
            # language whose tokenizer needs a package that is missing (ja: SudachiPy, ko, th, vi),
            # or a pipeline that is not installed here (spaCy's OSError E050)
            try:
                pipeline_lang = pipeline_language(self._lang, model)  # not built again after extract's check
            except (ImportError, OSError) as exc:
                what = f"lang {lang!r}" if model is None else f"model {model!r}"
                raise ValueError(f"{what}: spaCy cannot load it ({exc}){load_failure_hint(lang, model, exc)}") from exc
            if language_beside_pipeline(lang, model, pipeline_lang):
                raise ValueError(f"lang {lang!r} is not the language of model {model!r} ({pipeline_lang!r}), which "
                                 "is the one used: leave lang out")
        check_segmenter(self._lang, model, segmenter)  # else each worker would fail after the reading
        self._model = model
        self._max_sentence_tokens = max_sentence_tokens
        self._batch_size = batch_size
        self._segmenter = segmenter

    def expand(self, documents: beam.PCollection) -> dict[str, beam.PCollection]:
        check_collection(self.label, documents)
        results = (
            documents
            # min = max: fixed-size batches (BatchElements flushes the remainder at bundle end), in
            # units of 4096 characters so that the text held at once stays bounded
            | "Batch" >> beam.BatchElements(min_batch_size=self._batch_size, max_batch_size=self._batch_size,
                                            element_size_fn=document_weight)
            | "Tokenize" >> beam.ParDo(_TokenizeFn(self._lang, self._model, self._max_sentence_tokens, self._segmenter))
            .with_outputs("errors", main="sentences")
        )
        return {"sentences": results.sentences, "errors": results.errors}


def document_weight(document: Document) -> int:
    """A document's share of a tokenization batch: one per started 4096 characters (one for a text
    that is not a str, which the tokenizer makes an error record)."""
    check_element("TokenizeWithSpacy", document, Document)
    return 1 + len(document.text) // 4096 if isinstance(document.text, str) else 1


class _TokenizeFn(beam.DoFn):
    def __init__(self, lang: str, model: str | None, max_sentence_tokens: int, segmenter: str | None) -> None:
        self._lang = lang
        self._model = model
        self._max_sentence_tokens = max_sentence_tokens
        self._segmenter = segmenter
        self._nlp = None

    def setup(self) -> None:
        segmenter = self._segmenter
        if segmenter is None and self._lang == "zh" and self._model is None:
            segmenter = chinese_segmenter()
        self._nlp = build_nlp(self._lang, self._model, segmenter)
        self._by_characters = segmenter == "char"

    def start_bundle(self) -> None:
        self._counts = BundleCounts()

    def process(self, batch: list[Document]):
        counts = self._counts
        for result in tokenize_documents(self._nlp, batch, self._max_sentence_tokens):
            if isinstance(result, ErrorRecord):
                counts.add(TOKENIZE_ERRORS)
                yield pvalue.TaggedOutput("errors", result)
                continue
            n_sentences = 0
            for sentence in result:  # a list, or a lazy iterator for a very long document
                if isinstance(sentence, ErrorRecord):  # a later piece failed: earlier sentences are out
                    counts.add(TOKENIZE_ERRORS)
                    yield pvalue.TaggedOutput("errors", sentence)
                    break
                n_sentences += 1
                counts.add(TOKENS, len(sentence.tokens))
                counts.add(WINDOWS_CUT, sentence.window_index == 1)  # one count per cut sentence
                if max(map(len, sentence.tokens), default=0) >= LONG_RUN_CHARS:
                    counts.add(LONG_TOKENS, sum(len(token) >= LONG_RUN_CHARS for token in sentence.tokens))
                yield sentence
            else:
                counts.add(DOCUMENTS_TOKENIZED)
                counts.add(EMPTY_DOCUMENTS, n_sentences == 0)
                counts.add(ZH_CHAR_FALLBACK_DOCUMENTS, self._by_characters)
            counts.add(SENTENCES, n_sentences)

    def finish_bundle(self) -> None:
        self._counts.commit()
