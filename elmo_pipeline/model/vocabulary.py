"""Word vocabulary for the word encoder and the softmax: `<S>`, `</S>`, `<UNK>` first, then by count."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from elmo_pipeline.model.characters import SENTENCE_END, SENTENCE_START
from elmo_pipeline.strict import ConfigError, dumps_strict, parse_json_strict

UNKNOWN = "<UNK>"
SPECIALS = (SENTENCE_START, SENTENCE_END, UNKNOWN)


class Vocabulary:
    """An ordered token list; ids are positions. Unknown tokens map to `<UNK>`."""

    def __init__(self, tokens: Sequence[str], counts: Sequence[int] | None = None) -> None:
        if tuple(tokens[:3]) != SPECIALS:
            raise ConfigError(f"vocabulary must start with {list(SPECIALS)}, got {list(tokens[:3])}")
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            raise ConfigError("vocabulary has duplicate tokens")
        self.counts = None if counts is None else [int(c) for c in counts]
        if self.counts is not None and len(self.counts) != len(self.tokens):
            raise ConfigError(f"vocabulary has {len(self.tokens)} tokens but {len(self.counts)} counts")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def unk_id(self) -> int:
        return 2

    def ids(self, tokens: Iterable[str]) -> np.ndarray:
        get = self.index.get
        return np.fromiter((get(t, 2) for t in tokens), dtype=np.int64)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], min_count: int = 1, max_size: int | None = None) -> "Vocabulary":
        """Most frequent first, ties broken by the token so the result never depends on input order."""
        kept = sorted(((c, t) for t, c in counts.items() if c >= min_count and t not in SPECIALS),
                      key=lambda ct: (-ct[0], ct[1]))
        if max_size is not None:
            kept = kept[: max(0, max_size - len(SPECIALS))]
        special_counts = [counts.get(t, 0) for t in SPECIALS]
        return cls([*SPECIALS, *(t for _, t in kept)], [*special_counts, *(c for c, _ in kept)])

    def to_json(self) -> str:
        return dumps_strict({"tokens": self.tokens, "counts": self.counts}, "vocab.json", ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "vocab.json") -> "Vocabulary":
        raw = parse_json_strict(text, where)
        if not isinstance(raw, dict) or set(raw) - {"tokens", "counts"} or "tokens" not in raw:
            raise ConfigError(f"{where}: expected an object with 'tokens' and optional 'counts'")
        tokens, counts = raw["tokens"], raw.get("counts")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ConfigError(f"{where}: 'tokens' must be a list of strings")
        if counts is not None and (not isinstance(counts, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in counts)):
            raise ConfigError(f"{where}: 'counts' must be a list of integers")
        return cls(tokens, counts)
