"""bf16 autocast on CPU: the promises fp32 keeps, kept in bf16.

- a sentence's vectors do not depend on its batch, neighbours, order or torch's thread count (bit
  for bit, word cache on or off);
- the exact kernel applies its clips to the float32 cell state and to the projection;
- a CPU without native bf16 instructions runs bf16 with one warning; fp16 is refused on CPU.
(Threads sharing one model under bf16: tests/model/test_threads.py.)
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline import runtime
from elmo_pipeline.model.batch_invariance import BF16_INPUT_TILE
from elmo_pipeline.model.config import CharCnnConfig, LstmConfig


def _bf16_vectors(model: BiLM, batch: list[list[str]], index: int) -> torch.Tensor:
    with torch.inference_mode(), runtime.autocast(model.device, "bf16"):
        out = model.embed(batch)
    assert out.layers.dtype == torch.bfloat16
    return out.layers[:, index, : out.lengths[index]].float()


def _sentences(elmo_fixture_dir) -> list[list[str]]:
    data = json.loads((elmo_fixture_dir / "sentences.json").read_text())
    return [s.split() for group in data for s in group]


@pytest.mark.parametrize("which", ["default", "reference"])
@pytest.mark.parametrize("cache_size", [0, 100_000])
def test_bf16_vectors_are_the_same_bits_in_any_batch(which, cache_size, elmo_fixture_dir):
    d = elmo_fixture_dir
    model = (BiLM.from_pretrained(cache_size=cache_size) if which == "default" else
             BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5"), cache_size=cache_size)).eval()
    sents = _sentences(elmo_fixture_dir)
    rng = random.Random(7)
    threads = torch.get_num_threads()
    try:
        for target in sents[:3]:
            alone = _bf16_vectors(model, [target], 0)
            neighbours = [rng.choice(sents)[: rng.randint(1, 40)] for _ in range(30)]
            neighbours[3] = target * 4  # a much longer neighbour
            big = neighbours[:17] + [target] + neighbours[17:]
            results = [_bf16_vectors(model, [sents[1], target, sents[7]], 1), _bf16_vectors(model, big, 17),
                       _bf16_vectors(model, big[::-1], len(big) - 1 - 17)]
            torch.set_num_threads(1)
            results += [_bf16_vectors(model, [target], 0), _bf16_vectors(model, big, 17)]
            torch.set_num_threads(threads)
            for other in results:
                assert torch.equal(other, alone)
    finally:
        torch.set_num_threads(threads)


def test_bf16_vectors_are_the_same_bits_in_a_batch_wider_than_one_input_projection_call(elmo_fixture_dir):
    """Over BF16_INPUT_TILE sentences, a step's rows fill more than one input-projection call: the
    sentences of a short batch (its input projection one call of three steps) get the same bits
    at the head and at the tail of a wide batch. The LSTM is 512 wide, where oneDNN's bf16
    product gives a row other bits at other row counts (the embedded model's 128-wide one does
    not); one-word sentences keep the short batch's rows below the counts that switch kernels.
    A changed bit is rare (in one call over all rows instead of fixed calls, 0 to 132 of 184,320
    values a batch differed): four batches."""
    config = ElmoConfig(lstm=LstmConfig(dim=512, projection_dim=512, n_layers=2),
                        char_cnn=CharCnnConfig(embedding_dim=8, filters=((1, 32), (2, 32)), n_highway=1))
    torch.manual_seed(5)
    model = BiLM(config, cache_size=0).eval()
    words = sorted({w for s in _sentences(elmo_fixture_dir) for w in s})
    for seed in range(4):
        rng = random.Random(seed)
        short = [[w] for w in rng.sample(words, 60)]
        filler = [rng.sample(words, rng.randint(1, 6)) for _ in range(BF16_INPUT_TILE + 30)]
        with torch.inference_mode(), runtime.autocast(model.device, "bf16"):
            alone = model.embed(short).layers.float()
            for wide, first in ((short + filler, 0), (filler + short, len(filler))):
                out = model.embed(wide)
                assert torch.equal(out.layers[:, first : first + len(short), : alone.shape[2]].float(), alone)


def _clipped_model(cell_clip: float, proj_clip: float) -> BiLM:
    """Random weights, scaled up so that both clips bite on most steps."""
    config = ElmoConfig(lstm=LstmConfig(dim=48, projection_dim=24, n_layers=2, cell_clip=cell_clip,
                                        proj_clip=proj_clip, use_skip_connections=True),
                        char_cnn=CharCnnConfig(embedding_dim=8, filters=((1, 16), (2, 16), (3, 32)), n_highway=1))
    torch.manual_seed(3)
    model = BiLM(config, cache_size=0).eval()
    with torch.no_grad():
        for layer in model.lstm.layers:
            layer.recurrent_weight.mul_(4.0)
            layer.input_weight.mul_(4.0)
            layer.projection.mul_(8.0)
    return model


def test_bf16_exact_kernel_clips_the_float32_cell_state_and_the_projection():
    model = _clipped_model(cell_clip=0.75, proj_clip=0.5)
    batch = [["the", "cat", "sat", "on", "the", "mat"] * 3, ["a", "b"], ["one", "more", "short", "one"]]
    with torch.inference_mode():
        tokens, lengths = model.sentence_tokens(batch)
        with runtime.autocast(model.device, "bf16"):
            layers, state = model.lstm(tokens, lengths, kernel="exact")
    # the cell state stays float32: clipped to exactly +-0.75 where it bites (measured on 37% of
    # the values), and not rounded to bf16 elsewhere (most float32 values are not bf16 values)
    assert state.c.dtype == torch.float32
    assert state.c.abs().max() == 0.75 and (state.c.abs() == 0.75).float().mean() > 0.25
    inner = state.c[state.c.abs() < 0.75]
    assert (inner != inner.to(torch.bfloat16).float()).float().mean() > 0.9
    # the projection clip: every layer's last h, and every output of layer 0 (no residual added),
    # within +-0.5 and at it for most values (measured 65% of layer 0's)
    assert state.h.float().abs().max() == 0.5
    valid = torch.arange(layers[0].shape[2]) < lengths.unsqueeze(1)
    first = layers[0].float()[:, valid]
    assert first.abs().max() == 0.5 and (first.abs() == 0.5).float().mean() > 0.4


def test_bf16_drift_from_float32_on_the_reference_model(reference_model, elmo_fixture_dir):
    sentences = _sentences(elmo_fixture_dir)
    with torch.inference_mode():
        fp32 = reference_model.embed(sentences).layers
        with runtime.autocast(reference_model.device, "bf16"):
            bf16 = reference_model.embed(sentences).layers.float()
    drift = (bf16 - fp32).abs().amax(dim=(1, 2, 3))
    # measured 0.023 / 0.020 / 0.021 on values up to 7.1 / 3.0 / 4.6 (bf16 keeps 8 bits of mantissa)
    assert (drift > 0).all() and (drift < 0.06).all(), drift


def test_bf16_on_a_cpu_without_native_bf16_warns_once(monkeypatch):
    monkeypatch.setattr(runtime, "native_bf16", lambda device: False)
    monkeypatch.setattr(runtime, "_warned", set())
    cpu = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with runtime.autocast(cpu, "bf16"):
                pass
    slow = [w for w in caught if issubclass(w.category, runtime.SlowPrecisionWarning)]
    assert len(slow) == 1 and "AVX512-BF16 or AMX" in str(slow[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.check_precision(cpu, "fp32")
    assert caught == []


def test_native_bf16_agrees_with_the_cpu_flags():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(cpuinfo.read_text().split())
    assert runtime.native_bf16(torch.device("cpu")) == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_a_cuda_device_this_machine_lacks_is_not_called_slow(monkeypatch):
    """A job launched here for GPU workers: the warning described this machine, not theirs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(runtime, "_warned", set())
    assert runtime.native_bf16(torch.device("cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.check_precision(torch.device("cuda"), "bf16")
    assert caught == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU here without bf16 is judged
    assert not runtime.native_bf16(torch.device("cuda"))


def test_fp16_is_refused_on_cpu_and_unknown_precisions_everywhere():
    with pytest.raises(ValueError, match="fp16 autocast is for GPUs"):
        runtime.check_precision(torch.device("cpu"), "fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        runtime.check_precision(torch.device("cpu"), "int8")


def test_a_float16_model_under_bf16_autocast_is_refused_by_name():
    # torch failed deep in the token encoder: "Unexpected floating ScalarType in at::autocast::prioritize"
    import copy

    model = BiLM.from_pretrained().eval()
    half = copy.deepcopy(model).to(torch.float16)
    with torch.inference_mode(), runtime.autocast(torch.device("cpu"), "bf16"):
        with pytest.raises(ValueError, match="torch.bfloat16 autocast with a torch.float16 model: autocast takes a "
                                             "float32 model"):
            half.embed([["a", "rose"]])
        bf16 = copy.deepcopy(model).to(torch.bfloat16).embed([["a", "rose"]]).layers  # its own dtype runs
        assert torch.isfinite(bf16.float()).all() and bf16.dtype == torch.bfloat16
