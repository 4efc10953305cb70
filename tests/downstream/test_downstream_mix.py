"""TrainableMix (ScalarMix + dropout + L2) and the [x_k ; ELMo_k] helper."""

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.corpus.schema import OutputSpec, build_table
from elmo_pipeline.embedding.batch import apply_mixes, build_mixes
from elmo_pipeline.pipelines.extract import parse_mixes
from elmo_pipeline.transforms.mix import MixLayers

from elmo_pipeline.downstream.mix import ElmoConcat, TrainableMix, concat_elmo, dump_learned_mixes
from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix, load_mix_specs


def test_mix_is_the_paper_formula_and_dropout_only_in_training():
    torch.manual_seed(0)
    layers = torch.randn(3, 2, 5, 8)
    mix = TrainableMix(3, l2_lambda=0.5, dropout=0.5)
    with torch.no_grad():
        mix.mix.weights.copy_(torch.tensor([0.2, -1.0, 0.7]))
        mix.mix.gamma.fill_(1.3)
    s = torch.softmax(torch.tensor([0.2, -1.0, 0.7]), 0)
    expected = 1.3 * (s.view(3, 1, 1, 1) * layers).sum(0)
    mix.eval()
    torch.testing.assert_close(mix(layers), expected)
    assert mix.penalty().item() == pytest.approx(0.5 * (0.04 + 1.0 + 0.49))
    assert mix.weights() == pytest.approx(s.tolist())
    mix.train()
    dropped = mix(layers)
    assert (dropped == 0).float().mean() > 0.3  # about half the values dropped
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], 2 * expected[kept])  # inverted dropout scaling


def test_mask_zeroes_padding_and_gradients_reach_the_weights():
    layers = torch.randn(3, 2, 4, 6)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    mix = TrainableMix(3, l2_lambda=0.001)
    out = mix(layers, mask)
    assert torch.all(out[0, 2:] == 0)
    (out.sum() + mix.penalty()).backward()
    assert mix.mix.weights.grad is not None and mix.mix.gamma.grad is not None
    for wrong in (mask[:, :1], mask[0], mask.T):  # they broadcast, zeroing other positions than the padding
        with pytest.raises(ValueError, match=rf"mask of shape {re.escape(str(tuple(wrong.shape)))} for layers of "
                                             r"shape \(3, 2, 4, 6\): expected \(2, 4\)"):
            mix(layers, wrong)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a mask on another device than the layers)")
def test_the_readme_mix_runs_on_cuda_with_embed_s_mask_or_a_cpu_mask():
    """`TrainableMix(out.layers, out.mask)` on CUDA: embed's mask is on the
    layers' device, and a mask built on the CPU is moved (both failed in the product on CUDA)."""
    from elmo_pipeline import BiLM

    with torch.no_grad():  # tensors a trainable mix may use (inference_mode's may not)
        out = BiLM.from_pretrained().to("cuda").eval().embed([["The", "bank", "rose"], ["It", "fell"]])
    assert out.mask.device == out.layers.device
    cpu_mask = out.mask.cpu()
    mix = TrainableMix(out.layers.shape[0]).eval()
    expected = mix(out.layers.cpu(), cpu_mask)
    mix.to("cuda")
    for mask in (out.mask, cpu_mask):
        got = mix(out.layers, mask)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
        assert torch.all(got[1, 2:] == 0)


def test_layer_norm_matches_the_extract_mix():
    layers = torch.randn(3, 7, 16) * 5 + 2
    spec = MixSpec((0.3, 0.1, -0.4), 0.8, True)
    trained = TrainableMix(3, initial=spec).eval()
    torch.testing.assert_close(trained(layers), ScalarMix.from_spec(spec)(layers))
    assert TrainableMix(3, layer_norm=True, initial=spec).mix.layer_norm
    with pytest.raises(ValueError, match=r"layer_norm=True and the initial mix's layer_norm=False disagree"):
        TrainableMix(3, layer_norm=True, initial=MixSpec((0.0, 0.0, 0.0)))  # it was dropped for the spec's


def test_spec_round_trip_to_extract_mix_parsing(tmp_path):
    mix = TrainableMix(3, layer_norm=True)
    with torch.no_grad():
        mix.mix.weights.copy_(torch.tensor([1.5, -0.25, 0.125]))
        mix.mix.gamma.fill_(2.5)
    path = tmp_path / "mix.json"
    path.write_text(dump_learned_mixes({"pos": mix}))
    assert load_mix_specs(path.read_text(), "mix.json") == {"pos": MixSpec((1.5, -0.25, 0.125), 2.5, True)}
    assert parse_mixes([f"tagger={path}"], 3)["tagger"] == mix.to_spec()  # a single mix: any NAME takes it
    layers = torch.randn(3, 4, 10)
    mix.eval()
    torch.testing.assert_close(ScalarMix.from_spec(parse_mixes([f"pos={path}"], 3)["pos"])(layers), mix(layers))
    with pytest.raises(ValueError, match="3 weights"):  # a mix learned for another model depth
        MixLayers(parse_mixes([f"pos={path}"], 4), 4)


def test_a_mix_file_that_is_missing_a_folder_endless_or_too_large_is_refused_naming_it(tmp_path):
    (tmp_path / "zero.json").symlink_to("/dev/zero")  # was read until memory ran out
    (tmp_path / "big.json").write_bytes(b" " * ((1 << 20) + 1))
    (tmp_path / "folder").mkdir()
    for name, says in (("zero.json", "not a regular file (a device, FIFO or socket); refused unread"),
                       ("big.json", "larger than the 1,048,576 bytes a mix file may have; refused"),
                       ("missing.json", "file not found"), ("folder", "Is a directory")):
        source = tmp_path / name
        with pytest.raises(ValueError, match=re.escape(f"--mix 'm={source}': ") + ".*" + re.escape(says)):
            parse_mixes([f"m={source}"], 3)


@pytest.mark.parametrize("name", ["a\n", "1a", "a-b", "", "a" * 65])
def test_a_mix_name_that_is_no_column_name_is_refused(name):
    # "a\n" passed (a regex $ matches before a last newline) and made a column "mix_a\n"
    with pytest.raises(ValueError, match=re.escape(f"mix name {name!r}: use a letter, then letters, digits or '_'")):
        parse_mixes([f"{name}=average"], 3)


def test_a_mix_file_of_values_past_float32_is_named_with_its_option(tmp_path):
    # "mix weights and gamma must be finite in float32, got [inf, 0.0, 0.0]": no option, no file, and inf
    path = tmp_path / "huge.json"
    path.write_text('{"a": {"weights": [1e300, 0, 0]}}')
    with pytest.raises(ValueError, match=re.escape(f"--mix 'a={path}': mix weights and gamma must be finite in "
                                                   "float32, got [1e+300, 0.0, 0.0] and 1.0")):
        parse_mixes([f"a={path}"], 3)


def test_a_mix_file_of_another_layer_count_is_named_with_its_option(tmp_path):
    # "mix 'a' has 2 weights; the model has 3 layers": neither the option nor the file it came from
    path = tmp_path / "two.json"
    path.write_text('{"a": {"weights": [0.5, 0]}}')
    with pytest.raises(ValueError, match=re.escape(f"--mix 'a={path}': mix 'a' has 2 weights; the model has 3 layers")):
        parse_mixes([f"a={path}"], 3)


def test_mix_weights_float32_cannot_tell_apart_make_the_mix_their_file_records(tmp_path):
    """Weights 2^24 and 2^24 + 1 are one number in float32, where the layers are mixed: the column
    was the mix [0.5, 0.5, 0] where the file and the metadata say softmax [0.2689, 0.7311, 0]; the
    first fix refused them, and with them weights such as [100.3, 100.7, 0], which float32 moves by
    2e-6. Each is that mix, written and read back to 1e-6 of a float64 reference; weights that
    float32 holds well are taken as they are (their mixes' bits unchanged)."""
    rng = np.random.default_rng(0)
    layers = rng.standard_normal((3, 5, 8)).astype(np.float32)
    sentence = Sentence("d", 0, 0, tuple("abcde"), np.arange(5), np.arange(1, 6))
    for weights in ([16777216, 16777217, 0], [100.3, 100.7, 0], [1000.1, 1000.2, -3]):
        path = tmp_path / "close.json"
        path.write_text(json.dumps({"a": {"weights": weights, "gamma": -2}}))
        item = apply_mixes(EmbeddedSentence(sentence, layers, {}), build_mixes(parse_mixes([f"a={path}"], 3), 3))
        spec = OutputSpec(n_layers=3, width=8, layers="none", dtype="float32", mix_names=("a",))
        pq.write_table(build_table([item], spec), tmp_path / "mix.parquet")
        written = np.array(pq.read_table(tmp_path / "mix.parquet").column("mix_a").to_pylist())
        s = np.exp(np.subtract(weights, max(weights), dtype=np.float64))
        want = -2 * np.tensordot(s / s.sum(), layers.astype(np.float64), 1)
        np.testing.assert_allclose(written, want, rtol=0, atol=1e-6, err_msg=str(weights))
    for weights in ([0.1, 0.2, 0.7], [-10000, 0, 0], [30.1, 30.2, 0]):
        mix = ScalarMix(3, initial_weights=weights, trainable=False)
        assert torch.equal(mix.weights.detach(), torch.tensor(weights, dtype=torch.float32))


def test_concat_helpers():
    x = torch.randn(2, 5, 10)
    layers = torch.randn(3, 2, 5, 8)
    out = concat_elmo(x, layers[2])
    assert out.shape == (2, 5, 18) and torch.equal(out[..., :10], x)
    with pytest.raises(ValueError):
        concat_elmo(x, torch.randn(2, 4, 8))
    module = ElmoConcat(3, dropout=0.1).eval()
    out = module(x, layers, torch.ones(2, 5, dtype=torch.bool))
    torch.testing.assert_close(out[..., 10:], layers.mean(0))  # w = 0, gamma = 1: the plain average
    assert module.penalty().item() == 0
