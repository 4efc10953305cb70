"""Training and evaluation precision: `pretrain --precision` and its older spelling `--bf16`,
bf16 training on CPU, validation and `evaluate --precision`, run folders of earlier versions.

The bounds below were measured with this file's setup (the tiny preset, 30 steps, seeds 0-9):
bf16 training against fp32 training moved the held-out perplexity by 0.16-0.56%, a bf16
evaluation of one model against its fp32 evaluation by at most 0.08%.
"""

import argparse
import contextlib
import io
import json
import math

import pytest
import torch

from elmo_pipeline import BiLM
from elmo_pipeline.cli import training as cli_training
from elmo_pipeline.cli.main import main as cli_main
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.model import lstm_reference
from elmo_pipeline.runtime import autocast
from elmo_pipeline.training.evaluate import evaluate
from elmo_pipeline.training.initial_model import build_model
from elmo_pipeline.training.lm import make_batch
from elmo_pipeline.training.options import TRAIN_PRECISIONS, TrainArgs
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.shards import PreparedCorpus
from elmo_pipeline.training.trainer import StopTraining, Trainer
from support import data_path

TRAINING_GAP = 0.02  # bf16-trained vs fp32-trained perplexity (measured <= 0.56%)
EVALUATION_GAP = 0.005  # one model evaluated in bf16 vs fp32 (measured <= 0.08%)


def _prepare(lines: list[str], folder) -> str:
    doc = Document("sample", "".join(line for line in lines if line.strip()), "sample", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(folder), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=1500)
    return str(folder)


@pytest.fixture(scope="module")
def wiki(tmp_path_factory) -> dict[str, str]:
    """~4,000 tokens of WikiText-2 valid to train on, ~2,000 others held out."""
    lines = data_path("wikitext2", "wiki.valid.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    folder = tmp_path_factory.mktemp("wiki")
    return {"train": _prepare(lines[:120], folder / "train"), "held": _prepare(lines[200:260], folder / "held")}


def _pretrain_argv(wiki: dict[str, str], output, *extra: str, steps: int = 30) -> list[str]:
    return ["pretrain", "--data", wiki["train"], "--output", str(output), "--preset", "tiny", "--epochs", "20",
            "--max-steps", str(steps), "--batch-tokens", "300", "--optimizer", "adam", "--lr", "0.01", "--seed", "0",
            "--threads", "1", "--log-every", "1000", "--checkpoint-every", "3", *extra]


@pytest.fixture(scope="module")
def trained(wiki, tmp_path_factory) -> dict[str, dict]:
    """The same 30 steps from the same seed through the command line, in fp32 and in bf16."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for precision in ("fp32", "bf16"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli_main(_pretrain_argv(wiki, root / precision, "--precision", precision, "--valid", wiki["held"]))
        assert code == 0, err.getvalue()[-2000:]
        runs[precision] = {"run": root / precision, "log": err.getvalue(),
                           "model": BiLM.from_pretrained(str(root / precision / "model"))}
    return runs


def test_bf16_training_on_cpu_lands_close_to_fp32_training(wiki, trained):
    assert "on cpu, bf16" in trained["bf16"]["log"] and "on cpu, fp32" in trained["fp32"]["log"]
    a, b = (trained[p]["model"].state_dict() for p in ("fp32", "bf16"))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # bf16 did run: the weights moved otherwise
    scores = {p: evaluate(trained[p]["model"], wiki["held"])["average_perplexity"] for p in trained}
    assert all(math.isfinite(s) for s in scores.values())
    assert scores["fp32"] < len(trained["fp32"]["model"].vocab) / 5  # learned: far below a uniform guess
    assert abs(scores["bf16"] / scores["fp32"] - 1) < TRAINING_GAP, scores


def test_validation_during_training_runs_in_the_run_precision(wiki, trained):
    for precision, run in trained.items():
        logged = json.loads((run["run"] / "best" / "valid.json").read_text())["average_perplexity"]
        again = evaluate(run["model"], wiki["held"], precision=precision)["average_perplexity"]
        assert logged == again, precision
    other = evaluate(trained["bf16"]["model"], wiki["held"], precision="fp32")["average_perplexity"]
    assert other != logged


def test_evaluate_in_bf16_is_close_to_fp32(wiki, trained, capsys):
    model = str(trained["fp32"]["run"] / "model")
    out = {}
    for precision in ("fp32", "bf16"):
        assert cli_main(["evaluate", "--model", model, "--data", wiki["held"], "--precision", precision,
                         "--threads", "1"]) == 0
        out[precision] = json.loads(capsys.readouterr().out)
        assert out[precision]["precision"] == precision
    fp32, bf16 = (out[p]["average_perplexity"] for p in ("fp32", "bf16"))
    assert fp32 != bf16 and abs(bf16 / fp32 - 1) < EVALUATION_GAP, (fp32, bf16)
    assert out["fp32"]["tokens"] == out["bf16"]["tokens"]


def test_fp16_on_cpu_is_refused_with_a_reason(wiki, trained, tmp_path, capsys):
    model = str(trained["fp32"]["run"] / "model")
    assert cli_main(["evaluate", "--model", model, "--data", wiki["held"], "--precision", "fp16",
                     "--device", "cpu"]) == 2
    assert "fp16 autocast is for GPUs; use bf16 or fp32 on CPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a choice of pretrain's
        cli_main(_pretrain_argv(wiki, tmp_path / "run", "--precision", "fp16"))
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="loss scaling"):
        TrainArgs(data="d", output="o", precision="fp16")


def _namespace(*argv: str) -> argparse.Namespace:
    """pretrain's options parsed (--data and --output placeholders unless `argv` gives them)."""
    parser = argparse.ArgumentParser()
    cli_training.add_pretrain_args(parser)
    return parser.parse_args(["--data", "d", "--output", "o", *argv])


@pytest.mark.parametrize("argv, expected", [
    ((), "auto"), (("--bf16", "auto"), "auto"), (("--bf16", "on"), "bf16"), (("--bf16", "off"), "fp32"),
    (("--precision", "bf16"), "bf16"), (("--precision", "fp32", "--bf16", "off"), "fp32"),
    (("--bf16", "on", "--precision", "bf16"), "bf16"),
])
def test_the_older_bf16_option_maps_onto_precision(argv, expected):
    args = cli_training.train_args_from_namespace(_namespace(*argv))
    assert args.precision == expected
    assert "bf16" not in args.to_dict() and args.to_dict()["precision"] == expected


@pytest.mark.parametrize("argv", [("--bf16", "on", "--precision", "fp32"), ("--bf16", "auto", "--precision", "bf16"),
                                  ("--bf16", "off", "--precision", "auto")])
def test_disagreeing_bf16_and_precision_are_refused(argv):
    with pytest.raises(ValueError) as caught:
        cli_training.train_args_from_namespace(_namespace(*argv))
    message = str(caught.value)
    assert f"--bf16 {argv[1]}" in message and f"--precision {argv[3]}" in message


def test_the_command_refuses_disagreeing_options_before_writing_anything(wiki, tmp_path, capsys):
    assert cli_main(_pretrain_argv(wiki, tmp_path / "run", "--bf16", "on", "--precision", "fp32")) == 2
    assert "--bf16 on and --precision fp32 disagree" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_command_line_offers_the_trainers_precisions():
    assert cli_training.TRAIN_PRECISIONS == TRAIN_PRECISIONS  # one tuple, in runtime, for both


def _weights(folder) -> dict[str, torch.Tensor]:
    return BiLM.from_pretrained(str(folder)).state_dict()


def _stop_after(step: int):
    def hook(done: int) -> None:
        if done > step:
            raise StopTraining
    return hook


@pytest.mark.parametrize("recorded", ["auto", "off", "on"])
def test_a_run_folder_of_the_previous_version_resumes(wiki, tmp_path, recorded):
    """Earlier versions wrote `bf16` (auto, on, off: on CUDA only) into run.json and no
    `precision`; the same command resumes such a run, exactly where its precision is unchanged."""
    straight, old = tmp_path / "straight", tmp_path / "old"
    assert cli_main(_pretrain_argv(wiki, straight, "--bf16", "off", steps=6)) == 0
    args = cli_training.train_args_from_namespace(_namespace(*_pretrain_argv(wiki, old, "--bf16", recorded,
                                                                         steps=6)[1:]))
    with pytest.raises(StopTraining), contextlib.redirect_stderr(io.StringIO()):
        Trainer(args, step_hook=_stop_after(3)).run()  # a checkpoint at step 3, then a crash
    run_json = old / "run.json"
    written = json.loads(run_json.read_text())
    as_before = {**{k: v for k, v in written.items() if k != "precision"}, "bf16": recorded}  # the old file
    run_json.write_text(json.dumps(as_before))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli_main(_pretrain_argv(wiki, old, "--bf16", recorded, steps=6)) == 0
    log = err.getvalue()
    assert "resuming from" in log and "arguments differ" not in log
    assert json.loads(run_json.read_text()) == as_before  # the run's first command stays as it was
    a, b = _weights(straight / "model"), _weights(old / "model")
    if recorded == "on":  # the old version ran fp32 on CPU; the steps after the checkpoint run bf16
        assert "trained in fp32 on cpu" in log and any(not torch.equal(a[k], b[k]) for k in a)
    else:
        assert "trained in fp32" not in log and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_training_keeps_the_cell_state_and_the_gradients_float32(wiki, monkeypatch):
    corpus = PreparedCorpus(wiki["train"])
    model = build_model(TrainArgs(data=wiki["train"], output="-", preset="tiny"), corpus, lambda m: None).train()
    tokens, ids = corpus.read_shard(0)
    batch = make_batch(model, tokens[:6], ids[:6])
    seen: list[tuple[torch.dtype, ...]] = []
    step = lstm_reference.lstm_step

    def spy(x_gates, h, c, layer, cell_clip, proj_clip):
        h, c_new = step(x_gates, h, c, layer, cell_clip, proj_clip)
        seen.append((x_gates.dtype, c.dtype, c_new.dtype, h.dtype))
        return h, c_new

    monkeypatch.setattr(lstm_reference, "lstm_step", spy)
    with autocast(torch.device("cpu"), "bf16"):
        reps = model.token_encoder(batch.char_ids, batch.word_ids)
        reps = torch.cat([reps, reps.new_zeros(1, reps.shape[1])])[batch.index]
        layers, _ = model.lstm.reference_forward(reps, batch.lengths)
        loss = sum(layer.float().square().mean() for layer in layers)
    loss.backward()
    assert seen and set(seen) == {(torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and {g.dtype for g in grads} == {torch.float32} == {p.dtype for p in model.parameters()}
