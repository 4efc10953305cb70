"""Training with the fused kernel (`pretrain --kernel fused`): torch's LSTM op and its own backward
instead of the reference recurrence, in float32 even under autocast (which would hand cuDNN
float16), and refused for a model with clips, which that op lacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elmo_pipeline.model import lstm as lstm_module
from elmo_pipeline.model.lstm import FUSED
from elmo_pipeline.runtime import autocast
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.training.initial_model import build_model
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.shards import PreparedCorpus
from elmo_pipeline.training.trainer import train
from support import data_path
from test_training import _args, _lines, _prepare_text


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    """~4,000 tokens of WikiText-2 valid, prepared into 3 shards (as test_training's sample)."""
    folder = tmp_path_factory.mktemp("wiki")
    _prepare_text(_lines(data_path("wikitext2", "wiki.valid.tokens"), 0, 120), folder / "train")
    return folder


def _model_and_batch(wiki, kernel, **kw):
    corpus = PreparedCorpus(str(wiki / "train"))
    model = build_model(_args(wiki / "train", "unused", kernel=kernel, **kw), corpus, lambda m: None).train()
    tokens, ids = corpus.read_shard(0)
    return model, make_batch(model, tokens[:7], ids[:7])


def _loss_and_grads(model, batch, dropout=0.0):
    model.zero_grad(set_to_none=True)
    f, b, n = run_objective(LmObjective(model), batch, dropout)
    loss = (f + b) / (2 * n)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_fused_training_gives_the_reference_loss_and_gradients(wiki):
    model, batch = _model_and_batch(wiki, "auto")
    loss_ref, grads_ref = _loss_and_grads(model, batch)
    model.kernel = FUSED  # the same weights through the other kernel
    loss_fused, grads_fused = _loss_and_grads(model, batch)
    assert loss_fused == pytest.approx(loss_ref, rel=1e-6)
    assert grads_ref.keys() == grads_fused.keys() and any("lstm" in k for k in grads_ref)
    for name, expected in grads_ref.items():
        scale = float(expected.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(grads_fused[name], expected, rtol=0, atol=1e-5 * scale + 1e-8, msg=name)


def test_fused_training_runs_the_op_in_float32_outside_autocast(wiki, monkeypatch):
    model, batch = _model_and_batch(wiki, "fused")
    seen = []
    real = torch.lstm

    def spy(data, *args):
        train_mode = args[6]  # batch_sizes, hx, params, has_biases, num_layers, dropout, train, ...
        seen.append((data.dtype, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), train_mode))
        return real(data, *args)

    monkeypatch.setattr(lstm_module.torch, "lstm", spy)
    with autocast(torch.device("cpu"), "bf16"):
        f, b, n = run_objective(LmObjective(model), batch, 0.1)
    ((f + b) / (2 * n)).backward()
    # the op in training mode, without which cuDNN has no backward
    assert seen and all(s == (torch.float32, True, False, True) for s in seen)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.lstm.parameters())
    seen.clear()
    with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):  # evaluation keeps autocast's choice
        run_objective(LmObjective(model.eval()), batch)
    assert seen and all(s[1:] == (False, True, False) for s in seen)


def test_pretrain_with_the_fused_kernel_follows_the_reference_run(wiki, tmp_path):
    runs = {}
    for kernel in ("auto", "fused"):
        out = tmp_path / kernel
        result = train(_args(wiki / "train", out, kernel=kernel, epochs=1, optimizer="adam", lr=0.003,
                             max_steps=6, dropout=0.0))
        assert result["done"] and result["step"] == 6
        rows = [r.split(",") for r in (out / "metrics.csv").read_text().splitlines()[1:] if r.startswith("train")]
        runs[kernel] = [float(r[6]) for r in rows]
    assert len(runs["auto"]) == 3
    assert runs["fused"] == pytest.approx(runs["auto"], rel=1e-4)


def _clipped_args(wiki, tmp_path, **kw) -> TrainArgs:
    """A tiny model with cell and projection clips, trained on the wiki corpus into tmp_path/run."""
    spec = tmp_path / "clipped.json"
    spec.write_text('{"token_encoder": "char_cnn", "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4]], '
                    '"n_highway": 0}, "lstm": {"dim": 16, "projection_dim": 8, "cell_clip": 3.0, "proj_clip": 3.0}, '
                    '"softmax": {"kind": "full"}}')
    return TrainArgs(data=str(wiki / "train"), output=str(tmp_path / "run"), preset=None, model_config=str(spec),
                     max_steps=2, **kw)


def test_the_fused_kernel_refuses_to_train_a_model_with_clips(wiki, tmp_path):
    args = _clipped_args(wiki, tmp_path, kernel="fused")
    with pytest.raises(ValueError, match="clips"):
        train(args)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resuming_a_model_with_clips_with_the_fused_kernel_is_refused_as_such(wiki, tmp_path):
    # the check ran inside the checkpoint reader, which said the (good) checkpoint could not be
    # read and told the user to delete it
    args = _clipped_args(wiki, tmp_path, checkpoint_every=1)
    train(args)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints
    with pytest.raises(ValueError) as refused:
        train(dataclasses.replace(args, kernel="fused", max_steps=4))
    assert "has no cell or projection clips" in str(refused.value) and "cannot be read" not in str(refused.value)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == checkpoints
