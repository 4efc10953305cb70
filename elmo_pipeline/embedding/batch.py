"""Embedding batches of tokenized sentences and mixing their layers; the library behind the Beam stages."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from elmo_pipeline.model.bilm import BiLM, TokenListError
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.runtime import autocast
from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix


def sentence_weight(sentence: Sentence) -> int:
    """A batch's cost is its padded token count; +2 for the boundary tokens the model adds."""
    if not isinstance(sentence, Sentence):  # the first place a stray element meets the embedding
        raise TypeError(f"sentences to embed are Sentences, got a {type(sentence).__name__} ({sentence!r:.80})")
    return len(sentence.tokens) + 2


def length_sorted_batches(sentences: Iterable[Sentence], batch_tokens: int, max_sentences: int,
                          ) -> Iterator[list[Sentence]]:
    """`sentences` sorted by `sentence_weight` (stable) and cut into batches by Beam's
    SortAndBatchElements rule: a batch closes before its weight would reach `batch_tokens` or its
    size exceed `max_sentences` (a sentence heavier than the budget goes alone)."""
    batch: list[Sentence] = []
    weight = 0
    for sentence in sorted(sentences, key=sentence_weight):
        w = sentence_weight(sentence)
        if batch and (len(batch) >= max_sentences or weight + w >= batch_tokens):
            yield batch
            batch, weight = [], 0
        batch.append(sentence)
        weight += w
    if batch:
        yield batch


def _is_out_of_memory(exc: BaseException) -> bool:
    # cuBLAS and cuDNN report a failed allocation of their own as *_STATUS_ALLOC_FAILED
    message = str(exc)
    return (isinstance(exc, torch.OutOfMemoryError) or "out of memory" in message.lower()
            or "STATUS_ALLOC_FAILED" in message)


def embed_batch(
    model: BiLM, sentences: Sequence[Sentence], precision: str = "fp32",
    on_split: Callable[[int], None] | None = None,
) -> list[EmbeddedSentence]:
    """Zero-state embeddings of `sentences`, in order. An out-of-memory error halves the batch
    and retries each half, so no sentence is ever dropped; one sentence alone that does not
    fit is an error."""
    layers = _layers_unless_out_of_memory(model, sentences, precision)
    if layers is None:
        # Split only here, outside the handler: the error's traceback holds the frames of the
        # failed forward pass and so its tensors, which would stay allocated while the halves run.
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        if on_split:
            on_split(len(sentences))
        half = len(sentences) // 2
        return (embed_batch(model, sentences[:half], precision, on_split)
                + embed_batch(model, sentences[half:], precision, on_split))
    # views of the batch's array, not copies: the writer converts each to its columns as it arrives
    return [EmbeddedSentence(s, layers[:, i, : len(s.tokens)], {}) for i, s in enumerate(sentences)]


class SharedEmbedder:
    """A loaded biLM behind two methods that take and return plain values: what a proxy can serve.

    Shared between a machine's processes (Beam's `large_model`), the model lives in one server
    process and the others hold a proxy that forwards method calls only and pickles what they
    take and return. So the whole batch, autocast included, runs where the model is."""

    def __init__(self, model: BiLM) -> None:
        self.model = model

    def runtime(self) -> tuple[str, str]:
        """The device type and LSTM kernel the model embeds with."""
        return self.model.device.type, self.model.resolved_kernel()

    def embed_sentences(self, sentences: Sequence[Sentence], precision: str) -> tuple[list[EmbeddedSentence], int]:
        """`embed_batch`'s sentences, and how many times an out-of-memory error split the batch."""
        splits: list[int] = []
        return embed_batch(self.model, sentences, precision, on_split=splits.append), len(splits)


def _layers_unless_out_of_memory(model: BiLM, sentences: Sequence[Sentence], precision: str) -> np.ndarray | None:
    """The layers, (L+1, B, T, 2P) float32, or None when the batch ran out of memory and can be split."""
    try:
        with torch.inference_mode(), autocast(model.device, precision):
            out = model.embed([s.tokens for s in sentences])
            return out.layers.float().cpu().numpy()
    except TokenListError as exc:  # named by the sentence's key, not its place in a length-sorted batch
        # a blank token is embed's ValueError (BlankTokenError) here too, not a TypeError
        kind = ValueError if isinstance(exc, ValueError) else TypeError
        raise kind(f"sentence {sentences[exc.index].key} {exc.problem}") from None
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not _is_out_of_memory(exc) or len(sentences) == 1:
            raise
    return None


def build_mixes(specs: Mapping[str, MixSpec], n_layers: int) -> dict[str, ScalarMix]:
    mixes = {}
    for name, spec in specs.items():
        if len(spec.weights) != n_layers:
            raise ValueError(f"mix {name!r} has {len(spec.weights)} weights; the model has {n_layers} layers")
        mixes[name] = ScalarMix.from_spec(spec).eval()
    return mixes


def apply_mixes(item: EmbeddedSentence, mixes: Mapping[str, ScalarMix]) -> EmbeddedSentence:
    """Adds each named mix, (n, 2P) float32, to an embedded sentence."""
    layers = torch.from_numpy(item.layers)
    with torch.inference_mode():
        mixed = {name: mix(layers).numpy() for name, mix in mixes.items()}
    return item._replace(mixes={**item.mixes, **mixed})
