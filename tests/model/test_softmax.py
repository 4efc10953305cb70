"""The biLM output layer: full, sampled (log-uniform candidates) and adaptive softmax."""

import math

import pytest
import torch
import torch.nn.functional as F

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.model.config import SoftmaxConfig
from elmo_pipeline.model.softmax import LmOutputLayer, default_cutoffs
from elmo_pipeline.model.vocabulary import Vocabulary


def _vocab(n: int) -> Vocabulary:
    return Vocabulary(["<S>", "</S>", "<UNK>", *(f"w{i}" for i in range(n - 3))])


@pytest.mark.parametrize("kind", ["full", "sampled", "adaptive"])
def test_exact_nll_is_normalised_and_matches_log_probs(kind):
    vocab = _vocab(60)
    layer = LmOutputLayer(SoftmaxConfig(kind=kind, n_samples=8, cutoffs=(10, 30)), 8, vocab).eval()
    h = torch.randn(13, 8)
    t = torch.randint(0, 60, (13,))
    logp = layer.log_probs(h)
    assert logp.shape == (13, 60)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(13), atol=1e-5, rtol=0)
    torch.testing.assert_close(layer.nll(h, t), -logp.gather(1, t[:, None])[:, 0], atol=1e-5, rtol=0)
    # evaluation is always the full softmax, whatever the training objective
    torch.testing.assert_close(layer.training_nll(h, t), layer.nll(h, t))


@pytest.mark.parametrize("kind", ["full", "adaptive"])
def test_nll_in_row_tiles_is_nll_and_each_rows_value_is_the_same_alone(kind):
    """evaluate's NLL: every product over a fixed tile of rows, so a row's value does not follow
    the rows beside it (the adaptive clusters hold the rows whose targets fall in them)."""
    torch.manual_seed(0)
    layer = LmOutputLayer(SoftmaxConfig(kind=kind, cutoffs=(300, 1200)), 64, _vocab(4000)).eval()
    h, t = torch.randn(700, 64), torch.randint(0, 4000, (700,))
    with torch.no_grad():
        tiled = layer.nll_in_row_tiles(h, t, 256)
        torch.testing.assert_close(tiled, layer.nll(h, t), atol=1e-5, rtol=0)
        for rows in (slice(0, 1), slice(5, 42), slice(300, 700)):
            assert torch.equal(layer.nll_in_row_tiles(h[rows], t[rows], 256), tiled[rows])
        assert layer.nll_in_row_tiles(h[:0], t[:0], 256).shape == (0,)


def test_full_softmax_is_cross_entropy_and_chunks_large_vocabularies(monkeypatch):
    vocab = _vocab(50)
    layer = LmOutputLayer(SoftmaxConfig(kind="full"), 4, vocab)
    h, t = torch.randn(9, 4), torch.randint(0, 50, (9,))
    expected = F.cross_entropy(h @ layer.weight.T + layer.bias, t, reduction="none")
    monkeypatch.setattr("elmo_pipeline.model.softmax._MAX_LOGITS", 100)  # 2 rows at a time
    torch.testing.assert_close(layer.nll(h, t), expected)


def test_log_uniform_sampler_follows_zipf():
    vocab = _vocab(20)
    layer = LmOutputLayer(SoftmaxConfig(kind="sampled", n_samples=200_000), 4, vocab)
    torch.manual_seed(1)
    ids = layer.sample_candidates(torch.device("cpu"))
    assert int(ids.min()) >= 0 and int(ids.max()) <= 19
    freq = torch.bincount(ids, minlength=20).double() / ids.numel()
    k = torch.arange(20, dtype=torch.float64)
    p = torch.log((k + 2) / (k + 1)) / math.log(21)
    assert abs(float(p.sum()) - 1) < 1e-12
    torch.testing.assert_close(freq, p, atol=4e-3, rtol=0)


def test_sampled_softmax_trains_and_removes_accidental_hits():
    vocab = _vocab(500)
    layer = LmOutputLayer(SoftmaxConfig(kind="sampled", n_samples=32), 6, vocab).train()
    h = torch.randn(7, 6, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 6])  # frequent ids: the sampler draws them often
    torch.manual_seed(0)
    nll = layer.training_nll(h, t)
    assert nll.shape == (7,) and torch.isfinite(nll).all() and (nll > 0).all()
    nll.sum().backward()
    assert h.grad is not None and layer.weight.grad is not None
    # the sampled estimate is an approximation of the exact loss, same order of magnitude
    with torch.no_grad():
        exact = layer.nll(h.detach(), t)
    assert float((nll.detach() - exact).abs().mean()) < float(exact.mean())
    # with as many samples as words it is the exact softmax
    small = LmOutputLayer(SoftmaxConfig(kind="sampled", n_samples=500), 6, vocab).train()
    torch.testing.assert_close(small.training_nll(h.detach(), t), small.nll(h.detach(), t))


def test_default_cutoffs_fit_the_vocabulary():
    assert default_cutoffs(33279) == (2000, 10000)
    assert default_cutoffs(5) == (2,)
    with pytest.raises(ValueError):
        LmOutputLayer(SoftmaxConfig(kind="adaptive", cutoffs=(40, 30)), 4, _vocab(60))
    with pytest.raises(ValueError):
        LmOutputLayer(SoftmaxConfig(kind="full"), 4, None)


@pytest.mark.parametrize("kind", ["full", "adaptive"])
def test_softmax_weights_round_trip_through_save_pretrained(tmp_path, kind):
    vocab = _vocab(40)
    raw = {
        "format": "elmo-pipeline", "format_version": 1, "token_encoder": "char_cnn",
        "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 4]], "n_highway": 1},
        "lstm": {"dim": 8, "projection_dim": 4}, "vocab_size": 40,
        "softmax": {"kind": kind, "cutoffs": [10, 20] if kind == "adaptive" else []},
    }
    model = BiLM(ElmoConfig.from_dict(raw), vocab)
    model.save_pretrained(str(tmp_path))
    loaded = BiLM.from_pretrained(str(tmp_path))
    keys = [k for k in model.state_dict() if k.startswith("softmax.")]
    assert keys
    for k in keys:
        torch.testing.assert_close(loaded.state_dict()[k], model.state_dict()[k], rtol=0, atol=0)
