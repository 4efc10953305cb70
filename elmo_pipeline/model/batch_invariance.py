"""Row padding that keeps CPU matrix products independent of the batch.

BLAS takes a matrix-vector path for one row and other small-row paths whose summation order
differs from the blocked kernel, so a sentence's vectors would change in the last bits with
its batch. The LSTM's float32 batched products (`bmm`, `baddbmm` on transposed weights) gave
every row the same bits at every row count that is a multiple of 4 and at least MIN_ROWS, on
the two x86 CPUs measured (on one, AVX512 with AMX, 4, 8 and 12 rows took other paths):
padding to that makes batch, neighbours and order irrelevant to the result. Its 16-bit products on CPU run in
calls of a fixed row count instead (`lstm_row_tiles`, `row_tiles`): BF16_ROW_TILE rows for the steps'
products, BF16_INPUT_TILE for the input projection, which is made for many steps at once.

The token encoder's products and convolutions (`Linear`, oneDNN's convolutions) are less
regular: in bf16 on the AMX machine some row counts in the hundreds gave other bits, and the
char CNN's width-1 convolution with one torch thread takes another path for a few rows than
for many. On CPU the encoder therefore runs on exactly WORD_TILE words per call (`word_tiles`),
the last call padded. (Figures: docs/design-measurements.md.)

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
MIN_ROWS = 16
# Rows per LSTM product call on CPU in 16 bits: oneDNN's bf16 products on the AMX machine gave
# other bits at scattered row counts, while a product of a fixed 16 to 64 rows gave every row
# the same bits wherever it sat.
BF16_ROW_TILE = 64
# Rows per input-projection call on CPU in 16 bits: its rows span several time steps, a call of
# 512 rows ran 1.3-2x faster per row than one of 64, and it is the LSTM's chunk of input rows
# (lstm._INPUT_CHUNK_ROWS_CPU), so a chunk's product is one call on a contiguous block.
BF16_INPUT_TILE = 512
# Words per token-encoder call on CPU: as fast per word as the 256 of a full chunk, and a short
# batch pads fewer words.
WORD_TILE = 128
# Predictions per output-layer call when evaluating (`LmOutputLayer.nll_in_row_tiles`): a product
# over all of a batch's predictions, or over those whose targets fall in one adaptive cluster, has a
# row count that follows the batch, and gave some rows other last bits.
PREDICTION_TILE = 256


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


def padded_row_count(n: int, minimum: int = MIN_ROWS, multiple: int = ROW_MULTIPLE) -> int:
    return max(minimum, -(-n // multiple) * multiple)


def pad_rows(x: torch.Tensor, value: float | int = 0, minimum: int = MIN_ROWS, multiple: int = ROW_MULTIPLE,
             dim: int = 0) -> torch.Tensor:
    """Pad dim `dim` of `x` up to `padded_row_count`; the caller slices the result back."""
    extra = padded_row_count(x.shape[dim], minimum, multiple) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def lstm_row_tiles(device: torch.device, dtype: torch.dtype) -> tuple[int | None, int | None]:
    """Rows per call of the LSTM's (step, input projection) products: (BF16_ROW_TILE,
    BF16_INPUT_TILE) for 16-bit products on CPU, else (None, None): one call over every row."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return BF16_ROW_TILE, BF16_INPUT_TILE
    return None, None


def row_tiles(rows: int, tile: int | None) -> list[slice]:
    """The row ranges a product over `rows` rows (a multiple of `tile`) is made in."""
    if tile is None:
        return [slice(0, rows)]
    return [slice(start, start + tile) for start in range(0, rows, tile)]


def word_tiles(n: int, device: torch.device) -> tuple[int, list[slice]]:
    """(rows, tiles): the rows `n` words are padded to and the slices the token encoder runs
    them in: on CPU WORD_TILE words per call; on CUDA one call over at least MIN_ROWS."""
    if device.type == "cuda":
        rows = padded_row_count(n)
        return rows, [slice(0, rows)]
    rows = padded_row_count(n, WORD_TILE, WORD_TILE)
    return rows, row_tiles(rows, WORD_TILE)
