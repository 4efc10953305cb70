import json
import math
import re

import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM, CarriedState, ScalarMix
from elmo_pipeline.model.lstm import LstmState
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


def test_a_large_capacity_costs_memory_only_as_words_are_kept():
    """A list of every free row and a (capacity, P) table were made up front: --cache-size 3e7
    took 2.3 GB to embed two words. Rows now grow by doubling; values stay exact across growth and
    eviction."""
    import tracemalloc

    tracemalloc.start()
    cache = WordCache(capacity=30_000_000)
    assert tracemalloc.get_traced_memory()[1] < 1_000_000
    tracemalloc.stop()

    def compute(words):
        return torch.tensor([[float(int(w)), -float(int(w))] for w in words])

    for start in range(0, 3000, 500):
        words = [str(i) for i in range(start, start + 500)]
        assert torch.equal(cache.lookup(words, compute, ("cpu",)), compute(words))
    assert cache.table.shape[0] == 4096 and len(cache) == 3000
    everything = [str(i) for i in range(3000)]
    assert torch.equal(cache.lookup(everything, compute, ("cpu",)), compute(everything))
    assert cache.hits == 3000
    small = WordCache(capacity=1500)  # growth stops at the capacity; eviction reuses rows
    for start in range(0, 3000, 500):
        words = [str(i) for i in range(start, start + 500)]
        assert torch.equal(small.lookup(words, compute, ("cpu",)), compute(words))
    assert small.table.shape[0] == 1500 and len(small) == 1500
    assert torch.equal(small.lookup(everything[-1500:], compute, ("cpu",)), compute(everything[-1500:]))


def test_words_longer_than_the_key_bound_are_computed_not_kept():
    # keys were whole words: 1,000 tokens of 131,072 characters held 125 Mi characters
    from elmo_pipeline.model.word_cache import MAX_CACHED_CHARS

    cache, calls = WordCache(capacity=10), []

    def compute(words):
        calls.append(list(words))
        return torch.tensor([[float(len(w))] for w in words])

    long, edge = "x" * (MAX_CACHED_CHARS + 1), "y" * MAX_CACHED_CHARS
    for _ in range(2):
        assert cache.lookup(["a", long, edge], compute, ("cpu",))[:, 0].tolist() == [1.0, len(long), len(edge)]
    assert calls == [["a", long, edge], [long]] and len(cache) == 2


def test_a_cache_size_that_is_no_count_is_named_when_the_model_is_built():
    """BiLM.from_pretrained(cache_size=5.5) loaded, and its first batch whose words fit the cache
    failed deep in torch ("new_empty() takes 1 positional argument but 2 were given"); "10" failed
    on "'<' not supported between instances of 'str' and 'int'", and -1 was "cache capacity"."""
    for value in (5.5, "10", True, None):
        with pytest.raises(TypeError, match=re.escape(f"cache_size must be an int, got {value!r}")):
            BiLM.from_pretrained(cache_size=value)
    with pytest.raises(ValueError, match=re.escape("cache_size must be >= 0, got -1")):
        BiLM.from_pretrained(cache_size=-1)
    sentences = [["a", "rose", "is", "a", "rose"]]
    model = BiLM.from_pretrained(cache_size=np.int64(24)).eval()
    with torch.inference_mode():
        cached = model.embed(sentences).layers
        assert len(model.word_cache) == 5  # <S>, a, rose, is, </S>
        assert torch.equal(cached, BiLM.from_pretrained(cache_size=0).eval().embed(sentences).layers)


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
    # zeros and tiny values on top of large lower layers: a weight of exp(-100) (a denormal in
    # float32, not 0) left to a lower layer shows here, where it rounded away beside values near 1
    wide = layers.clone()
    wide[:2] *= 1e30
    wide[2, 0], wide[2, 1] = 0.0, 1e-30
    assert torch.equal(top(wide), wide[2])
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


def test_an_initial_state_not_of_the_sentences_or_the_model_is_refused(reference_model):
    a, b = ["one", "two", "three"], ["four", "five"]
    weight = reference_model.token_encoder.projection.weight
    carried = CarriedState(reference_model)
    with torch.no_grad():
        carried.embed([a, b])
        state = carried.state  # (2, 2, 2, 16) and (2, 2, 2, 64): two rows
        want = reference_model.embed([a, b], state).layers
        assert (want - reference_model.embed([a, b]).layers).abs().max() > 1e-4  # the state matters
        one_row = LstmState(state.h[:, :, :1], state.c[:, :, :1])
        # was embedded with a zero state for b (and a 3-row state's last row dropped), no error
        with pytest.raises(ValueError, match=r"state.h has shape \(2, 2, 1, 16\); 2 sentences with this model need "
                                             r"\(2, 2, 2, 16\)"):
            reference_model.embed([a, b], one_row)
        with pytest.raises(ValueError, match=r"state.c has shape \(2, 2, 3, 64\)"):
            reference_model.embed([a, b], reference_model.lstm.zero_state(3, weight)._replace(h=state.h))
        with pytest.raises(ValueError, match=r"state.h has shape \(2, 2, 2, 128\)"):  # another model's: a bmm error
            reference_model.embed([a, b], (torch.zeros(2, 2, 2, 128), state.c))
        assert torch.equal(reference_model.embed([a, b], (state.h, state.c)).layers, want)  # a plain tuple too


def test_an_initial_state_of_another_dtype_device_or_kind_is_refused(reference_model):
    """A float64 state (numpy's default) ran the LSTM cells in float64: the float32 outputs moved
    (the default model, a zero state, one 40-token sentence: 16,585 of 30,720 values, by up to
    1.4e-6); a str, a dict or one tensor failed on "'str' object has no attribute 'shape'" or
    said "state.h has shape ()"."""
    sentences = [["one", "two", "three"], ["four", "five"]]
    weight = reference_model.token_encoder.projection.weight
    zero = reference_model.lstm.zero_state(2, weight)
    with torch.no_grad():
        assert torch.equal(reference_model.embed(sentences, zero).layers, reference_model.embed(sentences).layers)
        for state, name, what in (((zero.h.double(), zero.c), "h", "torch.float64 on cpu"),
                                  ((zero.h, zero.c.to("meta")), "c", "torch.float32 on meta")):
            with pytest.raises(ValueError, match=re.escape(f"state.{name} is {what}; this model's state is "
                                                           "torch.float32 on cpu")):
                reference_model.embed(sentences, state)
        for state in ("state", {"h": zero.h, "c": zero.c}, zero.h, (zero.h,), (zero.h.numpy(), zero.c.numpy())):
            with pytest.raises(TypeError, match=r"^state is \(h, c\), two tensors \(an LstmState, as CarriedState "
                                                r"keeps\), got "):
                reference_model.embed(sentences, state)


def test_carried_state_goes_on_when_the_grad_mode_changes(reference_model):
    # a smaller batch wrote into the state tensors, which refuse writes outside inference_mode
    # when made inside it: RuntimeError "Inplace update to inference tensor outside InferenceMode"
    a, b, c = ["one", "two", "three"], ["four", "five"], ["six"]
    mixed, plain = CarriedState(reference_model), CarriedState(reference_model)
    with torch.inference_mode():
        mixed.embed([a, b])
    with torch.no_grad():
        plain.embed([a, b])
        results = [(mixed.embed(batch).layers, plain.embed(batch).layers) for batch in ([c], [a, b])]
    for got, want in results:
        assert torch.equal(got, want)


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
    # an iterator was used up by the check and embedded as an empty sentence; a set's order
    # changes with the hash seed; a dict gave its keys
    ([["a"], map(str.lower, ["The", "Bank"])], "sentence 1 is a map, not a sequence of token strings"),
    ([(t for t in ["a"])], "sentence 0 is a generator, not a sequence"),
    ([{"the", "bank"}], "sentence 0 is a set, not a sequence"),
    ([{"the": 1}], "sentence 0 is a dict, not a sequence"),
    ([None], "sentence 0 is a NoneType, not a sequence"),
    # the list of sentences itself: a generator failed on len(), a set embedded in hash order
    ((s for s in [["a"]]), "embed takes a list of sentences (each a list of token strings), got a generator"),
    ({("a", "b"), ("c",)}, "got a set: pass list(...) of it, in sentence order"),
    ("The bank", "got a str"),
])
def test_embed_refuses_what_is_not_a_list_of_token_strings(reference_model, sentences, says):
    with pytest.raises(TypeError, match=re.escape(says)):
        reference_model.embed(sentences)


def test_embed_refuses_an_empty_or_blank_token_as_the_commands_do(reference_model):
    """"a  b".split(" ") gives ['a', '', 'b']: the '' was embedded as a word of no text, one more
    token than the sentence holds (embed-file --tab-separated and PretokenizedSentences refuse such
    a token, and spaCy's are dropped)."""
    for sentences, k, token in (([["The", "bank", "", "rose"]], 2, ""), ([["a"], ["b", " "]], 1, " "),
                                ([["a"], ["\u3000", "b"]], 0, "\u3000"), ([["a", "\t\n"]], 1, "\t\n")):
        i = len(sentences) - 1
        with pytest.raises(ValueError, match=re.escape(f"sentence {i} has an empty or blank token, its token {k} "
                                                       f"({token!r}); tokens hold text: split on any whitespace "
                                                       "with str.split(), not split(' ')")):
            reference_model.embed(sentences)
    with torch.inference_mode():  # a token holding a space in its text is one (tab-separated input's may)
        out = reference_model.embed([["New York", "rose"], "The  bank".split()])
    assert out.lengths == [2, 2]


def test_a_mix_of_no_layers_or_non_finite_numbers_is_refused_when_built():
    from elmo_pipeline.downstream.mix import TrainableMix
    from elmo_pipeline.strict import ConfigError

    for build in (lambda: ScalarMix(0), lambda: TrainableMix(0)):
        with pytest.raises(ValueError, match="a mix needs at least one layer, got 0"):
            build()
    for name in ("top", "average"):
        with pytest.raises(ConfigError, match="a mix needs at least one layer, got 0"):
            MixSpec.preset(name, 0)
    with pytest.raises(ValueError,
                       match=r"mix weights and gamma must be finite in float32, got \[0\.0, nan\] and 1\.0"):
        ScalarMix(2, initial_weights=[0.0, math.nan])
    with pytest.raises(ValueError, match="must be finite"):
        ScalarMix(2, gamma=math.inf)
    # finite as a Python float, inf as the float32 it is stored in: every mixed vector was inf
    with pytest.raises(ValueError, match=r"must be finite in float32, got \[0\.0, 0\.0, 0\.0\] and 1e\+39"):
        ScalarMix(3, gamma=1e39)
    with pytest.raises(ValueError, match=r"gamma must be from -10000 to 10000, got 20000\.0"):
        ScalarMix(3, gamma=20000.0)
    assert ScalarMix(3, gamma=-10000.0).to_spec().gamma == -10000.0  # the bound itself is a mix file's too
    assert MixSpec.preset("top", 1).weights == (0.0,)


def test_carried_state_names_a_model_that_is_not_one_when_built(reference_model):
    """CarriedState(None) or of a path was built, and its first embed failed with "'NoneType' object
    has no attribute 'token_encoder'"."""
    for model in (None, "my-model/", torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=re.escape(f"CarriedState carries the state of a BiLM, got "
                                                      f"{type(model).__name__} ({model!r:.80})")):
            CarriedState(model)
    sentences = [["The", "bank", "rose"], ["Prices", "fell"]]
    with torch.inference_mode():
        carried = CarriedState(reference_model)
        first = carried.embed(sentences)
        assert torch.equal(first.layers, reference_model.embed(sentences).layers)  # a zero state at first
        assert not torch.equal(carried.embed(sentences).layers, first.layers)  # then the carried one


def test_a_mix_whose_layer_count_is_not_an_int_is_named_when_built():
    """ScalarMix(2.5) failed in torch.zeros ("argument 'size' (position 1) must be tuple of ints, not
    float") and ScalarMix("3") in a comparison ("'<' not supported"), neither naming n_layers; so did
    MixSpec.preset("average", 2.5) ("can't multiply sequence by non-int of type 'float'")."""
    from elmo_pipeline.downstream.mix import TrainableMix

    for value in (2.5, "3", True, None):
        for build in (ScalarMix, TrainableMix, lambda n: MixSpec.preset("average", n),
                      lambda n: MixSpec.preset("top", n)):  # the presets failed in a product or a comparison
            with pytest.raises(TypeError, match=re.escape(f"n_layers must be an int, got {value!r}")):
                build(value)
    layers = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)
    torch.testing.assert_close(ScalarMix(np.int64(3))(layers), layers.mean(0), rtol=0, atol=1e-6)


def test_a_mix_s_switches_and_numbers_of_another_type_are_named_when_built():
    """ScalarMix(3, layer_norm="no") normalised the layers (a str is true) and TrainableMix's
    bool("no") did the same; trainable="no" failed inside torch's Parameter ("argument 'require_grad'
    must be bool, not str"); gamma=None in float() and l2_lambda="x" at l2_penalty, naming none."""
    from elmo_pipeline.downstream.mix import TrainableMix

    layers = torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    for build, name, value in ((lambda v: ScalarMix(3, layer_norm=v), "layer_norm", "no"),
                               (lambda v: ScalarMix(3, layer_norm=v), "layer_norm", np.bool_(False)),
                               (lambda v: TrainableMix(3, layer_norm=v), "layer_norm", "no"),
                               (lambda v: ScalarMix(3, trainable=v), "trainable", "no")):
        with pytest.raises(TypeError, match=re.escape(f"{name} must be a bool, got {value!r}")):
            build(value)
    for build, name, value in ((lambda v: ScalarMix(3, gamma=v), "gamma", None),
                               (lambda v: ScalarMix(3, gamma=v), "gamma", "1.5"),
                               (lambda v: ScalarMix(3, l2_lambda=v), "l2_lambda", "x"),
                               (lambda v: TrainableMix(3, l2_lambda=v), "l2_lambda", True),
                               (lambda v: TrainableMix(3, dropout=v), "dropout", "0.1")):
        with pytest.raises(TypeError, match=re.escape(f"{name} must be a number, got {value!r}")):
            build(value)
    # what they take: False is the plain average, True each token normalised, None the spec's (off)
    torch.testing.assert_close(ScalarMix(3, layer_norm=False)(layers), layers.mean(0), rtol=0, atol=1e-6)
    assert not torch.allclose(ScalarMix(3, layer_norm=True)(layers), layers.mean(0))
    assert TrainableMix(3, layer_norm=None).mix.layer_norm is False
    assert ScalarMix(3, gamma=np.float32(2.0), l2_lambda=1).to_spec().gamma == 2.0


def test_a_mix_s_numbers_may_be_0_d_tensors_or_arrays_as_a_trained_mix_holds_them():
    """d68c216 refused ScalarMix(3, gamma=trained.gamma) ("gamma must be a number, got Parameter
    containing: ...") and every 0-d tensor or array as gamma, l2_lambda or dropout, which 83a31d1
    took: a trained mix copied by its parameters, initial_weights=trained.weights taken all along."""
    from elmo_pipeline.downstream.mix import TrainableMix

    layers = torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    trained = ScalarMix(3, initial_weights=[0.3, -0.2, 0.9], gamma=1.7, l2_lambda=0.5)
    copies = (ScalarMix(3, initial_weights=trained.weights.detach(), gamma=trained.gamma, l2_lambda=torch.tensor(0.5)),
              ScalarMix(3, initial_weights=np.array([0.3, -0.2, 0.9]), gamma=np.array(1.7), l2_lambda=np.array(0.5)))
    with torch.no_grad():
        for copy in copies:
            assert copy.to_spec() == trained.to_spec()
            assert torch.equal(copy(layers), trained(layers)) and torch.equal(copy.l2_penalty(), trained.l2_penalty())
    plain, given = TrainableMix(3, dropout=0.5), TrainableMix(3, dropout=torch.tensor(0.5), l2_lambda=np.array(0.001))
    torch.manual_seed(1)
    dropped = plain(layers)
    torch.manual_seed(1)
    assert torch.equal(given(layers), dropped) and torch.equal(given.penalty(), plain.penalty())
    # a tensor of more than no dimension, or of bools or complex numbers, is no number
    for value in (torch.tensor([1.7]), torch.tensor(True), np.array(True), np.array(1 + 2j)):
        with pytest.raises(TypeError, match=re.escape(f"gamma must be a number, got {value!r}")):
            ScalarMix(3, gamma=value)


def test_initial_weights_that_are_no_numbers_are_named():
    """ScalarMix(3, initial_weights="abc") failed in torch on "too many dimensions 'str'", [None] * 3
    on "must be real number, not NoneType" and 5 on "'int' object is not iterable"."""
    for value in ("abc", [None] * 3, 5, ["0.5", "1", "2"]):
        with pytest.raises(TypeError, match=re.escape(f"initial_weights must be a sequence of numbers, got {value!r}")):
            ScalarMix(3, initial_weights=value)
    for value in ([0.5, -1.0, 2.0], (0.5, -1, 2), np.array([0.5, -1.0, 2.0]), torch.tensor([0.5, -1.0, 2.0])):
        assert ScalarMix(3, initial_weights=value).to_spec().weights == (0.5, -1.0, 2.0)


def test_a_mix_s_l2_lambda_outside_probe_s_l2_bound_is_named_when_built():
    """ScalarMix(3, l2_lambda=nan) and TrainableMix's took a NaN, infinite or negative lambda, which
    probe's --l2 refuses: penalty() was NaN (the task loss with it) or -lambda * ||w||^2, which
    rewards weights that move apart, with no error."""
    from elmo_pipeline.downstream.mix import TrainableMix

    for value in (math.nan, math.inf, -0.5, 1e39, 10**400, torch.tensor(math.nan), np.array(-1.0)):
        for build in (ScalarMix, TrainableMix):
            with pytest.raises(ValueError, match=re.escape(f"l2_lambda must be >= 0 and at most 3.403e+38, got {value}")):
                build(3, l2_lambda=value)
    weights = torch.tensor([0.5, -1.0, 2.0])
    for value in (0, 0.001, 1, torch.tensor(0.5), 3.4028234663852886e38):
        mix = ScalarMix(3, initial_weights=weights, l2_lambda=value)
        assert torch.equal(mix.l2_penalty(), float(value) * (weights ** 2).sum())


def test_a_trainable_mix_s_dropout_outside_probe_s_bound_is_named_when_built():
    """TrainableMix(3, dropout=nan) passed nn.Dropout's check and failed at its first call in
    training ("dropout probability has to be between 0 and 1, but got nan"), and dropout=1 zeroed
    every vector, with no error; probe's --dropout refuses both."""
    from elmo_pipeline.downstream.mix import TrainableMix

    for value in (math.nan, 1, 1.5, -0.5, 10**400, torch.tensor(math.nan)):
        with pytest.raises(ValueError, match=re.escape(f"dropout must be in [0, 1), got {value}")):
            TrainableMix(3, dropout=value)
    layers = torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    for value in (0, 0.5, np.array(0.5)):
        mix = TrainableMix(3, dropout=value)
        torch.manual_seed(1)
        dropped = mix(layers)
        torch.manual_seed(1)
        assert torch.equal(dropped, torch.nn.functional.dropout(mix.mix(layers), float(value)))


def test_an_int_weight_or_gamma_past_float64_s_range_is_refused_as_not_finite():
    """ScalarMix(3, initial_weights=[10**400, 0, 0]) and gamma=10**400 failed on "int too large to
    convert to float" (an OverflowError inside torch or float()), where 1e39 is refused naming both."""
    for kw, shown in ((dict(initial_weights=[10**400, 0, 0]), f"[{10**400}, 0, 0] and 1.0"),
                      (dict(initial_weights=(0, -10**400, 0)), f"[0, {-10**400}, 0] and 1.0"),
                      (dict(gamma=10**400), f"[0.0, 0.0, 0.0] and {10**400}"),
                      (dict(initial_weights=[1e39, 0, 0]), "[1e+39, 0, 0] and 1.0")):
        with pytest.raises(ValueError, match=re.escape(f"mix weights and gamma must be finite in float32, got {shown}")):
            ScalarMix(3, **kw)
    with pytest.raises(ValueError, match=re.escape("expected 3 mix weights, got (1,)")):
        ScalarMix(3, initial_weights=[10**400])


def test_initial_weights_given_as_an_iterator_make_the_mix_they_hold():
    """initial_weights=map(float, ...) (or a generator) was listed twice, and empty the second time:
    "The size of tensor a (0) must match the size of tensor b (3)"."""
    layers = torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    listed = ScalarMix(3, initial_weights=[0.5, -1.0, 2.0])
    for given in (map(float, "0.5 -1 2".split()), (w for w in (0.5, -1.0, 2.0))):
        mix = ScalarMix(3, initial_weights=given)
        assert mix.to_spec() == listed.to_spec()
        with torch.no_grad():
            assert torch.equal(mix(layers), listed(layers))
    # weights whose softmax float32 moves (2^24 and 2^24 + 1) are shifted from the same numbers
    assert ScalarMix(2, initial_weights=iter([2.0**24, 2.0**24 + 1])).to_spec().weights == (-1.0, 0.0)


def test_a_mix_made_from_what_is_not_a_mixspec_says_how_to_read_one():
    """ScalarMix.from_spec and TrainableMix(initial=...) given a mix file's dict (json.load) or a
    preset's name failed on "'dict' object has no attribute 'weights'" (MixLayers named it)."""
    from elmo_pipeline.downstream.mix import TrainableMix

    read = load_mix_specs('{"syntax": {"weights": [0.5, -1.0, 2.0], "gamma": 1.5}}', "mixes.json")
    for build, name in ((ScalarMix.from_spec, "spec"), (lambda v: TrainableMix(3, initial=v), "initial")):
        for value in ({"weights": [0.5, -1.0, 2.0], "gamma": 1.5}, "average"):
            with pytest.raises(TypeError, match=re.escape(f"{name} is a {type(value).__name__}, not a MixSpec (read a "
                                                          "mix file with elmo_pipeline.model.scalar_mix.load_mix_specs(")):
                build(value)
    assert ScalarMix.from_spec(read["syntax"]).to_spec() == read["syntax"]
    assert TrainableMix(3, initial=read["syntax"]).to_spec() == read["syntax"]


def test_the_way_a_mix_refusal_gives_to_read_a_mix_file_reads_it(tmp_path):
    """A mix that is no MixSpec was refused saying "read a mix file with ...load_mix_specs", which
    had no doc and takes the file's text: given the file's path, as the message read, it said
    "mixes.json: not valid JSON (Expecting value: line 1 column 1 (char 0))" of a valid file."""
    path = tmp_path / "mixes.json"
    path.write_text(dump_mix_specs({"syntax": MixSpec((0.5, -1.0, 2.0), 1.5)}))
    with pytest.raises(TypeError) as refused:
        ScalarMix.from_spec(json.loads(path.read_text())["syntax"])
    assert str(refused.value).endswith("load_mix_specs(text, where): the file's text, not its path, and its name for "
                                       "errors)")
    assert load_mix_specs(path.read_text(), str(path)) == {"syntax": MixSpec((0.5, -1.0, 2.0), 1.5)}
    assert "`text`, the file's content (not its path" in load_mix_specs.__doc__ and "`where`" in load_mix_specs.__doc__
    assert "`load_mix_specs` reads back" in dump_mix_specs.__doc__


def test_a_mix_called_on_what_is_not_one_tensor_of_layers_says_what_it_takes(reference_model):
    """A mix called on embed's whole result, or on a list of layers (what AllenNLP's ScalarMix
    took), failed on "'Embeddings' object has no attribute 'shape'" ('list' likewise); integer
    layers were mixed with weights cast to 0 (all zeros, no error)."""
    from elmo_pipeline.downstream.mix import TrainableMix

    with torch.no_grad():
        out = reference_model.embed([["The", "bank", "rose"], ["Prices", "fell"]])
    for mix in (ScalarMix(3), TrainableMix(3).eval()):
        with pytest.raises(TypeError, match=r"got embed's whole result: give it its \.layers$"):
            mix(out)
        with pytest.raises(TypeError, match=r"got a list of 3: torch\.stack them first$"):
            mix(list(out.layers))
        with pytest.raises(TypeError, match=r"takes floating-point layers, got torch\.int64$"):
            mix(torch.ones(3, 2, 4, dtype=torch.int64))
        with pytest.raises(TypeError, match=r"got a ndarray$"):
            mix(out.layers.numpy())
        assert torch.equal(mix(torch.stack(list(out.layers))), mix(out.layers))
    torch.testing.assert_close(ScalarMix(3)(out.layers), out.layers.mean(0), rtol=0, atol=1e-6)


@pytest.fixture
def default_model_copy():
    """The embedded model, loaded for one test (these tests edit its weights)."""
    return BiLM.from_pretrained().eval()


def _words_batch():
    return [["a", "rose", "is", "a", "rose"], ["is", "a", "rose"]]


def test_a_replaced_parameter_never_meets_the_old_ones_table(default_model_copy):
    """The table's key holds the weights it was made with: a parameter freed and another made at
    its address (with version 0 again) used to be served the freed one's vectors."""
    model, batch = default_model_copy, _words_batch()
    weight = model.token_encoder.projection.weight.detach().clone()
    encoder = model.token_encoder.projection
    for trial in range(6):
        encoder.weight = torch.nn.Parameter(weight * 1.0)  # A: a tensor of its own
        with torch.no_grad():
            model.embed(batch)  # the table is keyed on A
        encoder.weight = torch.nn.Parameter(weight * 2.0)  # B: A is freed
        encoder.weight = torch.nn.Parameter(weight * 3.0)  # C, made while B lives: often where A was
        with torch.no_grad():
            served = model.embed(batch).layers
            model.clear_cache()
            computed = model.embed(batch).layers
        assert torch.equal(served, computed), trial


def test_load_state_dict_into_inference_tensors_empties_the_cache():
    """A model built under inference_mode has parameters without version counters: the load
    itself clears the caches."""
    batch = _words_batch()
    with torch.inference_mode():
        model = BiLM.from_pretrained().eval()
        other = {k: v * 2 if k.startswith("token_encoder.") else v for k, v in model.state_dict().items()}
        before = model.embed(batch).layers
        model.load_state_dict(other)
        served = model.embed(batch).layers
        model.clear_cache()
        computed = model.embed(batch).layers
    assert model.token_encoder.projection.weight.is_inference()
    assert torch.equal(served, computed) and not torch.equal(served, before)


def test_a_model_loaded_under_inference_mode_says_so_when_gradients_are_on():
    batch = _words_batch()
    with torch.inference_mode():
        model = BiLM.from_pretrained().eval()
        want = model.embed(batch).layers
    # was torch's "Inference tensors cannot be saved for backward" from inside the char CNN
    with pytest.raises(RuntimeError, match="made under torch.inference_mode, and gradients are on: embed under "
                                           r"torch.no_grad\(\)"):
        model.embed(batch)
    with torch.no_grad():
        assert torch.equal(model.embed(batch).layers, want)
    model.requires_grad_(False)  # frozen: nothing to record, so gradient mode runs it
    assert torch.equal(model.embed(batch).layers, want)


def test_clear_cache_after_data_edits_reaches_the_word_cache_and_the_bf16_casts(default_model_copy):
    model, batch = default_model_copy, _words_batch()
    truth = BiLM.from_pretrained().eval()
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)  # entered afresh each time: torch's own cast cache lasts
    with torch.no_grad(), bf16:                          # until the outermost autocast block ends
        before = model.embed(batch).layers
    model.token_encoder.projection.weight.data.mul_(2)  # .data moves no version counter
    model.lstm.layers[0].recurrent_weight.data.mul_(0.5)
    model.clear_cache()
    truth.load_state_dict(model.state_dict())
    with torch.no_grad(), bf16:
        after = model.embed(batch).layers
        expected = truth.embed(batch).layers
    assert torch.equal(after, expected) and not torch.equal(after, before)


def test_a_model_copies_with_an_empty_cache_of_its_own(default_model_copy):
    import copy
    import io

    from torch.optim.swa_utils import AveragedModel

    model, batch = default_model_copy, _words_batch()
    with torch.no_grad():
        expected = model.embed(batch).layers
    assert len(model.word_cache) > 0
    twin = copy.deepcopy(model)
    assert len(twin.word_cache) == 0 and twin.word_cache.capacity == model.word_cache.capacity
    assert twin.word_cache._lock is not model.word_cache._lock
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a whole module, as users of torch.save do (loading it would unpickle: not ours)
    assert buffer.tell() > 0
    averaged = AveragedModel(model)
    with torch.no_grad():
        assert torch.equal(twin.embed(batch).layers, expected)
        assert torch.equal(averaged.module.embed(batch).layers, expected)
    assert twin.word_cache.misses > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_model_embeds_with_gradients_on_as_with_them_off(dtype):
    model = BiLM.from_pretrained().to(dtype).eval()
    batch = [["The", "bank", "rose", "sharply", "."], ["A", "b"]]
    with torch.no_grad():
        without = model.embed(batch).layers.float()
    tracked = model.embed(batch).layers  # the reference recurrence: the state is float32, the weights not
    assert tracked.dtype == dtype and tracked.requires_grad
    tracked.float().sum().backward()
    assert model.lstm.layers[0].recurrent_weight.grad is not None
    # the two paths round in other places: within the dtype's own precision of each other
    tolerance = {torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    assert (tracked.detach().float() - without).abs().max() < tolerance


def test_carried_state_names_a_list_of_sentences_that_is_not_one(reference_model):
    # a generator or an iterator failed on len(), "object of type 'generator' has no len()", where
    # embed itself says what to pass; the state is left as it was
    carried = CarriedState(reference_model)
    with torch.no_grad():
        carried.embed([["one", "two"]])
        before = carried.state
        for bad in ((s for s in [["a"]]), iter([["a"]])):
            with pytest.raises(TypeError, match=r"^embed takes a list of sentences \(each a list of token strings\), "
                                                rf"got a {type(bad).__name__}: pass list\(\.\.\.\) of it"):
                carried.embed(bad)
        assert carried.state is before
