"""Held-out perplexity with the full softmax.

forward perplexity  = exp(mean NLL of the forward LM over its predictions),
backward perplexity = the same for the backward LM,
average perplexity  = exp(mean NLL over both directions' predictions)
                    = exp(0.5 * (forward NLL + backward NLL)), the quantity the original
                      implementation reports (the geometric mean of the two).
Each sentence of n words contributes n + 1 predictions per direction (the words and the
closing `</S>`, or `<S>` for the backward LM), from a zero initial state.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from elmo_pipeline.filesystems import without_userinfo
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.runtime import autocast
from elmo_pipeline.training.data import length_batches
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.corpus.options import DEFAULT_MAX_SENTENCE_TOKENS, mib_shown
from elmo_pipeline.training.prepare import whitespace_text_sentences, windows
from elmo_pipeline.training.shards import PreparedCorpus, is_prepared, vocab_digest


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class NonFinitePerplexity(ValueError):
    """A model whose held-out loss is not a finite number, or whose perplexity overflows a float."""


_LARGEST_EXPONENT = math.log(sys.float_info.max)  # exp of more overflows a float


def perplexity(nll: float, direction: str) -> float:
    """exp(nll), or NonFinitePerplexity naming `direction` where that is no finite number."""
    if not math.isfinite(nll) or nll > _LARGEST_EXPONENT:
        raise NonFinitePerplexity(f"the {direction} loss per prediction is {nll}: the perplexity is not a finite "
                                  "number (the model's outputs are NaN or infinite, or it diverged)")
    return math.exp(nll)


class ExactSum:
    """A sum of float32 values that is the same bits whatever groups and order they come in: each
    one is a whole multiple of 2**-149 (float32's smallest step), so the multiples are added as
    integers and divided once, correctly rounded. A float32 sum per batch (as training takes it)
    made a perplexity depend on --batch-tokens in its 7th digit."""

    _STEPS = 1 << 149

    def __init__(self) -> None:
        self._steps = 0
        self._non_finite = 0.0  # NaN and infinities, kept as they are for perplexity() to name

    def add(self, values: torch.Tensor) -> None:
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            self._non_finite += float(values[~finite].double().sum())
            values = values[finite]
        self._steps += sum(int(v) for v in (values.double() * float(self._STEPS)).tolist())

    @property
    def value(self) -> float:
        return self._steps / self._STEPS + self._non_finite


def evaluate_sentences(model: BiLM, sentences: Iterable[tuple[Sequence[str], np.ndarray | None]],
                       batch_tokens: int = 8192, device: torch.device | None = None,
                       precision: str = "fp32", progress: bool = False) -> dict:
    """Perplexities of `sentences` ((words, ids or None) pairs), streamed in chunks; `progress`
    shows a bar on a terminal (the trainer's validation keeps it off, under its own bar).
    `precision` is the model's autocast (runtime.autocast); the softmax runs in float32."""
    device = device or model.device
    objective = LmObjective(model, per_prediction=True)
    was_training = model.training
    model.eval()
    fwd, bwd = ExactSum(), ExactSum()
    n_pred = n_words = n_sent = n_unknown = 0
    start = time.perf_counter()
    bar = progress_bar("evaluate", enabled=progress)
    with bar, torch.no_grad(), autocast(device, precision):
        for chunk in _chunks((s for s in sentences if len(s[0]) > 0), 20000):
            for rows in length_batches([len(w) for w, _ in chunk], batch_tokens, 1024, None):
                words = [list(chunk[i][0]) for i in rows]
                ids = [chunk[i][1] for i in rows]
                batch = make_batch(model, words, None if any(x is None for x in ids) else ids).to(device)
                f, b, n = run_objective(objective, batch)
                fwd.add(f)
                bwd.add(b)
                n_pred += n
                n_words += batch.n_words
                n_unknown += batch.n_unknown
                n_sent += len(rows)
                note_tokens(bar, len(rows), batch.n_words)
    model.train(was_training)
    if n_pred == 0:
        raise ValueError("no sentences to evaluate")
    fwd_nll, bwd_nll = fwd.value / n_pred, bwd.value / n_pred
    return {
        "forward_perplexity": perplexity(fwd_nll, "forward"),
        "backward_perplexity": perplexity(bwd_nll, "backward"),
        "average_perplexity": perplexity(0.5 * (fwd_nll + bwd_nll), "average"),
        "forward_nll": fwd_nll, "backward_nll": bwd_nll,
        "sentences": n_sent, "tokens": n_words, "predictions_per_direction": n_pred,
        # one class for every word the vocabulary lacks: a text it never saw (another language) is
        # predictable as a run of them, and its perplexity low; this count shows it
        "unknown_tokens": n_unknown,
        "seconds": round(time.perf_counter() - start, 3),
    }


def _raw_text_only(data: str, tokenizer: str) -> None:
    if tokenizer != "whitespace":
        raise ValueError(f"{data}: not a prepared folder; evaluate reads raw text only with the whitespace "
                         "tokenizer (run `elmo-pipeline prepare` for spaCy tokenization)")


def check_sentences(data: str, tokenizer: str = "whitespace", option: str = "--data", read_all: bool = False,
                    max_document_mb: float | None = None) -> None:
    """Raises unless `data` (as `data_sentences` reads it) holds a sentence; reads up to the first,
    or with `read_all` every sentence, so that a line or shard that cannot be read is named now
    (pretrain's --valid: found at the validation after training, it cost the training)."""
    if is_prepared(data):
        corpus = PreparedCorpus(data)
        empty = corpus.manifest.tokens == 0
        for shard in range(corpus.n_shards if read_all else 0):
            corpus.read_shard(shard)
    else:
        _raw_text_only(data, tokenizer)
        sentences = whitespace_text_sentences(data, max_document_mb=max_document_mb)
        empty = not (sum(1 for _ in sentences) if read_all else any(True for _ in sentences))
    if empty:
        raise ValueError(f"{option} {data}: no sentences to evaluate")


def check_max_document_mb(data: str, max_document_mb: float | None) -> None:
    """Raises when --max-document-mb is given for a prepared folder: prepare read its lines
    (under its own --max-document-mb), so the option would do nothing."""
    if max_document_mb is not None and is_prepared(data):
        raise ValueError(f"--max-document-mb {mib_shown(max_document_mb)}: {data} is a prepared folder, whose "
                         "lines prepare read under its own --max-document-mb; the option bounds the lines of text only")


def check_windows(data: str, max_sentence_tokens: int | None) -> None:
    """Raises when `max_sentence_tokens` is more than the windows a prepared folder's sentences
    were cut into by `prepare`: they cannot be joined again, so the option would do nothing."""
    if max_sentence_tokens is not None and max_sentence_tokens < 1:
        raise ValueError(f"--max-sentence-tokens must be >= 1, got {max_sentence_tokens}")
    if max_sentence_tokens is None or not is_prepared(data):
        return
    cut = PreparedCorpus(data).manifest.max_sentence_tokens
    if max_sentence_tokens > cut:
        raise ValueError(f"--max-sentence-tokens {max_sentence_tokens}: {data} is a prepared folder whose sentences "
                         f"prepare already cut into windows of at most {cut} tokens, which cannot be joined again; "
                         f"give at most {cut}, or the text itself as --data (or prepare it again with "
                         "--max-sentence-tokens)")


def data_sentences(model: BiLM, data: str, tokenizer: str = "whitespace",
                   max_sentence_tokens: int | None = None, max_document_mb: float | None = None,
                   ) -> Iterator[tuple[list[str], np.ndarray | None]]:
    """Sentences of a prepared folder (ids reused when its vocabulary is the model's), or of
    already-tokenized text files (`tokenizer="whitespace"`, one sentence per line). Sentences
    longer than `max_sentence_tokens` are cut into windows: text by default at
    DEFAULT_MAX_SENTENCE_TOKENS, a prepared folder's as prepare cut them, or again at a given
    value up to that (see `check_windows`). A text line of more than `max_document_mb` is refused
    (`whitespace_text_sentences`)."""
    check_windows(data, max_sentence_tokens)
    if is_prepared(data):
        corpus = PreparedCorpus(data)
        same_vocab = model.vocab is not None and vocab_digest(model.vocab) == vocab_digest(corpus.vocab)
        for shard in range(corpus.n_shards):
            tokens, ids = corpus.read_shard(shard)
            for t, i in zip(tokens, ids):
                yield from _windows_of(t, i if same_vocab else None, max_sentence_tokens)
        return
    _raw_text_only(data, tokenizer)
    limit = DEFAULT_MAX_SENTENCE_TOKENS if max_sentence_tokens is None else max_sentence_tokens
    for words in whitespace_text_sentences(data, limit, max_document_mb):
        yield words, None


def _windows_of(words: list[str], ids: np.ndarray | None, max_tokens: int | None,
                ) -> Iterator[tuple[list[str], np.ndarray | None]]:
    """A prepared sentence, whole (`max_tokens` None) or in windows of at most `max_tokens`."""
    if max_tokens is None:
        yield words, ids
        return
    for a, b in windows(len(words), max_tokens):
        yield words[a:b], (None if ids is None else ids[a:b])


def evaluate(model: BiLM, data: str, *, tokenizer: str = "whitespace",
             max_sentence_tokens: int | None = None, batch_tokens: int = 8192,
             device: torch.device | None = None, precision: str = "fp32", progress: bool = False,
             max_document_mb: float | None = None) -> dict:
    """`evaluate_sentences` over `data` (see `data_sentences`), the result naming it."""
    check_windows(data, max_sentence_tokens)  # now, not when the generator first runs
    result = evaluate_sentences(model, data_sentences(model, data, tokenizer, max_sentence_tokens, max_document_mb),
                                batch_tokens, device, precision, progress=progress)
    result["data"] = without_userinfo(data)  # the JSON is kept: a URL's password is not written there
    result["precision"] = precision
    return result
