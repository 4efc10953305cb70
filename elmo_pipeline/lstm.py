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
- `fused`: torch's nn.LSTM with proj_size (cuDNN on GPU). It has no clips, so it is exact
  only for configs without clips; elsewhere it is an approximation the user opts into.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .batch_invariance import ROW_MULTIPLE, pad_rows
from .config import LstmConfig

KERNELS = ("auto", "exact", "fused")


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


def _exact_layer(
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


_SHELLS: dict[tuple[int, int, int], nn.LSTM] = {}


def _fused_layer(
    x: torch.Tensor, lengths: torch.Tensor, layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # nn.LSTM is only a shell here: our parameters are passed in, so both kernels share weights.
    two, b, t, i = x.shape
    key = (i, layer.hidden, layer.proj)
    if key not in _SHELLS:
        _SHELLS[key] = nn.LSTM(i, layer.hidden, proj_size=layer.proj, batch_first=True)
    shell = _SHELLS[key]
    lengths_cpu = lengths.cpu()
    outs, hs, cs = [], [], []
    for d in range(2):
        params = {
            "weight_ih_l0": layer.input_weight[d], "weight_hh_l0": layer.recurrent_weight[d],
            "bias_ih_l0": layer.bias[d], "bias_hh_l0": layer.forget_bias.to(layer.bias.dtype),
            "weight_hr_l0": layer.projection[d],
        }
        packed = pack_padded_sequence(x[d], lengths_cpu, batch_first=True, enforce_sorted=True)
        with warnings.catch_warnings():
            # cuDNN copies non-contiguous weights into one buffer per call and says so; harmless.
            warnings.filterwarnings("ignore", message=".*contiguous chunk of memory.*")
            out, (hn, cn) = functional_call(shell, params, (packed, (h[d : d + 1].contiguous(), c[d : d + 1].contiguous())))
        outs.append(pad_packed_sequence(out, batch_first=True, total_length=t)[0])
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
        n = self.cfg.n_layers
        return LstmState(like.new_zeros(n, 2, batch, self.cfg.projection_dim), like.new_zeros(n, 2, batch, self.cfg.dim))

    def resolve_kernel(self, kernel: str) -> str:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "auto":
            return "exact" if self.cfg.has_clips else "fused"
        return kernel

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, state: LstmState | None = None,
        kernel: str = "auto", dropout: float = 0.0,
    ) -> tuple[list[torch.Tensor], LstmState]:
        """tokens (B, T, P) with boundaries, lengths (B,) >= 1.

        Returns one (2, B, T, P) tensor per layer (forward, backward in natural order, zero
        at padding) and the final state of every row, for the carry policy.
        """
        kernel = self.resolve_kernel(kernel)
        b_in, t, _ = tokens.shape
        if state is None:
            state = self.zero_state(b_in, tokens)
        # at least 4 rows (see batch_invariance); the extra rows are one-step sentences
        tokens = pad_rows(tokens)
        lengths = pad_rows(lengths.cpu(), 1)
        state = LstmState(*(pad_rows(s.transpose(0, 2)).transpose(0, 2) for s in state))
        b = tokens.shape[0]
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
