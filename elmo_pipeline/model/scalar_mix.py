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
from typing import Annotated, Any, Iterable, Mapping, Optional

import torch
import torch.nn.functional as F
from pydantic import Field, Strict
from torch import nn

from elmo_pipeline.model.config import Sha256
from elmo_pipeline.runtime_choices import FLOAT32_MAX
from elmo_pipeline.strict import (ConfigError, StrictModel, check_bools, check_ints, check_numbers, dumps_strict,
                                  expecting, parse_json_strict, validated)

LAYER_NORM_EPS = 1e-12
PRESETS = ("average", "top")
EXCLUDED_WEIGHT = -1e4  # exp(-1e4) is 0 in every float type: no weight at all after the softmax
# The largest |gamma| a mix may have. A learned gamma is of the order of 1; beyond this one only
# scales vectors into overflow: in float32 for gamma 1e308, in float16 (max 65504) for gamma 30000
# times a value of 3. Output that overflows all the same is counted (extract's nonfinite_values).
MAX_GAMMA = 1e4
# How far the softmax of a mix's weights may move when they are rounded to float32, the type the
# layers are mixed in; weights that move it further are shifted first (_float32_weights). Weights
# of a file, float64, that float32 cannot tell apart (2^24 and 2^24 + 1) made another mix than the
# one the metadata records; probe's, float32 already, move by 0.
MAX_WEIGHT_ROUNDING = 1e-6

_Finite = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class MixSpec(StrictModel):
    """A named mix as written in a mix JSON file: weights before the softmax. `layers_sha256`,
    which `probe` writes, is the digest of the layers the mix was learned on (`layers_digest`,
    the same for one model in any file format): its weights mean those layers, and `extract`
    refuses to apply it to another model's."""

    weights: Annotated[tuple[_Finite, ...], Field(min_length=1), expecting("a non-empty list of finite numbers")]
    gamma: Annotated[_Finite, Field(ge=-MAX_GAMMA, le=MAX_GAMMA),
                     expecting(f"a finite number from {-MAX_GAMMA:g} to {MAX_GAMMA:g}")] = 1.0
    layer_norm: Annotated[bool, Strict()] = False
    layers_sha256: Optional[Sha256] = None

    def __init__(self, *values: Any, **fields: Any) -> None:
        # positional too, as MixSpec(weights, gamma, layer_norm) was before it was a pydantic model
        super().__init__(**dict(zip(type(self).model_fields, values)), **fields)

    def to_dict(self) -> dict[str, Any]:
        """The mix as a mix file holds it under its name."""
        # a mix without a model (a preset, a hand-written file) is written as it always was
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def preset(cls, name: str, n_layers: int) -> "MixSpec":
        """The mix `name` of `n_layers` layers: "average" (equal weights) or "top" (the top layer alone,
        bit for bit)."""
        check_layer_count(n_layers)
        if name == "average":
            return cls((0.0,) * n_layers)
        if name == "top":
            return cls((EXCLUDED_WEIGHT,) * (n_layers - 1) + (0.0,))
        raise ConfigError(f"unknown mix preset {name!r}; presets are {list(PRESETS)}")


def check_spec(spec: object, what: str) -> None:
    """A TypeError naming `what` unless `spec` is a MixSpec: a mix file's dict (json.load) failed on
    "'dict' object has no attribute 'weights'"."""
    if not isinstance(spec, MixSpec):
        raise TypeError(f"{what} is a {type(spec).__name__}, not a MixSpec (read a mix file with "
                        "elmo_pipeline.model.scalar_mix.load_mix_specs(text, where): the file's text, not its path, "
                        "and its name for errors)")


def check_layer_count(n_layers: int) -> None:
    """A mix's layer count, named where the mix is built: 2.5 failed in torch.zeros ("argument
    'size' must be tuple of ints") or in a tuple's product, and "3" in a comparison."""
    check_ints(n_layers=n_layers)
    if n_layers < 1:
        raise ConfigError(f"a mix needs at least one layer, got {n_layers}")


_MixFile = Annotated[dict[str, MixSpec], Field(min_length=1)]


def load_mix_specs(text: str | bytes, where: str) -> dict[str, MixSpec]:
    """The mixes of a mix file by name, from `text`, the file's content (not its path: that is
    "not valid JSON"); `where` names the file in a ConfigError, with the key at fault."""
    return validated(_MixFile, parse_json_strict(text, where), where)


def dump_mix_specs(specs: Mapping[str, MixSpec]) -> str:
    """The text of a mix file holding `specs` by name, which `load_mix_specs` reads back."""
    return dumps_strict({name: spec.to_dict() for name, spec in specs.items()}, "mix file", indent=2)


def _float32_weights(given: list[float], weights: torch.Tensor) -> torch.Tensor:
    """`weights`, the `given` numbers in float32, or, where that rounding moves their softmax by
    more than MAX_WEIGHT_ROUNDING, the given numbers less their largest: the same softmax, and
    float32 holds numbers up to 0 finely enough that it moves by at most about 2e-8. Weights that
    round well stay as they are, so their mixes' bits do not change."""
    exact = torch.tensor(given, dtype=torch.float64)
    moved = float((torch.softmax(exact, 0) - torch.softmax(weights.double(), 0)).abs().max())
    return weights if moved <= MAX_WEIGHT_ROUNDING else (exact - exact.max()).float()


def _weights_tensor(initial_weights: Iterable[float]) -> tuple[list[Any], torch.Tensor]:
    """`initial_weights` listed, once: an iterator (map(float, ...)) read again was empty, and
    failed in _float32_weights on "The size of tensor a (0) must match ..."; and as float32 weights.
    A TypeError names initial_weights unless it holds numbers: a str failed in torch on "too many
    dimensions 'str'", [None, ...] on "must be real number, not NoneType" and a number on "'int'
    object is not iterable"."""
    try:
        given = list(initial_weights)
        try:
            return given, torch.tensor(given, dtype=torch.float32)
        except OverflowError:  # see _float32_scalar
            return given, torch.full((len(given),), math.inf)
    except (TypeError, ValueError):
        raise TypeError(f"initial_weights must be a sequence of numbers, got {initial_weights!r:.80}") from None


def _float32_scalar(value: Any) -> torch.Tensor:
    """`value` in float32; an int past float64's range (10**400) raised OverflowError, naming
    nothing: it is infinite, which the mix refuses as it does any weight or gamma float32 cannot hold."""
    try:
        return torch.tensor(float(value))
    except OverflowError:
        return torch.tensor(math.inf)


def layer_norm_per_token(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(biased variance + LAYER_NORM_EPS) over the last axis, without a scale or shift."""
    return F.layer_norm(x, x.shape[-1:], eps=LAYER_NORM_EPS)


def check_layers(layers: object) -> None:
    """A TypeError unless `layers` is one floating-point tensor (L+1, ..., D): `embed`'s whole
    result or a list of layers (what AllenNLP's ScalarMix took) failed on "object has no attribute
    'shape'", and integer layers were mixed with weights cast to 0."""
    if isinstance(getattr(layers, "layers", None), torch.Tensor):  # an Embeddings, or a result like it
        raise TypeError("a mix takes the layers tensor, got embed's whole result: give it its .layers")
    if isinstance(layers, (list, tuple)):
        raise TypeError(f"a mix takes the layers as one tensor (L+1, ..., D), got a {type(layers).__name__} of "
                        f"{len(layers)}: torch.stack them first")
    if not isinstance(layers, torch.Tensor):
        raise TypeError(f"a mix takes the layers as one tensor (L+1, ..., D), got a {type(layers).__name__}")
    if not layers.is_floating_point():
        raise TypeError(f"a mix takes floating-point layers, got {layers.dtype}")


class ScalarMix(nn.Module):
    """gamma * sum_j softmax(w)_j * h_j over `n_layers` layers: (L+1, ..., D) -> (..., D), in the
    layers' dtype. `initial_weights` are w before the softmax (default all 0: the average);
    `layer_norm` normalises each layer per token (over D) first; `trainable` makes w and gamma
    parameters that learn; `l2_penalty()` is `l2_lambda` * ||w||^2."""

    def __init__(
        self, n_layers: int, layer_norm: bool = False, initial_weights: Iterable[float] | None = None,
        gamma: float = 1.0, trainable: bool = True, l2_lambda: float = 0.0,
    ) -> None:
        super().__init__()
        check_layer_count(n_layers)
        # layer_norm="no" is true: it normalised; trainable="no" failed inside torch's Parameter
        check_bools(layer_norm=layer_norm, trainable=trainable)
        check_numbers(gamma=gamma, l2_lambda=l2_lambda)
        given, weights = ([0.0] * n_layers, torch.zeros(n_layers)) if initial_weights is None else \
            _weights_tensor(initial_weights)
        if weights.shape != (n_layers,):
            raise ValueError(f"expected {n_layers} mix weights, got {tuple(weights.shape)}")
        gamma_value = _float32_scalar(gamma)  # float32, as the weights: checked after the conversion
        if not (bool(torch.isfinite(weights).all()) and bool(torch.isfinite(gamma_value))):
            raise ValueError(f"mix weights and gamma must be finite in float32, got {given} and {gamma}")  # not inf
        if abs(float(gamma_value)) > MAX_GAMMA:  # the bound a mix file's gamma has (MixSpec)
            raise ValueError(f"gamma must be from {-MAX_GAMMA:g} to {MAX_GAMMA:g}, got {gamma}")
        if initial_weights is not None:
            weights = _float32_weights(given, weights)
        self.layer_norm = layer_norm
        # probe's --l2 bound: a NaN, infinite or negative lambda made a NaN or rewarding penalty, silently
        if not 0 <= l2_lambda <= FLOAT32_MAX:
            raise ValueError(f"l2_lambda must be >= 0 and at most {FLOAT32_MAX:.4g}, got {l2_lambda}")
        self.l2_lambda = float(l2_lambda)  # a 0-d numpy array times a tensor fails in numpy
        self.weights = nn.Parameter(weights, requires_grad=trainable)
        self.gamma = nn.Parameter(gamma_value, requires_grad=trainable)

    @classmethod
    def from_spec(cls, spec: MixSpec, trainable: bool = False) -> "ScalarMix":
        """The mix of `spec`'s weights, gamma and layer_norm; `trainable` as the class's."""
        check_spec(spec, "spec")
        return cls(len(spec.weights), spec.layer_norm, spec.weights, spec.gamma, trainable)

    def to_spec(self) -> MixSpec:
        """The mix as a MixSpec, which `dump_mix_specs` writes as a mix file."""
        return MixSpec(tuple(float(w) for w in self.weights.detach().cpu()), float(self.gamma.detach()), self.layer_norm)

    def normalized_weights(self) -> torch.Tensor:
        """softmax(w): each layer's share of the mix."""
        return torch.softmax(self.weights, dim=0)

    def l2_penalty(self) -> torch.Tensor:
        """lambda * ||w||^2 on the weights before the softmax, as in the paper."""
        return self.l2_lambda * (self.weights ** 2).sum()

    def forward(self, layers: torch.Tensor) -> torch.Tensor:
        """`layers` (L+1, ..., D) mixed into (..., D), in their dtype."""
        check_layers(layers)
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
