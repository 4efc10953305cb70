"""The biLM's LSTM, written to be read: the specification that every fast kernel is held to.

One layer of one direction is the original's LSTM with a projection (Peters et al. 2018,
bilm-tf's LSTMCell with num_proj, cell_clip and proj_clip):

    i, f, g, o = split(x_t W_ih^T + b + h_{t-1} W_hh^T)     four (B, H) gate blocks
    c_t = clip(sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g), cell_clip)
    h_t = clip((sigmoid(o) * tanh(c_t)) W_p^T, proj_clip)  (B, P): the layer's output

with +1 on the forget gate's bias (added at run time, not stored, as in the original). Layer
k > 0 adds its input to its output (the residual). The backward LM reads each sentence
reversed within its own length, so both directions are left-to-right recurrences; they sit
side by side on a leading axis of 2 (0 = forward, 1 = backward) and never mix: every product
below is a batched product over that axis. A sentence's final state is its state after its
last step (the carry policy starts the next sentence from it).

Gate blocks are stored in torch's order (i, f, g, o). The model's own kernels live in
`lstm.py`; `tests/model/test_lstm_reference.py` holds them to this file.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn

from elmo_pipeline.model.config import LstmConfig


class LstmState(NamedTuple):
    h: torch.Tensor  # (L, 2, B, P)
    c: torch.Tensor  # (L, 2, B, H)


class BiLstmLayer(nn.Module):
    """The weights of one layer, both directions on the leading axis."""

    def __init__(self, input_dim: int, hidden: int, proj: int) -> None:
        super().__init__()
        self.hidden, self.proj = hidden, proj
        self.input_weight = nn.Parameter(torch.empty(2, 4 * hidden, input_dim))  # W_ih
        self.recurrent_weight = nn.Parameter(torch.empty(2, 4 * hidden, proj))  # W_hh
        self.bias = nn.Parameter(torch.zeros(2, 4 * hidden))  # b
        self.projection = nn.Parameter(torch.empty(2, proj, hidden))  # W_p
        forget = torch.zeros(4 * hidden)
        forget[hidden : 2 * hidden] = 1.0
        self.register_buffer("forget_bias", forget, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = self.hidden ** -0.5
        for p in (self.input_weight, self.recurrent_weight, self.projection):
            nn.init.uniform_(p, -bound, bound)
        nn.init.zeros_(self.bias)

    def gate_bias(self) -> torch.Tensor:
        """(2, 1, 4H): the stored bias with the forget gate's +1."""
        return (self.bias + self.forget_bias).unsqueeze(1)


def reverse_within_lengths(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first `length` steps along dim 1, leaving padding in place."""
    b, t = x.shape[:2]
    steps = torch.arange(t, device=x.device).expand(b, t)
    lens = lengths.to(x.device).unsqueeze(1)
    idx = torch.where(steps < lens, lens - 1 - steps, steps)  # (B, T)
    idx = idx.view(b, t, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)


def input_gates(x: torch.Tensor, layer: BiLstmLayer) -> torch.Tensor:
    """x (2, N, I) -> (2, N, 4H) = b + x W_ih^T: the part of the gates that does not depend on
    the state, so one product serves every time step (N = B * T rows)."""
    return torch.baddbmm(layer.gate_bias(), x, layer.input_weight.transpose(1, 2))


def clip_for(clip: float | None, dtype: torch.dtype) -> float | None:
    """The bound a `dtype` tensor is clamped at for `clip`: None (no clamp) past the dtype's largest
    value, where the clip rounded to the dtype is infinite and clips nothing, and torch refuses it
    ("value cannot be converted to type c10::Half without overflow": every sentence of a float16
    model with a proj_clip of 1e5 failed). A float32 clip is always itself (the config bounds it)."""
    return None if clip is None or clip > torch.finfo(dtype).max else clip


def lstm_step(
    x_gates: torch.Tensor, h: torch.Tensor, c: torch.Tensor, layer: BiLstmLayer,
    cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One time step of each direction (the two slices of the leading axis never meet).
    x_gates (2, B, 4H) = b + x_t W_ih^T from `input_gates`, h (2, B, P), c (2, B, H) -> new h, c."""
    # the products' operands in the weights' dtype: the state is float32 (zero_state), which a
    # float16 or bfloat16 model's products refuse outside autocast (inside it, autocast casts)
    h = h.to(layer.recurrent_weight.dtype)
    gates = torch.baddbmm(x_gates, h, layer.recurrent_weight.transpose(1, 2))  # (2, B, 4H)
    i, f, g, o = gates.chunk(4, dim=-1)  # (2, B, H) each
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (2, B, H)
    if (clip := clip_for(cell_clip, c.dtype)) is not None:
        c = c.clamp(-clip, clip)
    hidden = (torch.sigmoid(o) * torch.tanh(c)).to(layer.projection.dtype)  # (2, B, H)
    h = torch.bmm(hidden, layer.projection.transpose(1, 2))  # (2, B, P)
    if (clip := clip_for(proj_clip, h.dtype)) is not None:
        h = h.clamp(-clip, clip)
    return h, c


def lstm_layer(
    x: torch.Tensor, lengths: torch.Tensor, layer: BiLstmLayer, h: torch.Tensor, c: torch.Tensor,
    cell_clip: float | None, proj_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (2, B, T, I), lengths (B,), initial h (2, B, P) and c (2, B, H) -> outputs (2, B, T, P),
    zero at padding, and each row's state after its last step (its initial state if it has none)."""
    two, b, t, _ = x.shape
    x_gates = input_gates(x.reshape(two, b * t, -1), layer).view(two, b, t, -1)  # (2, B, T, 4H)
    h0, c0 = h, c
    outs, cells = [], []
    # unbind, not x_gates[:, :, step]: its backward is one stack instead of T zero-filled copies
    for x_t in x_gates.unbind(2):  # (2, B, 4H)
        h, c = lstm_step(x_t, h, c, layer, cell_clip, proj_clip)
        outs.append(h)
        cells.append(c)
    # A row that has ended goes on stepping over its padding, which follows its last step in both
    # directions (the backward one is reversed within the length): no valid step reads it.
    valid = (torch.arange(t) < lengths.cpu().unsqueeze(1)).unsqueeze(-1).to(x.device)  # (B, T, 1)
    return torch.stack(outs, dim=2) * valid, at_last_step(outs, lengths, h0), at_last_step(cells, lengths, c0)


def at_last_step(steps: Sequence[torch.Tensor], lengths: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """steps: T tensors (2, B, D) -> (2, B, D): each row's value at its last step, `initial` if
    it has none."""
    lengths = lengths.cpu()
    final = initial
    for n in lengths.unique().tolist():
        if n > 0:
            final = torch.where((lengths == n).view(1, -1, 1).to(initial.device), steps[n - 1], final)
    return final


def bilstm(
    layers: Sequence[BiLstmLayer], cfg: LstmConfig, tokens: torch.Tensor, lengths: torch.Tensor,
    state: LstmState, dropout: float = 0.0, training: bool = False,
) -> tuple[list[torch.Tensor], LstmState]:
    """tokens (B, T, P) with boundaries, lengths (B,) -> one (2, B, T, P) tensor per layer
    (forward, backward in natural order, zero at padding) and every row's final state."""
    t = tokens.shape[1]
    mask = (torch.arange(t, device=tokens.device) < lengths.to(tokens.device).unsqueeze(1)).unsqueeze(-1)
    x = torch.stack([tokens, reverse_within_lengths(tokens, lengths)])  # (2, B, T, P)
    outputs, final_h, final_c = [], [], []
    for index, layer in enumerate(layers):
        x_in = nn.functional.dropout(x, dropout, training) if dropout else x
        out, h, c = lstm_layer(x_in, lengths, layer, state.h[index], state.c[index], cfg.cell_clip, cfg.proj_clip)
        if index > 0 and cfg.use_skip_connections:
            out = out + x_in * mask
        outputs.append(out)
        final_h.append(h)
        final_c.append(c)
        x = out
    natural = [torch.stack([out[0], reverse_within_lengths(out[1], lengths)]) for out in outputs]
    return natural, LstmState(torch.stack(final_h), torch.stack(final_c))
