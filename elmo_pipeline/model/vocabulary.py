"""Vocabularies: words for the word encoder and the softmax (`<S>`, `</S>`, `<UNK>` first, then by
count), and the character dictionary of models whose characters are not UTF-8 bytes.

An ELMoForManyLangs model names its specials otherwise: its word vocabulary marks sentences with
`<bos>` and `<eos>` and unknown words with `<oov>` (`FORMANYLANGS_SPECIALS`), and its characters
come from a dictionary (`CharVocabulary`, written as chars.json) with six special entries.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from elmo_pipeline.model.characters import SENTENCE_END, SENTENCE_START
from elmo_pipeline.strict import ConfigError, dumps_strict, parse_json_strict

UNKNOWN = "<UNK>"
SPECIALS = (SENTENCE_START, SENTENCE_END, UNKNOWN)
# ELMoForManyLangs: sentence start, sentence end and unknown word, wherever the dictionary puts them
FORMANYLANGS_SPECIALS = ("<bos>", "<eos>", "<oov>")
CHAR_SPECIALS = ("<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>")


class Vocabulary:
    """An ordered token list; ids are positions. Unknown tokens map to the unknown special.

    `specials` names the sentence start, sentence end and unknown tokens: ours (`SPECIALS`) must
    be the first three tokens; another family's (`FORMANYLANGS_SPECIALS`) may sit anywhere."""

    def __init__(self, tokens: Sequence[str], counts: Sequence[int] | None = None,
                 specials: Sequence[str] = SPECIALS) -> None:
        self.specials = tuple(specials)
        if self.specials == SPECIALS and tuple(tokens[:3]) != SPECIALS:
            raise ConfigError(f"vocabulary must start with {list(SPECIALS)}, got {list(tokens[:3])}")
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            raise ConfigError("vocabulary has duplicate tokens")
        missing = [t for t in self.specials if t not in self.index]
        if len(set(self.specials)) != 3 or missing:
            raise ConfigError(f"vocabulary specials {list(self.specials)}: three distinct tokens of the "
                              f"vocabulary needed{f', {missing} missing' if missing else ''}")
        self.start_id, self.end_id, self._unk_id = (self.index[t] for t in self.specials)
        self.counts = None if counts is None else [int(c) for c in counts]
        if self.counts is not None and len(self.counts) != len(self.tokens):
            raise ConfigError(f"vocabulary has {len(self.tokens)} tokens but {len(self.counts)} counts")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def unk_id(self) -> int:
        return self._unk_id

    def ids(self, tokens: Iterable[str]) -> np.ndarray:
        get, unk = self.index.get, self._unk_id
        return np.fromiter((get(t, unk) for t in tokens), dtype=np.int64)

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
        raw: dict = {"tokens": self.tokens, "counts": self.counts}
        if self.specials != SPECIALS:  # ours are implied, so files of our own models stay as they were
            raw["specials"] = list(self.specials)
        return dumps_strict(raw, "vocab.json", ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "vocab.json") -> "Vocabulary":
        raw = parse_json_strict(text, where)
        if not isinstance(raw, dict) or set(raw) - {"tokens", "counts", "specials"} or "tokens" not in raw:
            raise ConfigError(f"{where}: expected an object with 'tokens' and optional 'counts' and 'specials'")
        tokens, counts, specials = raw["tokens"], raw.get("counts"), raw.get("specials", list(SPECIALS))
        if not _strings(tokens):
            raise ConfigError(f"{where}: 'tokens' must be a list of strings")
        if counts is not None and (not isinstance(counts, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in counts)):
            raise ConfigError(f"{where}: 'counts' must be a list of integers")
        if not _strings(specials) or len(specials) != 3:
            raise ConfigError(f"{where}: 'specials' must be a list of three strings")
        try:
            return cls(tokens, counts, specials)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, str) for t in value)


class CharVocabulary:
    """The characters of an ELMoForManyLangs model: entry i of `entries` has id i. Every entry
    but the six specials (`CHAR_SPECIALS`) is matched against one character (a code point) of a
    token; a character not in the dictionary gets the id of `<oov>`.

    A token's row, as that family builds it (`char_ids`): the id of `<eow>`, the token's
    characters, the id of `<bow>`, then `<pad>` to `max_characters` positions. The two word
    markers are used the other way round from their names (its trainer does the same, so the
    weights expect it). A token `<bos>` or `<eos>` (the sentence boundaries, also when they
    appear in the text) is the single special character of that name between the markers."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.entries = list(entries)
        self.index = {c: i for i, c in enumerate(self.entries)}
        if len(self.index) != len(self.entries):
            twice = next(c for i, c in enumerate(self.entries) if self.index[c] != i)
            raise ConfigError(f"character dictionary: {twice!r} appears twice")
        missing = [c for c in CHAR_SPECIALS if c not in self.index]
        if missing:
            raise ConfigError(f"character dictionary: special entries {missing} are missing")
        self.begin, self.end, self.pad, self.unknown = (self.index[c] for c in ("<eow>", "<bow>", "<pad>", "<oov>"))

    def __len__(self) -> int:
        return len(self.entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocabulary) and other.entries == self.entries

    def token_ids(self, token: str, max_characters: int) -> np.ndarray:
        """(max_characters,) int64 ids of one token, cut to max_characters - 2 characters (the
        boundary tokens are never cut: that family adds them after cutting the sentence's tokens)."""
        row = np.full(max_characters, self.pad, dtype=np.int64)
        row[0] = self.begin
        if token in ("<bos>", "<eos>"):
            chars = [self.index[token]]
        else:
            get, unknown = self.index.get, self.unknown
            chars = [get(c, unknown) for c in token[: max_characters - 2]]
        row[1 : 1 + len(chars)] = chars
        row[1 + len(chars)] = self.end
        return row

    def char_ids(self, tokens: Sequence[str], max_characters: int) -> np.ndarray:
        """(n_tokens, max_characters) int64 ids for a flat list of tokens."""
        out = np.empty((len(tokens), max_characters), dtype=np.int64)
        for row, token in enumerate(tokens):
            out[row] = self.token_ids(token, max_characters)
        return out

    def to_json(self) -> str:
        return dumps_strict({"characters": self.entries}, "chars.json", ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "chars.json") -> "CharVocabulary":
        raw = parse_json_strict(text, where)
        if not isinstance(raw, dict) or set(raw) != {"characters"} or not _strings(raw["characters"]):
            raise ConfigError(f"{where}: expected an object with 'characters', a list of strings")
        try:
            return cls(raw["characters"])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
