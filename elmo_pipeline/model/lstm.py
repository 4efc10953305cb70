"""The biLM's two LSTM stacks (forward and backward): the kernels that run `lstm_reference`.

`lstm_reference.py` is the specification: the step, the layer loop and the stack, written to
be read. It is also what runs whenever gradients are needed (training, fine-tuning): its
backward costs O(T). Without gradients, `BiLstmStack` runs one of two kernels:
- `exact`: the reference's step op for op, in place, with rows whose sentence has ended
  dropping out of the recurrence (rows are sorted by length). It equals the reference bit for
  bit on CPU float32 (tests/model/test_lstm_reference.py).
- `fused`: torch's LSTM op with proj_size, the one behind nn.LSTM (cuDNN on GPU). It has no
  clips, so it equals the reference (within 1e-5) only for configs without clips, and a model
  with clips refuses it (`check_kernel`), as does one whose projection_dim is not below dim
  (torch's op cannot run it). Its sums run in another order, so on CPU it is not batch
  invariant within 1e-6 (see BiLstmStack.resolve_kernel). It has a backward of its own:
  training asked for `fused` (pretrain --kernel fused) runs it instead of the reference.
`auto` picks one of them per call.
"""

from __future__ import annotations

import re
import threading
import warnings
import weakref
from typing import Iterable

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from elmo_pipeline.model.batch_invariance import (
    MIN_ROWS, ROW_MULTIPLE, elementwise_rows, lstm_row_tiles, pad_rows, padded_row_count, row_tiles,
)
from elmo_pipeline.model.config import LstmConfig
from elmo_pipeline.model.lstm_reference import (BiLstmLayer, LstmState, at_last_step, bilstm, clip_for, lstm_layer,
                                                reverse_within_lengths)
from elmo_pipeline.model.lstm_static import layer_weights
from elmo_pipeline.runtime import product_dtype
from elmo_pipeline.runtime_choices import AUTO, EXACT, FUSED, KERNELS


__all__ = ["AUTO", "EXACT", "FUSED", "KERNELS", "BiLstmLayer", "BiLstmStack", "LstmState", "check_kernel",
           "reverse_within_lengths"]


def check_kernel(kernel: str, cfg: LstmConfig | None = None) -> str:
    """`kernel`, if it is a kernel's name and, given the model's `cfg`, one that computes that
    model: fused has no clips, and a model with clips asked to run fused is refused rather than
    approximated (the clips of the released models bind: layers differ by more than 1)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    why = None if kernel != FUSED or cfg is None else _why_not_fused(cfg)
    if why:
        raise ValueError(f"kernel 'fused' (torch's LSTM op) {why}: it would not compute this model; "
                         "use kernel 'exact' or 'auto' (auto picks exact for such a model)")
    return kernel


def _why_not_fused(cfg: LstmConfig) -> str | None:
    """Why torch's LSTM op cannot run the model of `cfg`, or None when it can."""
    if cfg.has_clips:
        return (f"has no cell or projection clips, and this model clips (cell_clip {cfg.cell_clip}, "
                f"proj_clip {cfg.proj_clip})")
    if cfg.projection_dim >= cfg.dim:  # torch's op takes a projection only to fewer units than the cell's
        return (f"projects only to fewer units than the cell has, and this model has lstm.projection_dim "
                f"{cfg.projection_dim}, lstm.dim {cfg.dim}")
    return None


# Rows of the input projection computed per chunk of time steps on CPU: a few hundred rows
# already run at the full GEMM rate, and a small reused buffer avoids faulting in a large one
# on every call. On CUDA one large product is faster and memory is cheap: one chunk there.
_INPUT_CHUNK_ROWS_CPU = 512


def _needs_grad(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, layer: BiLstmLayer) -> bool:
    return torch.is_grad_enabled() and (
        x.requires_grad or h.requires_grad or c.requires_grad or any(p.requires_grad for p in layer.parameters()))


# cuDNN's LSTM op copies weights that are not one contiguous buffer (ours are tensors of their own)
# into one at every call, and warns each time; harmless. One filter, set here, silences it for the
# calls made from this module only: catch_warnings around each call saved the process's whole
# filter list and put it back, so threads embedding at once dropped the filters the program added
# meanwhile and left this one behind.
warnings.filterwarnings("ignore", message=".*contiguous chunk of memory.*", module=re.escape(__name__) + r"\Z")

_CAST_LOCK = threading.Lock()
_CASTS: weakref.WeakKeyDictionary[BiLstmLayer, tuple] = weakref.WeakKeyDictionary()


def forget_casts(layers: Iterable[BiLstmLayer]) -> None:
    """Drops the layers' cast copies: after an edit through `.data`, which moves no version counter."""
    with _CAST_LOCK:
        for layer in layers:
            _CASTS.pop(layer, None)


def _weights_as(layer: BiLstmLayer, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(W_ih^T, W_hh^T, W_p^T, gate bias) in the product dtype `dt`, transposed for the products.

    Under bf16 autocast the casts of a layer's weights took about 8% of a batch of the Original
    shape on CPU when made at every call, so a cast copy is kept per layer and dtype, and made
    again when a weight changes: another tensor (the entry holds the old storage, so its address
    cannot come back as a new tensor's) or the same one written in place (its version counter
    moves). In the weights' own dtype nothing is copied, and inference tensors, which keep no
    version counter, are cast at every call."""
    params = (layer.input_weight, layer.recurrent_weight, layer.projection, layer.bias)

    def cast() -> tuple[torch.Tensor, ...]:
        return tuple(w.detach() for w in layer_weights(layer, dt))

    if dt == layer.input_weight.dtype or any(p.is_inference() for p in params):
        return cast()
    versions = tuple(p._version for p in params)
    with _CAST_LOCK:
        cached = _CASTS.get(layer)
    if cached is not None:
        sources, cached_dt, cached_versions, weights = cached
        if (cached_dt == dt and cached_versions == versions
                and all(s.data_ptr() == p.data_ptr() and s.device == p.device for s, p in zip(sources, params))):
            return weights
    weights = cast()
    with _CAST_LOCK:
        _CASTS[layer] = (tuple(p.detach() for p in params), dt, versions, weights)
    return weights


def _exact_layer(
    x: torch.Tensor, lengths: torch.Tensor, batch_sizes: list[int], layer: BiLstmLayer, h: torch.Tensor,
    c: torch.Tensor, cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lstm_reference.lstm_layer` without per-step allocations, for calls without gradients.

    x (2, B, T, I) with rows sorted by length (descending), batch_sizes[t] rows still running
    at step t. The reference allocates ~10 (2, B, H)-sized temporaries per step and one
    (2, B*T, 4H) input projection; on CPU every fresh large block is page-faulted in again and
    every op is one more parallel region. Here:
    - the input projection runs over chunks of rows into one reused buffer;
    - each step's gates live in one reused contiguous block and the activations are applied
      in place; the cell state is updated in place for the running rows only (rows that have
      ended keep their final state);
    - the projection product writes each step's h straight into the (2, B, T, P) result.
    Elementwise ops see the same operands in the same order (a * b == b * a bit for bit), the
    products keep at least MIN_ROWS rows, a multiple of 4, or on CPU in 16 bits run in calls of
    a fixed row count (`lstm_row_tiles`: the rows are padded to a multiple of it here), and the
    float32 sigmoid and tanh run over the rows at which torch's threads cut between rows
    (`elementwise_rows`, see batch_invariance): a row's outputs do not depend on its batch.
    """
    b = x.shape[1]
    hid = layer.hidden
    dt = product_dtype(x, layer.input_weight.dtype)
    tile, in_tile = lstm_row_tiles(x.device, dt)
    minimum, multiple = (tile, tile) if tile else (MIN_ROWS, ROW_MULTIPLE)
    x, h, c = (pad_rows(v, minimum=minimum, multiple=multiple, dim=1) for v in (x, h, c))
    two, b_pad, t, i = x.shape
    w_ih, w_hh, w_p, bias = _weights_as(layer, dt)  # (2, I, 4H), (2, P, 4H), (2, H, P), (2, 1, 4H)
    x = x.to(dt)
    out = x.new_zeros(two, b_pad, t, layer.proj)  # zero at padding; steps write their rows
    # The cell state accumulates over the sentence: keep it at least fp32 under bf16 autocast.
    c_dtype = c.dtype
    c = c.to(torch.promote_types(c.dtype, torch.float32), copy=True)
    h_prev = h.to(dt)
    wide = None if dt == c.dtype or c.is_cuda else c.new_empty(two, batch_sizes[0], 4 * hid)  # see _exact_step
    threads = 1 if c.is_cuda or wide is not None else torch.get_num_threads()  # a CUDA thread: one element
    act_rows = {n: elementwise_rows(n, (2 * hid, hid), threads) for n in set(batch_sizes)}
    most = max(act_rows.values())
    if most > c.shape[1]:  # rows the activations read past the batch (see _cell): zeros
        c = torch.cat([c, c.new_zeros(two, most - c.shape[1], hid)], dim=1)

    def rows(n: int) -> int:
        return min(padded_row_count(n, minimum, multiple), b_pad)

    chunk = t if x.is_cuda else max(1, min(t, _INPUT_CHUNK_ROWS_CPU // rows(batch_sizes[0])))
    in_multiple = in_tile or 1  # a chunk's input rows fill whole calls of in_tile rows
    most_in = padded_row_count(chunk * rows(batch_sizes[0]), in_multiple, in_multiple)
    x_rows = x.new_zeros(two * most_in * i)  # rows past a chunk's k * m0 only fill a call's tile
    buffer = x.new_empty(two * most_in * 4 * hid)
    scratch = x.new_zeros(two * max(rows(batch_sizes[0]), most) * 4 * hid)
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        k, m0 = stop - start, rows(batch_sizes[start])
        n_in = padded_row_count(k * m0, in_multiple, in_multiple)
        # time-major (2, k, m0, 4H): a step's rows are adjacent, so its copy below streams
        x_in = x_rows[: two * n_in * i].view(two, n_in, i)
        x_in[:, : k * m0].view(two, k, m0, i).copy_(x[:, :m0, start:stop].transpose(1, 2))
        xw = buffer[: two * n_in * 4 * hid].view(two, n_in, 4 * hid)
        for rows_in in row_tiles(n_in, in_tile):
            torch.baddbmm(bias, x_in[:, rows_in], w_ih, out=xw[:, rows_in])
        xw = xw[:, : k * m0].view(two, k, m0, 4 * hid)
        for j in range(k):
            step = start + j
            n = batch_sizes[step]
            m = rows(n)
            # A contiguous copy lets the recurrent product take BLAS's batched path (one
            # direction per thread, no synchronisation inside a product).
            block = scratch[: two * max(m, act_rows[n]) * 4 * hid].view(two, -1, 4 * hid)
            block[:, :m].copy_(xw[:, j, :m])
            h_prev = _exact_step(block, m, h_prev[:, :m], c, n, act_rows[n], w_hh, w_p, hid, cell_clip, proj_clip,
                                 out[:, :m, step], wide, tile)
    out = out[:, :b]
    return out, at_last_step(out.unbind(2), lengths, h[:, :b].to(dt)), c[:, :b].to(c_dtype)


def _exact_step(
    block: torch.Tensor, m: int, h_prev: torch.Tensor, c: torch.Tensor, n: int, act_rows: int, w_hh: torch.Tensor,
    w_p: torch.Tensor, hid: int, cell_clip: float | None, proj_clip: float | None, h_out: torch.Tensor,
    wide: torch.Tensor | None, tile: int | None,
) -> torch.Tensor:
    """`lstm_reference.lstm_step` in place, for the first n rows. block (2, >= m, 4H), contiguous,
    holds x W_ih + b in its first m rows, the step's gates, and is overwritten; c (2, >= act_rows,
    H) is updated for rows < n; h_out (2, m, P) receives the new h (rows n..m-1 are only there to
    keep m padded and are zeroed). The float32 activations run over act_rows rows (>= n,
    see `elementwise_rows`), whose extra rows are discarded. `wide` (2, >= n, 4H), float32, is
    given for 16-bit gates on CPU: see `_cell_in_float32`. The products run `tile` rows a call
    (`row_tiles`)."""
    gates = block[:, :m]
    tiles = row_tiles(m, tile)
    for rows in tiles:
        gates[:, rows].baddbmm_(h_prev[:, rows], w_hh)
    if wide is None:
        _cell(block[:, :act_rows], c[:, :act_rows], n, hid, cell_clip)
    else:
        _cell_in_float32(gates[:, :n], c[:, :n], hid, cell_clip, wide[:, :n])
    # the product reads all m rows of the g block; rows >= n hold stale values that only reach
    # rows >= n of the result (rows of a product are independent), which are reset below
    for rows in tiles:
        torch.bmm(gates[:, rows, 2 * hid : 3 * hid], w_p, out=h_out[:, rows])
    if h_out.shape[1] > n:
        h_out[:, n:].zero_()
    if (clip := clip_for(proj_clip, h_out.dtype)) is not None:
        h_out[:, :n].clamp_(-clip, clip)
    return h_out


def _cell(act: torch.Tensor, c: torch.Tensor, n: int, hid: int, cell_clip: float | None) -> None:
    """The step's elementwise part, in place, for the first n rows: act (2, r, 4H) holds the
    gates' pre-activations; c (2, r, H) becomes the new cell state in its first n rows and the
    g block of `act` the hidden value sigmoid(o) * tanh(c), which the projection reads. The
    sigmoids and tanhs run over all r rows (see `elementwise_rows`); the products and sums,
    exact on every path, over the first n, so the other rows of c are never written."""
    in_forget, cell_in, out_gate = act[..., : 2 * hid], act[..., 2 * hid : 3 * hid], act[..., 3 * hid :]
    in_forget.sigmoid_()  # i and f are adjacent (torch gate order i, f, g, o): one call
    cell_in.tanh_()
    out_gate.sigmoid_()
    new_in = act[:, :n, :hid].mul_(cell_in[:, :n])  # sigmoid(i) * tanh(g)
    live = c[:, :n]
    live.mul_(act[:, :n, hid : 2 * hid]).add_(new_in)  # sigmoid(f) * c + sigmoid(i) * tanh(g)
    if (clip := clip_for(cell_clip, live.dtype)) is not None:
        live.clamp_(-clip, clip)
    torch.tanh(c, out=cell_in).mul_(out_gate)  # hidden, in the g block (free again)


def _cell_in_float32(act: torch.Tensor, c: torch.Tensor, hid: int, cell_clip: float | None,
                     wide: torch.Tensor) -> None:
    """`_cell` for 16-bit gates and a float32 cell state on CPU, computed in float32.

    Done in place on the 16-bit block, every op that meets the float32 cell state first copies
    its 16-bit operand, and torch's float32 tanh is ~10x slower than its sigmoid: here the gates
    are widened once into `wide` (2, n, 4H), tanh x is 2 sigmoid(2x) - 1 in float32, and the
    hidden value is rounded to 16 bits once, as the projection reads it
    (docs/design-measurements.md). The cell clip is applied to the float32 cell state."""
    gates = wide.copy_(act)
    cell_in, out_gate = gates[..., 2 * hid : 3 * hid], gates[..., 3 * hid :]
    cell_in.mul_(2.0)
    gates.sigmoid_()  # i, f, o; sigmoid(2g) in the g block
    cell_in.mul_(2.0).sub_(1.0)  # tanh(g)
    c.mul_(gates[..., hid : 2 * hid]).addcmul_(gates[..., :hid], cell_in)  # f * c + i * tanh(g)
    if (clip := clip_for(cell_clip, c.dtype)) is not None:
        c.clamp_(-clip, clip)
    hidden = torch.mul(c, 2.0, out=cell_in).sigmoid_().mul_(2.0).sub_(1.0).mul_(out_gate)  # o * tanh(c)
    act[..., 2 * hid : 3 * hid].copy_(hidden)


def _fused_layer(
    x: torch.Tensor, lengths: torch.Tensor, layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # torch's LSTM op is called with our own tensors as its weights: no module holds them, so
    # threads sharing one model never see each other's weights (an nn.LSTM shell with
    # functional_call swaps weights into a shared module for the length of a call).
    device = x.device.type
    if torch.is_grad_enabled() and torch.is_autocast_enabled(device):
        # Autocast hands cuDNN's LSTM float16 whatever its dtype (bfloat16 included), and float16
        # gradients without loss scaling underflow: training runs this op in float32 (TF32 products
        # on a GPU where cuDNN allows them).
        with torch.autocast(device, enabled=False):
            return _fused_layer(x.float(), lengths, layer, h.float(), c.float())
    t = x.shape[2]
    lengths_cpu = lengths.cpu()
    # cuDNN keeps what its backward needs only in training mode ("cudnn RNN backward can only be
    # called in training mode"); without gradients inference mode skips that memory
    train = _needs_grad(x, h, c, layer)
    outs, hs, cs = [], [], []
    for d in range(2):
        weights = [layer.input_weight[d], layer.recurrent_weight[d], layer.bias[d],
                   layer.forget_bias.to(layer.bias.dtype), layer.projection[d]]
        packed = pack_padded_sequence(x[d], lengths_cpu, batch_first=True, enforce_sorted=True)
        state = (h[d : d + 1].contiguous(), c[d : d + 1].contiguous())
        out, hn, cn = torch.lstm(packed.data, packed.batch_sizes, state, weights,
                                 True, 1, 0.0, train, False)  # biases, 1 layer, no dropout, unidirectional
        outs.append(pad_packed_sequence(packed._replace(data=out), batch_first=True, total_length=t)[0])
        hs.append(hn[0])
        cs.append(cn[0])
    return torch.stack(outs), torch.stack(hs), torch.stack(cs)


class BiLstmStack(nn.Module):
    def __init__(self, cfg: LstmConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.projection_dim
        self.layers = nn.ModuleList(BiLstmLayer(p, cfg.dim, p) for _ in range(cfg.n_layers))

    def zero_state(self, batch: int, like: torch.Tensor) -> LstmState:
        # float32 at least: under bf16/fp16 autocast a low-precision cell state would lose the
        # small increments it accumulates over a long sentence
        n, dtype = self.cfg.n_layers, torch.promote_types(like.dtype, torch.float32)
        return LstmState(like.new_zeros(n, 2, batch, self.cfg.projection_dim, dtype=dtype),
                         like.new_zeros(n, 2, batch, self.cfg.dim, dtype=dtype))

    def resolve_kernel(self, kernel: str, device: torch.device) -> str:
        """The kernel that `kernel` means for a call on `device`. `auto` is exact on CPU, where the
        two kernels run at about the same speed and only exact gives a sentence the same bits in
        every batch; on CUDA it is fused (cuDNN) unless the config is one fused cannot run (clips)."""
        check_kernel(kernel)
        if kernel == AUTO:
            return FUSED if device.type == "cuda" and _why_not_fused(self.cfg) is None else EXACT
        return kernel

    def reference_forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, state: LstmState | None = None, dropout: float = 0.0,
    ) -> tuple[list[torch.Tensor], LstmState]:
        """`lstm_reference.bilstm` on this stack's weights: the function `forward` computes, read
        straight from the specification. Training runs it: its backward costs O(T)."""
        if state is None:
            state = self.zero_state(tokens.shape[0], tokens)
        return bilstm(self.layers, self.cfg, tokens, lengths, state, dropout, self.training)

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, state: LstmState | None = None,
        kernel: str = AUTO, dropout: float = 0.0,
    ) -> tuple[list[torch.Tensor], LstmState]:
        """tokens (B, T, P) with boundaries, lengths (B,) >= 1.

        Returns one (2, B, T, P) tensor per layer (forward, backward in natural order, zero
        at padding) and the final state of every row, for the carry policy.
        """
        kernel = self.resolve_kernel(kernel, tokens.device)
        b_in, t, _ = tokens.shape
        if state is None:
            state = self.zero_state(b_in, tokens)
        # at least MIN_ROWS rows, a multiple of 4 (see batch_invariance); extra rows are one-step sentences
        lengths = pad_rows(lengths.cpu(), 1)
        state = LstmState(*(pad_rows(s.transpose(0, 2)).transpose(0, 2) for s in state))
        order = torch.argsort(lengths.cpu(), descending=True, stable=True)
        sorted_lengths = lengths.cpu()[order]
        order_dev = order.to(tokens.device)
        batch_sizes = [int((sorted_lengths > s).sum()) for s in range(t)]
        x_sorted = pad_rows(tokens).index_select(0, order_dev)
        x = torch.stack([x_sorted, reverse_within_lengths(x_sorted, sorted_lengths)])  # (2, B, T, P)
        del x_sorted  # a long sentence's padded copies are what its memory is made of
        h_all = state.h.index_select(2, order_dev)
        c_all = state.c.index_select(2, order_dev)
        outputs, final_h, final_c = [], [], []
        for index, layer in enumerate(self.layers):
            x_in = nn.functional.dropout(x, dropout, self.training) if dropout else x
            h, c, clips = h_all[index], c_all[index], (self.cfg.cell_clip, self.cfg.proj_clip)
            if kernel == FUSED:
                out, hn, cn = _fused_layer(x_in, sorted_lengths, layer, h, c)
            elif _needs_grad(x_in, h, c, layer):
                out, hn, cn = lstm_layer(x_in, sorted_lengths, layer, h, c, *clips)
            else:
                out, hn, cn = _exact_layer(x_in, sorted_lengths, batch_sizes, layer, h, c, *clips)
            if index > 0 and self.cfg.use_skip_connections:
                out = out + x_in
            outputs.append(out)
            final_h.append(hn)
            final_c.append(cn)
            x = out
        restore = torch.argsort(order_dev)
        mask = (torch.arange(t, device=tokens.device) < sorted_lengths.to(tokens.device).unsqueeze(1))
        mask = mask.unsqueeze(-1).to(tokens.dtype)  # (B, T, 1)
        # only the caller's rows are gathered, and each padded layer output is let go once read:
        # the padding rows made a long sentence cost MIN_ROWS times its own rows
        natural = []
        while outputs:
            out = outputs.pop(0).to(tokens.dtype)
            fwd = out[0] * mask
            bwd = reverse_within_lengths(out[1], sorted_lengths) * mask
            del out
            natural.append(torch.stack([fwd, bwd]).index_select(1, restore[:b_in]))
            del fwd, bwd
        new_state = LstmState(torch.stack(final_h).index_select(2, restore)[:, :, :b_in],
                              torch.stack(final_c).index_select(2, restore)[:, :, :b_in])
        return natural, new_state
