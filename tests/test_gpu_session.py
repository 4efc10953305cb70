"""benchmarks/gpu_session.py: the plan's arithmetic for a lent session's 15 minutes, and the main
call end to end on CPU (the quick suite, then a tiny model trained to the call's deadline,
chosen, exported and cut into parts, everything under one folder as the device brings it back)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from benchmarks import gpu_session as s
from benchmarks import gpu_train_default as g
from elmo_pipeline.model.bilm import BiLM
from support import strict_json

EXTRAS = [".whl/extra-1", ".whl/extra-2"]
DEVICE_COMMAND_LIMIT = 2000  # the device tool's limit on one command's length


def spent(plan: dict) -> float:
    """Device seconds the plan's calls take by its own figures."""
    a = plan["assumed_s"]
    transfers = sum(1 for c in plan["calls"] if c.command.startswith("ls "))
    return a["cold_start"] + transfers * a["transfer_call"] + plan["calls"][-1].timeout_s + a["after"]


def test_a_fresh_session_carries_beam_and_spacy_then_runs_both_issues_in_one_call():
    plan = s.plan(900, False, ".whl", EXTRAS, True)
    *transfers, main = plan["calls"]
    assert [(c.command, c.carry) for c in transfers] == [(f"ls {e}", (e,)) for e in EXTRAS]
    assert main.carry == (".whl/suite", ".whl/train") and main.timeout_s == s.CALL_LIMIT_S
    seconds = s.CALL_LIMIT_S - s.INSTALL_S - s.CALL_MARGIN_S
    assert "gpu_session run --out $OUT --until $UNTIL --train-data .whl/train" in main.command
    # the deadline taken before the install: its time counts, however long it takes
    assert main.command.startswith(f"set -o pipefail; UNTIL=$(( $(date +%s) + {s.CALL_LIMIT_S - s.CALL_MARGIN_S} )); "
                                   "{ { python3 -m pip install") and main.command.endswith("} 2>&1 | tee $OUT/session.log")
    assert len(main.command) < DEVICE_COMMAND_LIMIT
    assert spent(plan) <= 900
    window = seconds - s.SUITE_SECONDS - s.SUITE_OVERHEAD_S - s.FINISH_SECONDS
    assert window >= s.MIN_TRAIN_SECONDS and f"about {window} s of training" in main.why
    # a start slower than assumed leaves less device time, and the tool stops a command there
    assert main.why.endswith("only if budget_left_s (status's, or the last reply's lease) is at least 600, else "
                             "first `plan --warm --no-extras --budget-left` that figure")
    late = s.plan(520, True, ".whl", [], True)  # what that plan gives: a call that fits
    assert [c.timeout_s for c in late["calls"]] == [520 - s.AFTER_S] and "at least 480," in late["calls"][0].why


def test_a_short_budget_drops_the_transfers_then_the_training_then_refuses():
    short = s.plan(500, False, ".whl", EXTRAS, True)
    assert short["extras_dropped"] == EXTRAS and len(short["calls"]) == 1
    assert "skipped: under" in short["calls"][0].why and spent(short) <= 500
    with pytest.raises(SystemExit, match="too little|under the"):
        s.plan(300, False, ".whl", EXTRAS, True)
    warm = s.plan(700, True, ".whl", EXTRAS, True)  # a held machine pays no start
    assert warm["extras_carried"] == EXTRAS and spent(warm) <= 700


def test_without_the_suite_the_whole_call_trains():
    plan = s.plan(900, False, ".whl", EXTRAS, True, suite=False)
    (main,) = plan["calls"]  # Beam and spaCy serve the suite only
    assert "--suite-seconds 0 --train-data .whl/train" in main.command
    assert f"about {s.CALL_LIMIT_S - s.INSTALL_S - s.CALL_MARGIN_S - s.FINISH_SECONDS} s of training" in main.why
    with pytest.raises(SystemExit, match="nothing to plan"):
        s.plan(900, False, ".whl", EXTRAS, False, suite=False)


def test_the_plan_command_reads_the_wheels_folder_in_the_checkout(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(g, "ROOT", tmp_path)  # the checkout, wherever the command is started from
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(SystemExit, match="gpu_wheels.sh first"):
        s.main(["plan", "--budget-left", "900", "--wheels", "w"])
    for folder in ("suite", "train", "extra-1", "extra-2"):
        (tmp_path / "w" / folder).mkdir(parents=True)
    assert s.main(["plan", "--budget-left", "900", "--wheels", "./w/"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("run(command=") == 3 and 'carry=["w/extra-2"]' in printed
    assert 'carry=["w/suite", "w/train"]' in printed and "ELMO_PIPELINE_DATA=$PWD/w/suite/data" in printed
    for outside in (str(tmp_path / "w"), "../w", "w/../../w"):  # the tool could not carry these
        with pytest.raises(SystemExit, match="inside the checkout"):
            s.main(["plan", "--budget-left", "900", "--wheels", outside])


def _wheel(folder, name: str, files: dict) -> None:
    """A wheel of `files` (path -> text) that pip installs: the package and its dist-info."""
    import zipfile

    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for path, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(path, text)


def test_a_wheel_pip_refuses_costs_beam_and_spacy_not_the_session(tmp_path):
    """pip installs all of its wheels or none: one extra wheel cut short in transfer stopped the
    main call before the suite, and its error was not in the log that comes back."""
    weights = tmp_path / s.DEFAULT_WEIGHTS
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    _wheel(tmp_path / "w" / "suite", "elmo_pipeline", {"elmo_pipeline/__init__.py": "",
                                                        "elmo_pipeline/default_model/config.json": "{}"})
    _wheel(tmp_path / "w" / "extra-1", "beamish", {"beamish.py": "x = 1"})
    cut = tmp_path / "w" / "extra-1" / "beamish-1.0-py3-none-any.whl"
    cut.write_bytes(cut.read_bytes()[:40])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").symlink_to(sys.executable)
    site = tmp_path / "site"
    command = (f"set -o pipefail; {{ {s.install_line('w', str(site))} && python3 -c 'import elmo_pipeline' "
               f"&& echo RAN; }} 2>&1 | tee log")

    def install() -> tuple[int, str]:
        """The call's install line, then the suite's stand-in: its exit status and its log."""
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
        return done.returncode, (tmp_path / "log").read_text()

    returncode, log = install()
    assert returncode == 0 and log.rstrip().endswith("RAN"), log
    assert "beamish" in log and "w/suite alone, without Beam and spaCy" in log
    assert (site / s.DEFAULT_WEIGHTS).read_bytes() == b"weights" and not (site / "beamish.py").exists()
    (tmp_path / "w" / "suite" / "elmo_pipeline-1.0-py3-none-any.whl").write_bytes(b"cut")
    returncode, log = install()
    assert returncode != 0 and "w/suite did not install: nothing ran" in log and "RAN" not in log


@pytest.mark.parametrize("folder, message", [
    ("/tmp/wheels", "inside the checkout"), ("../wheels", "inside the checkout"), (".", "not ignored by git"),
    ("benchmarks", "not ignored by git"), ("{user}", "not a folder this script made")])
def test_the_wheels_script_refuses_a_folder_it_must_not_empty_before_fetching(folder, message):
    build = g.ROOT / "build"
    made_build = not build.exists()
    users = build / f"wheels-refusal-{os.getpid()}"  # git-ignored, as .venv is, and someone's
    folder = folder.format(user=users.relative_to(g.ROOT))
    try:
        users.mkdir(parents=True)
        (users / "keep.txt").write_text("mine")
        done = subprocess.run(["bash", "benchmarks/gpu_wheels.sh", folder], cwd=g.ROOT, capture_output=True,
                              text=True, env={**g.checkout_env(), "PYTHON": sys.executable}, timeout=60)
        if not (g.ROOT / ".git").exists():  # a copy of the tree (benchmarks/gpu_rehearse.sh tests one)
            message = "not a git checkout"
        assert done.returncode == 2 and message in done.stderr and "fetching" not in done.stderr, done.stderr
        assert (users / "keep.txt").read_text() == "mine" and (g.ROOT / "benchmarks" / "gpu_wheels.sh").exists()
    finally:
        shutil.rmtree(build if made_build else users, ignore_errors=True)


@pytest.mark.parametrize("argv, message", [
    (["--seconds", "0"], "--seconds must be positive"),
    (["--until", "1000"], "--until in the future"),
    ([], "one of the arguments --seconds --until is required"),
    (["--seconds", "60", "--until", "99999999999"], "not allowed with argument"),
    (["--seconds", "60", "--suite-seconds", "-1"], "not negative"),
    (["--seconds", "60", "--suite-sections", "speed,nope"], "unknown \\['nope'\\]"),
    (["--seconds", "60", "--", "--no-such-flag"], "gpu_train_default start's"),
    (["--seconds", "60", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_run_refuses_what_it_cannot_honour_before_any_work(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        s.parse_args(["run", "--out", str(tmp_path), *argv])
    assert re.search(message, capsys.readouterr().err)


def test_an_out_folder_that_cannot_be_written_stops_the_call_before_any_work(tmp_path, capsys):
    """An --out that exists but takes no file (root ignores a folder's mode; /proc takes none from
    anyone) ran the suite and the whole training, all of it lost, then said the suite never started."""
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit, match=r"--out /proc/self: cannot write there \(.*\): nothing would come back"):
        s.main(["run", "--out", "/proc/self", "--seconds", "60", "--suite-seconds", "0", "--train-data",
                str(tmp_path), "--runs", str(runs)])
    assert not runs.exists() and "=== training" not in capsys.readouterr().out


def test_a_suite_past_its_time_is_stopped_with_its_process_group(tmp_path):
    began = time.time()
    code, how = s.run_suite(tmp_path / "suite", 0.5, True, "oom", overhead=0.5)
    assert code == -1 and how.startswith("stopped after 1 s") and time.time() - began < 15


@pytest.fixture(scope="module")
def session(tmp_path_factory, wikitext_pack):
    root = tmp_path_factory.mktemp("gpu_session")
    pack, _ = wikitext_pack
    out = root / "out"
    began = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_session", "run", "--out", str(out), "--until", f"{began + 60:.0f}",
         "--quick",
         "--suite-sections", "oom", "--finish-seconds", "20", "--min-train-seconds", "10", "--train-data", str(pack),
         "--runs", str(root / "runs"), "--", "--variants", "0.2", "--preset", "tiny", "--device", "cpu",
         "--warmup-steps", "4", "--batch-tokens", "1024", "--log-every", "2", "--reserve", "3", "--threads", "1"],
        capture_output=True, text=True, cwd=g.ROOT, env=g.checkout_env(), timeout=300)
    return root, out, done, time.time() - began


def test_the_main_call_runs_the_suite_then_trains_to_its_deadline(session):
    root, out, done, seconds = session
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = strict_json((out / "suite" / "report.json").read_text())
    assert report["suite"]["mode"] == "quick" and list(report["sections"]) == ["oom"]
    assert report["sections"]["oom"]["status"] == "ok" and report["sections"]["oom"]["results"]["all_there"]
    summary = strict_json((out / "model" / g.SUMMARY).read_text())
    (variant,) = summary["variants"]
    assert variant["phase"] == "done" and variant["steps"] > 4
    # start took no smoke test (the session's default), and the deadline was the call's
    assert summary["plan"]["smoke"] == {} and summary["plan"]["deadline"] <= summary["plan"]["started"] + 60
    assert set(summary["float16"]) == {"valid", "test"}
    assert seconds < 60 + 60  # the deadline held: a loaded machine may overrun the finish reserve, not the window
    # the closing lines name both results and every file that comes back
    tail = done.stdout[done.stdout.index("=== session:"):]
    assert "suite (exit 0, ended): " in tail and "oom ok" in tail
    test_ppl = summary["float16"]["test"]["average_perplexity"]
    assert f"test {test_ppl:.2f} (float16)" in tail
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert f"files under {out}: {', '.join(files)}" in tail
    assert len(files) + 1 <= g.DEVICE_FILE_COUNT  # with the teed session.log


def test_what_comes_back_rebuilds_the_model(session, tmp_path):
    _, out, _, _ = session
    summary = g.assemble(out / "model", tmp_path / "model")
    model = BiLM.load(str(tmp_path / "model"))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert json.loads((tmp_path / "model.summary.json").read_text())["sha256"] == summary["sha256"]


def test_a_call_after_one_that_was_stopped_finishes_its_variants(session, tmp_path, wikitext_pack):
    """A main call stopped at the tool's limit leaves its variants training, detached; the next
    call (plan --warm --no-suite) refused their runs folder as used and exported nothing."""
    root, out, _, _ = session
    first = strict_json((out / "model" / g.SUMMARY).read_text())
    again = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_session", "run", "--out", str(again), "--seconds", "100",
         "--suite-seconds", "0", "--finish-seconds", "20", "--min-train-seconds", "10", "--train-data",
         str(wikitext_pack[0]), "--runs", str(root / "runs")],
        capture_output=True, text=True, cwd=g.ROOT, env=g.checkout_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "holds the variants an earlier call started" in done.stdout and "=== training: gpu_train_default start" \
        not in done.stdout
    summary = strict_json((again / "model" / g.SUMMARY).read_text())
    assert summary["plan"] == first["plan"] and summary["variants"] == first["variants"]
    assert (summary["chosen"], summary["picked"], summary["sha256"]) == (first["chosen"], first["picked"],
                                                                         first["sha256"])
    assert summary["float16"]["test"]["average_perplexity"] == first["float16"]["test"]["average_perplexity"]
    assert "training (resumed: the variants an earlier call started): " in done.stdout


def test_finish_runs_after_a_wait_that_failed_and_not_after_a_start_that_did(monkeypatch, tmp_path):
    """A wait that raised on a progress line (a sampled softmax's empty perplexity cell) returned
    before finish: the variants were never stopped, chosen or brought back."""
    ran = []

    def main(argv):
        ran.append(argv[0])
        if argv[0] in failing:
            raise ValueError("could not convert string to float: ''")
        return 0

    monkeypatch.setattr(g, "main", main)
    failing = {"wait"}
    ok, said = s.train(tmp_path / "out", tmp_path / "data", tmp_path / "runs", 100, [])
    assert ran == ["start", "wait", "finish"] and not ok and said.startswith("wait: ValueError")
    ran.clear()
    failing = {"start"}
    ok, said = s.train(tmp_path / "out", tmp_path / "data", tmp_path / "runs", 100, [])
    assert ran == ["start"] and not ok


def test_progress_and_records_read_a_sampled_softmaxs_empty_perplexity(tmp_path):
    run = tmp_path / "runs" / "v" / "run"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(
        "kind,step,epoch,elapsed_s,tokens,tokens_per_s,loss,perplexity,forward_perplexity,backward_perplexity,lr,"
        "grad_norm,peak_memory_gib\n"
        "train,10,0,5.0,1000,200.0,4.25,,,,0.2,1.0,\n")
    rows = g._metrics(run)
    assert g._train_figure(rows[-1]) == "train loss 4.250" and g._number(rows[-1], "perplexity") is None


def test_a_report_cut_short_is_a_line_not_a_traceback(tmp_path):
    torn = tmp_path / "report.json"
    torn.write_text('{"suite": {"seconds": 3')
    assert s.suite_line(torn).startswith(f"{torn} cannot be read (JSONDecodeError")
    assert s.model_line(torn).startswith(f"{torn} cannot be read")
