"""Pretraining: the objective, exact resumption (also after SIGKILL), fine-tuning, evaluation.

Tiny models on samples cut at run time from WikiText-2 (valid) and UD English EWT.
"""

import csv
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elmo_pipeline import BiLM
from elmo_pipeline.formats.atomic import recover_folder, replace_folder
from elmo_pipeline.cli.main import main as cli_main
from elmo_pipeline.cli.training import main as pretrain_main
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.evaluate import evaluate
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.initial_model import grown_vocabulary
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.shards import PreparedCorpus
from elmo_pipeline.training.stopping import StoppedBySignal
from elmo_pipeline.training.trainer import StopTraining, Trainer, train
from support import data_path


def _lines(path, start, count):
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= start + count:
                break
            if i >= start and line.strip():
                out.append(line)
    return out


def _prepare_text(lines, folder, shard_tokens=1500, max_tokens=40):
    doc = Document("sample", "".join(lines), "sample", 1)
    return prepare_in_process(whitespace_sentences(doc, max_tokens), str(folder), tokenizer="whitespace",
                              lang="en", max_sentence_tokens=max_tokens, unk_alias="<unk>",
                              shard_tokens=shard_tokens)


def _conllu_sentences(path, limit):
    sentences, words = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if words:
                    sentences.append(" ".join(words) + "\n")
                    words = []
                    if len(sentences) >= limit:
                        break
                continue
            if line.startswith("#"):
                continue
            cols = line.split("\t")
            if cols[0].isdigit():
                words.append(cols[1].replace(" ", "_"))
    return sentences


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    """~4,000 tokens of WikiText-2 valid, prepared into 3 shards."""
    src = data_path("wikitext2", "wiki.valid.tokens")
    folder = tmp_path_factory.mktemp("wiki")
    _prepare_text(_lines(src, 0, 120), folder / "train")
    _prepare_text(_lines(src, 200, 60), folder / "held", shard_tokens=10**6)
    return folder


def _args(data, out, **kw):
    base = dict(data=str(data), output=str(out), preset="tiny", epochs=2, batch_tokens=300, log_every=2,
                checkpoint_every=3, keep_checkpoints=2, seed=3, threads=1)
    base.update(kw)
    return TrainArgs(**base)


def _weights(path):
    return {k: v.clone() for k, v in BiLM.from_pretrained(str(path)).state_dict().items()}


def test_training_kernel_matches_the_model_forward(wiki):
    corpus = PreparedCorpus(str(wiki / "train"))
    from elmo_pipeline.training.initial_model import build_model

    model = build_model(_args(wiki / "train", "unused"), corpus, lambda m: None)
    tokens, _ = corpus.read_shard(0)
    batch = make_batch(model, tokens[:5])
    reps = model.token_encoder(batch.char_ids, batch.word_ids)
    reps = torch.cat([reps, reps.new_zeros(1, reps.shape[1])])[batch.index]
    with torch.no_grad():  # the inference kernel
        expected, _ = model(reps, batch.lengths)
    got, _ = model.lstm.reference_forward(reps, batch.lengths)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the objective counts n + 1 predictions per direction and sentence
    with torch.no_grad():
        f, b, n = run_objective(LmObjective(model), batch)
    assert n == batch.n_words + 5 == batch.n_predictions
    assert math.isclose(float(f) / n, math.log(len(model.vocab)), rel_tol=0.2)  # untrained: ~uniform


def test_accumulated_micro_batches_step_on_their_mean_loss(tmp_path):
    """--grad-accum K steps on the mean of K micro-batches' losses. Every sentence the same, every
    micro-batch gives the same gradient: the first step's norm with K = 2 is that of K = 1 (their
    sum doubled it, and no test saw it)."""
    _prepare_text(["the cat sat on the mat .\n"] * 60, tmp_path / "data")
    norms = {}
    for accum in (1, 2):
        run = tmp_path / f"run{accum}"
        train(_args(tmp_path / "data", run, grad_accum=accum, dropout=0.0, max_steps=1, epochs=1, log_every=1))
        rows = [r for r in _metrics_rows(run) if r["kind"] == "train"]
        assert [r["step"] for r in rows] == ["1"]
        norms[accum] = float(rows[0]["grad_norm"])
    assert norms[1] > 0 and norms[2] == pytest.approx(norms[1], rel=1e-3)  # the log rounds to 4 places


def test_pretrain_lowers_loss_and_writes_metrics(wiki, tmp_path, capsys):
    run = tmp_path / "run"
    result = train(_args(wiki / "train", run, epochs=3, optimizer="adam", lr=0.01, valid=str(wiki / "held"),
                         eval_every=0))
    assert result["done"] and result["step"] > 10
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("kind,step,epoch")
    train_rows = [r.split(",") for r in rows[1:] if r.startswith("train")]
    assert float(train_rows[-1][6]) < float(train_rows[0][6])  # loss
    assert any(r.startswith("valid") for r in rows)
    err = capsys.readouterr().err
    assert "tokens/s" in err and "perplexity" in err
    assert (run / "model" / "model.safetensors").exists() and (run / "best" / "valid.json").exists()
    # the last K checkpoints are kept, and no temporary folder is left
    names = sorted(os.listdir(run / "checkpoints"))
    assert len(names) == 2 and all(n.startswith("step-") for n in names)


@pytest.mark.parametrize("softmax,optimizer,accum,schedule", [
    ("full", "adagrad", 1, "constant"), ("sampled", "adam", 2, "constant"), ("full", "adagrad", 1, "cosine")])
def test_resumed_run_ends_with_the_same_weights(wiki, tmp_path, softmax, optimizer, accum, schedule):
    kw = dict(softmax=softmax, optimizer=optimizer, grad_accum=accum, dropout=0.2, max_steps=9, epochs=5,
              schedule=schedule, warmup_steps=2 if schedule == "cosine" else 0,
              n_samples=20 if softmax == "sampled" else None)  # the full softmax refuses n_samples
    straight = tmp_path / "straight"
    train(_args(wiki / "train", straight, **kw))

    broken = tmp_path / "broken"

    def crash(step):
        if step == 5:  # after the checkpoint of step 3: steps 4 and 5 are lost
            raise StopTraining

    with pytest.raises(StopTraining):
        Trainer(_args(wiki / "train", broken, **kw), step_hook=crash).run()
    assert ckpt.latest_checkpoint(str(broken)).endswith("step-000000003")
    result = train(_args(wiki / "train", broken, **kw))
    assert result["step"] == 9
    a, b = _weights(straight / "model"), _weights(broken / "model")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the metrics of the redone steps appear once, with the learning rates of the straight run, and
    # its figures: the row of step 4 sums steps 3 and 4 (the checkpoint carried step 3's sums;
    # before, the resumed run's row held step 4 alone)
    def train_rows(run):
        rows = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:] if r.startswith("train")]
        return [(int(r[1]), float(r[10])) for r in rows], [(r[4], *r[6:10], r[11]) for r in rows]

    assert train_rows(broken) == train_rows(straight) and [s for s, _ in train_rows(broken)[0]] == [2, 4, 6, 8, 9]
    perplexities = {r[2] for r in train_rows(broken)[1]}
    assert perplexities == {""} if softmax == "sampled" else "" not in perplexities  # no perplexity of sampled losses
    if schedule == "cosine":  # the schedule moved: the resumed run did not restart it
        assert len({lr for _, lr in train_rows(broken)[0]}) == 5


def test_a_weight_decay_changed_at_resume_applies_from_the_resumed_step(wiki, tmp_path):
    """The checkpoint's optimizer groups were put back whole, their weight decay with them: a run
    resumed with --weight-decay 0.5, noted as taken, trained as without it, bit for bit."""
    run = tmp_path / "run"
    train(_args(wiki / "train", run, max_steps=2, checkpoint_every=2))
    checkpoint = ckpt.latest_checkpoint(str(run))
    train(_args(wiki / "train", run, max_steps=3, checkpoint_every=2, weight_decay=0.5))
    model = BiLM.from_pretrained(checkpoint)
    name = "token_encoder.char_cnn.char_embedding.weight"
    index = [n for n, p in model.named_parameters() if p.requires_grad].index(name)
    sums = load_file(os.path.join(checkpoint, "optimizer.safetensors"))[f"{index}/sum"]
    row = 1 + 7  # byte 7 (BEL) is in no word of the corpus: only the decay moves its row (Adagrad, lr 0.2)
    start = model.state_dict()[name][row]
    decay = 0.5 * start
    expected = start - 0.2 * decay / ((sums[row] + decay * decay).sqrt() + 1e-10)
    after = BiLM.from_pretrained(str(run / "model")).state_dict()[name][row]
    assert not torch.equal(after, start)
    torch.testing.assert_close(after, expected, rtol=1e-6, atol=0)
    groups = json.loads((Path(ckpt.latest_checkpoint(str(run))) / "optimizer.json").read_text())["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.5]


def test_a_resume_with_another_valid_judges_best_on_that_data(wiki, tmp_path, capsys):
    """best/ was kept or replaced by comparing the new --valid's perplexities with its own on the
    earlier --valid: resumed on harder data, a step's model no better than best/ on it was judged
    worse than best/'s perplexity on the easier data, and best/valid.json still named that data."""
    easy, hard = tmp_path / "easy.txt", tmp_path / "hard.txt"
    easy.write_text("qq zz xx qq zz\n" * 5, encoding="utf-8")  # unknown words: the likeliest, early on
    hard.write_text("".join(_lines(data_path("wikitext2", "wiki.valid.tokens"), 0, 20)), encoding="utf-8")
    run = tmp_path / "run"
    train(_args(wiki / "train", run, max_steps=2, checkpoint_every=2, lr=1.0, valid=str(easy)))
    result = train(_args(wiki / "train", run, max_steps=3, checkpoint_every=2, lr=1e-30, valid=str(hard)))
    again = evaluate(BiLM.from_pretrained(str(run / "best")), str(hard))
    assert result["best_valid"] == again["average_perplexity"]  # was the easy data's perplexity
    best = json.loads((run / "best" / "valid.json").read_text(encoding="utf-8"))
    assert (best["data"], best["average_perplexity"]) == (str(hard), again["average_perplexity"])
    assert f"note: best/ (step 2) was judged on --valid {easy}; on {hard} its perplexity is" in capsys.readouterr().err
    state = ckpt.load_trainer_state(ckpt.latest_checkpoint(str(run)))
    assert (state["best_data"], state["best_valid"]) == (str(hard), best["average_perplexity"])


class _Killed(Exception):
    """What the test's own SIGTERM handler raises: the signal reached the handler the run replaced."""


@pytest.fixture
def sigterm_guard():
    """A SIGTERM handler of the test's (a SIGTERM not taken by the run must not end pytest)."""
    def killed(*_):
        raise _Killed

    previous = signal.signal(signal.SIGTERM, killed)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_stops_after_the_step_with_its_checkpoint_and_the_run_resumes_exactly(
        wiki, tmp_path, sigterm_guard, capfd):
    kw = dict(optimizer="adam", dropout=0.2, max_steps=9, epochs=5, checkpoint_every=100,
              valid=str(wiki / "held"))
    straight = tmp_path / "straight"
    train(_args(wiki / "train", straight, **kw))
    stopped = tmp_path / "stopped"

    def terminate(step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(StoppedBySignal) as caught:
        Trainer(_args(wiki / "train", stopped, **kw), step_hook=terminate).run()
    assert caught.value.signum == signal.SIGTERM
    assert str(caught.value).startswith("terminated (SIGTERM) after step 5,")
    # no periodic checkpoint was due: the one at step 5 is the signal's, and nothing is published
    assert [step for step, _ in ckpt.list_checkpoints(str(stopped))] == [5]
    assert not (stopped / "model").exists() and not (stopped / "best").exists()  # no validation either
    assert "terminated (SIGTERM): stopping after this step" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the test's handler is back
    result = train(_args(wiki / "train", stopped, **kw))
    assert result["step"] == 9 and result["done"]
    a, b = _weights(straight / "model"), _weights(stopped / "model")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # step 5 is inside a log window (every 2 steps): the checkpoint carries it, so no row was
    # written for it at the stop, and the rows are the unbroken run's (all but the clock's columns)
    rows = [_untimed_rows(run) for run in (straight, stopped)]
    assert rows[0] == rows[1] and [r["step"] for r in rows[0] if r["kind"] == "train"] == ["2", "4", "6", "8", "9"]


def _metrics_rows(run: Path) -> list[dict[str, str]]:
    """A run's metrics.csv, a dict of its columns' text a row."""
    with open(run / "metrics.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _untimed_rows(run: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in ("elapsed_s", "tokens_per_s")} for row in _metrics_rows(run)]


def test_the_same_signal_again_ends_the_run_at_once(wiki, tmp_path, sigterm_guard):
    def terminate_twice(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # reaches the handler the run had replaced

    with pytest.raises(_Killed):
        Trainer(_args(wiki / "train", tmp_path / "run", max_steps=9, checkpoint_every=100),
                step_hook=terminate_twice).run()
    assert ckpt.list_checkpoints(str(tmp_path / "run")) == []


def test_a_validations_time_is_left_out_of_the_training_tokens_per_second(wiki, tmp_path, monkeypatch):
    # A clock on which every validation takes 1,000 s more than it did. Before, its time was in the
    # next log window's: the row after it gave the window's words over more than 1,000 s.
    from elmo_pipeline.training import trainer as trainer_module

    real_clock, real_evaluate, late = time.perf_counter, trainer_module.evaluate_sentences, [0.0]

    def evaluate_slowly(*args, **kwargs):
        result = real_evaluate(*args, **kwargs)
        late[0] += 1000.0
        return result

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + late[0])
    monkeypatch.setattr(trainer_module, "evaluate_sentences", evaluate_slowly)
    run = tmp_path / "run"
    train(_args(wiki / "train", run, max_steps=3, log_every=1, eval_every=2, valid=str(wiki / "held")))
    rows = {(row["kind"], row["step"]): row for row in _metrics_rows(run)}
    assert ("valid", "2") in rows and late[0] == 2000.0  # at step 2 and at the end (step 3)
    words = int(rows["train", "3"]["tokens"]) - int(rows["train", "2"]["tokens"])
    seconds = words / float(rows["train", "3"]["tokens_per_s"])
    assert 0 < seconds < 100  # one step of the tiny model, not the validation before it
    assert float(rows["valid", "3"]["elapsed_s"]) >= 1000  # the run's elapsed time still counts it


def test_pretrain_command_ends_by_sigterm_with_a_checkpoint_and_one_line(wiki, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "elmo_pipeline.cli.training", "pretrain", "--data", str(wiki / "train"),
           "--output", str(run), "--preset", "tiny", "--epochs", "1000", "--max-steps", "100000",
           "--batch-tokens", "300", "--log-every", "1", "--checkpoint-every", "100000", "--threads", "1"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # the first step's log line: the loop runs and the signal is taken
        if line.startswith("step "):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert out == ""  # no result document: the run is not done
    last = err.strip().splitlines()[-1]
    step = ckpt.list_checkpoints(str(run))[-1][0]
    assert last == (f"elmo-pipeline pretrain: terminated (SIGTERM) after step {step}, which its checkpoint "
                    "holds; the same command resumes there")
    assert 1 <= step < 100000 and not (run / "model").exists()


def test_sigkill_then_same_command_resumes_exactly(wiki, tmp_path):
    cmd = [sys.executable, "-m", "elmo_pipeline.cli.training", "pretrain", "--data", str(wiki / "train"),
           "--preset", "tiny", "--epochs", "40", "--max-steps", "24", "--batch-tokens", "300",
           "--checkpoint-every", "4", "--log-every", "10", "--seed", "5", "--threads", "1", "--optimizer", "adam"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd + ["--output", str(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(ckpt.list_checkpoints(str(killed))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    found = ckpt.list_checkpoints(str(killed))
    assert found and found[-1][0] < 24, "the run ended before it could be killed"
    subprocess.run(cmd + ["--output", str(killed)], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    train(TrainArgs(data=str(wiki / "train"), output=str(straight), preset="tiny", epochs=40, max_steps=24,
                    batch_tokens=300, checkpoint_every=4, log_every=10, seed=5, threads=1, optimizer="adam"))
    a, b = _weights(straight / "model"), _weights(killed / "model")
    for k in a:
        assert torch.equal(a[k], b[k]), k


# `pretrain` killed (SIGKILL) just before or just after the first rename to a given name.
KILL_AT_RENAME = """
import os, signal, sys
from elmo_pipeline.cli.training import main
name, when, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
rename = os.rename
def rename_and_die_around(src, dst):
    hit = os.path.basename(dst) == name
    if hit and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)
    if hit and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename_and_die_around
sys.exit(main(argv))
"""
FINISHING = dict(preset="tiny", epochs=40, batch_tokens=300, checkpoint_every=2, log_every=10, seed=4, threads=1,
                 optimizer="adam", schedule="constant")


@pytest.fixture(scope="module")
def finished_weights(wiki, tmp_path_factory) -> dict:
    """The model of a run of 5 steps that nothing interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    train(TrainArgs(data=str(wiki / "train"), output=str(run), max_steps=5, **FINISHING))
    return _weights(run / "model")


def _pretrain_argv(data, output, **kw) -> list[str]:
    return ["pretrain", "--data", str(data), "--output", str(output)] + [
        arg for key, value in kw.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


@pytest.mark.parametrize("name, when, first_steps", [
    ("model", "before", None),  # finished training, model/ not yet published
    ("model", "after", None),  # model/ published, the run not yet marked done
    ("model.old", "after", 3),  # a finished run continued: its old model/ moved aside, the new one not yet in
])
def test_a_kill_while_publishing_the_model_ends_with_the_complete_model(wiki, tmp_path, finished_weights, name, when,
                                                                        first_steps):
    # Before: the run was marked done first and model/ written after, with rmtree then rename: a
    # kill at ("model", "before") left a done run without model/, and the rerun said it had finished.
    run = tmp_path / "run"
    if first_steps:
        train(TrainArgs(data=str(wiki / "train"), output=str(run), max_steps=first_steps, **FINISHING))
    argv = _pretrain_argv(wiki / "train", run, max_steps=5, **FINISHING)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_RENAME, name, when, *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]  # it reached the rename
    assert pretrain_main(argv) == 0  # the same command again
    state = ckpt.load_trainer_state(ckpt.latest_checkpoint(str(run)))
    assert state["done"] and state["step"] == 5
    got = _weights(run / "model")  # resumption is exact, also across a finished run continued
    assert got.keys() == finished_weights.keys() and all(torch.equal(got[k], finished_weights[k]) for k in got)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(("model", "best"))) == ["model"]


# `pretrain` killed (SIGKILL) once it removed the first file of the folder of checkpoint `name`
# (under its own name or the temporary one it is first renamed to).
KILL_WHILE_REMOVING = """
import os, re, signal, sys
from elmo_pipeline.cli.training import main
name, argv = sys.argv[1], sys.argv[2:]
unlink = os.unlink
def unlink_and_die(path, *args, dir_fd=None, **kwargs):
    folder = os.path.dirname(os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else "",
                                          os.fsdecode(path)))
    unlink(path, *args, dir_fd=dir_fd, **kwargs)
    if re.fullmatch(r"(\\.tmp-old-)?" + name, os.path.basename(folder)):
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = unlink_and_die
sys.exit(main(argv))
"""


def test_a_kill_while_the_final_checkpoint_replaces_its_steps_resumes(wiki, tmp_path):
    # The last step (4) has a checkpoint of the loop, which the final one replaces. Before, that
    # one was removed in place: killed with some of its files gone, it was still listed, and the
    # same command refused to resume ("checkpoint .../step-000000004 cannot be read (... no random
    # state for rank 0 ...); delete that folder").
    run, straight = tmp_path / "run", tmp_path / "straight"
    argv = _pretrain_argv(wiki / "train", run, max_steps=4, **FINISHING)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    killed = subprocess.run([sys.executable, "-c", KILL_WHILE_REMOVING, ckpt.checkpoint_name(4), *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]  # it reached the removal
    assert pretrain_main(argv) == 0  # the same command again
    assert [step for step, _ in ckpt.list_checkpoints(str(run))] == [2, 4]
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000000002", "step-000000004"]  # no temporary left
    state = ckpt.load_trainer_state(ckpt.latest_checkpoint(str(run)))
    assert state["done"] and state["step"] == 4
    train(TrainArgs(data=str(wiki / "train"), output=str(straight), max_steps=4, **FINISHING))
    got, expected = _weights(run / "model"), _weights(straight / "model")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_pruning_leaves_the_newest_checkpoints_whole_and_nothing_else(wiki, tmp_path):
    run = tmp_path / "run"
    train(TrainArgs(data=str(wiki / "train"), output=str(run), max_steps=9, keep_checkpoints=2, **FINISHING))
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000000008", "step-000000009"]
    for step in (8, 9):
        files = sorted(os.listdir(run / "checkpoints" / ckpt.checkpoint_name(step)))
        assert files == ["config.json", "model.safetensors", "optimizer.json", "optimizer.safetensors",
                         "rng-rank00000.safetensors", "trainer_state.json", "vocab.json"]


def test_a_finished_run_without_its_model_folder_writes_it_again(wiki, tmp_path, capsys):
    # a run left by the older order (done, then model/), or whose model/ was removed
    run = tmp_path / "run"
    train(TrainArgs(data=str(wiki / "train"), output=str(run), max_steps=3, **FINISHING))
    published = _weights(run / "model")
    shutil.rmtree(run / "model")
    result = train(TrainArgs(data=str(wiki / "train"), output=str(run), max_steps=3, **FINISHING))
    assert result["done"] and "model/ was missing" in capsys.readouterr().err
    again = _weights(run / "model")
    assert all(torch.equal(published[k], again[k]) for k in published)


def test_pretrain_on_a_folder_prepare_did_not_write_says_to_run_prepare(tmp_path, capsys):
    # Before: "[Errno 2] No such file or directory: '.../manifest.json'", after writing run.json
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "corpus.txt").write_text("Plain text , not prepared .\n")
    for data, says in [(raw, f"{raw} is not a prepared folder (it has no manifest.json)"),
                       (tmp_path / "absent", f"{tmp_path / 'absent'} does not exist")]:
        assert cli_main(["pretrain", "--data", str(data), "--output", str(tmp_path / "run"), "--preset", "tiny"]) == 2
        err = capsys.readouterr().err
        assert f"elmo-pipeline pretrain: error: {says}" in err and "run that first" in err
        assert "`elmo-pipeline prepare --input TEXT --output FOLDER`" in err
    assert not (tmp_path / "run").exists()  # nothing written for a command that cannot run


@pytest.mark.parametrize("which", ["manifest.json", "vocab.json"])
def test_a_prepared_folder_whose_file_is_endless_is_refused_unread(tmp_path, capsys, wikitext_pack, which):
    pack, _ = wikitext_pack
    data = tmp_path / "train"
    shutil.copytree(pack / "wt2-train", data)
    (data / which).unlink()
    (data / which).symlink_to("/dev/zero")  # was read until memory ran out
    assert cli_main(["pretrain", "--data", str(data), "--output", str(tmp_path / "run"), "--preset", "tiny"]) == 2
    says = f"{data / which}: not a regular file (a device, FIFO or socket); refused unread"
    assert f"elmo-pipeline pretrain: error: {says}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("left", ["old+staging", "old+final", "old only", "staging only"])
def test_a_half_done_folder_swap_is_completed_or_undone(tmp_path, left):
    final = tmp_path / "model"

    def folder(path: Path, text: str) -> None:
        path.mkdir()
        (path / "weights").write_text(text)

    parts = left.split("+") if "+" in left else [left.split()[0]]
    for part in parts:
        folder({"old": tmp_path / "model.old", "staging": tmp_path / "model.tmp", "final": final}[part], part)
    recover_folder(str(final))
    expected = {"old+staging": "staging", "old+final": "final", "old only": "old", "staging only": None}[left]
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if expected is None else ["model"])
    if expected:
        assert (final / "weights").read_text() == expected  # a staging folder without .old may be partial

    replace_folder(str(final), lambda path: folder(Path(path), "new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and (final / "weights").read_text() == "new"


def test_finetuning_lowers_domain_perplexity_and_grows_the_vocabulary(wiki, tmp_path):
    """Domain transfer: a model pretrained on Wikipedia text, fine-tuned on web text (EWT)."""
    base = tmp_path / "base"
    train(_args(wiki / "train", base, epochs=3, optimizer="adam", lr=0.01, checkpoint_every=1000))
    ewt = data_path("ud_english_ewt", "en_ewt-ud-train.conllu")
    sentences = _conllu_sentences(ewt, 260)
    _prepare_text(sentences[:200], tmp_path / "domain")
    _prepare_text(sentences[200:], tmp_path / "domain_held")
    held = str(tmp_path / "domain_held")

    before = evaluate(BiLM.from_pretrained(str(base / "model")), held)
    tuned = tmp_path / "tuned"
    train(_args(tmp_path / "domain", tuned, preset=None, init=str(base / "model"), grow_vocab=False, epochs=3,
                optimizer="adam", lr=0.01, checkpoint_every=1000))
    after = evaluate(BiLM.from_pretrained(str(tuned / "model")), held)
    assert after["average_perplexity"] < 0.9 * before["average_perplexity"], (before, after)

    # with a growing vocabulary the old rows are kept and the new words are appended
    grown = tmp_path / "grown"
    train(_args(tmp_path / "domain", grown, preset=None, init=str(base / "model"), max_steps=1))
    old, new = BiLM.from_pretrained(str(base / "model")), BiLM.from_pretrained(str(grown / "checkpoints" /
                                                                                 "step-000000001"))
    assert new.vocab.tokens[: len(old.vocab)] == old.vocab.tokens and len(new.vocab) > len(old.vocab)
    assert new.config.vocab_size == len(new.vocab)
    w_old, w_new = old.softmax.weight, new.softmax.weight
    assert w_new.shape[0] == len(new.vocab)
    # one Adagrad step moves the old rows a little, but they came from the old model
    assert float((w_new[: len(old.vocab)] - w_old).detach().abs().max()) < 0.5


def test_finetuning_says_how_much_of_the_corpus_is_outside_the_vocabulary(wiki, tmp_path):
    """With --no-grow-vocab a corpus of another language trains nearly every word as <UNK>, and the
    run said nothing of it (the default model on 100 UD Chinese sentences: 2,636 of 2,725)."""
    base = tmp_path / "base"
    train(_args(wiki / "train", base, max_steps=1))
    text = "北京 是 中国 的 首都 .\nthe <unk> of 北京 , the capital\n" * 3
    _prepare_text([text], tmp_path / "domain")
    vocab = BiLM.from_pretrained(str(base / "model")).vocab
    words = text.split()
    outside = sum(1 for w in words if w not in vocab.index or w == "<unk>")  # <unk> is WikiText's unknown word
    assert 0 < outside < len(words)
    for grow, expected in ((False, outside), (True, words.count("<unk>"))):
        log = io.StringIO()
        Trainer(_args(tmp_path / "domain", tmp_path / f"tuned-{grow}", preset=None, init=str(base / "model"),
                      grow_vocab=grow, max_steps=0), out=log).run()
        assert (f"; {expected:,} of the corpus's {len(words)} tokens are outside the vocabulary and train as <UNK>\n"
                in log.getvalue())


def test_grown_vocabulary_appends_in_count_order():
    from elmo_pipeline.model.vocabulary import Vocabulary

    old = Vocabulary(["<S>", "</S>", "<UNK>", "a", "b"], [1, 1, 0, 5, 3])
    new = Vocabulary(["<S>", "</S>", "<UNK>", "c", "a", "d"], [2, 2, 1, 9, 4, 1])
    grown = grown_vocabulary(old, new)
    assert grown.tokens == ["<S>", "</S>", "<UNK>", "a", "b", "c", "d"]
    assert grown.counts == [1, 1, 0, 5, 3, 9, 1]


def test_init_from_original_weights_builds_a_new_softmax(wiki, tmp_path, elmo_fixture_dir):
    init = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    original = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(elmo_fixture_dir / "lm_weights.hdf5"))
    run = tmp_path / "run"
    train(_args(wiki / "train", run, preset=None, init=init, max_steps=2, lr=1e-9, clip_norm=None, dropout=0.0))
    model = BiLM.from_pretrained(str(run / "model"))
    assert model.softmax is not None and model.config.softmax.kind == "full"
    assert len(model.vocab) == len(PreparedCorpus(str(wiki / "train")).vocab)
    # everything but the new softmax started from the original weights (lr ~ 0: unchanged)
    for k, v in original.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, atol=1e-6, rtol=0)


def test_init_with_other_cutoffs_builds_a_new_adaptive_softmax(wiki, tmp_path):
    """--cutoffs with an --init model of other adaptive clusters failed naming a tensor ("cannot
    continue from 'softmax.adaptive.head.weight'"); the softmax is built new, as for another --softmax."""
    base = tmp_path / "base"
    train(_args(wiki / "train", base, softmax="adaptive", cutoffs=[20], max_steps=1))
    source = BiLM.from_pretrained(str(base / "model"))
    tuned = tmp_path / "tuned"
    train(_args(wiki / "train", tuned, preset=None, init=str(base / "model"), cutoffs=[10], max_steps=0))
    model = BiLM.from_pretrained(str(tuned / "model"))
    assert model.config.softmax.cutoffs == (10,)
    assert model.softmax.adaptive.head.weight.shape[0] == 10 + 1  # the shortlist and one tail cluster
    for name, value in source.state_dict().items():  # everything else came from the --init model
        if not name.startswith("softmax."):
            assert torch.equal(model.state_dict()[name], value), name


def test_evaluate_cli_prints_three_perplexities(wiki, tmp_path, capsys):
    run = tmp_path / "run"
    train(_args(wiki / "train", run, max_steps=2))
    from elmo_pipeline.cli.training import main

    text = str(data_path("wikitext2", "wiki.valid.tokens"))
    sample = tmp_path / "sample.txt"
    sample.write_text("".join(_lines(text, 200, 60)), encoding="utf-8")
    assert main(["evaluate", "--model", str(run / "model"), "--data", str(sample), "--max-sentence-tokens",
                 "40"]) == 0
    out = json.loads(capsys.readouterr().out)
    f, b, avg = out["forward_perplexity"], out["backward_perplexity"], out["average_perplexity"]
    assert math.isclose(avg, math.sqrt(f * b), rel_tol=1e-9)
    # raw text and the prepared folder of the same text give the same numbers
    prepared = evaluate(BiLM.from_pretrained(str(run / "model")), str(wiki / "held"))
    assert math.isclose(prepared["average_perplexity"], avg, rel_tol=1e-5)
    assert prepared["tokens"] == out["tokens"]


def test_export_averages_checkpoints_and_refuses_other_vocabularies(wiki, tmp_path, capsys):
    from elmo_pipeline.cli.training import main
    from elmo_pipeline.model.vocabulary import Vocabulary

    run = tmp_path / "run"
    train(_args(wiki / "train", run, max_steps=6, checkpoint_every=3, optimizer="adam", lr=0.01))
    first, second = (run / "checkpoints" / f"step-00000000{s}" for s in (3, 6))
    w3, w6 = _weights(first), _weights(second)
    assert any(not torch.equal(w3[k], w6[k]) for k in w3)

    out = tmp_path / "mean"
    assert main(["export", str(first), str(second), "--output", str(out), "--dtype", "float16"]) == 0
    assert json.loads(capsys.readouterr().out)["averaged"] == 2
    mean = _weights(out)
    for k in w3:
        expected = ((w3[k].double() + w6[k].double()) / 2).to(torch.float16).to(w3[k].dtype)
        torch.testing.assert_close(mean[k], expected, rtol=0, atol=0)
    assert BiLM.from_pretrained(str(out)).vocab.tokens == BiLM.from_pretrained(str(first)).vocab.tokens

    # one source: a plain copy
    assert main(["export", str(second), "--output", str(tmp_path / "copy")]) == 0
    assert all(torch.equal(v, w6[k]) for k, v in _weights(tmp_path / "copy").items())

    # a model whose word ids mean other words cannot be averaged in
    other = BiLM.from_pretrained(str(first))
    tokens = list(other.vocab.tokens)
    tokens[-2], tokens[-1] = tokens[-1], tokens[-2]
    other.vocab = Vocabulary(tokens, other.vocab.counts)
    other.save_pretrained(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="vocabulary differs"):
        ckpt.export_model([str(second), str(tmp_path / "other")], str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()


def test_a_validation_row_counts_the_tokens_trained_by_its_step(wiki, tmp_path):
    """Validations between log lines gave the tokens of the last log line (0 at step 2)."""
    def rows(run, log_every):
        train(_args(wiki / "train", run, epochs=1, max_steps=6, log_every=log_every, eval_every=2,
                    valid=str(wiki / "held")))
        return _metrics_rows(run)

    every_step = {int(r["step"]): int(r["tokens"]) for r in rows(tmp_path / "a", 1) if r["kind"] == "train"}
    valid = {int(r["step"]): int(r["tokens"]) for r in rows(tmp_path / "b", 4) if r["kind"] == "valid"}
    assert sorted(valid) == [2, 4, 6]
    assert every_step[2] > 0
    assert valid == {step: every_step[step] for step in (2, 4, 6)}


def test_a_resume_cutting_the_batches_otherwise_is_taken_at_a_shard_end_only(wiki, tmp_path):
    """--batch-tokens or --seed changed at resume applied the checkpoint's batch count to other
    batches: measured on 300 EWT sentences, 84 were trained twice and 29 never in that epoch."""
    run = tmp_path / "run"
    train(_args(wiki / "train", run, epochs=1, max_steps=3, checkpoint_every=3))
    for changed in (dict(batch_tokens=200), dict(seed=4), dict(max_batch_sentences=3)):
        with pytest.raises(ValueError, match=r"the checkpoint's data position \(epoch 0, shard 1 of 5, batch 3\) "
                                             r"counts batches cut otherwise \(--"):
            train(_args(wiki / "train", run, epochs=1, **changed))
    # a finished epoch ends every shard: the next one is cut as now asked, every sentence once
    done = tmp_path / "done"
    first = train(_args(wiki / "train", done, epochs=1))
    second = train(_args(wiki / "train", done, epochs=2, batch_tokens=200, seed=4))
    tokens = PreparedCorpus(str(wiki / "train")).manifest.tokens
    assert first["tokens"] == tokens and second["tokens"] == 2 * tokens and second["done"]
