"""Records to vectors outside Beam: one batch through the model (halving on out-of-memory), the
extract options, and embed-file.
"""

from __future__ import annotations

from typing import Iterator, Sequence

# padded tokens per model call, <S>/</S> included: extract's and embed-file's default
DEFAULT_BATCH_TOKENS = 8192
# --max-sentence-tokens where a sentence is embedded whole (embed-file, similarity, probe:
# `options.add_whole_sentence_bound`), not cut into windows as extract's (corpus.options'): one
# sentence costs some 60 KB a token with the default model (the LSTM pads a call to 16 rows), so
# about 600 MB
DEFAULT_MAX_WHOLE_SENTENCE_TOKENS = 10_000


def too_long(n_tokens: int, max_sentence_tokens: int) -> str | None:
    """Why a sentence of `n_tokens`, embedded whole, is refused under `--max-sentence-tokens`, or None."""
    if n_tokens <= max_sentence_tokens:
        return None
    return (f"{n_tokens:,} tokens, more than --max-sentence-tokens {max_sentence_tokens} (a sentence is embedded "
            "whole, and its memory grows with its length); cut it, or raise --max-sentence-tokens")


def padded_length_batches(lengths: Sequence[int], batch_size: int, batch_tokens: int) -> Iterator[list[int]]:
    """Indexes into `lengths` (tokens per sentence) in batches of similar lengths, for calls whose
    results do not depend on their batch (a zero state): at most `batch_size` sentences and
    `batch_tokens` padded tokens, <S>/</S> included, or one sentence alone. (batch.length_sorted_batches
    cuts Beam's way instead, by summed weights, for the extract stage.) Each batch is made as it is
    taken, and the order is a numpy array: 8 bytes a sentence, where a list of every batch's ints
    takes some 40."""
    import numpy as np  # here: the command line imports this module for its defaults

    last: list[int] = []
    # ascending, ties in input order (as sorted() orders them): the one added is the longest
    for i in map(int, np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")):
        if last and len(last) < batch_size and (len(last) + 1) * (lengths[i] + 2) <= batch_tokens:
            last.append(i)
        else:
            if last:
                yield last
            last = [i]
    if last:
        yield last
