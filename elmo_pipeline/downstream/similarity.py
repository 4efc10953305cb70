"""Polysemy: one word in several sentences, the cosine similarity of its vectors per layer.

Layer 0 is context-free: the same word form gets the same vector in every sentence (cosine 1).
The biLSTM layers see the sentence, so the same form gets different vectors; on a trained model
occurrences with the same sense should be closer than occurrences with different senses.

    from elmo_pipeline import BiLM
    from elmo_pipeline.downstream.similarity import word_similarity
    result = word_similarity(model, [["Apple", "pie", "is", "sweet"], ["Apple", "sells", "phones"]], "Apple",
                             senses=["fruit", "company"])
    print(result.format())
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np
import torch

from elmo_pipeline.embedding import DEFAULT_BATCH_TOKENS, padded_length_batches
from elmo_pipeline.model.bilm import BiLM, check_sentence_list, check_token_lists


@dataclass
class SimilarityResult:
    word: str
    sentences: list[list[str]]
    positions: list[int]  # the word's token position in each sentence (its first occurrence)
    senses: list[str] | None
    vectors: np.ndarray  # (L+1, N, 2P)
    cosine: np.ndarray  # (L+1, N, N)

    @property
    def n_layers(self) -> int:
        return self.cosine.shape[0]

    def pairs(self, same: bool) -> list[tuple[int, int]]:
        if self.senses is None:
            return []
        return [(i, j) for i, j in combinations(range(len(self.sentences)), 2)
                if (self.senses[i] == self.senses[j]) == same]

    def summary(self) -> list[dict[str, Any]]:
        """Per layer: mean cosine over all pairs, same-sense pairs and cross-sense pairs."""
        everything = list(combinations(range(len(self.sentences)), 2))
        rows = []
        for j in range(self.n_layers):
            c = self.cosine[j]
            row = {"layer": j, "all_pairs": _mean(c, everything)}
            if self.senses is not None:
                same, cross = _mean(c, self.pairs(True)), _mean(c, self.pairs(False))
                row.update(same_sense=same, cross_sense=cross,
                           gap=None if same is None or cross is None else same - cross)
            rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"word": self.word, "sentences": [" ".join(s) for s in self.sentences], "positions": self.positions,
                "senses": self.senses, "summary": self.summary(),
                "cosine": [[[round(float(v), 6) for v in row] for row in layer] for layer in self.cosine]}

    def format(self, matrices: bool = False) -> str:
        lines = [f"word {self.word!r} in {len(self.sentences)} sentences"]
        for i, s in enumerate(self.sentences):
            sense = f" [{self.senses[i]}]" if self.senses else ""
            lines.append(f"  s{i}{sense}: {' '.join(s)}")
        head = f"{'layer':<8}{'all pairs':>10}"
        if self.senses is not None:
            head += f"{'same sense':>12}{'cross sense':>13}{'gap':>8}"
        lines.append(head)
        for row in self.summary():
            line = f"{row['layer']:<8}{_fmt(row['all_pairs']):>10}"
            if self.senses is not None:
                line += f"{_fmt(row['same_sense']):>12}{_fmt(row['cross_sense']):>13}{_fmt(row['gap']):>8}"
            lines.append(line)
        if matrices:
            for j in range(self.n_layers):
                lines.append(f"layer {j} cosine:")
                lines.append("       " + "".join(f"{f's{i}':>8}" for i in range(len(self.sentences))))
                for i, row in enumerate(self.cosine[j]):
                    lines.append(f"  s{i:<4}" + "".join(f"{v:>8.4f}" for v in row))
        return "\n".join(lines)


def _mean(c: np.ndarray, pairs: Sequence[tuple[int, int]]) -> float | None:
    return float(np.mean([c[i, j] for i, j in pairs])) if pairs else None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{0.0 if abs(value) < 5e-5 else value:.4f}"  # no "-0.0000"


def find_word(tokens: Sequence[str], word: str, ignore_case: bool = False) -> int:
    key = word.casefold() if ignore_case else word
    for i, token in enumerate(tokens):
        if (token.casefold() if ignore_case else token) == key:
            return i
    raise ValueError(f"{word!r} is not a token of: {' | '.join(tokens)}" if tokens else
                     f"{word!r} is not a token of an empty sentence")


def cosine_matrix(vectors: torch.Tensor) -> torch.Tensor:
    """(..., N, D) -> (..., N, N), in float64, within [-1, 1] (rounding gave 1.0000000000000004
    for a vector with itself)."""
    v = vectors.double()
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return (v @ v.transpose(-1, -2)).clamp(-1.0, 1.0)


def _check_finite(vectors: torch.Tensor, sentences: Sequence[Sequence[str]], word: str) -> None:
    """Refuses NaN or infinite vectors (finite weights can still overflow), naming the first
    sentence that has them: their cosines would be NaN, printed as results."""
    finite = torch.isfinite(vectors).all(dim=2).all(dim=0)  # (N,)
    if not bool(finite.all()):
        i = int((~finite).nonzero()[0])
        raise ValueError(f"the vectors of {word!r} in sentence s{i} ({' '.join(sentences[i])}) are not finite (NaN "
                         f"or infinite; {int((~finite).sum())} of {len(sentences)} sentences): the model's weights "
                         "overflow on this input")


def _word_vectors(model: BiLM, sentences: list[list[str]], positions: list[int]) -> torch.Tensor:
    """(L+1, N, 2P) float32: each sentence's vectors at its word, embedded in length-sorted batches of
    at most DEFAULT_BATCH_TOKENS padded tokens (one call took 2,000 sentences padded to the longest)."""
    found: list[torch.Tensor | None] = [None] * len(sentences)
    for batch in padded_length_batches([len(s) for s in sentences], len(sentences), DEFAULT_BATCH_TOKENS):
        layers = model.embed([sentences[i] for i in batch]).layers
        for row, i in enumerate(batch):
            found[i] = layers[:, row, positions[i]].float().cpu()
    return torch.stack(found, dim=1)  # type: ignore[arg-type]  # every sentence is in one batch


@torch.no_grad()
def word_similarity(model: BiLM, sentences: Sequence[Sequence[str]], word: str,
                    senses: Sequence[str] | None = None, ignore_case: bool = False) -> SimilarityResult:
    """The vectors of `word` (its first occurrence) in each tokenized sentence, and their cosines per layer."""
    check_sentence_list(sentences)  # before len(): a generator said only "has no len()"
    if len(sentences) < 2:
        raise ValueError("give at least two sentences")
    if not isinstance(word, str):  # else each sentence was said not to hold it
        raise TypeError(f"word must be a str, got {type(word).__name__} ({word!r:.80})")
    # a str of as many characters as sentences was taken for one-letter senses; a generator failed on len(),
    # and a set or dict has no order to pair with the sentences. A numpy array or pandas Series of labels
    # (no Sequence to Python's ABCs) is taken, as it was before these checks
    if senses is not None and (isinstance(senses, (str, bytes, Set, Mapping)) or not isinstance(senses, Collection)):
        raise TypeError(f"senses is a list of labels, one per sentence, not a {type(senses).__name__} ({senses!r:.80})")
    if senses is not None and len(senses) != len(sentences):
        raise ValueError(f"{len(senses)} senses for {len(sentences)} sentences")
    # checked as given, before the copy into lists: a sentence that is a str (list() made one token
    # per character of it), a set or an iterator is named by its place, as embed names it
    check_token_lists(sentences)
    sentences = [list(s) for s in sentences]
    positions = []
    for i, tokens in enumerate(sentences):
        try:
            positions.append(find_word(tokens, word, ignore_case))
        except ValueError as exc:  # named as the output names sentences: an empty one listed no token to tell it by
            raise ValueError(f"sentence s{i}: {exc}") from None
    vectors = _word_vectors(model, sentences, positions)
    _check_finite(vectors, sentences, word)
    return SimilarityResult(word, sentences, positions, list(senses) if senses is not None else None,
                            vectors.numpy(), cosine_matrix(vectors).numpy())
