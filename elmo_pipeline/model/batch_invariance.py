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
"""

from __future__ import annotations

import torch

ROW_MULTIPLE = 4
CONV_MIN_ROWS = 16


def padded_row_count(n: int, minimum: int = ROW_MULTIPLE) -> int:
    return max(minimum, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def pad_rows(x: torch.Tensor, value: float | int = 0, minimum: int = ROW_MULTIPLE) -> torch.Tensor:
    """Pad dim 0 of `x` up to `padded_row_count`; the caller slices the result back."""
    extra = padded_row_count(x.shape[0], minimum) - x.shape[0]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])
