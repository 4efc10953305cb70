import math
import re

import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM, CarriedState, ScalarMix
from elmo_pipeline.model.scalar_mix import MixSpec, dump_mix_specs, load_mix_specs
from elmo_pipeline.model.word_cache import WordCache


def test_cached_and_uncached_outputs_are_equal(reference_model, elmo_fixture_dir):
    uncached = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(elmo_fixture_dir / "lm_weights.hdf5"),
                                  cache_size=0).eval()
    batch = [["a", "rose", "is", "a", "rose"], ["is", "a", "rose"]]
    with torch.no_grad():
        reference_model.embed(batch)  # warm the cache
        cached = reference_model.embed(batch).layers
        plain = uncached.embed(batch).layers
    np.testing.assert_allclose(cached, plain, atol=1e-6)
    assert reference_model.word_cache.hits > 0
    assert uncached.word_cache.hits == 0


def test_cache_is_bounded_and_evicts_least_recently_used():
    cache = WordCache(capacity=3)
    calls = []

    def compute(words):
        calls.append(list(words))
        return torch.tensor([[float(len(w)), float(ord(w[0]))] for w in words])

    key = ("cpu",)
    cache.lookup(["a", "bb", "ccc"], compute, key)
    cache.lookup(["a"], compute, key)  # "a" becomes the most recent
    out = cache.lookup(["dddd", "a"], compute, key)  # evicts "bb", the oldest
    assert len(cache) == 3
    assert calls[-1] == ["dddd"]
    assert out.tolist() == [[4.0, ord("d")], [1.0, ord("a")]]
    cache.lookup(["bb"], compute, key)
    assert calls[-1] == ["bb"]  # it was evicted, so computed again
    assert cache.lookup(["ccc", "dddd", "bb"], compute, key)[:, 0].tolist() == [3.0, 4.0, 2.0]
    assert calls[-1] == ["ccc"]  # "ccc" had become the oldest and was evicted for "bb"


def test_cache_is_dropped_when_training_starts(reference_model):
    with torch.no_grad():
        reference_model.embed([["warm"]])
    assert len(reference_model.word_cache) > 0
    reference_model.train()
    assert len(reference_model.word_cache) == 0
    reference_model.eval()


def test_scalar_mix_is_gamma_times_softmax_weighted_sum():
    layers = torch.randn(3, 2, 4, 6)
    mix = ScalarMix(3, initial_weights=[0.5, -1.0, 2.0], gamma=1.7)
    s = torch.softmax(torch.tensor([0.5, -1.0, 2.0]), 0)
    expected = 1.7 * (s[0] * layers[0] + s[1] * layers[1] + s[2] * layers[2])
    torch.testing.assert_close(mix(layers), expected)
    mix.l2_lambda = 0.01
    assert math.isclose(mix.l2_penalty().item(), 0.01 * (0.25 + 1 + 4), rel_tol=1e-6)


def test_top_preset_is_exactly_the_top_layer_and_average_is_the_mean():
    layers = torch.randn(3, 5, 8)
    top = ScalarMix.from_spec(MixSpec.preset("top", 3))
    assert torch.equal(top(layers), layers[2])
    avg = ScalarMix.from_spec(MixSpec.preset("average", 3))
    torch.testing.assert_close(avg(layers), layers.mean(0))


def test_layer_norm_is_per_token_so_a_token_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    alone = torch.randn(3, 1, 1, 8)
    batch = torch.cat([alone, 100 * torch.randn(3, 1, 1, 8)], dim=2)
    mix = ScalarMix(3, layer_norm=True)
    torch.testing.assert_close(mix(batch)[:, :1], mix(alone))
    normed = mix(alone)
    assert abs(float(normed.mean())) < 1e-5


def test_mix_spec_file_round_trip_and_strictness():
    specs = {"syntax": MixSpec((0.1, 2.0, -1.0), 0.5, True)}
    assert load_mix_specs(dump_mix_specs(specs), "x.json") == specs
    with pytest.raises(ValueError, match="weights"):
        load_mix_specs('{"m": {"weights": "abc"}}', "x.json")
    with pytest.raises(ValueError, match="gamma"):
        load_mix_specs('{"m": {"weights": [1], "gamma": "1"}}', "x.json")
    with pytest.raises(ValueError, match="NaN"):
        load_mix_specs('{"m": {"weights": [NaN]}}', "x.json")


def test_carried_state_follows_rows_across_batches(reference_model):
    a, b, c = ["one", "two", "three"], ["four", "five"], ["six"]
    carried = CarriedState(reference_model)
    with torch.no_grad():
        carried.embed([a, b])
        small = carried.embed([c]).layers  # row 0 continues from a
        third = carried.embed([a, b]).layers  # row 0 continues from c, row 1 still from b
        fresh = CarriedState(reference_model)
        fresh.embed([a, b])
        two_rows = fresh.embed([a, b]).layers
    zero = reference_model.embed([c]).layers
    assert (small - zero).abs().max() > 1e-4
    np.testing.assert_allclose(third[:, 1], two_rows[:, 1], atol=1e-6)  # row 1 was untouched by [c]
    assert (third[:, 0] - two_rows[:, 0]).abs().max() > 1e-5


def test_cache_filled_under_inference_mode_serves_no_grad_calls_too(elmo_fixture_dir):
    model = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(elmo_fixture_dir / "lm_weights.hdf5")).eval()
    with torch.inference_mode():
        first = model.embed([["a", "rose"]]).layers.clone()
    with torch.no_grad():  # a cache table made of inference tensors cannot be updated here
        again = model.embed([["a", "rose"]]).layers
    np.testing.assert_allclose(again, first, atol=1e-6)


def test_the_cache_follows_the_weights_when_they_change_in_eval_mode(reference_model, elmo_fixture_dir):
    """An optimizer step or load_state_dict on a model kept in eval mode: the cache must not
    serve the old weights' vectors (train() clears it, but neither of these calls train())."""
    options, weights = str(elmo_fixture_dir / "options.json"), str(elmo_fixture_dir / "lm_weights.hdf5")
    model = BiLM.from_allennlp(options, weights).eval()
    batch = [["a", "rose", "is", "a", "rose"]]
    with torch.no_grad():
        before = model.embed(batch).layers
        other = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(other)
        loaded = model.embed(batch).layers
        fresh = BiLM.from_allennlp(options, weights, cache_size=0).eval()
        fresh.load_state_dict(other)
        assert torch.equal(loaded, fresh.embed(batch).layers)
        assert not torch.equal(loaded[0], before[0])
        next(model.token_encoder.parameters()).mul_(2.0)  # as an optimizer's in-place step does
        fresh_param = next(fresh.token_encoder.parameters())
        fresh_param.mul_(2.0)
        assert torch.equal(model.embed(batch).layers, fresh.embed(batch).layers)


@pytest.mark.parametrize("sentences, says", [
    (["The bank rose", "Hello"], "sentence 0 is a str, not a list of token strings"),
    ([["a", None]], "sentence 0 has a token of type NoneType (None); tokens are strings"),
    ([["a"], [b"bytes"]], "sentence 1 has a token of type bytes"),
    ([["a"], b"ab"], "sentence 1 is a bytes"),
    ([["a", type("Word", (str,), {})("b"), 5]], "sentence 0 has a token of type int"),  # after a str subclass
])
def test_embed_refuses_what_is_not_a_list_of_token_strings(reference_model, sentences, says):
    with pytest.raises(TypeError, match=re.escape(says)):
        reference_model.embed(sentences)


def test_a_mix_of_no_layers_or_non_finite_numbers_is_refused_when_built():
    from elmo_pipeline.downstream.mix import TrainableMix
    from elmo_pipeline.strict import ConfigError

    for build in (lambda: ScalarMix(0), lambda: TrainableMix(0)):
        with pytest.raises(ValueError, match="a mix needs at least one layer, got 0"):
            build()
    for name in ("top", "average"):
        with pytest.raises(ConfigError, match="a mix needs at least one layer, got 0"):
            MixSpec.preset(name, 0)
    with pytest.raises(ValueError, match=r"mix weights and gamma must be finite, got \[0\.0, nan\] and 1\.0"):
        ScalarMix(2, initial_weights=[0.0, math.nan])
    with pytest.raises(ValueError, match="must be finite"):
        ScalarMix(2, gamma=math.inf)
    assert MixSpec.preset("top", 1).weights == (0.0,)
