"""What `pretrain` and `evaluate` refuse, and when: before the run folder is touched for bad
options and inputs, at the step for a diverging run, at resume for a damaged checkpoint."""

import argparse
import json
import os
import re
import shutil
import time

import pytest

from elmo_pipeline import BiLM
from elmo_pipeline.commands import run_command
from elmo_pipeline.cli.training import main
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.training import checkpointing as ckpt
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from support import data_path

TINY = ["--preset", "tiny", "--batch-tokens", "300", "--threads", "1", "--log-every", "1"]


def _text(count: int) -> str:
    lines = []
    with open(data_path("wikitext2", "wiki.valid.tokens"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            if len(lines) >= count:
                break
    return "".join(lines)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Prepared WikiText-2 sentences, and the same kind of text as a --valid file."""
    folder = tmp_path_factory.mktemp("refusals")
    doc = Document("sample", _text(40), "sample", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(folder / "data"), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=10**6)
    (folder / "valid.txt").write_text(_text(5), encoding="utf-8")
    return folder


def _pretrain(corpus, run, *extra):
    """`pretrain` on the corpus with TINY's options, those that `extra` gives again left to it."""
    tiny = [part for option, value in zip(TINY[::2], TINY[1::2]) if option not in extra for part in (option, value)]
    return main(["pretrain", "--data", str(corpus / "data"), "--output", str(run), *tiny, *extra])


@pytest.mark.parametrize("option, value, says", [
    ("--grad-accum", "0", "--grad-accum must be >= 1, got 0"),
    ("--log-every", "0", "--log-every must be >= 1, got 0"),
    ("--clip-norm", "-0.01", "--clip-norm must be >= 0.0, got -0.01"),  # would flip the gradients
    ("--lr", "nan", "--lr: expected a finite number, got nan"),
    ("--lr", "0", "--lr must be > 0.0, got 0.0"),
    # past float32: torch failed at the first step naming no option, the run folder made
    ("--lr", "1e39", "--lr must be <= 3.4028234663852886e+38, got 1e+39"),
    ("--weight-decay", "1e39", "--weight-decay must be <= 3.4028234663852886e+38, got 1e+39"),
    ("--adagrad-init", "1e39", "--adagrad-init must be <= 3.4028234663852886e+38, got 1e+39"),
    ("--epochs", "0", "--epochs must be >= 1, got 0"),
    ("--max-steps", "-1", "--max-steps must be >= 0, got -1"),
    ("--dropout", "1.5", "--dropout must be < 1.0, got 1.5"),
    ("--max-time", "inf", "--max-time: expected a finite number, got inf"),
    ("--cutoffs", "5000,10", "--cutoffs must be positive and strictly increasing, got [5000, 10]"),
    ("--seed", "-1", "--seed must be >= 0, got -1"),
    ("--seed", str(2**70), f"--seed must be <= {2**32 - 1}"),
])
def test_an_option_out_of_range_is_refused_before_the_run_folder_exists(corpus, tmp_path, capsys, option, value,
                                                                        says):
    run = tmp_path / "run"
    assert _pretrain(corpus, run, *(["--max-steps", "2"] if option != "--max-steps" else []), option, value) == 2
    assert says in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("url", ["memory://run1", "gs://bucket/run"])
def test_a_run_folder_on_another_file_system_is_refused_before_training(corpus, tmp_path, capsys, monkeypatch, url):
    """It used to train, then fail at the first checkpoint and leave a local folder `memory:/run1`."""
    monkeypatch.chdir(tmp_path)
    assert _pretrain(corpus, url, "--max-steps", "2") == 2
    assert (f"--output {url}: the run folder is a local folder (checkpoints are published by atomic renames, which "
            f"object stores lack), not a {url.split(':')[0]}:// URL; give a local path") in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bad_held_out_data_is_refused_before_training(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "2", "--valid", str(tmp_path / "missing.txt")) == 2
    assert f"input pattern '{tmp_path / 'missing.txt'}' matches no files" in capsys.readouterr().err
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n", encoding="utf-8")
    assert _pretrain(corpus, run, "--max-steps", "2", "--valid", str(blank)) == 2
    assert f"--valid {blank}: no sentences to evaluate" in capsys.readouterr().err
    assert not run.exists()


def test_held_out_data_unreadable_past_its_first_sentence_is_refused_before_training(corpus, tmp_path, capsys):
    """Only its first sentence was read up front: a bad line further on, or a damaged shard, ended
    the run at the validation after training, before any checkpoint or model/ held the steps."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    held = tmp_path / "held"
    held.mkdir()
    (held / "a.txt").write_text(_text(5), encoding="utf-8")
    (held / "b.txt").write_bytes(b"a fine line\nanother one\nbad \xff byte\n")
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "2", "--valid", str(held / "*.txt")) == 2
    assert f"{held / 'b.txt'}: line 3 is not UTF-8 (invalid start byte at byte 4)" in capsys.readouterr().err
    assert not run.exists()

    folder = tmp_path / "prepared"
    doc = Document("held", _text(5), "held", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(folder), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, shard_tokens=40)
    shards = sorted(folder.glob("shard-*.parquet"))
    assert len(shards) > 1
    table = pq.read_table(shards[-1])
    ids = table.column("ids").to_pylist()
    ids[-1][-1] = 10**6  # past the vocabulary, in the last sentence of the last shard
    pq.write_table(table.set_column(4, "ids", pa.array(ids, pa.list_(pa.int32()))), shards[-1])
    assert _pretrain(corpus, run, "--max-steps", "2", "--valid", str(folder)) == 2
    assert f"{shards[-1]}: token id 1000000 is outside the vocabulary" in capsys.readouterr().err
    assert not run.exists()


def test_an_adaptive_cluster_of_no_dimensions_is_refused_before_training(corpus, tmp_path, capsys):
    """torch gives tail cluster k projection_dim // 4**k dimensions: the tiny preset's 8 leave the
    second cluster none, and every word of it was equally likely, silently."""
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "1", "--softmax", "adaptive", "--cutoffs", "20,40") == 2
    assert ("--cutoffs 20,40: the adaptive softmax's cluster 2 (words from rank 40) would have 8 // 4^2 = 0 "
            "dimensions, every word in it equally likely; give --cutoffs with at most 1 value (e.g. 20)"
            ) in capsys.readouterr().err
    assert not run.exists()
    # the default cutoffs of a vocabulary past 10,001 words are 2000,10000: named as such
    words = [f"w{i}" for i in range(10_100)]
    doc = Document("many", "".join(" ".join(words[i : i + 10]) + "\n" for i in range(0, len(words), 10)), "many", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(tmp_path / "many"), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40)
    assert main(["pretrain", "--data", str(tmp_path / "many"), "--output", str(run), *TINY, "--max-steps", "1",
                 "--softmax", "adaptive"]) == 2
    assert "cutoffs [2000, 10000]: the adaptive softmax's cluster 2 (words from rank 10000)" in capsys.readouterr().err
    assert not run.exists()
    # one cluster of 8 // 4 = 2 dimensions trains
    assert _pretrain(corpus, run, "--max-steps", "1", "--softmax", "adaptive", "--cutoffs", "20") == 0


@pytest.mark.parametrize("output", ["", "file://"])
def test_an_output_naming_no_folder_is_refused_by_name(corpus, tmp_path, capsys, monkeypatch, output):
    """It failed with "[Errno 2] No such file or directory: ''", naming no option."""
    monkeypatch.chdir(tmp_path)
    assert _pretrain(corpus, output, "--max-steps", "1") == 2
    assert f"--output {output!r} names no folder; give a local path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_model_config_that_is_not_an_object_is_refused_by_name(corpus, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text("[1, 2]", encoding="utf-8")
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(corpus / "data"), "--output", str(run), "--model-config", str(spec),
                 "--max-steps", "1"]) == 2
    assert f"{spec}: expected a JSON object" in capsys.readouterr().err
    assert not run.exists()  # the model is built before the run folder is made


@pytest.mark.parametrize("softmax, says", [
    ({"kind": "sampled", "n_samples": 0}, "softmax.n_samples: must be >= 1, got 0"),
    ({"kind": "adaptive", "div_value": 1}, "softmax.div_value: must be > 1.0, got 1"),
])
def test_a_model_configs_bad_softmax_is_refused_naming_its_file(corpus, tmp_path, capsys, softmax, says):
    """The softmax section was checked on its own, and its errors named config.json, a file the
    command was not given."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"token_encoder": "char_cnn", "softmax": softmax,
                                "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4]], "n_highway": 1},
                                "lstm": {"dim": 12, "projection_dim": 6, "n_layers": 1}}), encoding="utf-8")
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(corpus / "data"), "--output", str(run), "--model-config", str(spec),
                 "--max-steps", "1"]) == 2
    assert f"error: {spec}: {says}" in capsys.readouterr().err
    assert not run.exists()


def test_a_model_config_too_large_to_train_is_refused_before_anything_is_allocated(corpus, tmp_path, capsys):
    """6 million filters of width 2: the highway layer alone is 2 x 6M x 6M weights, hundreds of TB.
    torch's allocator failed naming no field (and tens of GB were killed by the OOM killer)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"token_encoder": "char_cnn", "softmax": {"kind": "full"},
                                "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 6_000_000]],
                                             "n_highway": 1},
                                "lstm": {"dim": 12, "projection_dim": 6, "n_layers": 2}}), encoding="utf-8")
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(corpus / "data"), "--output", str(run), "--model-config", str(spec),
                 "--max-steps", "1", "--optimizer", "adam"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"(\S+): ([\d,]+) parameters \(lstm.dim 12, lstm.projection_dim 6, lstm.n_layers 2, char_cnn "
                      r"filters 6000004; vocabulary [\d,]+\) need ([\d,.]+) GiB to train \(float32 weights, "
                      r"gradients and adam state\), more than the [\d,.]+ GiB", err)
    assert found and found[1] == str(spec), err
    parameters = int(found[2].replace(",", ""))
    assert parameters > 2 * 6_000_004 ** 2  # the highway's transform and gate
    assert float(found[3].replace(",", "")) == pytest.approx(16 * parameters / 2**30, abs=0.06)  # 4 float32 copies
    assert not run.exists()


@pytest.mark.parametrize("lstm_layers, highways, filters, says", [
    (1_000_000, 1, 1, "lstm.n_layers 1000000: "),
    (2, 1001, 1, "char_cnn.n_highway 1001: "),
    (2, 1, 100_000, "char_cnn.filters 100000: "),
])
def test_a_model_config_of_too_many_layers_is_refused_at_once(corpus, tmp_path, capsys, lstm_layers, highways,
                                                              filters, says):
    """A million LSTM or highway layers of a few weights each fit in memory, but each is a module
    built one by one: the run was minutes in building them before its first step (100,000 filter
    entries, a convolution each: more than 100 s)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"token_encoder": "char_cnn", "softmax": {"kind": "full"},
                                "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4]] * filters, "n_highway": highways},
                                "lstm": {"dim": 12, "projection_dim": 6, "n_layers": lstm_layers}}), encoding="utf-8")
    run = tmp_path / "run"
    started = time.perf_counter()
    assert main(["pretrain", "--data", str(corpus / "data"), "--output", str(run), "--model-config", str(spec),
                 "--max-steps", "1", "--threads", "1"]) == 2
    assert time.perf_counter() - started < 5
    assert (f"{spec}: {says}a new model has at most 1000 layers of each kind (LSTM, highway, convolutions: the "
            "original has 2, 2 and 7); give fewer") in capsys.readouterr().err
    assert not run.exists()


def test_a_model_config_with_a_character_dictionary_is_refused_by_name(corpus, tmp_path, capsys):
    """An imported ELMoForManyLangs model's config.json given as the shape of a new model: its
    char_dictionary numbers that model's chars.json, which the new one lacks. The refusal was BiLM's
    'a character dictionary goes with the config's char_dictionary section', naming no file."""
    shape = {"format": "elmo-pipeline", "format_version": 1, "token_encoder": "char_cnn", "softmax": {"kind": "full"},
             "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 6]], "n_highway": 1,
                          "max_characters_per_token": 20},
             "lstm": {"dim": 12, "projection_dim": 6, "n_layers": 2}, "vocab_size": 426}
    spec = tmp_path / "config.json"
    spec.write_text(json.dumps({**shape, "char_dictionary": {"size": 454}}), encoding="utf-8")
    run = tmp_path / "run"
    command = ["pretrain", "--data", str(corpus / "data"), "--output", str(run), "--model-config", str(spec),
               "--batch-tokens", "300", "--threads", "1", "--max-steps", "1"]
    assert main(command) == 2
    assert (f"{spec}: char_dictionary: a new model reads the UTF-8 bytes of its words; a character dictionary "
            "belongs to the model whose chars.json it numbers: continue from that model with --init, or leave the "
            "section out") in capsys.readouterr().err
    assert not run.exists()
    spec.write_text(json.dumps(shape), encoding="utf-8")  # as the message says
    assert main(command) == 0
    trained = BiLM.from_pretrained(str(run / "model"))
    assert trained.config.char_dictionary is None and trained.config.char_cnn.max_characters_per_token == 20


def test_an_empty_corpus_is_refused(tmp_path, capsys):
    prepare_in_process(iter(()), str(tmp_path / "empty"), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, unk_alias=None, shard_tokens=1000)
    assert main(["pretrain", "--data", str(tmp_path / "empty"), "--output", str(tmp_path / "run"), *TINY]) == 2
    assert "holds no tokens; there is nothing to train on" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_diverging_run_stops_before_the_step_and_publishes_nothing(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "6", "--lr", "1e30", "--checkpoint-every", "100",
                     "--valid", str(corpus / "valid.txt")) == 2
    err = capsys.readouterr().err
    assert "training diverged at step" in err and "the gradient norm is nan" in err
    assert "no checkpoint was written, so the same command starts again" in err
    assert not (run / "model").exists() and not (run / "best").exists()
    assert ckpt.list_checkpoints(str(run)) == []
    losses = [row.split(",")[6] for row in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert losses and all(loss not in ("nan", "inf") for loss in losses)  # the diverged step logged nothing


def test_a_loss_past_exps_range_stops_the_run_as_diverged(corpus, tmp_path, capsys):
    # its perplexity overflowed math.exp in the log line: a traceback, exit 1
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "30", "--optimizer", "adam", "--lr", "1000", "--clip-norm", "0",
                     "--checkpoint-every", "100") == 2
    err = capsys.readouterr().err
    assert re.search(r"training diverged by step \d+: the (average|forward|backward) loss per prediction is "
                     r"[0-9.e+]+: the perplexity is not a finite number", err), err
    assert "Lower --lr or --clip-norm, or add --warmup-steps" in err and "Traceback" not in err
    assert not (run / "model").exists() and ckpt.list_checkpoints(str(run)) == []
    rows = (run / "metrics.csv").read_text().splitlines()[1:]
    assert rows and all(float(row.split(",")[6]) < 709 for row in rows)  # the diverged window logged nothing


def test_a_last_step_that_overflows_the_weights_publishes_nothing(corpus, tmp_path):
    """Its gradients were finite, so the step ran; the weights it left are not (an overflow is
    put in by the step hook, as a step too large for float32 would leave it)."""
    import torch

    from elmo_pipeline.training.options import TrainArgs
    from elmo_pipeline.training.trainer import Trainer, TrainingDiverged

    run = tmp_path / "run"

    class Overflowing(Trainer):
        def _after_step(self, s):
            with torch.no_grad():
                next(s.model.parameters()).view(-1)[0] = float("inf")
            return super()._after_step(s)

    args = TrainArgs(data=str(corpus / "data"), output=str(run), preset="tiny", max_steps=1, batch_tokens=300,
                     threads=1)
    with pytest.raises(TrainingDiverged, match="training diverged by step 1: parameter .* holds NaN or infinite"):
        Overflowing(args).run()
    assert not (run / "model").exists() and ckpt.list_checkpoints(str(run)) == []


def test_train_args_changed_after_they_were_made_are_checked_again(corpus, tmp_path):
    from elmo_pipeline.training.options import TrainArgs
    from elmo_pipeline.training.trainer import train

    args = TrainArgs(data=str(corpus / "data"), output=str(tmp_path / "run"), preset="tiny", max_steps=2)
    args.grad_accum = 0
    with pytest.raises(ValueError, match="--grad-accum must be >= 1, got 0"):
        train(args)
    args.grad_accum, args.epochs = 1, 1.5
    with pytest.raises(ValueError, match="--epochs: expected an integer, got 1.5"):
        train(args)
    args.epochs, args.schedule = 1, "step"
    with pytest.raises(ValueError, match=r"--schedule: expected one of \('constant', 'linear', 'cosine'\)"):
        train(args)
    assert not (tmp_path / "run").exists()


@pytest.fixture
def two_checkpoints(corpus, tmp_path):
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "3") == 0
    found = [path for _, path in ckpt.list_checkpoints(str(run))]
    assert [os.path.basename(p) for p in found] == ["step-000000002", "step-000000004"]
    return run, found


@pytest.mark.parametrize("damage", ["optimizer.json", "optimizer.safetensors", "rng-rank00000.safetensors",
                                    "trainer_state.json"])
def test_a_damaged_checkpoint_is_named_with_the_one_to_resume_from(corpus, two_checkpoints, capsys, damage):
    run, (earlier, latest) = two_checkpoints
    path = os.path.join(latest, damage)
    if damage.endswith(".safetensors"):
        os.truncate(path, 4)
    elif damage == "optimizer.json":
        with open(path, "w", encoding="utf-8") as f:
            f.write("{}")
    else:
        state = json.loads(open(path, encoding="utf-8").read())
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps({**state, "elapsed": float("nan")}))  # not JSON: refused
    assert _pretrain(corpus, run, "--max-steps", "6", "--checkpoint-every", "2") == 2
    err = capsys.readouterr().err
    assert f"checkpoint {latest} cannot be read" in err
    if damage.endswith(".safetensors"):  # safetensors' own message names no file
        assert f"cannot be read ({damage}: SafetensorError: " in err
    assert f"delete that folder and run the same command to resume from {earlier}" in err
    shutil.rmtree(latest)  # as the message says: the run goes on from the earlier checkpoint
    assert _pretrain(corpus, run, "--max-steps", "6", "--checkpoint-every", "2") == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6


def test_a_checkpoint_copied_or_linked_under_another_steps_name_is_refused(corpus, two_checkpoints, capsys):
    """A link step-000000009 -> step-000000002 (or a copy under that name) was resumed at step 2, and
    every checkpoint written after it was pruned as older than "step 9", the final one too: the
    next command went back to step 2 again."""
    run, (earlier, latest) = two_checkpoints
    linked = run / "checkpoints" / "step-000000009"
    os.symlink(earlier, linked)
    assert _pretrain(corpus, run, "--max-steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "1") == 2
    err = capsys.readouterr().err
    assert (f"checkpoint {linked} cannot be read ({linked}/trainer_state.json: holds step 2, not the step 9 its "
            f"folder's name says (a copy or link of another checkpoint?)); delete that folder and run the same "
            f"command to resume from {latest}") in err
    os.unlink(linked)
    assert _pretrain(corpus, run, "--max-steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "1") == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6
    assert [step for step, _ in ckpt.list_checkpoints(str(run))] == [6]
    assert ckpt.load_trainer_state(ckpt.latest_checkpoint(str(run)))["done"] is True


def test_a_checkpoint_of_another_runs_model_is_refused(corpus, two_checkpoints, tmp_path, capsys):
    """A checkpoint of a run of another --model-config copied into the folder was resumed in silence:
    the run went on training that other model as its own."""
    run, (earlier, latest) = two_checkpoints
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"token_encoder": "char_cnn", "softmax": {"kind": "full"},
                                "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 6]], "n_highway": 1},
                                "lstm": {"dim": 12, "projection_dim": 6, "n_layers": 2}}), encoding="utf-8")
    other = tmp_path / "other"
    assert main(["pretrain", "--data", str(corpus / "data"), "--output", str(other), "--model-config", str(spec),
                 "--batch-tokens", "300", "--threads", "1", "--max-steps", "6", "--checkpoint-every", "6"]) == 0
    copied = run / "checkpoints" / "step-000000006"
    shutil.copytree(other / "checkpoints" / "step-000000006", copied)
    capsys.readouterr()
    assert _pretrain(corpus, run, "--max-steps", "8", "--checkpoint-every", "2") == 2
    assert (f"checkpoint {copied} cannot be read (its model's configuration is not the one {run / 'run.json'} says "
            "the run started with (char_cnn, lstm differ): a checkpoint of another run?); delete that folder and run "
            f"the same command to resume from {latest}") in capsys.readouterr().err
    shutil.rmtree(copied)
    assert _pretrain(corpus, run, "--max-steps", "8", "--checkpoint-every", "2") == 0
    assert json.loads(capsys.readouterr().out)["step"] == 8
    resumed = BiLM.from_pretrained(str(run / "model"))
    assert (resumed.config.lstm.dim, resumed.config.char_cnn.n_filters) == (16, 12)  # the tiny preset's, kept


def test_a_run_started_again_without_checkpoints_records_its_new_model(corpus, tmp_path, capsys):
    """A run whose checkpoints are gone (killed before the first, or its only one deleted as the
    refusal of a damaged one advises) starts again from the command given; with its --model-config
    edited in place, its first resume was refused as holding another run's model, run.json still
    recording the one of the start that left nothing."""
    spec = tmp_path / "spec.json"
    shape = {"token_encoder": "char_cnn", "softmax": {"kind": "full"},
             "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 6]], "n_highway": 1},
             "lstm": {"dim": 12, "projection_dim": 6, "n_layers": 2}}
    spec.write_text(json.dumps(shape), encoding="utf-8")
    run = tmp_path / "run"
    command = ["pretrain", "--data", str(corpus / "data"), "--output", str(run), "--model-config", str(spec),
               "--batch-tokens", "300", "--threads", "1", "--checkpoint-every", "2"]
    assert main([*command, "--max-steps", "2"]) == 0
    shutil.rmtree(run / "checkpoints")
    shape["lstm"]["dim"] = 14
    spec.write_text(json.dumps(shape), encoding="utf-8")
    assert main([*command, "--max-steps", "2"]) == 0
    assert json.loads((run / "run.json").read_text(encoding="utf-8"))["model"]["lstm"]["dim"] == 14
    assert main([*command, "--max-steps", "4"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert BiLM.from_pretrained(str(run / "model")).config.lstm.dim == 14


def test_a_run_folder_in_use_is_refused(corpus, two_checkpoints, capsys):
    run, _ = two_checkpoints
    with ckpt.run_lock(str(run)):
        assert _pretrain(corpus, run, "--max-steps", "6") == 2
    assert f"{run} is in use by another pretrain (pid {os.getpid()} on" in capsys.readouterr().err
    assert _pretrain(corpus, run, "--max-steps", "6") == 0  # released


def test_a_resume_on_another_corpus_or_with_another_model_shape_is_refused(corpus, two_checkpoints, tmp_path, capsys):
    # another --data had the old data position applied to it (the run could end "done" untrained on
    # it), and --preset small went on training the tiny model, with a note only
    run, (_, latest) = two_checkpoints
    other = tmp_path / "other"
    doc = Document("other", _text(60), "other", 1)
    prepare_in_process(whitespace_sentences(doc, 40), str(other), tokenizer="whitespace", lang="en",
                       max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=10**6)
    common = ["--output", str(run), "--batch-tokens", "300", "--threads", "1", "--max-steps", "6"]
    assert main(["pretrain", "--data", str(other), *common]) == 2
    err = capsys.readouterr().err
    assert f"--data {other} is not the corpus {run} started on (" in err and "its data position would be" in err
    assert main(["pretrain", "--data", str(corpus / "data"), *common, "--preset", "small", "--softmax", "full"]) == 2
    assert (f"{run} holds a run whose first command built its model (--preset 'tiny' then, 'small' now; --softmax "
            "None then, 'full' now): a resumed run keeps that model") in capsys.readouterr().err
    assert [os.path.basename(p) for _, p in ckpt.list_checkpoints(str(run))][-1] == os.path.basename(latest)
    moved = tmp_path / "moved"
    shutil.copytree(corpus / "data", moved)  # the same corpus elsewhere resumes
    assert main(["pretrain", "--data", str(moved), *common]) == 0
    assert ckpt.list_checkpoints(str(run))[-1][0] == 6


def test_a_resume_with_another_optimizer_or_adagrad_init_is_refused(corpus, tmp_path, capsys):
    """Adam's checkpointed moments given to Adagrad (or the reverse, --optimizer left out after a run
    of adam) failed at the first step with a KeyError traceback ('sum', 'betas'), the run folder
    claimed; --adagrad-init given anew was noted as taken, and changed nothing: the sums are in the
    checkpoint."""
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "2", "--checkpoint-every", "2", "--optimizer", "adam") == 0
    latest = ckpt.latest_checkpoint(str(run))
    capsys.readouterr()
    assert _pretrain(corpus, run, "--max-steps", "4") == 2
    assert (f"{run} holds a run trained with --optimizer adam, whose state its checkpoints hold; --optimizer adagrad "
            f"(the default) cannot take it: give --optimizer adam as its first command did, or a new --output with "
            f"--init {latest}") in capsys.readouterr().err
    again = tmp_path / "again"
    assert _pretrain(corpus, again, "--max-steps", "2", "--checkpoint-every", "2", "--adagrad-init", "0.5") == 0
    capsys.readouterr()
    assert _pretrain(corpus, again, "--max-steps", "4", "--optimizer", "adam") == 2
    assert "--optimizer adam cannot take it: give --optimizer adagrad as" in capsys.readouterr().err
    assert _pretrain(corpus, again, "--max-steps", "4", "--adagrad-init", "2") == 2
    assert (f"--adagrad-init 2.0: {again} holds a run whose Adagrad sums began at 0.5, and its checkpoints hold them, "
            "so the value would change nothing") in capsys.readouterr().err
    assert [step for step, _ in ckpt.list_checkpoints(str(again))] == [2]
    # as it was, or left out (the sums in the checkpoint go on), and the adam run with its optimizer: resumed
    assert _pretrain(corpus, again, "--max-steps", "4", "--checkpoint-every", "2") == 0
    assert _pretrain(corpus, run, "--max-steps", "4", "--checkpoint-every", "2", "--optimizer", "adam") == 0
    assert [step for step, _ in ckpt.list_checkpoints(str(run))] == [2, 4]


def test_a_resume_notes_only_the_options_it_takes(corpus, two_checkpoints, tmp_path, capsys):
    """A run started with --init and --adagrad-init, resumed with them left out, was told 'arguments
    differ from the run's first command: adagrad_init, init, max_steps, preset', as if it now trained
    another model from other sums; it keeps both, and --max-steps is the one taken."""
    run, _ = two_checkpoints
    tuned = tmp_path / "tuned"
    common = ["pretrain", "--data", str(corpus / "data"), "--output", str(tuned), "--batch-tokens", "300",
              "--threads", "1", "--checkpoint-every", "2"]
    assert main([*common, "--init", str(run / "model"), "--adagrad-init", "0.5", "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main([*common, "--max-steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "note: arguments differ from the run's first command: max_steps\n" in err
    assert BiLM.from_pretrained(str(tuned / "model")).config.lstm.dim == 16  # the --init model's (tiny preset)


def test_a_torn_last_metrics_row_is_dropped_and_a_damaged_metrics_csv_named(corpus, two_checkpoints, capsys):
    run, _ = two_checkpoints
    metrics = run / "metrics.csv"
    before = metrics.read_text(encoding="utf-8")
    for damaged, says in ((before.replace("train,2,", "train,2,x,y\ntrain,2,", 1).encode(),
                           f"{metrics}, line 3: not a whole row"),
                          (before.encode() + b"\xff\n", f"{metrics}: cannot be read as metrics.csv (")):
        metrics.write_bytes(damaged)
        assert _pretrain(corpus, run, "--max-steps", "6") == 2
        assert says in capsys.readouterr().err
    metrics.write_text(before + "train,5,0,1.", encoding="utf-8")  # a kill while the row was appended
    assert _pretrain(corpus, run, "--max-steps", "6") == 0
    steps = [row.split(",")[1] for row in metrics.read_text(encoding="utf-8").splitlines()[1:]]
    assert steps == ["1", "2", "3", "4", "5", "6"]


def test_an_unreadable_run_json_is_named(corpus, two_checkpoints, capsys):
    run, _ = two_checkpoints
    (run / "run.json").write_text("", encoding="utf-8")
    assert _pretrain(corpus, run, "--max-steps", "6") == 2
    assert f"{run / 'run.json'}: not valid JSON" in capsys.readouterr().err


def test_evaluate_names_the_line_that_is_not_utf8_and_refuses_bad_numbers(corpus, two_checkpoints, tmp_path,
                                                                          capsys):
    run, _ = two_checkpoints
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a fine line\nanother one\nbad \xff byte\n")
    assert main(["evaluate", "--model", str(run / "model"), "--data", str(bad)]) == 2
    assert f"{bad}: line 3 is not UTF-8 (invalid start byte at byte 4)" in capsys.readouterr().err
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")  # named before the model loads (it said only "no sentences")
    assert main(["evaluate", "--model", str(tmp_path / "absent"), "--data", str(blank)]) == 2
    assert f"--data {blank}: no sentences to evaluate" in capsys.readouterr().err
    good = tmp_path / "good.txt"
    good.write_text("a fine line\n", encoding="utf-8")
    for option, value, says in (("--max-sentence-tokens", "0", "must be an integer >= 1, got 0"),
                                ("--batch-tokens", "0", "must be an integer >= 1, got 0"),
                                ("--threads", "100000", "must be an integer from 1 to 1024, got 100000")):
        with pytest.raises(SystemExit) as stopped:  # argparse's own error: usage, then the message
            main(["evaluate", "--model", str(run / "model"), "--data", str(good), option, value])
        assert stopped.value.code == 2 and f"argument {option}: {says}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # segfaulted torch
        _pretrain(corpus, tmp_path / "threads", "--threads", "100000")
    assert "argument --threads: must be an integer from 1 to 1024" in capsys.readouterr().err
    assert not (tmp_path / "threads").exists()


def test_a_prepared_folder_missing_a_shard_is_refused_before_training(tmp_path, capsys):
    """A shard missing from a prepared folder (a copy cut short) was found when the run reached it,
    after the shards read before it (shard 0 of 3 gone: 15 steps trained and checkpointed first, in
    a run measured so), and so was it by evaluate."""
    doc = Document("sample", _text(60), "sample", 1)
    data = tmp_path / "data"
    manifest = prepare_in_process(whitespace_sentences(doc, 40), str(data), tokenizer="whitespace", lang="en",
                                  max_sentence_tokens=40, unk_alias="<unk>", shard_tokens=1700)
    assert len(manifest.shards) == 3
    (data / manifest.shards[0].file).unlink()
    says = f"{data}: 1 of the 3 shards its manifest lists are missing ({manifest.shards[0].file}); copy the folder whole"
    run = tmp_path / "run"
    assert main(["pretrain", "--data", str(data), "--output", str(run), *TINY]) == 2
    assert says in capsys.readouterr().err
    assert not run.exists()
    assert main(["evaluate", "--data", str(data), "--threads", "1"]) == 2
    assert says in capsys.readouterr().err


def test_a_truncated_shard_is_named(corpus, two_checkpoints, tmp_path, capsys):
    run, _ = two_checkpoints
    data = tmp_path / "data"
    shutil.copytree(corpus / "data", data)
    shard = next(data.glob("shard-*.parquet"))
    os.truncate(shard, shard.stat().st_size // 2)
    assert main(["evaluate", "--model", str(run / "model"), "--data", str(data)]) == 2
    assert f"{shard}: not a readable training shard" in capsys.readouterr().err


def test_a_shard_with_ids_outside_its_vocabulary_or_damaged_bytes_is_named(corpus, two_checkpoints, tmp_path,
                                                                            capsys):
    """An id past the vocabulary failed in the softmax with a traceback; bytes zeroed inside a
    shard raised zstd's error naming no file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run, _ = two_checkpoints
    data = tmp_path / "data"
    shutil.copytree(corpus / "data", data)
    shard = next(data.glob("shard-*.parquet"))
    table = pq.read_table(shard)
    ids = table.column("ids").to_pylist()
    ids[0][0] = 1_000_000
    pq.write_table(table.set_column(table.schema.get_field_index("ids"), "ids",
                                    pa.array(ids, table.schema.field("ids").type)), shard)
    assert main(["evaluate", "--model", str(run / "model"), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: token id 1000000 is outside the vocabulary of " in err and "Traceback" not in err
    shutil.copy(next((corpus / "data").glob("shard-*.parquet")), shard)
    raw = bytearray(shard.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 100] = bytes(100)
    shard.write_bytes(bytes(raw))
    assert main(["evaluate", "--model", str(run / "model"), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: " in err and "run `prepare` again" in err and "Traceback" not in err, err


@pytest.mark.parametrize("edit", ["blanked", "byte-order mark", "swapped"])
def test_a_prepared_vocabulary_that_is_not_the_one_its_manifest_records_is_refused(corpus, two_checkpoints, tmp_path,
                                                                                 capsys, edit):
    """The shards' ids number the vocabulary `prepare` wrote; a vocab.json edited after it (a token
    blanked or given a byte-order mark, two tokens swapped) trained and evaluated each of those rows
    under the other word (pretrain exit 0, the model's vocabulary then holding '' for the word)."""
    run, _ = two_checkpoints
    data = tmp_path / "data"
    shutil.copytree(corpus / "data", data)
    raw = json.loads((data / "vocab.json").read_text(encoding="utf-8"))
    tokens = raw["tokens"]
    if edit == "swapped":
        tokens[3], tokens[4] = tokens[4], tokens[3]
    else:
        tokens[5] = "" if edit == "blanked" else "\ufeff" + tokens[5]
    (data / "vocab.json").write_text(json.dumps(raw, ensure_ascii=False), encoding="utf-8")
    says = f"{data / 'vocab.json'}: not the vocabulary the manifest records"
    assert main(["pretrain", "--data", str(data), "--output", str(tmp_path / "new"), *TINY]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert main(["evaluate", "--model", str(run / "model"), "--data", str(data), "--threads", "1"]) == 2
    assert says in capsys.readouterr().err


def test_a_checkpoint_the_disk_cannot_hold_is_named_and_taken_away(corpus, tmp_path, capsys, monkeypatch):
    """safetensors' SafetensorError on a full disk named no file and gave a traceback (exit 1), and
    the checkpoint's temporary folder stayed; the rerun, with room again, resumes."""
    from safetensors import SafetensorError

    save_file = ckpt.save_file

    def full_disk(tensors, path):
        if path.endswith("optimizer.safetensors") and "step-000000004" in path:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    run = tmp_path / "run"
    assert _pretrain(corpus, run, "--max-steps", "6", "--checkpoint-every", "2") == 2
    err = capsys.readouterr().err
    assert ("error: cannot write " + str(run / "checkpoints" / ".tmp-step-000000004" / "optimizer.safetensors")
            + ": Error while serializing: I/O error: No space left on device") in err and "Traceback" not in err
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000000002"]
    monkeypatch.setattr(ckpt, "save_file", save_file)
    assert _pretrain(corpus, run, "--max-steps", "6", "--checkpoint-every", "2") == 0
    assert "resuming from" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    assert run_command(argparse.Namespace(func=interrupted, command="pretrain")) == 130
    assert capsys.readouterr().err == "elmo-pipeline pretrain: interrupted\n"


def test_export_refuses_weights_beyond_float16s_range(two_checkpoints, tmp_path, capsys):
    import torch

    from elmo_pipeline import BiLM

    run, _ = two_checkpoints
    model = BiLM.from_pretrained(str(run / "model"))
    name = next(n for n, p in model.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        model.get_parameter(name)[0, 0] = 70000.0  # finite in float32 and bfloat16, not in float16
    model.save_pretrained(str(tmp_path / "large"))
    out = tmp_path / "half"
    assert main(["export", str(tmp_path / "large"), "--output", str(out), "--dtype", "float16"]) == 2
    assert f"tensor {name!r} has values beyond float16's range (largest finite 65504)" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export", str(tmp_path / "large"), "--output", str(out), "--dtype", "bfloat16"]) == 0


def test_export_averages_models_that_differ_only_in_name_and_names_a_differing_field(two_checkpoints, tmp_path,
                                                                                    capsys):
    """The same model imported twice under two names was refused as of another architecture."""
    from safetensors import safe_open

    run, _ = two_checkpoints

    def relabelled(folder: str, **changes) -> str:
        copy = tmp_path / folder
        shutil.copytree(run / "model", copy)
        config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
        for key, value in changes.items():
            section, _, field = key.partition("__")
            (config[section].__setitem__(field, value) if field else config.__setitem__(section, value))
        (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return str(copy)

    out = tmp_path / "mean"
    assert main(["export", str(run / "model"), relabelled("other_name", name="zhs.model"), "--output", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["averaged"] == 2
    assert json.loads((out / "config.json").read_text(encoding="utf-8"))["name"] == "elmo"  # the first's
    with safe_open(str(run / "model" / "model.safetensors"), "pt") as a, \
            safe_open(str(out / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_tensor(k).equal(b.get_tensor(k)) for k in a.keys())  # the mean of one model twice

    clipped = relabelled("clipped", lstm__cell_clip=3.0, name="x")
    assert main(["export", str(run / "model"), clipped, "--output", str(tmp_path / "bad")]) == 2
    assert "its configuration differs from" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match=r"differs from .*'s \(lstm\); only models of one architecture"):
        ckpt.export_model([str(run / "model"), clipped], str(tmp_path / "bad"))


def test_export_needs_a_new_folder_or_replaces_a_model_folder_whole(two_checkpoints, tmp_path, capsys):
    from safetensors import safe_open

    run, _ = two_checkpoints
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    # refused before the sources are read: the missing source is not what it names
    assert main(["export", str(tmp_path / "missing"), "--output", str(out)]) == 2
    assert "is not empty; give a new folder, or --overwrite to replace a model folder" in capsys.readouterr().err
    assert main(["export", str(run / "model"), "--output", str(out), "--overwrite"]) == 2
    assert "holds files but no config.json: not a model folder, so not replaced" in capsys.readouterr().err
    assert os.listdir(out) == ["notes.txt"]

    (out / "notes.txt").unlink()
    assert main(["export", str(run / "model"), "--output", str(out)]) == 0  # an empty folder is new enough
    (out / "stale.json").write_text("{}")  # left by something else: refused without --overwrite
    assert main(["export", str(run / "model"), "--output", str(out), "--dtype", "float16"]) == 2
    capsys.readouterr()
    assert main(["export", str(run / "model"), "--output", str(out), "--dtype", "float16", "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "vocab.json"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    # the original weights are a source as every command takes them (it looked for WEIGHTS.hdf5/config.json)
    pair = f"{data_path('allennlp_elmo', 'options.json')},{data_path('allennlp_elmo', 'lm_weights.hdf5')}"
    assert main(["export", pair, "--output", str(tmp_path / "original"), "--dtype", "float16"]) == 0
    assert sorted(os.listdir(tmp_path / "original")) == ["config.json", "model.safetensors"]
    capsys.readouterr()
    assert main(["export", str(run / "model"), str(run / "model"), "--output", str(tmp_path / "twice")]) == 2
    assert f"export sources given more than once: {run / 'model'} and {run / 'model'}" in capsys.readouterr().err
    # spelt apart, it is the same model: it was averaged in twice (A, A/, B gave (2A + B) / 3)
    spellings = [f"{run / 'model'}/", f"file://{run / 'model'}", f"{run}/../{run.name}/model"]
    assert main(["export", str(run / "model"), *spellings, "--output", str(tmp_path / "twice")]) == 2
    assert (f"export sources given more than once: {run / 'model'} and {' and '.join(spellings)}"
            in capsys.readouterr().err)
    assert not (tmp_path / "twice").exists()
    # the output is, or holds, a source: replacing it would delete what was read (it did, exit 0)
    before = (out / "model.safetensors").read_bytes()
    (out / "inner").mkdir()
    shutil.copytree(run / "model", out / "inner" / "m")
    for source in (out, out / "inner" / "m"):
        assert main(["export", str(source), "--output", str(out), "--overwrite", "--dtype", "bfloat16"]) == 2
        assert f"{out} holds {source}, which this command reads: replacing the folder would delete it" in \
            capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before and (out / "inner" / "m" / "config.json").exists()
