"""benchmarks/gpu_suite.py in its quick mode (tiny shapes, CPU here): every section runs or says
why not, the reports are strict JSON and Markdown tables, the figures add up, and one section's
failure, timeout or skip leaves the others running."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from benchmarks import gpu_checks, gpu_suite
from support import strict_json

STATUSES = {"ok", "partial", "skipped", "failed"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    start = time.perf_counter()
    # generous budgets: a loaded CI machine must not turn a slow section into a missing figure
    rc = gpu_suite.main(["--quick", "--out", str(out), "--budget-scale", "10"])
    seconds = time.perf_counter() - start
    report = strict_json((out / "report.json").read_text())
    return rc, report, (out / "report.md").read_text(), seconds


def _numbers(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def test_quick_mode_runs_every_section_and_says_why_where_it_leaves_something_out(quick_run):
    rc, report, _, seconds = quick_run
    sections = report["sections"]
    assert list(sections) == list(gpu_suite.SECTIONS)
    for name, section in sections.items():
        assert section["status"] in STATUSES - {"failed"}, (name, section["reason"], section.get("traceback"))
        if section["status"] == "skipped":
            assert section["reason"], name
        if section["status"] == "partial":
            assert section["skipped"] and all(s["item"] and s["reason"] for s in section["skipped"]), name
        if section["status"] in ("ok", "partial"):
            assert section["tables"] and section["results"], name
    assert rc == 0
    assert report["suite"]["mode"] == "quick" and report["suite"]["seconds"] <= seconds + 1
    env = report["environment"]
    assert env["torch"] and env["device"] and env["cpus"] >= 1
    assert env["tf32_matmul"] is False and env["tf32_cudnn"] is False and env["float32_matmul_precision"] == "highest"


def test_every_number_is_finite_and_the_figures_add_up(quick_run):
    _, report, _, _ = quick_run
    assert report["non_finite"] == []
    assert all(math.isfinite(v) for _, v in _numbers(report))
    speed = report["sections"]["speed"]["results"]
    assert speed["rows"]
    for row in speed["rows"]:
        assert row["tokens"] > 0 and row["seconds"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-9)
        mflop = speed["mflop_per_token"][row["shape"]]
        assert row["model_gflops"] == pytest.approx(row["tokens"] * mflop * 1e6 / row["seconds"] / 1e9, rel=1e-6)
        assert row["work_over_mm"] == pytest.approx(row["work_gflops"] / row["matmul_gflops"], rel=1e-9)
    assert {(r["kernel"], r["precision"]) for r in speed["rows"]} >= {("exact", "bf16"), ("fused", "bf16"),
                                                                      ("static", "bf16"), ("static", "fp32")}
    verdicts = report["targets"]["verdicts"]
    assert {v["target"].split(",")[1].strip().split(" ")[0] for v in verdicts} >= {"exact", "static"}
    assert all(isinstance(v["met"], bool) for v in verdicts) and not report["targets"]["meaningful"]


def test_the_cpu_checks_hold(quick_run):
    """What quick mode can check for real on CPU: the exact and static kernels reproduce the
    original fixture and are batch invariant; halving on out-of-memory loses nothing."""
    _, report, _, _ = quick_run
    exactness = report["sections"]["exactness"]["results"]
    fixture = {r["kernel"]: r for r in exactness["fixture"]}
    assert fixture["exact"]["within"] and fixture["static"]["within"]
    assert fixture["exact"]["max_abs_diff"] <= gpu_checks.FIXTURE_TOLERANCE
    assert not fixture["fused"]["within"]  # clips: fused is not expected to match
    invariance = {r["kernel"]: r["max_abs_diff_per_layer"] for r in exactness["batch_invariance"]["rows"]}
    assert max(invariance["exact"]) == 0.0
    # the static kernel is the CUDA path, kept capturable: on CPU its products run over the whole
    # batch, and where BLAS picks its kernel by row count (an AMX Xeon: 2.9e-6) rows move a little
    assert max(invariance["static"]) <= 1e-5
    drift = exactness["bf16_drift"]
    assert drift and all(0 < r["max"] < 1 and 0.9 < r["min_cos"] <= 1 + 1e-9 for r in drift if r["layer"] > 0)
    oom = report["sections"]["oom"]["results"]
    assert oom["simulated"] and oom["splits"] > 0 and oom["all_there"]
    assert (oom["sentences_in"], oom["tokens_in"]) == (oom["sentences_out"], oom["tokens_out"])
    profile = report["sections"]["profile"]["results"]["exact"]
    assert profile["top"] and sum(profile["shares"].values()) == pytest.approx(1.0)


def test_the_markdown_report_holds_the_tables(quick_run):
    _, report, md, _ = quick_run
    for name in gpu_suite.SECTIONS:
        assert f"## {name}" in md
    for header in ("| what | value |", "| section | status | seconds | budget s | reason |",
                   "| target | measured | at batch tokens | met |", "| kernel | max abs diff | within 1e-05 |",
                   "| shape | kernel | precision | batch tokens | tokens/s | model TFLOP/s | work TFLOP/s",
                   "| operation | calls | self CPU ms | share |", "| sentences in | sentences out | tokens in |",
                   "| device | tokens/s | train FLOP/token |"):
        assert header in md, header
    for section in report["sections"].values():
        for table in section["tables"]:
            assert f"**{table['title']}**" in md
            assert all(len(row) == len(table["columns"]) for row in table["rows"])


def _run(tmp_path, monkeypatch, sections: dict, *args: str):
    for name, fn in sections.items():
        monkeypatch.setitem(gpu_suite.SECTIONS, name, (fn, 1.0, 1.0))
    rc = gpu_suite.main(["--quick", "--out", str(tmp_path), "--sections", ",".join(sections), *args])
    return rc, strict_json((tmp_path / "report.json").read_text())


def test_a_failing_or_skipped_section_does_not_stop_the_others(tmp_path, monkeypatch):
    def boom(ctx):
        ctx.results["before"] = 1
        raise RuntimeError("boom")

    def cannot(ctx):
        raise gpu_checks.Skipped("needs a GPU")

    def fine(ctx):
        ctx.table("t", ["a"], [[1]])
        ctx.results["a"] = 1

    rc, report = _run(tmp_path, monkeypatch, {"exactness": boom, "speed": cannot, "oom": fine})
    sections = report["sections"]
    assert rc == 1
    assert sections["exactness"]["status"] == "failed" and sections["exactness"]["reason"] == "RuntimeError: boom"
    assert sections["exactness"]["results"] == {"before": 1}  # what it measured before failing is kept
    assert "boom" in sections["exactness"]["traceback"]
    assert sections["speed"]["status"] == "skipped" and sections["speed"]["reason"] == "needs a GPU"
    assert sections["oom"]["status"] == "ok" and sections["oom"]["results"] == {"a": 1}
    assert "RuntimeError: boom" in (tmp_path / "report.md").read_text()


def test_a_section_past_its_hard_limit_is_stopped(tmp_path, monkeypatch):
    def slow(ctx):
        for _ in range(300):
            time.sleep(0.1)

    def fine(ctx):
        ctx.results["a"] = 1

    monkeypatch.setattr(gpu_suite, "HARD_LIMIT_GRACE_S", 0.0)
    rc, report = _run(tmp_path, monkeypatch, {"training": slow, "end_to_end": fine}, "--budget-scale", "0.1")
    assert report["sections"]["training"]["seconds"] < 10  # stopped at 0.15 s, not after its 30 s
    assert report["sections"]["training"]["status"] == "failed"
    assert report["sections"]["training"]["reason"].startswith("SectionTimeout: stopped at its hard limit")
    assert report["sections"]["end_to_end"]["status"] == "ok"


def test_a_suite_stopped_by_the_session_says_what_it_did_not_run(tmp_path, monkeypatch):
    """The session stops a suite past its time with SIGTERM, then SIGKILL: the section running died
    with its rows and the report named neither it nor the sections after it."""
    on_disk = []

    def measures_then_is_stopped(ctx):
        ctx.results["measured"] = 7
        # what a SIGKILL would leave now: the section running and those after it, each saying so
        on_disk.append({n: (r["status"], r["reason"]) for n, r in
                        strict_json((tmp_path / "report.json").read_text())["sections"].items()})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal ends it here

    def outside_the_suite(signum, frame):  # code without a handler of its own fails here, not kills pytest
        raise RuntimeError("SIGTERM reached the test's own handler")

    ran, before = [], signal.signal(signal.SIGTERM, outside_the_suite)
    try:
        rc, report = _run(tmp_path, monkeypatch, {"exactness": lambda ctx: ran.append("exactness"),
                                                  "speed": measures_then_is_stopped,
                                                  "oom": lambda ctx: ran.append("oom"),
                                                  "profile": lambda ctx: ran.append("profile")})
        assert signal.getsignal(signal.SIGTERM) == outside_the_suite  # put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert on_disk == [{"exactness": ("ok", None),
                        "speed": ("failed", "the suite was killed while it ran: its rows are lost"),
                        "oom": ("skipped", "the suite was killed before it"),
                        "profile": ("skipped", "the suite was killed before it")}]
    sections = report["sections"]
    stopped = "the suite was stopped (SIGTERM: the session's time for it was up)"
    assert rc == 1 and ran == ["exactness"] and list(sections) == ["exactness", "speed", "oom", "profile"]
    assert sections["speed"]["status"] == "failed" and sections["speed"]["reason"] == f"SectionTimeout: {stopped}"
    assert sections["speed"]["results"] == {"measured": 7}
    assert [(sections[n]["status"], sections[n]["reason"]) for n in ("oom", "profile")] == [("skipped", stopped)] * 2


def test_a_broken_cuda_context_skips_the_sections_after_it_with_the_reason(tmp_path, monkeypatch):
    """After an illegal access or a device assert every CUDA call raises, emptying the cache
    included: the section that broke it is recorded, and the rest are skipped saying so."""
    broken = []

    def breaks(ctx):
        ctx.results["measured"] = 1
        broken.append(True)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def free(ctx):
        if broken:
            raise gpu_checks.CudaBroken("AcceleratorError: CUDA error: an illegal memory access was encountered")

    ran = []
    monkeypatch.setattr(gpu_checks, "free_device", free)
    rc, report = _run(tmp_path, monkeypatch, {"exactness": lambda ctx: ran.append("exactness"), "speed": breaks,
                                              "oom": lambda ctx: ran.append("oom")})
    sections = report["sections"]
    assert rc == 1 and ran == ["exactness"]
    assert sections["exactness"]["status"] == "ok"
    assert sections["speed"]["status"] == "failed" and sections["speed"]["results"] == {"measured": 1}
    assert "illegal memory access" in sections["speed"]["cuda_broken"]
    assert sections["oom"]["status"] == "skipped"
    assert sections["oom"]["reason"].startswith("the CUDA context broke in section speed")


def test_seconds_scales_every_section_to_the_whole_budget(tmp_path, capsys):
    """A lent session gives the suite 300 s: --seconds scales the budgets to fit, for either mode."""
    full = gpu_suite.parse_args(["--out", str(tmp_path), "--seconds", "255"])
    assert full.budget_scale == pytest.approx(255 / gpu_suite.TOTAL_BUDGET_S) == pytest.approx(0.5)
    quick = gpu_suite.parse_args(["--out", str(tmp_path), "--quick", "--seconds", "250"])
    assert gpu_suite.QUICK_TOTAL_BUDGET_S == sum(q for _, _, q in gpu_suite.SECTIONS.values())
    assert quick.budget_scale == pytest.approx(250 / gpu_suite.QUICK_TOTAL_BUDGET_S)
    for argv, message in ((["--seconds", "0"], "--seconds must be positive"),
                          (["--budget-scale", "-1"], "--budget-scale must be positive"),
                          (["--seconds", "10", "--budget-scale", "2"], "not allowed with")):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(["--out", str(tmp_path), *argv])
        assert message in capsys.readouterr().err


def test_a_section_stopped_at_its_hard_limit_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """bf16_drift kept its rows only once every place had run: on a GPU machine a slow host-CPU
    pass past the hard limit took the device's rows, measured before it, away with it."""
    monkeypatch.setattr(gpu_checks.Ctx, "cuda", property(lambda self: True))  # so the host's pass is added
    calls = []

    def drift(model, sentences, budget):
        calls.append(len(sentences))
        if len(calls) == 2:  # the host's CPU pass: the limit fires 0.5 s into it, however long the load took
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            time.sleep(30)
        return [{"max": 0.1, "mean": 0.01, "p999": 0.05, "rel_rms": 0.01, "min_cos": 0.99}]

    monkeypatch.setattr(gpu_checks, "precision_drift", drift)
    ctx = gpu_checks.Ctx(device=torch.device("cpu"), quick=True, budget_s=60, work=tmp_path)
    with pytest.raises(gpu_checks.SectionTimeout), gpu_suite.hard_limit(120):
        gpu_checks.bf16_drift(ctx)
    assert calls == [16, 300]
    assert [(r["device"], r["sentences"], r["layer"]) for r in ctx.results["bf16_drift"]] == [("cpu", 16, 0)]


def test_the_environment_says_what_an_lstm_under_bf16_runs(quick_run):
    """`torch.backends.cudnn.is_acceptable` is False for any bfloat16 tensor: the report said cuDNN
    never took the fused bf16 rows, whatever torch did."""
    _, report, _, _ = quick_run
    assert report["environment"]["lstm_under_bf16"] == {"cudnn": False, "output_dtype": "bfloat16"}  # CPU
