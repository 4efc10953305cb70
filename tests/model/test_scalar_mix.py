"""Mix files parsed strictly with exact messages; the per-token layer norm against its formula."""

from __future__ import annotations

import pytest
import torch

from elmo_pipeline.strict import ConfigError
from elmo_pipeline.model.scalar_mix import LAYER_NORM_EPS, MixSpec, layer_norm_per_token, load_mix_specs


@pytest.mark.parametrize("text, message", [
    ('{"m": {"weights": [1, 2], "gama": 1}}',
     "mixes.json: m: unknown field(s) ['gama']; expected 'weights' with optional 'gamma', 'layer_norm' and "
     "'layers_sha256'"),
    ('{"m": {"gamma": 1}}',
     "mixes.json: m: missing field(s) ['weights']; expected 'weights' with optional 'gamma', 'layer_norm' and "
     "'layers_sha256'"),
    ('{"m": {"weights": [1, true]}}',
     "mixes.json: m.weights: expected a non-empty list of finite numbers, got [1, True]"),
    ('{"m": {"weights": []}}', "mixes.json: m.weights: expected a non-empty list of finite numbers, got []"),
    ('{"m": {"weights": [1], "gamma": "2"}}',
     "mixes.json: m.gamma: expected a finite number from -10000 to 10000, got '2'"),
    ('{"m": {"weights": [1], "gamma": 30000}}',  # would overflow float16 for any value past 2.2
     "mixes.json: m.gamma: expected a finite number from -10000 to 10000, got 30000"),
    ('{"m": {"weights": [1], "gamma": -1e40}}',  # would overflow even float32
     "mixes.json: m.gamma: expected a finite number from -10000 to 10000, got -1e+40"),
    ('{"m": {"weights": [1], "layer_norm": 0}}', "mixes.json: m.layer_norm: expected true or false, got 0"),
    ('[{"weights": [1]}]', "mixes.json: expected a JSON object, got list"),
    ("{}", "mixes.json: expected at least 1 item(s), got {}"),
])
def test_mix_file_refusals_name_the_file_and_the_field(text, message):
    with pytest.raises(ConfigError) as caught:
        load_mix_specs(text, "mixes.json")
    assert str(caught.value) == message


def test_mix_specs_are_positional_keyword_and_parsed_alike():
    parsed = load_mix_specs('{"a": {"weights": [1, -2.5], "gamma": 2, "layer_norm": true}}', "x.json")
    assert parsed == {"a": MixSpec((1.0, -2.5), 2.0, True)}
    assert parsed["a"] == MixSpec(weights=[1, -2.5], gamma=2, layer_norm=True)
    assert parsed["a"].to_dict() == {"weights": [1.0, -2.5], "gamma": 2.0, "layer_norm": True}
    with pytest.raises(ValueError, match="finite"):
        MixSpec((float("nan"),))


def _formula(x: torch.Tensor) -> torch.Tensor:
    """What layer_norm_per_token computed by hand before: biased variance, eps inside the root."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + LAYER_NORM_EPS)


@pytest.mark.parametrize("scale, shift", [(1.0, 0.0), (100.0, 5.0), (1e-3, 0.0)])
def test_layer_norm_per_token_is_the_formula(scale, shift):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, 1024, dtype=torch.float64) * scale + shift
    # float64: the same numbers up to rounding (measured 5e-15); float32: within a few ulps of
    # the exact float64 result (measured 7.6e-7 for values of order 1), as the hand formula was
    torch.testing.assert_close(layer_norm_per_token(x), _formula(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(layer_norm_per_token(x.float()).double(), _formula(x), rtol=0, atol=5e-6)
    assert layer_norm_per_token(torch.zeros(2, 8)).eq(0).all()  # a constant vector: 0, not NaN
