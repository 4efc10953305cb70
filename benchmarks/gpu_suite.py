"""Every GPU figure of issue 20 in one process: exactness, speed, out of memory, training, end to
end and a profile, written as DIR/report.md (tables for the README) and DIR/report.json
(strict JSON).

    python -m benchmarks.gpu_suite --out DIR                 # a CUDA machine: < 9 minutes on an H100
    python -m benchmarks.gpu_suite --out DIR --quick         # every code path, tiny shapes, seconds (CI)
    python -m benchmarks.gpu_suite --out DIR --sections speed,profile --budget-scale 2
    python -m benchmarks.gpu_suite --out DIR --seconds 300   # every section's budget scaled to fit 300 s

It first records the environment (device, torch, CUDA and cuDNN versions, packages) and turns
TF32 off (matmul and cuDNN; float32 matmul precision 'highest'), so that float32 means float32
in the exactness checks and in the fp32 speed rows. Then each section runs in turn within its
own time budget (`--budget-scale` multiplies them); a section stopped at 1.5 times its budget,
one that raises, and one that cannot run here (say, no Beam or spaCy for the end-to-end runs)
are recorded with the reason, printed, and the suite goes on. Items a section leaves out (a
kernel that needs CUDA, a configuration the budget did not reach) are listed with theirs. The
reports are rewritten after every section, so a run cut short leaves what it measured.

The sections are in benchmarks/gpu_checks.py; the LSTM kernel variants they compare (the
model's exact and fused kernels, and the static-shape exact layer eagerly, as CUDA graphs, and
with a compiled step) in benchmarks/kernel_variants.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from elmo_pipeline.formats.atomic import write_url_atomically
from elmo_pipeline.strict import dumps_strict

from . import gpu_checks

# name -> (function, budget in seconds on a GPU, budget in --quick mode), in the order they run
SECTIONS: dict[str, tuple[Callable[["gpu_checks.Ctx"], None], float, float]] = {
    "exactness": (gpu_checks.exactness, 50, 30),
    "speed": (gpu_checks.speed, 220, 20),
    "oom": (gpu_checks.out_of_memory, 40, 10),
    "training": (gpu_checks.training, 40, 15),
    "end_to_end": (gpu_checks.end_to_end, 120, 40),
    # last: CUPTI has been known to fail on CUDA graphs, and a broken context would stop the rest
    "profile": (gpu_checks.profile, 25, 10),
}
# The device tool stops a command at 600 s, the wheels' install included (~20 s): every section's
# budget is cut to what is left of TOTAL_BUDGET_S, and its hard limit to TOTAL_BUDGET_S + OVERRUN_S.
TOTAL_BUDGET_S = 510
QUICK_TOTAL_BUDGET_S = sum(quick for _, _, quick in SECTIONS.values())  # quick mode's, in seconds of CPU
OVERRUN_S = 40
MIN_SECTION_S = 5
HARD_LIMIT_FACTOR = 1.5
HARD_LIMIT_GRACE_S = 10.0
PACKAGES = ("torch", "triton", "numpy", "pyarrow", "pydantic", "h5py", "safetensors", "apache-beam", "spacy",
            "elmo-pipeline")


def total_budget(quick: bool) -> float:
    """The whole suite's budget at --budget-scale 1, in seconds."""
    return QUICK_TOTAL_BUDGET_S if quick else TOTAL_BUDGET_S


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """Raises SectionTimeout in the main thread after `seconds` (SIGALRM; a no-op elsewhere). A
    CUDA call in progress finishes first: the exception comes at the next Python line."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise gpu_checks.SectionTimeout(f"stopped at its hard limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- environment ------------------------------------------------------------------------------
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1])
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def library_source() -> dict[str, Any]:
    """Where elmo_pipeline was imported from, and whether its sources are this checkout's. On the
    GPU machine it comes from the wheel that gpu_wheels.sh built (for the Beam layer's package
    layout): a wheel built before the last edit would measure old code, so the report says so."""
    import elmo_pipeline

    checkout = Path(__file__).resolve().parents[1]
    installed = Path(elmo_pipeline.__file__).resolve().parent
    if installed == checkout / "elmo_pipeline":
        return {"library": str(installed), "matches_checkout": True, "differs": []}
    folders = {"elmo_pipeline": installed, "transforms": installed / "transforms", "pipelines": installed / "pipelines"}
    differs = []
    for folder, target in folders.items():
        for source in sorted((checkout / folder).rglob("*.py")):
            copy = target / source.relative_to(checkout / folder)
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                differs.append(str(source.relative_to(checkout)))
    return {"library": str(installed), "matches_checkout": not differs, "differs": differs[:20]}


def fp32_exact_mode() -> dict[str, Any]:
    """Turns TF32 off (returns the previous settings for `restore_fp32_mode`)."""
    before = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32,
              "precision": torch.get_float32_matmul_precision()}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return before


def restore_fp32_mode(before: dict[str, Any]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = before["matmul"]
    torch.backends.cudnn.allow_tf32 = before["cudnn"]
    torch.set_float32_matmul_precision(before["precision"])


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device), "python": platform.python_version(), "platform": platform.platform(),
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "packages": {name: _version(name) for name in PACKAGES}, "git_commit": _git_commit(),
        **library_source(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                   driver=nvidia_smi("driver_version"), compute_mode=nvidia_smi("compute_mode"))
    else:
        env["device_name"] = platform.processor() or platform.machine()
    env["lstm_under_bf16"] = lstm_under_bf16(device)
    return env


def lstm_under_bf16(device: torch.device) -> dict[str, Any]:
    """What torch does with an LSTM under bf16 autocast here, seen rather than asked: whether
    cuDNN's RNN op ran (`cudnn`) and the output's dtype (float16: cuDNN ran it in float16). What
    the fused kernel's bf16 rows measure. `torch.backends.cudnn.is_acceptable` says False for any
    bfloat16 tensor, whatever torch's LSTM then does."""
    try:
        lstm = torch.nn.LSTM(8, 8).to(device)
        x = torch.randn(3, 2, 8, device=device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace, torch.no_grad(), \
                torch.autocast(device.type, dtype=torch.bfloat16):
            out, _ = lstm(x)
        ops = {event.name for event in trace.events()}
        return {"cudnn": "aten::_cudnn_rnn" in ops, "output_dtype": str(out.dtype).removeprefix("torch.")}
    except Exception as exc:  # noqa: BLE001 - a fact of the environment, not worth the suite
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def nvidia_smi(field: str) -> str | None:
    """One `nvidia-smi --query-gpu` field of the first GPU (driver_version, compute_mode, ...)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


# -- sections ---------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    out: Path
    report: dict[str, Any] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)
    broken: str | None = None  # why the CUDA context cannot run anything more, once it cannot
    stopped: str | None = None  # why the suite ends early: the session's SIGTERM at its time
    in_section: bool = False  # where a SIGTERM ends the section running (with its rows)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def run_section(run: Run, name: str, work: Path, left: float) -> dict[str, Any]:
    """Runs one section within min(its budget, `left`) seconds, stopped at 1.5 times that (and
    never past `left` + OVERRUN_S)."""
    fn, full, quick = SECTIONS[name]
    budget = min((quick if run.args.quick else full) * run.args.budget_scale, left)
    hard = min(budget * HARD_LIMIT_FACTOR + HARD_LIMIT_GRACE_S, left + OVERRUN_S * run.args.budget_scale)
    ctx = gpu_checks.Ctx(device=run.device, quick=run.args.quick, budget_s=budget, work=work / name)
    ctx.work.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"status": "ok", "reason": None, "budget_s": round(budget, 1)}
    print(f"\n== {name} (budget {budget:.0f} s)", flush=True)
    start = time.perf_counter()
    try:
        with hard_limit(hard):
            run.in_section = True
            fn(ctx)
    except gpu_checks.Skipped as exc:
        record.update(status="skipped", reason=str(exc))
    except Exception as exc:  # one section's failure (SectionTimeout included) must not stop the others
        record.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:2000]}",
                      traceback=traceback.format_exc()[-4000:])
    finally:
        run.in_section = False
    try:
        gc.collect()
        gpu_checks.free_device(ctx)
    except gpu_checks.CudaBroken as exc:
        run.broken = f"the CUDA context broke in section {name}: {exc}"
        record["cuda_broken"] = run.broken
    if record["status"] == "ok" and ctx.skipped:
        record["status"] = "partial"
    record.update(seconds=round(time.perf_counter() - start, 1), results=ctx.results, tables=ctx.tables,
                  skipped=ctx.skipped)
    line = f"== {name}: {record['status']} in {record['seconds']:.0f} s"
    print(line + (f" ({record['reason']})" if record["reason"] else ""), flush=True)
    return record


def not_run(status: str, reason: str) -> dict[str, Any]:
    """The record of a section that ran nothing (skipped) or whose rows died with the process."""
    return {"status": status, "reason": reason, "budget_s": 0, "seconds": 0, "results": {}, "tables": [],
            "skipped": []}


@contextlib.contextmanager
def stop_on_sigterm(run: Run) -> Iterator[None]:
    """The session stops a suite past its time with SIGTERM (SIGKILL 10 s later). Rather than dying
    with the running section's rows and no word of the sections after it, the section ends there
    as a failure that keeps what it measured, and the rest are recorded as not run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        run.stopped = "the suite was stopped (SIGTERM: the session's time for it was up)"
        if run.in_section:
            raise gpu_checks.SectionTimeout(run.stopped)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- targets ----------------------------------------------------------------------------------
TARGET_SHARE_OF_MATMUL = 0.25
TARGET_FUSED_OVER_EXACT = 2.0


def targets(speed_rows: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    """The issue's two GPU targets from the speed rows: Original, exact (clipped) kernel, bf16 at
    >= 25% of the same-run bf16 matmul rate (work FLOPs), and exact within 2x of fused at the
    same batch size, for the model's exact kernel and each static variant measured."""
    shape = "tiny" if quick else "original"
    rows = [r for r in speed_rows if r["shape"] == shape and r["precision"] == "bf16"]
    fused = {r["batch_tokens"]: r for r in rows if r["kernel"] == "fused"}
    verdicts = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows if r["kernel"] != "fused"):
        mine = [r for r in rows if r["kernel"] == kernel]
        best = max(mine, key=lambda r: r["work_over_mm"])
        share = {"target": f"{shape}, {kernel}, bf16: work >= {TARGET_SHARE_OF_MATMUL:.0%} of the same-run bf16 matmul",
                 "measured": best["work_over_mm"], "at_batch_tokens": best["batch_tokens"],
                 "tokens_per_s": best["tokens_per_s"], "met": best["work_over_mm"] >= TARGET_SHARE_OF_MATMUL}
        verdicts.append(share)
        pairs = [(r, fused[r["batch_tokens"]]) for r in mine if r["batch_tokens"] in fused]
        if pairs:
            ratios = [f["tokens_per_s"] / r["tokens_per_s"] for r, f in pairs]
            i = int(np.argmin(ratios))
            verdicts.append({"target": f"{shape}, {kernel} within {TARGET_FUSED_OVER_EXACT:g}x of fused (bf16)",
                             "measured": ratios[i], "at_batch_tokens": pairs[i][0]["batch_tokens"],
                             "all": {str(r["batch_tokens"]): q for (r, _), q in zip(pairs, ratios)},
                             "met": ratios[i] <= TARGET_FUSED_OVER_EXACT})
    return {"shape": shape, "meaningful": not quick, "verdicts": verdicts}


# -- the report -------------------------------------------------------------------------------
def plain(value: Any, path: str, bad: list[str]) -> Any:
    """A JSON-ready copy: numpy and torch scalars as Python numbers, tuples as lists, NaN and
    infinities as null (their paths collected in `bad`: JSON cannot hold them)."""
    if isinstance(value, dict):
        return {str(k): plain(v, f"{path}.{k}", bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    if isinstance(value, (np.generic, torch.Tensor)):
        value = value.item()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    return value


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 0.01:
            return f"{value:.3g}"
        return f"{value:.2e}"
    return str(value).replace("|", "/").replace("\n", " ")


def table_md(table: dict[str, Any]) -> list[str]:
    lines = [f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |",
             "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in table["rows"]]
    return lines + [""] + ([table["note"], ""] if table.get("note") else [])


def markdown(report: dict[str, Any]) -> str:
    suite, env = report["suite"], report["environment"]
    lines = ["# GPU suite report", "",
             f"`{suite['command']}`: {suite['mode']} mode on {env.get('device_name')} ({env['device']}), torch "
             f"{env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, TF32 off: "
             f"{not env['tf32_matmul'] and not env['tf32_cudnn']}; {suite['seconds']:.0f} s, {suite['started_utc']}.", ""]
    lines += table_md({"title": "Environment", "columns": ["what", "value"],
                       "rows": [[k, v] for k, v in env.items() if k != "packages"]
                       + [[f"package {k}", v] for k, v in env["packages"].items()]})
    lines += table_md({"title": "Sections", "columns": ["section", "status", "seconds", "budget s", "reason"],
                       "rows": [[n, s["status"], s["seconds"], s["budget_s"], s["reason"]]
                                for n, s in report["sections"].items()]})
    verdicts = report.get("targets", {}).get("verdicts", [])
    if verdicts:
        lines += table_md({"title": "Targets" + ("" if report["targets"]["meaningful"] else " (quick mode: not meaningful)"),
                           "columns": ["target", "measured", "at batch tokens", "met"],
                           "rows": [[v["target"], v["measured"], v["at_batch_tokens"], v["met"]] for v in verdicts]})
    for name, section in report["sections"].items():
        lines += [f"## {name}", "", f"Status: {section['status']}" + (f" ({section['reason']})" if section["reason"] else ""), ""]
        for table in section["tables"]:
            lines += table_md(table)
        if section["skipped"]:
            lines += ["Left out:", ""] + [f"- {s['item']}: {s['reason']}" for s in section["skipped"]] + [""]
    if report.get("non_finite"):
        lines += ["Values that were not finite (null in report.json): " + ", ".join(report["non_finite"]), ""]
    return "\n".join(lines)


def write_reports(run: Run) -> None:
    run.report["suite"]["seconds"] = round(run.elapsed(), 1)
    speed = run.report["sections"].get("speed", {}).get("results", {}).get("rows", [])
    run.report["targets"] = targets(speed, run.args.quick)
    bad: list[str] = []
    report = plain(run.report, "report", bad)
    report["non_finite"] = bad
    # whole or not at all: the session kills the suite at its budget, maybe while it rewrites them
    write_url_atomically(str(run.out / "report.json"),
                         (dumps_strict(report, str(run.out / "report.json"), indent=1) + "\n").encode())
    write_url_atomically(str(run.out / "report.md"), (markdown(report) + "\n").encode())


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for report.md and report.json")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short budgets: every code path in seconds")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every section's time budget")
    budget.add_argument("--seconds", type=float, default=None,
                        help=f"the whole suite's budget (every section's scaled to fit; default {TOTAL_BUDGET_S}, "
                             f"{QUICK_TOTAL_BUDGET_S:g} with --quick)")
    args = p.parse_args(argv)
    if args.seconds is not None:
        if not args.seconds > 0:
            p.error(f"--seconds must be positive, got {args.seconds:g}")
        args.budget_scale = args.seconds / total_budget(args.quick)
    if not args.budget_scale > 0:
        p.error(f"--budget-scale must be positive, got {args.budget_scale:g}")
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args, device, out)
    before = fp32_exact_mode()
    try:
        env = environment(device)
        print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items() if k != "packages"), flush=True)
        if not env["matches_checkout"]:
            print(f"WARNING: elmo_pipeline comes from {env['library']}, whose sources differ from this checkout's "
                  f"({', '.join(env['differs'][:5])}...): rebuild its wheel (benchmarks/gpu_wheels.sh)", flush=True)
        if device.type != "cuda":
            print(f"no CUDA device: CUDA-only items are left out{'' if args.quick else ' (a full run on CPU is slow)'}")
        run.report = {"suite": {"mode": "quick" if args.quick else "full", "command": " ".join(
            ["python -m benchmarks.gpu_suite", *(argv if argv is not None else sys.argv[1:])]),
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": 0.0,
            "total_budget_s": total_budget(args.quick) * args.budget_scale},
            "environment": env, "sections": {}}
        chosen = [name for name in SECTIONS if name in args.sections.split(",")]
        # what a SIGKILL leaves on disk: every section not reached says so, the one running too
        run.report["sections"] = {name: not_run("skipped", "the suite was killed before it") for name in chosen}
        with tempfile.TemporaryDirectory(prefix="gpu_suite_") as work, stop_on_sigterm(run):
            for name in chosen:
                total = run.report["suite"]["total_budget_s"]
                left = total - run.elapsed()
                why = run.broken or run.stopped or (
                    f"the suite's budget ({total:.0f} s) was spent" if left < MIN_SECTION_S else None)
                if why:
                    run.report["sections"][name] = not_run("skipped", why)
                    print(f"== {name}: skipped ({why})")
                else:
                    run.report["sections"][name] = not_run("failed", "the suite was killed while it ran: its rows "
                                                                     "are lost")
                    write_reports(run)
                    run.report["sections"][name] = run_section(run, name, Path(work), left)
                write_reports(run)
        write_reports(run)
    finally:
        restore_fp32_mode(before)
    statuses = {n: s["status"] for n, s in run.report["sections"].items()}
    print(f"\nreports: {out / 'report.md'}, {out / 'report.json'}; {run.elapsed():.0f} s; {statuses}")
    for verdict in run.report["targets"]["verdicts"]:
        print(f"  target {verdict['target']}: {fmt(verdict['measured'])} -> {'met' if verdict['met'] else 'NOT met'}")
    return 1 if "failed" in statuses.values() else 0


if __name__ == "__main__":
    sys.exit(main())
