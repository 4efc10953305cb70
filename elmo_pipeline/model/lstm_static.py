"""The exact (clipped) LSTM layer as a static-shape time loop, for CUDA graphs and torch.compile.

`lstm.py`'s exact kernel drops rows out of the recurrence as their sentences end, so each step
has its own row count, read from a host-side list: fine on CPU, but every step is then a
different launch and nothing can be captured once and replayed. Here every step has the same
shapes and no step reads a value back to the host:
- the batch is padded to a bucket of rows and a bucket of steps (`bucket`: at most 25% more,
  rows a multiple of 4 as `batch_invariance` wants), so a handful of shapes covers all batches;
- rows whose sentence has ended (and padding rows) keep stepping, and a per-step mask, built
  before the loop, decides what they keep: `torch.where` holds their state at its last valid
  value and zeroes their output, instead of slicing them away;
- the step is one pure function (`static_step`) with the clips as constants of the call:
  torch.compile can fuse its elementwise work, and a CUDA graph can replay the whole loop.
The function is `lstm_reference.lstm_step`'s algebra (gates i, f, g, o; the forget gate's +1
inside `gate_bias`; cell clip, then projection, then projection clip), so on CPU float32 it
equals `lstm_reference.lstm_layer` (tests/model/test_lstm_static.py). Under bf16 autocast it
rounds where `lstm._exact_layer` rounds: products in bf16, the cell state in float32.

`static_exact_layer` has the contract of `lstm._exact_layer` and runs anywhere; `GraphedLayer`
(same contract) captures one CUDA graph per shape bucket and replays it, and runs
`static_exact_layer` eagerly elsewhere or when gradients are needed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch

from elmo_pipeline.model.batch_invariance import ROW_MULTIPLE
from elmo_pipeline.model.lstm_reference import BiLstmLayer, clip_for
from elmo_pipeline.runtime import product_dtype

_MANTISSAS = (4, 5, 6, 7)  # buckets m * 2^k: consecutive ones differ by at most 25%

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def bucket(n: int, multiple: int = 1) -> int:
    """The smallest m * 2^k >= n (m in 4..7, k >= 0) that is a multiple of `multiple`; at least 4."""
    k = 0
    while True:
        for m in _MANTISSAS:
            size = m << k
            if size >= n and size % multiple == 0:
                return size
        k += 1


def bucket_shape(rows: int, steps: int) -> tuple[int, int]:
    """(rows, steps) a batch is padded to: rows a multiple of 4 (see batch_invariance)."""
    return bucket(rows, ROW_MULTIPLE), bucket(steps)


def static_step(
    x_gates: torch.Tensor, valid: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_hh: torch.Tensor,
    w_p: torch.Tensor, cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of both directions for every row, running or not.

    x_gates (2, B, 4H) = b + x_t W_ih^T, valid (1, B, 1) bool, h (2, B, P), c (2, B, H) (float32
    at least), w_hh (2, P, 4H), w_p (2, H, P) -> (output (2, B, P), zero where not valid;
    new h; new c), with h and c unchanged where not valid."""
    gates = torch.baddbmm(x_gates, h, w_hh)
    i, f, g, o = gates.chunk(4, dim=-1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    if (clip := clip_for(cell_clip, c_new.dtype)) is not None:
        c_new = c_new.clamp(-clip, clip)
    # tanh(c) rounded to the matmul dtype before the product with the gate, as _exact_layer does
    hidden = torch.tanh(c_new).to(w_p.dtype) * torch.sigmoid(o)
    h_new = torch.bmm(hidden, w_p)
    if (clip := clip_for(proj_clip, h_new.dtype)) is not None:
        h_new = h_new.clamp(-clip, clip)
    out = torch.where(valid, h_new, torch.zeros_like(h_new))
    return out, torch.where(valid, h_new, h), torch.where(valid, c_new, c)


class LayerWeights(NamedTuple):
    w_ih: torch.Tensor  # (2, I, 4H)
    w_hh: torch.Tensor  # (2, P, 4H)
    w_p: torch.Tensor  # (2, H, P)
    bias: torch.Tensor  # (2, 1, 4H), the forget gate's +1 included


def layer_weights(layer: BiLstmLayer, dtype: torch.dtype) -> LayerWeights:
    """A layer's weights in `dtype`, transposed for the products (the exact kernel's too)."""
    return LayerWeights(layer.input_weight.to(dtype).transpose(1, 2), layer.recurrent_weight.to(dtype).transpose(1, 2),
                        layer.projection.to(dtype).transpose(1, 2), layer.gate_bias().to(dtype))


def step_mask(lengths: torch.Tensor, rows: int, steps: int, device: torch.device) -> torch.Tensor:
    """(steps, 1, rows, 1) bool: step s of row r is valid when s < lengths[r] (rows past
    len(lengths) are padding, never valid). Built on the host from host lengths, then copied."""
    lens = torch.zeros(rows, dtype=torch.long)
    lens[: lengths.shape[0]] = lengths.cpu()
    mask = torch.arange(steps).unsqueeze(1) < lens.unsqueeze(0)  # (steps, rows)
    return mask.view(steps, 1, rows, 1).to(device, non_blocking=True)


def static_time_loop(
    x: torch.Tensor, valid: torch.Tensor, h: torch.Tensor, c: torch.Tensor, weights: LayerWeights,
    cell_clip: float | None, proj_clip: float | None, step: StepFn = static_step,
    gates_buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loop over a padded batch: x (2, B, T, I) in the matmul dtype, valid (T, 1, B, 1),
    h (2, B, P), c (2, B, H) -> outputs (2, B, T, P), final h, final c. Fixed shapes, no host
    read: what a CUDA graph captures. `gates_buffer` (flat, >= 2 * T * B * 4H values of the
    matmul dtype) receives the input gates instead of a fresh tensor."""
    two, b, t, i = x.shape
    width = weights.w_ih.shape[2]
    # time-major input gates: one product for every step, each step's block contiguous
    x_tm = x.transpose(1, 2).reshape(two, t * b, i)
    if gates_buffer is None:
        x_gates = torch.baddbmm(weights.bias, x_tm, weights.w_ih)
    else:
        x_gates = gates_buffer[: two * t * b * width].view(two, t * b, width)
        torch.baddbmm(weights.bias, x_tm, weights.w_ih, out=x_gates)
    x_gates = x_gates.view(two, t, b, width)
    outs = []
    for s in range(t):
        out, h, c = step(x_gates[:, s], valid[s], h, c, weights.w_hh, weights.w_p, cell_clip, proj_clip)
        outs.append(out)
    return torch.stack(outs, dim=2), h, c


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def static_exact_layer(
    x: torch.Tensor, lengths: torch.Tensor, batch_sizes: list[int] | None, layer: BiLstmLayer, h: torch.Tensor,
    c: torch.Tensor, cell_clip: float | None, proj_clip: float | None, step: StepFn = static_step,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lstm._exact_layer`'s contract, eagerly: x (2, B, T, I), lengths (B,) (any order; sorting is
    not needed), h (2, B, P), c (2, B, H) -> outputs (2, B, T, P) in the matmul dtype, zero at
    padding; each row's h after its last step (matmul dtype) and c (c's dtype). `batch_sizes`
    is accepted for the contract and not used: the mask replaces it."""
    two, b, t, _ = x.shape
    rows, steps = bucket_shape(b, t)
    dt = product_dtype(x, layer.input_weight.dtype)
    c_dtype = c.dtype
    with torch.autocast(x.device.type, enabled=False):
        weights = layer_weights(layer, dt)
        xp = _pad(_pad(x.to(dt), 1, rows), 2, steps)
        hp = _pad(h.to(dt), 1, rows)
        cp = _pad(c.to(torch.promote_types(c_dtype, torch.float32)), 1, rows)
        out, hn, cn = static_time_loop(xp, step_mask(lengths, rows, steps, x.device), hp, cp, weights,
                                       cell_clip, proj_clip, step)
    return out[:, :b, :t], hn[:, :b], cn[:, :b].to(c_dtype)


def compiled_step(**options: Any) -> StepFn:
    """`static_step` through torch.compile (fullgraph: the step has no Python branch on data).
    Shapes are left to torch's automatic dynamic: the first row bucket compiles a static
    kernel, the second one kernel for any row count (one compile per bucket would reach dynamo's
    recompile limit, 8, within one corpus). Each clip setting is one more compile."""
    return torch.compile(static_step, fullgraph=True, **options)


class _Captured(NamedTuple):
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor  # static inputs, padded
    valid: torch.Tensor
    h: torch.Tensor
    c: torch.Tensor
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # static outputs
    keep: tuple[torch.Tensor, ...]  # the weights and the gates buffer whose addresses the graph holds
    bytes: int  # device memory the capture reserved (its buffers and the graph's pool)


class GraphedLayer:
    """`lstm._exact_layer`'s contract; on CUDA without gradients, one CUDA graph per shape bucket.

    A call pads its batch to `bucket_shape`, copies it into the bucket's static buffers, replays
    the captured loop and returns copies of the outputs. The first call of a bucket captures it
    (a warm-up run, then the capture: about two eager calls). The input gates of every step, the
    largest block (2 x rows x steps x 4H), go to one buffer per device and dtype that all graphs
    share (replays never overlap), grown, and the graphs dropped, when a bucket needs more.
    Graphs are kept per (layer weights, rows, steps, dtypes, clips), the `max_graphs` most
    recently used and, with `max_bytes`, no more than that much device memory besides the shared
    buffer (each graph holds its inputs, outputs and a private pool for one step's
    intermediates). A capture that runs out of memory drops every graph and the shared buffer
    and tries once more; a second failure is the caller's out-of-memory error (embed_batch then
    halves the batch). One lock serialises capture and replay: threads that share a model share
    its graphs safely. Elsewhere (CPU, gradients) it runs `static_exact_layer` eagerly. `step`
    may be a compiled step (`compiled_step()`).
    """

    def __init__(self, max_graphs: int = 32, step: StepFn = static_step, max_bytes: int | None = None) -> None:
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self.step = step
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._gates: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> the shared input-gate buffer
        self._lock = threading.Lock()
        self.captures = 0
        self.replays = 0

    def __call__(
        self, x: torch.Tensor, lengths: torch.Tensor, batch_sizes: list[int] | None, layer: BiLstmLayer,
        h: torch.Tensor, c: torch.Tensor, cell_clip: float | None, proj_clip: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grads = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters()))
        if not x.is_cuda or grads:
            return static_exact_layer(x, lengths, batch_sizes, layer, h, c, cell_clip, proj_clip, self.step)
        two, b, t, _ = x.shape
        rows, steps = bucket_shape(b, t)
        dt = product_dtype(x, layer.input_weight.dtype)
        key = (tuple(p.data_ptr() for p in layer.parameters()), x.device, x.dtype, dt, h.dtype, c.dtype,
               x.shape[3], rows, steps, cell_clip, proj_clip)
        with self._lock:
            with torch.inference_mode():
                entry = self._graphs.get(key)
                if entry is None:
                    entry = self._capture_or_retry(layer, dt, x, h, c, rows, steps, cell_clip, proj_clip)
                    self._graphs[key] = entry
                    while len(self._graphs) > 1 and (len(self._graphs) > self.max_graphs or self._over_bytes()):
                        self._graphs.popitem(last=False)
                self._graphs.move_to_end(key)
                entry.x.zero_()
                entry.x[:, :b, :t].copy_(x)
                entry.valid.copy_(step_mask(lengths, rows, steps, torch.device("cpu")))
                entry.h.zero_()
                entry.h[:, :b].copy_(h)
                entry.c.zero_()
                entry.c[:, :b].copy_(c)
                entry.graph.replay()
                self.replays += 1
            # copied under the lock (the next replay overwrites the buffers) and outside
            # inference mode, so that the caller gets ordinary tensors
            out, hn, cn = entry.out[0][:, :b, :t].clone(), entry.out[1][:, :b].clone(), entry.out[2][:, :b].clone()
        return out, hn, cn.to(c.dtype)

    def _loop(self, layer: BiLstmLayer, dt: torch.dtype, x: torch.Tensor, valid: torch.Tensor, h: torch.Tensor,
              c: torch.Tensor, cell_clip: float | None, proj_clip: float | None, gates: torch.Tensor):
        with torch.autocast("cuda", enabled=False):
            weights = layer_weights(layer, dt)  # cast inside the graph: it reads the live parameters
            c32 = c.to(torch.promote_types(c.dtype, torch.float32))
            return static_time_loop(x.to(dt), valid, h.to(dt), c32, weights, cell_clip, proj_clip, self.step, gates)

    def _gates_buffer(self, device: torch.device, dt: torch.dtype, values: int) -> torch.Tensor:
        """The shared input-gate buffer with room for `values`; growing it drops every graph
        (they hold the old address), and it grows by a quarter more than asked."""
        key = (device, dt)
        buffer = self._gates.get(key)
        if buffer is None or buffer.numel() < values:
            self._graphs.clear()
            self._gates.pop(key, None)
            del buffer
            torch.cuda.empty_cache()
            buffer = self._gates[key] = torch.empty(values + values // 4, dtype=dt, device=device)
        return buffer

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._gates.values())

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and sum(e.bytes for e in self._graphs.values()) > self.max_bytes

    @property
    def graph_bytes(self) -> int:
        return sum(e.bytes for e in self._graphs.values())

    def _capture_or_retry(self, *args) -> _Captured:
        try:
            return self._capture(*args)
        except torch.OutOfMemoryError:
            pass
        # outside the handler, so that the failed attempt's frames (and tensors) are gone; the
        # shared buffer may be sized for a larger batch than this one
        self._graphs.clear()
        self._gates.clear()
        torch.cuda.empty_cache()
        return self._capture(*args)

    def _capture(self, layer: BiLstmLayer, dt: torch.dtype, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                 rows: int, steps: int, cell_clip: float | None, proj_clip: float | None) -> _Captured:
        two, _, _, i = x.shape
        gates = self._gates_buffer(x.device, dt, two * steps * rows * 4 * layer.hidden)
        # the capture empties the allocator's cache on entry, which would free blocks that are not
        # the graph's (the last batch's temporaries, the warm-up's): empty it before and after too,
        # so that the difference is what the graph holds
        torch.cuda.synchronize(x.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(x.device)
        sx = x.new_zeros(two, rows, steps, i)
        valid = torch.zeros(steps, 1, rows, 1, dtype=torch.bool, device=x.device)
        sh = h.new_zeros(two, rows, h.shape[2])
        sc = c.new_zeros(two, rows, c.shape[2])
        args = (layer, dt, sx, valid, sh, sc, cell_clip, proj_clip, gates)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # warm-up outside the capture: library handles, compiled kernels
            self._loop(*args)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._loop(*args)
        self.captures += 1
        torch.cuda.synchronize(x.device)
        torch.cuda.empty_cache()
        used = max(0, torch.cuda.memory_reserved(x.device) - reserved)
        return _Captured(graph, sx, valid, sh, sc, out, (*layer.parameters(), gates), used)

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._gates.clear()
