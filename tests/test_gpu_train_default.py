"""benchmarks/gpu_train_default.py end to end at toy size on CPU, with the commands a lent GPU
runs: pack, detached variants that outlive the command that started them, wait, finish, assemble.
One variant is given a dropout the trainer refuses, so that its failure is seen to leave the
others running and to be reported; one trains with the fused kernel; a snapshot is taken while
they train."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import pytest

from benchmarks import gpu_train_default as g
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.training.evaluate import evaluate
from support import strict_json


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, wikitext_pack):
    root = tmp_path_factory.mktemp("gpu_train")
    pack, packed = wikitext_pack
    runs = root / "runs"
    # 60 s: the fitted run must have time left to be seen, and beside a second test worker
    # (pytest -n 2) on 2 cores the warm-up's start-up, 4 steps and validation once took all of 40 s
    assert g.main(["start", "--data", str(pack), "--runs", str(runs), "--seconds", "60",
                   "--variants", "0.2,1.5,0.2/fused", "--preset", "tiny", "--device", "cpu", "--warmup-steps", "4",
                   "--batch-tokens", "1024", "--log-every", "2", "--reserve", "3", "--threads", "1"]) == 0
    best = runs / "dropout-0.2" / "run" / "best" / "valid.json"
    for _ in range(600):  # the warm-up's validation publishes the first best/
        if best.exists():
            break
        time.sleep(0.1)
    # a snapshot while the variant trains on, as the first device call ends
    assert g.main(["finish", "--snapshot", "--runs", str(runs), "--out", str(root / "snapshot"),
                   "--part-bytes", "40000"]) == 0
    ended = g.wait(runs, seconds=120, every=2)
    # the runs' own copy of the data, as on the device, where the carried folder may be replaced
    assert g.main(["finish", "--runs", str(runs), "--out", str(root / "out"), "--grace", "30",
                   "--part-bytes", "40000"]) == 0
    return root, packed, ended


def test_pack_prepares_what_the_model_card_prepares(wikitext_pack):
    pack, packed = wikitext_pack
    assert packed["max_lines"] == 300 and set(packed["sources"]) == {"train", "valid", "test"}
    assert [c[:2] for c in packed["commands"]] == [["elmo-pipeline", "prepare"]] * 2
    for command in packed["commands"]:
        assert command[command.index("--tokenizer") + 1] == "whitespace"
        assert command[command.index("--unk-token") + 1] == "<unk>"
    manifest = json.loads((pack / "wt2-train" / "manifest.json").read_text())
    assert manifest["tokens"] > 10000
    test_text = (pack / "wiki.test.tokens").read_text(encoding="utf-8")
    assert test_text.count("\n") == 300 == packed["sources"]["test"]["lines"]
    assert hashlib.sha256(test_text.encode()).hexdigest() == packed["sources"]["test"]["sha256"]


def test_pack_replaces_an_earlier_pack_only(tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("mine too")
    for out in (users, tmp_path / "a-file"):
        with pytest.raises(SystemExit, match="not an earlier pack"):
            g.pack(out, Path("/nonexistent"), max_lines=1)
    assert (users / "notes.txt").read_text() == "mine" and (tmp_path / "a-file").read_text() == "mine too"


def test_variants_train_to_the_deadline_and_a_failure_stays_in_its_own_variant(toy_run):
    root, _, ended = toy_run
    assert ended
    summary = strict_json((root / "out" / g.SUMMARY).read_text())
    good, bad, fused = summary["variants"]
    assert bad["phase"] == "failed" and "dropout" in bad["error"] and "best_valid" not in bad
    assert good["phase"] == fused["phase"] == "done"
    assert summary["chosen"] == min((good, fused), key=lambda v: v["best_valid"])["name"]
    assert (good["name"], good["kernel"], fused["name"], fused["kernel"]) == (
        "dropout-0.2", "auto", "dropout-0.2-fused", "fused")
    assert all(c[c.index("--kernel") + 1] == "fused" for c in fused["commands"])
    warmup, fitted = good["commands"]
    assert warmup[warmup.index("--max-steps") + 1] == "4"
    assert int(fitted[fitted.index("--max-steps") + 1]) == good["max_steps"] > 4
    # both invocations are one command line but for the step limit and its companions
    varying = {"--max-steps", "--eval-every", "--checkpoint-every", "--max-time"}
    strip = lambda c: [a for i, a in enumerate(c) if a not in varying and c[i - 1] not in varying]  # noqa: E731
    assert strip(warmup) == strip(fitted)
    assert 4 < good["steps"] <= good["max_steps"] and good["tokens"] > 0
    # the fitted run's step count paid for a start-up and 8 validations timed from the warm-up
    assert good["overhead_s"] > 0 and 0 < good["validation_s"] < 25
    assert good["best_valid"] == min(v for _, v in good["valid_curve"])
    assert math.isfinite(good["best_valid"]) and good["best_valid"] < 3000


def test_a_warm_up_slower_than_planned_stops_at_the_deadline_with_a_validated_model(tmp_path, wikitext_pack):
    """A path far slower than planned on the GPU must not train past the session's device time
    with nothing validated: the warm-up stops for time and validates, and the variant is done."""
    pack, _ = wikitext_pack
    runs = tmp_path / "runs"
    assert g.main(["start", "--data", str(pack), "--runs", str(runs), "--seconds", "10", "--variants", "0.2",
                   "--preset", "tiny", "--device", "cpu", "--warmup-steps", "100000", "--batch-tokens", "1024",
                   "--log-every", "2", "--reserve", "4", "--threads", "1", "--smoke-steps", "0"]) == 0
    assert g.wait(runs, seconds=120, every=1)
    variant = g._read_json(runs / g.PLAN)["variants"][0]
    record = g.variant_record(runs, variant)
    assert record["phase"] == "done" and len(record["commands"]) == 1  # no fitted invocation: no time left
    assert "--max-time" in record["commands"][0]
    assert 0 < record["steps"] < 100000
    assert record["valid_curve"][-1][0] == record["steps"] and math.isfinite(record["best_valid"])
    assert "stopped at the time limit" in (runs / variant["name"] / "train.log").read_text()


def test_finish_picks_by_validation_and_its_parts_rebuild_the_model(toy_run, wikitext_pack):
    pack, _ = wikitext_pack
    root, _, _ = toy_run
    out = root / "out"
    summary = strict_json((out / g.SUMMARY).read_text())
    assert summary["picked"] == min(summary["candidates"], key=lambda c: c["valid"])["name"]
    # the suite's environment record: where the library came from, and that it is this checkout
    assert summary["environment"]["device"] == "cpu" and summary["environment"]["matches_checkout"] is True
    assert len(summary["candidates"]) == 2  # best/ and the mean of the last two checkpoints
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= g.DEVICE_FILE_COUNT and len(summary["parts"]) >= 2
    assert all(p["bytes"] <= 40000 for p in summary["parts"])
    model_dir = root / "assembled" / "model"
    g.main(["assemble", "--parts", str(out), "--output", str(model_dir)])
    weights = (model_dir / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == summary["sha256"]
    assert len(weights) == sum(p["bytes"] for p in summary["parts"])
    model = BiLM.load(str(model_dir))
    assert str(next(model.parameters()).dtype) == "torch.float32"  # float16 on disk, upcast on load
    again = evaluate(model, str(pack / "wt2-valid"), tokenizer="whitespace", max_sentence_tokens=128,
                     batch_tokens=8192)
    assert again["average_perplexity"] == pytest.approx(summary["float16"]["valid"]["average_perplexity"],
                                                        rel=1e-6)
    assert summary["float16"]["test"]["tokens"] > 10000


def test_assemble_refuses_a_part_that_does_not_match(toy_run, tmp_path):
    root, _, _ = toy_run
    copy = tmp_path / "out"
    copy.mkdir()
    for path in (root / "out").iterdir():
        copy.joinpath(path.name).write_bytes(path.read_bytes())
    part = copy / f"{g.PART_PREFIX}01"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="does not match its checksum"):
        g.assemble(copy, tmp_path / "model")


def test_start_refuses_a_used_runs_folder_and_missing_data(toy_run, tmp_path, wikitext_pack):
    pack, _ = wikitext_pack
    root, _, _ = toy_run
    with pytest.raises(SystemExit, match="not empty"):
        g.main(["start", "--data", str(pack), "--runs", str(root / "runs"), "--seconds", "5"])
    with pytest.raises(SystemExit, match="wt2-train is missing"):
        g.main(["start", "--data", str(tmp_path), "--runs", str(tmp_path / "new"), "--seconds", "5"])


def test_parts_hold_at_most_what_the_device_brings_back(tmp_path):
    source = tmp_path / "w"
    source.write_bytes(bytes(range(256)) * 10)
    parts = g.write_parts(source, tmp_path, 1000)
    assert [p["bytes"] for p in parts] == [1000, 1000, 560]
    assert b"".join((tmp_path / p["file"]).read_bytes() for p in parts) == source.read_bytes()
    with pytest.raises(ValueError, match="more than 8 parts"):
        g.write_parts(source, tmp_path, 300)
    with pytest.raises(ValueError, match="parts of 1 to"):
        g.write_parts(source, tmp_path, g.DEVICE_FILE_LIMIT + 1)


@pytest.mark.parametrize("rows, expected", [
    ([("train", 2, 1.0), ("train", 4, 2.0), ("train", 8, 3.0)], 4.0),  # the first row (start-up) left out
    ([("train", 2, 1.0), ("valid", 2, 1.5)], 2 / 0.5),  # too few rows: the invocation's own steps and time
])
def test_the_rate_that_fits_the_schedule(rows, expected):
    table = [{"kind": k, "step": str(s), "elapsed_s": str(t)} for k, s, t in rows]
    assert g.steps_per_second(table, 2, 0.5) == pytest.approx(expected)
    # 100 s left, 20 s of start-up once and 8 validations of 2.5 s: 60 s of steps, a twentieth kept
    assert g.fitted_steps(expected, 100.0, 4, 20.0, 2.5) == 4 + math.floor(0.95 * expected * 60)
    # validations that would take it all leave a quarter of the time to the steps
    assert g.fitted_steps(expected, 100.0, 4, 20.0, 50.0) == 4 + math.floor(0.95 * expected * 25)


def test_a_short_window_trains_most_of_it():
    """The 15-minute session leaves a few minutes to train: a start-up of 20 s and validations of
    about 1 s each must leave most of 150 s to the steps (the start-up counted once, not per
    validation)."""
    assert g.validation_seconds(217_646, 100_000.0) == pytest.approx(1.08823)
    steps = g.fitted_steps(1.0, 150.0, 100, 20.0, g.validation_seconds(217_646, 100_000.0))
    assert steps - 100 == math.floor(0.95 * (150 - 20 - 8 * 1.08823)) == 115


def test_a_snapshot_taken_while_training_is_a_whole_model(toy_run, tmp_path, wikitext_pack):
    pack, _ = wikitext_pack
    root, _, _ = toy_run
    summary = strict_json((root / "snapshot" / g.SUMMARY).read_text())
    assert summary["snapshot"] is True and summary["stopped_at_deadline"] == []
    assert set(summary["float16"]) == {"valid"}  # test is read once, by finish
    assert [c["name"] for c in summary["candidates"]] == ["best so far"]
    final = strict_json((root / "out" / g.SUMMARY).read_text())
    chosen = next(v for v in final["variants"] if v["name"] == summary["chosen"])
    assert summary["candidates"][0]["step"] <= chosen["steps"]
    g.assemble(root / "snapshot", tmp_path / "model")
    model = BiLM.load(str(tmp_path / "model"))
    again = evaluate(model, str(pack / "wt2-valid"), tokenizer="whitespace", max_sentence_tokens=128,
                     batch_tokens=8192)
    assert again["average_perplexity"] == pytest.approx(summary["float16"]["valid"]["average_perplexity"],
                                                        rel=1e-6)


def test_start_smoke_tests_each_kernel_and_the_variants_read_their_own_copy_of_the_data(toy_run):
    root, _, _ = toy_run
    plan = strict_json((root / "runs" / g.PLAN).read_text())
    assert set(plan["smoke"]) == {"auto", "fused"} and all(r["ok"] for r in plan["smoke"].values())
    for kernel in ("auto", "fused"):  # a few steps and a validation each, with the variants' flags
        rows = (root / "runs" / "smoke" / kernel / "run" / "metrics.csv").read_text().splitlines()
        assert any(r.startswith("valid") for r in rows) and any(r.startswith("train") for r in rows)
    assert plan["data"] == str(root / "runs" / "data")
    for name in ("wt2-train", "wt2-valid", "wiki.test.tokens"):
        assert (root / "runs" / "data" / name).exists()
    summary = strict_json((root / "out" / g.SUMMARY).read_text())
    assert all(c[c.index("--data") + 1] == str(root / "runs" / "data" / "wt2-train")
               for v in summary["variants"] for c in v["commands"])
    assert plan["compute_mode"] is None and plan["exclusive"] is False  # CPU: no GPU to ask


def test_a_kernel_that_fails_its_smoke_test_gives_way_to_one_that_passed(toy_run, tmp_path):
    """A model with clips: the fused kernel refuses to train it (torch's LSTM op has no clips),
    so the smoke test falls back on auto, which passes."""
    root, _, _ = toy_run
    spec = tmp_path / "clipped.json"
    spec.write_text(json.dumps({"token_encoder": "char_cnn", "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4]],
                                "n_highway": 0}, "lstm": {"dim": 16, "projection_dim": 8, "cell_clip": 3.0,
                                                          "proj_clip": 3.0}, "softmax": {"kind": "full"}}))
    plan = {"data": str(root / "runs" / "data"), "exclusive": False,
            "common": ["--model-config", str(spec), "--device", "cpu", "--threads", "1", "--batch-tokens", "1024"]}
    results = g.smoke_test(tmp_path / "runs", plan, ["fused"], 1)
    assert results["fused"]["ok"] is False and "clips" in results["fused"]["error"]
    assert results["auto"]["ok"] is True and "exact" not in results
    variants = g.plan_variants([(0.3, "auto"), (0.5, "fused"), (0.3, "fused")], results)
    assert [(v["name"], v["kernel"], v["asked"]) for v in variants] == [
        ("dropout-0.3", "auto", "auto"), ("dropout-0.5", "auto", "fused")]  # the third is the first again


@pytest.mark.parametrize("smoke, expected", [
    ({}, [("dropout-0.3", "auto"), ("dropout-0.45-fused", "fused")]),  # no smoke test: as asked
    ({"auto": {"ok": False}, "fused": {"ok": True}, "exact": {"ok": True}},
     [("dropout-0.3-exact", "exact"), ("dropout-0.45-fused", "fused")]),
    ({"auto": {"ok": False}, "fused": {"ok": False}, "exact": {"ok": False}}, []),
])
def test_the_variants_that_the_smoke_test_leaves(smoke, expected):
    variants = g.plan_variants([(0.3, "auto"), (0.45, "fused")], smoke)
    assert [(v["name"], v["kernel"]) for v in variants] == expected


def test_start_refuses_a_library_that_is_not_this_checkout(toy_run, tmp_path, monkeypatch, wikitext_pack):
    pack, _ = wikitext_pack
    from benchmarks import gpu_suite

    root, _, _ = toy_run
    monkeypatch.setattr(gpu_suite, "library_source", lambda: {
        "library": "/tmp/site/elmo_pipeline", "matches_checkout": False, "differs": ["elmo_pipeline/model/lstm.py"]})
    with pytest.raises(SystemExit, match="rebuild its wheel"):
        g.main(["start", "--data", str(pack), "--runs", str(tmp_path / "runs"), "--seconds", "5"])
    assert not (tmp_path / "runs").exists()


def test_wait_ends_when_a_variant_process_is_gone_without_a_word(tmp_path, capsys):
    """A variant killed outright (the OOM killer, SIGKILL) writes no status: `wait` must not sit
    out its whole time for it."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    g._write_json(tmp_path / g.PLAN, {"deadline": time.time() + 600, "variants": [
        {"name": "dropout-0.3", "dropout": 0.3, "kernel": "auto", "pid": gone.pid}]})
    (tmp_path / "dropout-0.3").mkdir()
    g._write_json(tmp_path / "dropout-0.3" / g.STATUS, {"phase": "training"})
    start = time.perf_counter()
    assert g.wait(tmp_path, seconds=60, every=1) is True
    assert time.perf_counter() - start < 10
    assert "its process is gone" in capsys.readouterr().out
