"""Character ids for the char CNN: a token is its UTF-8 bytes between word markers.

Ids follow the original (bytes 0..255, BOS 256, EOS 257, BOW 258, EOW 259, PAD 260) shifted
by +1 so that 0 is a padding token; the embedding table therefore has 262 rows. A token is
cut to `max_characters - 2` bytes, which may split a multi-byte character exactly as the
original does; the model only ever sees bytes, so any language works.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

BOS_CHAR, EOS_CHAR, BOW_CHAR, EOW_CHAR, PAD_CHAR = 256, 257, 258, 259, 260
SENTENCE_START, SENTENCE_END = "<S>", "</S>"


def _boundary_ids(marker: int, max_characters: int) -> np.ndarray:
    ids = np.full(max_characters, PAD_CHAR, dtype=np.int64)
    ids[:3] = (BOW_CHAR, marker, EOW_CHAR)
    return ids + 1


def token_char_ids(token: str, max_characters: int = 50) -> np.ndarray:
    """(max_characters,) int64 ids of one token, already shifted by +1."""
    if token == SENTENCE_START:
        return _boundary_ids(BOS_CHAR, max_characters)
    if token == SENTENCE_END:
        return _boundary_ids(EOS_CHAR, max_characters)
    # "ignore", as the original: a lone surrogate (a JSON escape without its pair) has no UTF-8
    # bytes, and the original drops it before cutting
    raw = token.encode("utf-8", "ignore")[: max_characters - 2]
    ids = np.full(max_characters, PAD_CHAR + 1, dtype=np.int64)
    ids[0] = BOW_CHAR + 1
    ids[1 : 1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) + 1
    ids[1 + len(raw)] = EOW_CHAR + 1
    return ids


def tokens_char_ids(tokens: Sequence[str], max_characters: int = 50) -> np.ndarray:
    """(n_tokens, max_characters) int64 ids for a flat list of tokens."""
    out = np.empty((len(tokens), max_characters), dtype=np.int64)
    for row, token in enumerate(tokens):
        out[row] = token_char_ids(token, max_characters)
    return out
