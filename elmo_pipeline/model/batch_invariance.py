"""Row padding that keeps CPU matrix products independent of the batch.

BLAS chooses its kernel, its blocking and its summation order by the shape of the product,
so a row's result can change in the last bits with the number of rows beside it. Which row
counts agree depends on the machine: on one x86 CPU every count >= 4 that is a multiple of 4
agreed, on another (AVX512 with AMX, MKL and oneDNN in torch 2.13) counts up to 128 gave other
bits than larger ones, in fp32 and bf16 alike, with no rule to pad to. What held on both is a
product of a fixed number of rows: a row gets the same bits wherever it sits among them and
whatever the others hold. So on CPU every product the model's inference makes runs in calls of
exactly ROW_TILE rows (`row_tiles`), the rows padded to a multiple of it: batch, neighbours
and order are then irrelevant to the result.

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
# Rows per product call on CPU. 16, 32 and 64 each kept every row's bits on both machines
# (README, "Notes behind the code"); 32 wastes at most 31 rows a step and adds few calls.
ROW_TILE = 32


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


def padded_row_count(n: int, minimum: int = ROW_MULTIPLE, multiple: int = ROW_MULTIPLE) -> int:
    return max(minimum, -(-n // multiple) * multiple)


def pad_rows(x: torch.Tensor, value: float | int = 0, minimum: int = ROW_MULTIPLE, multiple: int = ROW_MULTIPLE,
             dim: int = 0) -> torch.Tensor:
    """Pad dim `dim` of `x` up to `padded_row_count`; the caller slices the result back."""
    extra = padded_row_count(x.shape[dim], minimum, multiple) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def row_multiple(device: torch.device) -> int:
    """What a batch's row count is padded to a multiple of: ROW_TILE on CPU (see `row_tiles`)."""
    return ROW_MULTIPLE if device.type == "cuda" else ROW_TILE


def row_tiles(rows: int, device: torch.device) -> list[slice]:
    """The row ranges a product over `rows` rows (a multiple of `row_multiple`) is made in: on
    CPU one call per ROW_TILE rows; on CUDA one call over all."""
    if device.type == "cuda":
        return [slice(0, rows)]
    return [slice(start, start + ROW_TILE) for start in range(0, rows, ROW_TILE)]
