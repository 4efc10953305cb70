"""The trainable task mix and the `[x_k ; ELMo_k]` input of a downstream model.

`TrainableMix` is `scalar_mix.ScalarMix` (softmax weights, gamma, optional per-token layer norm,
the paper's L2 penalty lambda * ||w||^2) plus dropout on the mixed vector, active in training
only. Its `to_spec()` is a `MixSpec`, which `dump_mix_specs` writes in the JSON that
`extract --mix NAME=FILE` reads, so a mix learned on a labelled sample is applied to a corpus.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix, check_layers, check_spec, dump_mix_specs
from elmo_pipeline.strict import check_bools, check_numbers


class TrainableMix(nn.Module):
    """ELMo_k = dropout(gamma * sum_j softmax(w)_j * h_{k,j}) over `n_layers` layers (the model's
    output layers); w starts at 0 and gamma at 1, or at the `initial` spec's.

    l2_lambda: the paper's penalty weight (1: close to a plain average, 0.001: the weights are free
    to differ); add `penalty()` to the task loss. layer_norm: normalise each token's vector per
    layer before mixing (as the ScalarMix of `extract` does with the same spec); default: the
    `initial` spec's, else off.
    """

    def __init__(self, n_layers: int, l2_lambda: float = 0.001, dropout: float = 0.0, layer_norm: bool | None = None,
                 initial: MixSpec | None = None) -> None:
        super().__init__()
        if layer_norm is not None:
            check_bools(layer_norm=layer_norm)  # bool("no") is True: it normalised
        check_numbers(dropout=dropout)
        if initial is not None:
            check_spec(initial, "initial")
        if initial is not None and len(initial.weights) != n_layers:
            raise ValueError(f"initial mix has {len(initial.weights)} weights, expected {n_layers}")
        if initial is not None and layer_norm is not None and layer_norm != initial.layer_norm:
            raise ValueError(f"layer_norm={layer_norm} and the initial mix's layer_norm={initial.layer_norm} disagree: "
                             "give one of them")
        self.mix = ScalarMix(n_layers, layer_norm=initial.layer_norm if initial else bool(layer_norm),
                             initial_weights=initial.weights if initial else None,
                             gamma=initial.gamma if initial else 1.0, trainable=True, l2_lambda=l2_lambda)
        # probe's --dropout bound: NaN passed nn.Dropout's check and failed at the first call in
        # training, and 1 zeroes every vector
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = nn.Dropout(float(dropout))  # a 0-d tensor or array as well

    @property
    def n_layers(self) -> int:
        """The layers it mixes."""
        return self.mix.weights.shape[0]

    def forward(self, layers: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """layers (L+1, ..., D) -> (..., D); with `mask` (...) padding positions come out as zeros."""
        check_layers(layers)
        if mask is not None and tuple(mask.shape) != tuple(layers.shape[1:-1]):
            # a (B, 1) or (T,) mask broadcasts, and would zero other positions than the padding
            raise ValueError(f"mask of shape {tuple(mask.shape)} for layers of shape {tuple(layers.shape)}: expected "
                             f"{tuple(layers.shape[1:-1])}")
        out = self.dropout(self.mix(layers))
        if mask is not None:
            out = out * mask.unsqueeze(-1).to(out.device, out.dtype)  # a mask of the user's may be on the CPU
        return out

    def penalty(self) -> torch.Tensor:
        """l2_lambda * ||w||^2, to add to the task loss."""
        return self.mix.l2_penalty()

    def weights(self) -> list[float]:
        """The layer weights after the softmax."""
        return [float(w) for w in self.mix.normalized_weights().detach().cpu()]

    def gamma(self) -> float:
        """The learned gamma."""
        return float(self.mix.gamma.detach())

    def to_spec(self) -> MixSpec:
        """The learned mix as a MixSpec (`dump_learned_mixes` writes it for `extract --mix NAME=FILE`)."""
        return self.mix.to_spec()


def dump_learned_mixes(mixes: Mapping[str, TrainableMix]) -> str:
    """The JSON of `extract --mix NAME=FILE` for learned mixes."""
    return dump_mix_specs({name: mix.to_spec() for name, mix in mixes.items()})


def concat_elmo(x: torch.Tensor, elmo: torch.Tensor) -> torch.Tensor:
    """`[x_k ; ELMo_k]`: a task model's own token input `x` (B, T, d) joined with `elmo` (B, T, 2P)."""
    if x.shape[:-1] != elmo.shape[:-1]:
        raise ValueError(f"token shapes differ: input {tuple(x.shape)}, ELMo {tuple(elmo.shape)}")
    return torch.cat([x, elmo.to(x.dtype)], dim=-1)


class ElmoConcat(nn.Module):
    """A task model's input layer: its own token vectors x_k joined with a learned ELMo mix.

        elmo_input = ElmoConcat(n_layers=3, dropout=0.5)
        h = encoder(elmo_input(word_vectors, batch.features, batch.mask))  # (B, T, d + 2P)
        loss = task_loss + elmo_input.penalty()

    The same module (a second instance) gives the output-side `[h_k ; ELMo_k]` with its own weights.
    `n_layers`, `l2_lambda`, `dropout` and `layer_norm` are its TrainableMix's.
    """

    def __init__(self, n_layers: int, l2_lambda: float = 0.001, dropout: float = 0.0,
                 layer_norm: bool = False) -> None:
        super().__init__()
        self.mix = TrainableMix(n_layers, l2_lambda, dropout, layer_norm)

    def forward(self, x: torch.Tensor, layers: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`x` (B, T, d) joined with the mix of `layers` (L+1, B, T, 2P), the mix zero where `mask`
        (B, T) is False."""
        return concat_elmo(x, self.mix(layers, mask))

    def penalty(self) -> torch.Tensor:
        """The mix's `penalty()`, to add to the task loss."""
        return self.mix.penalty()
