"""The task mix: ELMo_k = gamma * sum_j softmax(w)_j * h_{k,j}.

The `top` preset keeps only the top layer with finite weights: the others get EXCLUDED_WEIGHT,
whose exp underflows to exactly 0 in float32 and float64, and a layer whose weight after the
softmax is exactly 0 is left out of the sum, so `top` returns the top layer bit for bit
(-0.0 included). Mix files stay strict JSON (no -Infinity) and a preset written to a file
reads back as the same mix.

Layer normalisation, when asked for, normalises each token's vector on its own (over its
2P features). AllenNLP instead pools the mean and variance over every unmasked element of
the batch, which makes a token's vector depend on its neighbours; ours does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from elmo_pipeline.model.config import ConfigError, dumps_strict, parse_json_strict

LAYER_NORM_EPS = 1e-12
PRESETS = ("average", "top")
EXCLUDED_WEIGHT = -1e4  # exp(-1e4) is 0 in every float type: no weight at all after the softmax


@dataclass(frozen=True)
class MixSpec:
    """A named mix as written in a mix JSON file: weights before the softmax."""

    weights: tuple[float, ...]
    gamma: float = 1.0
    layer_norm: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "gamma": self.gamma, "layer_norm": self.layer_norm}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> "MixSpec":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected an object")
        unknown = set(raw) - {"weights", "gamma", "layer_norm"}
        if unknown or "weights" not in raw:
            raise ConfigError(f"{where}: expected 'weights' with optional 'gamma' and 'layer_norm', got {sorted(raw)}")
        weights = raw["weights"]
        if not isinstance(weights, list) or not weights or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
            raise ConfigError(f"{where}.weights: expected a non-empty list of finite numbers")
        gamma = raw.get("gamma", 1.0)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma):
            raise ConfigError(f"{where}.gamma: expected a finite number")
        layer_norm = raw.get("layer_norm", False)
        if not isinstance(layer_norm, bool):
            raise ConfigError(f"{where}.layer_norm: expected true or false")
        return cls(tuple(float(w) for w in weights), float(gamma), layer_norm)

    @classmethod
    def preset(cls, name: str, n_layers: int) -> "MixSpec":
        if name == "average":
            return cls((0.0,) * n_layers)
        if name == "top":
            return cls((EXCLUDED_WEIGHT,) * (n_layers - 1) + (0.0,))
        raise ConfigError(f"unknown mix preset {name!r}; presets are {list(PRESETS)}")


def load_mix_specs(text: str | bytes, where: str) -> dict[str, MixSpec]:
    raw = parse_json_strict(text, where)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: expected an object of named mixes")
    return {name: MixSpec.from_dict(spec, f"{where}:{name}") for name, spec in raw.items()}


def dump_mix_specs(specs: Mapping[str, MixSpec]) -> str:
    return dumps_strict({name: spec.to_dict() for name, spec in specs.items()}, "mix file", indent=2)


def layer_norm_per_token(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + LAYER_NORM_EPS)


class ScalarMix(nn.Module):
    def __init__(
        self, n_layers: int, layer_norm: bool = False, initial_weights: Sequence[float] | None = None,
        gamma: float = 1.0, trainable: bool = True, l2_lambda: float = 0.0,
    ) -> None:
        super().__init__()
        weights = torch.zeros(n_layers) if initial_weights is None else torch.tensor(list(initial_weights), dtype=torch.float32)
        if weights.shape != (n_layers,):
            raise ValueError(f"expected {n_layers} mix weights, got {tuple(weights.shape)}")
        self.layer_norm = layer_norm
        self.l2_lambda = l2_lambda
        self.weights = nn.Parameter(weights, requires_grad=trainable)
        self.gamma = nn.Parameter(torch.tensor(float(gamma)), requires_grad=trainable)

    @classmethod
    def from_spec(cls, spec: MixSpec, trainable: bool = False) -> "ScalarMix":
        return cls(len(spec.weights), spec.layer_norm, spec.weights, spec.gamma, trainable)

    def to_spec(self) -> MixSpec:
        return MixSpec(tuple(float(w) for w in self.weights.detach().cpu()), float(self.gamma.detach()), self.layer_norm)

    def normalized_weights(self) -> torch.Tensor:
        return torch.softmax(self.weights, dim=0)

    def l2_penalty(self) -> torch.Tensor:
        """lambda * ||w||^2 on the weights before the softmax, as in the paper."""
        return self.l2_lambda * (self.weights ** 2).sum()

    def forward(self, layers: torch.Tensor) -> torch.Tensor:  # (L+1, ..., D) -> (..., D)
        if layers.shape[0] != self.weights.shape[0]:
            raise ValueError(f"mix has {self.weights.shape[0]} weights, got {layers.shape[0]} layers")
        s = self.normalized_weights()
        used = s != 0
        if not bool(used.all()):  # 0 * x + y is not y when y is -0.0: leave such layers out
            s, layers = s[used], layers[used.to(layers.device)]
        if self.layer_norm:
            layers = layer_norm_per_token(layers)
        s = s.to(layers.dtype)
        # summed from the first term, not from torch.sum's +0.0, which would turn a lone -0.0 into +0.0
        mixed = s[0] * layers[0]
        for j in range(1, layers.shape[0]):
            mixed = mixed + s[j] * layers[j]
        return self.gamma.to(layers.dtype) * mixed
