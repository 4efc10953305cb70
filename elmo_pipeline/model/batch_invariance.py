"""Row padding that keeps CPU matrix products independent of the batch.

BLAS takes a matrix-vector path for one row and other small-row paths whose summation order
differs from the blocked kernel, so a sentence's vectors would change in the last bits with
its batch. `bmm` gives every row the same bits once it has at least 4 rows, `mm`/`Linear`
once the row count is a multiple of 4: padding to that costs at most 3 rows and makes batch,
neighbours and order irrelevant to the result.

The char CNN's width-1 convolution with one torch thread takes another path for a few rows
than for many, while with two threads every row count agrees: its input is padded to at least
CONV_MIN_ROWS, so a word gets the same bits at any thread count. (Figures: README, "Notes
behind the code".)

Elementwise sigmoid and tanh give other last bits on the vectorised path than on the scalar
one that finishes a stretch of elements. Torch cuts an op over more than GRAIN_SIZE elements
into one stretch per thread, and a cut inside a row moves which of the row's elements end a
stretch; with 3 or more threads the cuts fall inside rows for some row counts, and a
sentence's vectors then depended on its batch. `elementwise_rows` gives the row count at
which every cut falls between rows.
"""

from __future__ import annotations

import torch

ROW_MULTIPLE = 4
CONV_MIN_ROWS = 16


# ATen's at::internal::GRAIN_SIZE: an elementwise op over more elements is split among threads
# into min(threads, ceil(elements / GRAIN_SIZE)) equal stretches (parallel_for)
GRAIN_SIZE = 32768


def elementwise_rows(n: int, widths: tuple[int, ...], threads: int, blocks: int = 2) -> int:
    """The fewest rows >= n for which an elementwise op over (blocks, rows, w), for each w in
    `widths`, is cut between `threads` threads only at row boundaries (or not at all), so that
    every row is computed as it is alone: the op then runs over these rows (the extra ones are
    discarded). With 1 or 2 threads this is n."""
    rows = n
    while not all(_cut_between_rows(blocks * rows, w, threads) for w in widths):
        rows += 1
    return rows


def _cut_between_rows(rows: int, width: int, threads: int) -> bool:
    stretches = min(threads, -(-rows * width // GRAIN_SIZE)) if rows * width > GRAIN_SIZE else 1
    return rows % stretches == 0


def padded_row_count(n: int, minimum: int = ROW_MULTIPLE) -> int:
    return max(minimum, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def pad_rows(x: torch.Tensor, value: float | int = 0, minimum: int = ROW_MULTIPLE) -> torch.Tensor:
    """Pad dim 0 of `x` up to `padded_row_count`; the caller slices the result back."""
    extra = padded_row_count(x.shape[0], minimum) - x.shape[0]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])
