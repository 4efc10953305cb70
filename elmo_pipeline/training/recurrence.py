"""A training kernel for the biLSTM stack: the same function as `BiLstmStack.forward` with the
exact kernel (forget bias +1, cell and projection clips, residuals, dropout on every layer's
input), arranged so that back-propagation costs O(T) rather than O(T^2).

Why: both inference kernels slice one step out of a precomputed (2, B, T, 4H) input
projection at every step; autograd turns each slice's gradient into a zero-filled tensor of
the full size plus an add, T times per layer (and torch's CPU LSTM with projections does the
same internally). Here the projection is split once with `unbind`, whose backward is a single
stack. Rows that have ended keep computing on padding and are masked: outputs at padding are
zero and valid positions never read padding (the backward direction is reversed within each
row's length, so padding is always after a row's end). Final states are not returned; training
starts every sentence from a zero state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elmo_pipeline.model.lstm import BiLstmLayer, BiLstmStack, reverse_within_lengths


def _layer(x: torch.Tensor, mask: torch.Tensor, layer: BiLstmLayer, cell_clip: float | None,
           proj_clip: float | None) -> torch.Tensor:
    # x (2, B, T, I); mask (B, T, 1) -> (2, B, T, P), zero at padding
    two, b, t, i = x.shape
    bias = (layer.bias + layer.forget_bias).unsqueeze(1)  # (2, 1, 4H)
    xw = torch.baddbmm(bias, x.reshape(two, b * t, i), layer.input_weight.transpose(1, 2)).view(two, b, t, -1)
    w_hh = layer.recurrent_weight.transpose(1, 2)  # (2, P, 4H)
    w_p = layer.projection.transpose(1, 2)  # (2, H, P)
    h = x.new_zeros(two, b, layer.proj)
    c = x.new_zeros(two, b, layer.hidden)
    outs = []
    for xw_t in xw.unbind(2):
        gates = torch.baddbmm(xw_t, h, w_hh)
        in_gate, forget_gate, cell_in, out_gate = gates.chunk(4, dim=-1)
        c = torch.sigmoid(forget_gate) * c + torch.sigmoid(in_gate) * torch.tanh(cell_in)
        if cell_clip is not None:
            c = c.clamp(-cell_clip, cell_clip)
        h = torch.bmm(torch.sigmoid(out_gate) * torch.tanh(c), w_p)
        if proj_clip is not None:
            h = h.clamp(-proj_clip, proj_clip)
        outs.append(h)
    return torch.stack(outs, dim=2) * mask


def bilstm_train_forward(stack: BiLstmStack, tokens: torch.Tensor, lengths: torch.Tensor,
                         dropout: float = 0.0) -> list[torch.Tensor]:
    """tokens (B, T, P) with boundaries; returns per layer (2, B, T, P) in natural order, as
    `BiLstmStack.forward` does (the states it would return are not computed)."""
    cfg = stack.cfg
    b, t, _ = tokens.shape
    lengths_dev = lengths.to(tokens.device)
    mask = (torch.arange(t, device=tokens.device).unsqueeze(0) < lengths_dev.unsqueeze(1)).unsqueeze(-1)
    mask = mask.to(tokens.dtype)  # (B, T, 1)
    x = torch.stack([tokens, reverse_within_lengths(tokens, lengths)])
    outputs = []
    for index, layer in enumerate(stack.layers):
        x_in = F.dropout(x, dropout, stack.training) if dropout else x
        out = _layer(x_in, mask, layer, cfg.cell_clip, cfg.proj_clip)
        if index > 0 and cfg.use_skip_connections:
            out = out + x_in * mask
        outputs.append(out)
        x = out
    natural = []
    for out in outputs:
        natural.append(torch.stack([out[0], reverse_within_lengths(out[1], lengths)]))
    return natural
