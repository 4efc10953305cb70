"""The biLM's two LSTM stacks (forward and backward), with projection, clips and residuals.

Both directions live in one tensor with a leading axis of 2 (0 = forward, 1 = backward).
The backward stack reads each sentence reversed within its own length, so after one
reversal at the bottom both directions are plain left-to-right recurrences that can share
every matrix product. Gate blocks are stored in torch's order (i, f, g, o); the original's
+1.0 forget bias is not stored, it is added at run time as in the original.

Two kernels compute the same function:
- `exact`: the original step with cell and projection clips; the input projection of all
  time steps is one matrix product outside the recurrence, and rows whose sentence has
  ended drop out of the recurrence (rows are sorted by length).
- `fused`: torch's LSTM op with proj_size, the one behind nn.LSTM (cuDNN on GPU). It has no
  clips, so it is exact only for configs without clips; elsewhere it is an approximation the
  user opts into. Its sums run in another order than `exact`'s, so on CPU it is not batch
  invariant within 1e-6 (see BiLstmStack.resolve_kernel).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from elmo_pipeline.model.batch_invariance import ROW_MULTIPLE, pad_rows, padded_row_count
from elmo_pipeline.model.config import LstmConfig

KERNELS = ("auto", "exact", "fused")


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


class LstmState(NamedTuple):
    h: torch.Tensor  # (L, 2, B, P)
    c: torch.Tensor  # (L, 2, B, H)


class BiLstmLayer(nn.Module):
    def __init__(self, input_dim: int, hidden: int, proj: int) -> None:
        super().__init__()
        self.hidden, self.proj = hidden, proj
        self.input_weight = nn.Parameter(torch.empty(2, 4 * hidden, input_dim))
        self.recurrent_weight = nn.Parameter(torch.empty(2, 4 * hidden, proj))
        self.bias = nn.Parameter(torch.zeros(2, 4 * hidden))
        self.projection = nn.Parameter(torch.empty(2, proj, hidden))
        forget = torch.zeros(4 * hidden)
        forget[hidden : 2 * hidden] = 1.0
        self.register_buffer("forget_bias", forget, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = self.hidden ** -0.5
        for p in (self.input_weight, self.recurrent_weight, self.projection):
            nn.init.uniform_(p, -bound, bound)
        nn.init.zeros_(self.bias)


def reverse_within_lengths(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first `length` steps along dim 1, leaving padding in place."""
    b, t = x.shape[:2]
    steps = torch.arange(t, device=x.device).expand(b, t)
    lens = lengths.to(x.device).unsqueeze(1)
    idx = torch.where(steps < lens, lens - 1 - steps, steps)  # (B, T)
    idx = idx.view(b, t, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)


# Rows of the input projection computed per chunk of time steps on CPU. The projection is a
# (rows, I) x (I, 4H) product; ~512 rows already run at the full GEMM rate, while one product
# over the whole batch needs a (2, B*T, 4H) buffer (268 MB for 2048 positions of Original)
# whose pages must be faulted in on every call. Chunking keeps the buffer small and reused.
# On CUDA the single large product is faster and memory is cheap, so it is one chunk there.
_INPUT_CHUNK_ROWS_CPU = 512


def _exact_layer(
    x: torch.Tensor, batch_sizes: list[int], layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
    cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bidirectional layer of the original LSTM step; see `_exact_layer_inference`."""
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or h.requires_grad or c.requires_grad or any(p.requires_grad for p in layer.parameters()))
    if needs_grad:
        return _exact_layer_autograd(x, batch_sizes, layer, h, c, cell_clip, proj_clip)
    return _exact_layer_inference(x, batch_sizes, layer, h, c, cell_clip, proj_clip)


def _matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give a matrix product here. In-place and out= products bypass
    autocast, so the inference kernel casts explicitly."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _exact_layer_inference(
    x: torch.Tensor, batch_sizes: list[int], layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
    cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same function as `_exact_layer_autograd`, op for op, without per-step allocations.

    The autograd kernel allocates ~10 (2, n, H)-sized temporaries per step, two torch.cat
    copies of the whole state, and one (2, B*T, 4H) input projection (268 MB for 2048
    positions of Original). On CPU every fresh block above glibc's mmap threshold is
    page-faulted in again, and every op is one more parallel region whose barrier stalls when
    a neighbour holds a core. Here:
    - the input projection runs over chunks of ~512 rows (still a full-rate GEMM) into one
      reused buffer;
    - each step's gates live in one reused contiguous block and the activations are applied
      in place; the cell state is updated in place for the active rows only (rows that have
      ended keep their final state, which is what the torch.cat kept);
    - the projection product writes each step's h straight into the (2, B, T, P) result, and
      the final h of each row is gathered from it at the end.
    Elementwise ops see the same operands in the same order (a * b == b * a bit for bit) and
    products keep a multiple of 4 rows, where BLAS gives every row the same bits whatever the
    row count or layout (see batch_invariance): the outputs equal the autograd kernel's bit
    for bit (benchmarks/check_exact_kernel.py checks it).
    """
    two, b, t, i = x.shape
    hid = layer.hidden
    dt = _matmul_dtype(x, layer.input_weight)
    w_ih = layer.input_weight.to(dt).transpose(1, 2)  # (2, I, 4H)
    w_hh = layer.recurrent_weight.to(dt).transpose(1, 2)  # (2, P, 4H)
    w_p = layer.projection.to(dt).transpose(1, 2)  # (2, H, P)
    bias = (layer.bias + layer.forget_bias).to(dt).unsqueeze(1)  # (2, 1, 4H)
    x = x.to(dt)
    out = x.new_zeros(two, b, t, layer.proj)  # zero at padding; steps write their rows
    # The cell state accumulates over the sentence: keep it at least fp32 under bf16 autocast.
    c_dtype = c.dtype
    c = c.to(torch.promote_types(c.dtype, torch.float32), copy=True)
    h_prev = h.to(dt)

    def rows(n: int) -> int:
        return min(padded_row_count(n), b)

    chunk = t if x.is_cuda else max(1, min(t, _INPUT_CHUNK_ROWS_CPU // rows(batch_sizes[0])))
    buffer = x.new_empty(two * chunk * rows(batch_sizes[0]) * 4 * hid)
    scratch = x.new_empty(two * rows(batch_sizes[0]) * 4 * hid)
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        k, m0 = stop - start, rows(batch_sizes[start])
        # time-major (2, k, m0, 4H): a step's rows are adjacent, so its copy below streams
        x_in = x[:, :m0, start:stop].transpose(1, 2).reshape(two, k * m0, i)
        xw = buffer[: two * k * m0 * 4 * hid].view(two, k * m0, 4 * hid)
        torch.baddbmm(bias, x_in, w_ih, out=xw)
        xw = xw.view(two, k, m0, 4 * hid)
        for j in range(k):
            step = start + j
            n = batch_sizes[step]
            m = rows(n)
            # Copied into a contiguous block so that the recurrent product takes BLAS's batched
            # path: one direction per thread, with no synchronisation inside a product. In place
            # on the strided slice, torch splits it into one product per direction, each shared
            # by all threads, which measured ~1.3x slower for Original with 2 threads.
            gates = scratch[: two * m * 4 * hid].view(two, m, 4 * hid).copy_(xw[:, j, :m])
            h_prev = _exact_step(gates, h_prev[:, :m], c, n, w_hh, w_p, hid, cell_clip, proj_clip,
                                 out[:, :m, step])
    return out, _final_outputs(out, batch_sizes, h.to(dt)), c.to(c_dtype)


def _exact_step(
    gates: torch.Tensor, h_prev: torch.Tensor, c: torch.Tensor, n: int, w_hh: torch.Tensor,
    w_p: torch.Tensor, hid: int, cell_clip: float | None, proj_clip: float | None, h_out: torch.Tensor,
) -> torch.Tensor:
    """One time step for the first n rows, in place. gates (2, m, 4H), contiguous, holds
    x W_ih + b and is overwritten; c (2, B, H) is updated for rows < n; h_out (2, m, P) receives the new h
    (rows n..m-1 are only there to keep m a multiple of 4 and are zeroed again)."""
    gates.baddbmm_(h_prev, w_hh)
    act = gates[:, :n]
    in_forget, cell_in, out_gate = act[..., : 2 * hid], act[..., 2 * hid : 3 * hid], act[..., 3 * hid :]
    in_forget.sigmoid_()  # i and f are adjacent (torch gate order i, f, g, o): one call
    cell_in.tanh_()
    out_gate.sigmoid_()
    new_in = act[..., :hid].mul_(cell_in)  # sigmoid(i) * tanh(g)
    c_act = c[:, :n]
    c_act.mul_(act[..., hid : 2 * hid]).add_(new_in)  # sigmoid(f) * c + sigmoid(i) * tanh(g)
    if cell_clip is not None:
        c_act.clamp_(-cell_clip, cell_clip)
    torch.tanh(c_act, out=cell_in).mul_(out_gate)  # hidden, in the g block (free again)
    # the product reads all m rows of the g block; rows >= n hold stale values that only reach
    # rows >= n of the result (rows of a product are independent), which are reset below
    torch.bmm(gates[..., 2 * hid : 3 * hid], w_p, out=h_out)
    if h_out.shape[1] > n:
        h_out[:, n:].zero_()
    if proj_clip is not None:
        h_out[:, :n].clamp_(-proj_clip, proj_clip)
    return h_out


def _final_outputs(out: torch.Tensor, batch_sizes: list[int], h0: torch.Tensor) -> torch.Tensor:
    """(2, B, P): each row's output at its last step (its initial h if it has no steps)."""
    two, b, t, p = out.shape
    lengths = (torch.tensor(batch_sizes).unsqueeze(1) > torch.arange(b)).sum(0)  # steps per row
    last = (lengths - 1).clamp(min=0).to(out.device)
    final = out.gather(2, last.view(1, b, 1, 1).expand(two, b, 1, p)).squeeze(2)
    if bool((lengths == 0).any()):
        empty = (lengths == 0).to(out.device).view(1, b, 1)
        final = torch.where(empty, h0, final)
    return final


def _exact_layer_autograd(
    x: torch.Tensor, batch_sizes: list[int], layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
    cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x (2, B, T, I), rows sorted by length descending; h (2, B, P), c (2, B, H)
    two, b, t, i = x.shape
    bias = (layer.bias + layer.forget_bias).unsqueeze(1)  # (2, 1, 4H)
    xw = torch.baddbmm(bias, x.reshape(two, b * t, i), layer.input_weight.transpose(1, 2))
    xw = xw.view(two, b, t, -1)  # (2, B, T, 4H)
    w_hh = layer.recurrent_weight.transpose(1, 2)  # (2, P, 4H)
    w_p = layer.projection.transpose(1, 2)  # (2, H, P)
    outs = []
    for step in range(t):
        n = batch_sizes[step]
        m = max(n, ROW_MULTIPLE)  # compute at least 4 rows (see batch_invariance), keep n
        gates = torch.baddbmm(xw[:, :m, step], h[:, :m], w_hh)  # (2, m, 4H)
        in_gate, forget_gate, cell_in, out_gate = gates.chunk(4, dim=-1)
        c_new = torch.sigmoid(forget_gate) * c[:, :m] + torch.sigmoid(in_gate) * torch.tanh(cell_in)
        if cell_clip is not None:
            c_new = c_new.clamp(-cell_clip, cell_clip)
        h_new = torch.bmm(torch.sigmoid(out_gate) * torch.tanh(c_new), w_p)  # (2, m, P)
        if proj_clip is not None:
            h_new = h_new.clamp(-proj_clip, proj_clip)
        h_new, c_new = h_new[:, :n], c_new[:, :n]
        outs.append(h_new)
        if n == b:
            h, c = h_new, c_new
        else:  # finished rows keep their last state (it is the final state in carry mode)
            h = torch.cat([h_new, h[:, n:]], dim=1)
            c = torch.cat([c_new, c[:, n:]], dim=1)
    if all(n == b for n in batch_sizes):
        out = torch.stack(outs, dim=2)
    else:
        out = x.new_zeros(two, b, t, layer.proj)
        for step, h_step in enumerate(outs):
            out[:, : h_step.shape[1], step] = h_step
    return out, h, c


def _fused_layer(
    x: torch.Tensor, lengths: torch.Tensor, layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # torch's LSTM op is called with our own tensors as its weights: no module holds them, so
    # threads sharing one model never see each other's weights (an nn.LSTM shell with
    # functional_call swaps weights into a shared module for the length of a call).
    t = x.shape[2]
    lengths_cpu = lengths.cpu()
    outs, hs, cs = [], [], []
    for d in range(2):
        weights = [layer.input_weight[d], layer.recurrent_weight[d], layer.bias[d],
                   layer.forget_bias.to(layer.bias.dtype), layer.projection[d]]
        packed = pack_padded_sequence(x[d], lengths_cpu, batch_first=True, enforce_sorted=True)
        state = (h[d : d + 1].contiguous(), c[d : d + 1].contiguous())
        with warnings.catch_warnings():
            # cuDNN copies non-contiguous weights into one buffer per call and says so; harmless.
            warnings.filterwarnings("ignore", message=".*contiguous chunk of memory.*")
            out, hn, cn = torch.lstm(packed.data, packed.batch_sizes, state, weights,
                                     True, 1, 0.0, False, False)  # biases, 1 layer, no dropout, unidirectional
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
        every batch; on CUDA it is fused (cuDNN) unless the config has clips, which fused lacks."""
        check_kernel(kernel)
        if kernel == "auto":
            return "fused" if device.type == "cuda" and not self.cfg.has_clips else "exact"
        return kernel

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, state: LstmState | None = None,
        kernel: str = "auto", dropout: float = 0.0,
    ) -> tuple[list[torch.Tensor], LstmState]:
        """tokens (B, T, P) with boundaries, lengths (B,) >= 1.

        Returns one (2, B, T, P) tensor per layer (forward, backward in natural order, zero
        at padding) and the final state of every row, for the carry policy.
        """
        kernel = self.resolve_kernel(kernel, tokens.device)
        b_in, t, _ = tokens.shape
        if state is None:
            state = self.zero_state(b_in, tokens)
        # at least 4 rows (see batch_invariance); the extra rows are one-step sentences
        tokens = pad_rows(tokens)
        lengths = pad_rows(lengths.cpu(), 1)
        state = LstmState(*(pad_rows(s.transpose(0, 2)).transpose(0, 2) for s in state))
        order = torch.argsort(lengths.cpu(), descending=True, stable=True)
        sorted_lengths = lengths.cpu()[order]
        order_dev = order.to(tokens.device)
        batch_sizes = [int((sorted_lengths > s).sum()) for s in range(t)]
        x_sorted = tokens.index_select(0, order_dev)
        x = torch.stack([x_sorted, reverse_within_lengths(x_sorted, sorted_lengths)])  # (2, B, T, P)
        h_all = state.h.index_select(2, order_dev)
        c_all = state.c.index_select(2, order_dev)
        outputs, final_h, final_c = [], [], []
        for index, layer in enumerate(self.layers):
            x_in = nn.functional.dropout(x, dropout, self.training) if dropout else x
            if kernel == "exact":
                out, hn, cn = _exact_layer(x_in, batch_sizes, layer, h_all[index], c_all[index],
                                           self.cfg.cell_clip, self.cfg.proj_clip)
            else:
                out, hn, cn = _fused_layer(x_in, sorted_lengths, layer, h_all[index], c_all[index])
            if index > 0 and self.cfg.use_skip_connections:
                out = out + x_in
            outputs.append(out)
            final_h.append(hn)
            final_c.append(cn)
            x = out
        restore = torch.argsort(order_dev)
        mask = (torch.arange(t, device=tokens.device) < sorted_lengths.to(tokens.device).unsqueeze(1))
        mask = mask.unsqueeze(-1).to(tokens.dtype)  # (B, T, 1)
        natural = []
        for out in outputs:
            out = out.to(tokens.dtype)
            fwd = out[0] * mask
            bwd = reverse_within_lengths(out[1], sorted_lengths) * mask
            natural.append(torch.stack([fwd, bwd]).index_select(1, restore)[:, :b_in])
        new_state = LstmState(torch.stack(final_h).index_select(2, restore)[:, :, :b_in],
                              torch.stack(final_c).index_select(2, restore)[:, :, :b_in])
        return natural, new_state
