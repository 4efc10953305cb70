"""A lent GPU session, planned for its 15 minutes of device time: the measurement suite (issue 20)
and a default-model candidate (issue 21) in one call, timed against one deadline.

    # here, after benchmarks/gpu_wheels.sh: the device calls, timed to what `status` says is left
    python -m benchmarks.gpu_session plan --budget-left 900
    # there, in the main call (the plan prints it whole, with the install line)
    python3 -m benchmarks.gpu_session run --out $OUT --until $UNTIL --train-data .whl/train

The device tool gives a session 15 minutes, all calls, starts and idle time counted, and one
command at most 10 of them. A cold start takes a minute or more, and Beam and spaCy (the suite's
end-to-end section) travel in calls of their own, so one command of about 9 minutes is what is
left for the work itself. `run` spends it in the issues' order: the suite first, in a process of
its own (its section budgets scaled to `--suite-seconds`, killed with its worker processes should
it overrun; its reports are rewritten after every section), then, in what the call has left, the
default-model variants (benchmarks/gpu_train_default.py: start, wait, finish), so that their
deadline is the call's. What comes back: `suite/report.md`, `suite/report.json`, `model/` (the
chosen model in parts, its summary.json), and the log the command tees to `session.log`: 8 files,
the device tool's limit. `plan` turns the budget left into the calls, with the figures it assumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import gpu_train_default

DEFAULT_WEIGHTS = "elmo_pipeline/default_model/model.safetensors"  # travels in the tree, not in the wheel
SITE = "/tmp/site"
LOG = "session.log"  # what the main call tees its output to, beside the files `run` writes

# The call's own figures (seconds). The suite's start-up (imports, the CUDA context) and a last
# section's overrun come on top of its budget; finish stops leftovers, exports and evaluates the
# chosen model on validation and test, in float32 on the device.
SUITE_SECONDS = 300
SUITE_OVERHEAD_S = 40
FINISH_SECONDS = 75
FINISH_GRACE_S = 20
WAIT_EVERY_S = 3  # how soon after the variants end finish starts (wait's default, 15 s, is a tenth of the window)
MIN_TRAIN_SECONDS = 120
# No smoke test: it costs a fifth of a window this short, and the default variants already mix
# the kernels (two reference recurrences, one cuDNN), so a kernel that fails leaves another running.
SESSION_START = ("--smoke-steps", "0")
# The session's (estimates, not yet measured on a lent machine: the first session that is lent
# one should put its figures here). A cold start is "a minute or more" in the device README.
COLD_START_S = 150
TRANSFER_CALL_S = 40  # a ~45 MiB folder carried, the reply, and the turn before the next call
INSTALL_S = 30  # the wheels installed with --no-deps --no-compile, the default weights copied
AFTER_S = 40  # the main call's reply and the give-back
CALL_LIMIT_S = 600
CALL_MARGIN_S = 10  # between the session's own deadline and the tool's kill


# -- run (there) --------------------------------------------------------------------------------
def suite_budget(seconds: float, asked: float = SUITE_SECONDS) -> float:
    """The suite's budget in a call of `seconds`: what was asked, at most the call less the room
    for the suite's start-up and overrun (0 or less: the call is too short for the suite)."""
    return min(asked, seconds - SUITE_OVERHEAD_S)


def run_suite(out: Path, seconds: float, quick: bool, sections: str | None,
              overhead: float = SUITE_OVERHEAD_S) -> tuple[int, str]:
    """The suite in a process of its own (a broken CUDA context or a leak stays there), killed with
    its process group (the CPU worker sweep's Beam workers) `overhead` s past its budget."""
    command = [sys.executable, "-m", "benchmarks.gpu_suite", "--out", str(out), "--seconds", f"{seconds:g}",
               *(["--quick"] if quick else []), *(["--sections", sections] if sections else [])]
    print(f"\n=== suite: {' '.join(command[1:])}", flush=True)
    child = subprocess.Popen(command, cwd=gpu_train_default.ROOT, env=gpu_train_default.checkout_env(),
                             start_new_session=True)
    try:
        return child.wait(timeout=seconds + overhead), "ended"
    except subprocess.TimeoutExpired:
        for sent in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(child.pid, sent)
            except ProcessLookupError:
                break
            try:
                child.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        return -1, f"stopped after {seconds + overhead:.0f} s (its reports hold the sections it finished)"


def started_before(runs: Path) -> bool:
    """Whether an earlier call started variants in `runs`: they train on, detached, after that
    call was stopped (the tool's limit), and this call waits for them and finishes them."""
    return (runs / gpu_train_default.PLAN).is_file()


def train(out: Path, data: Path, runs: Path, window: float, extra: Sequence[str]) -> tuple[bool, str]:
    """gpu_train_default's start, wait and finish, the variants' deadline `window` s from now, or,
    where an earlier call started them, wait and finish alone (the deadline being that call's).
    Once the variants have started, finish runs whatever wait did: it stops them and exports
    what they trained (a wait that failed on a progress line lost the whole training)."""
    steps = [
        ["start", "--data", str(data), "--runs", str(runs), "--seconds", f"{window:.0f}", *SESSION_START, *extra],
        ["wait", "--runs", str(runs), "--seconds", f"{max(window, 0) + FINISH_GRACE_S:.0f}", "--every",
         str(WAIT_EVERY_S)],
        ["finish", "--runs", str(runs), "--out", str(out), "--grace", str(FINISH_GRACE_S)],
    ]
    if started_before(runs):
        print(f"\n=== training: {runs} holds the variants an earlier call started: waiting for them, then "
              "finishing", flush=True)
        steps = steps[1:]
    problems = []
    for argv in steps:
        problem = _train_step(argv)
        if problem is not None:
            problems.append(problem)
            if argv[0] == "start":
                break
    return (not problems, "; ".join(problems) or "done")


def _train_step(argv: list[str]) -> str | None:
    """One gpu_train_default step; what went wrong in it, or None."""
    print(f"\n=== training: gpu_train_default {' '.join(argv)}", flush=True)
    try:
        code = gpu_train_default.main(argv)
    except SystemExit as stop:  # its refusals: a stale wheel, a used runs folder, no validated model
        return f"{argv[0]}: {stop.code}"
    except Exception as error:  # reported; what the suite measured still comes back
        return f"{argv[0]}: {type(error).__name__}: {str(error)[-1500:]}"
    if code != 0 and not (argv[0] == "wait" and code == 3):  # wait's 3: time up; finish stops them
        return f"{argv[0]} exited with {code}"
    return None


def _read_report(path: Path) -> dict[str, Any] | str:
    """A report the suite or the training wrote, or why it cannot be read (a kill mid-write)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path} cannot be read ({type(exc).__name__}: {exc})"
    return data if isinstance(data, dict) else f"{path} is not a JSON object"


def suite_line(report: Path) -> str:
    if not report.is_file():
        return "no report (the suite did not start)"
    data = _read_report(report)
    if isinstance(data, str):
        return data
    sections = ", ".join(f"{name} {s['status']}" for name, s in data["sections"].items())
    verdicts = "; ".join(f"{v['target']}: {v['measured']:.3g} ({'met' if v['met'] else 'NOT met'})"
                         for v in data.get("targets", {}).get("verdicts", []))
    return f"{data['suite']['seconds']:.0f} s; {sections}" + (f"; targets: {verdicts}" if verdicts else "")


def model_line(summary: Path) -> str:
    if not summary.is_file():
        return "no model"
    data = _read_report(summary)
    if isinstance(data, str):
        return data
    if "float16" not in data:
        return f"no model chosen (see {summary})"
    valid, test = data["float16"].get("valid", {}), data["float16"].get("test", {})  # empty until evaluated
    return (f"{data['chosen']} ({data['picked']}): valid {valid.get('average_perplexity', float('nan')):.2f}, "
            f"test {test.get('average_perplexity', float('nan')):.2f} (float16)")


def run(args: argparse.Namespace) -> int:
    began = time.time()
    deadline = began + args.seconds
    out = Path(args.out)
    try:  # before any work: what cannot be written there never comes back (seen: 92 s trained for nothing)
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-check").write_bytes(b"")
        (out / ".write-check").unlink()
    except OSError as exc:
        raise SystemExit(f"--out {out}: cannot write there ({exc}): nothing would come back, so nothing ran") from None
    suite_seconds = suite_budget(args.seconds, args.suite_seconds)
    if args.suite_seconds == 0:
        code, how = None, "not asked for (--suite-seconds 0)"
    elif suite_seconds <= 0:
        raise SystemExit(f"--seconds {args.seconds:g} leaves the suite no time (it needs over {SUITE_OVERHEAD_S} s)")
    else:
        code, how = run_suite(out / "suite", suite_seconds, args.quick, args.suite_sections)
    window = deadline - time.time() - args.finish_seconds
    resumed = args.train_data is not None and started_before(Path(args.runs))
    if args.train_data is None:
        trained, why = None, "no --train-data"
    elif window < args.min_train_seconds and not resumed:
        trained, why = None, (f"{max(window, 0):.0f} s were left to train, under the {args.min_train_seconds:.0f} s "
                              "that a warm-up and a fitted run need")
    else:
        trained, why = train(out / "model", Path(args.train_data), Path(args.runs), window, args.train_args)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    print(f"\n=== session: {time.time() - began:.0f} s of {args.seconds:.0f}", flush=True)
    if code is None:
        print(f"  suite: {how}")
    else:
        print(f"  suite (exit {code}, {how}): {suite_line(out / 'suite' / 'report.json')}")
    if trained is None:
        print(f"  training: skipped ({why})")
    else:
        print(f"  training{' (resumed: the variants an earlier call started)' if resumed else ''}: "
              f"{model_line(out / 'model' / gpu_train_default.SUMMARY) if trained else 'FAILED: ' + why}")
    over = len(set(files) | {LOG}) - gpu_train_default.DEVICE_FILE_COUNT  # the log the command tees counts too
    print(f"  files under {out}: {', '.join(files)}"
          + (f" (with {LOG}, {over} over what the device tool brings back)" if over > 0 else ""), flush=True)
    return 0 if code in (None, 0) and trained is not False else 1


# -- plan (here) --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    command: str
    carry: tuple[str, ...]
    timeout_s: int
    why: str

    def text(self) -> str:
        carry = ", ".join(f'"{c}"' for c in self.carry)
        return f'run(command="{self.command}", carry=[{carry}], timeout_s={self.timeout_s})'


def install_line(wheels: str, site: str = SITE) -> str:
    """Every folder carried installed, and the environment the session runs in. pip installs all
    of its wheels or none, so should one wheel be refused (cut short in transfer, say), the
    suite's folder is installed alone: the suite and the training run, Beam and spaCy missing."""
    suite = f"{wheels}/suite"
    pip = f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {site}"
    return (f"{{ {pip} {wheels}/*/*.whl || {{ echo 'gpu_session: the install of every folder failed (above): "
            f"{suite} alone, without Beam and spaCy'; {pip} {suite}/*.whl; }} || {{ echo 'gpu_session: {suite} "
            "did not install: nothing ran'; false; }; } "
            f"&& cp {DEFAULT_WEIGHTS} {site}/{DEFAULT_WEIGHTS} && export "
            f"PYTHONPATH={site}:$PWD PYTHONSAFEPATH=1 ELMO_PIPELINE_DATA=$PWD/{suite}/data PYTHONUNBUFFERED=1")


def plan(budget_left: float, warm: bool, wheels: str, extras: Sequence[str], train: bool,
         suite: bool = True) -> dict[str, Any]:
    """The calls for `budget_left` s of device time: the extra folders' transfers while the suite
    still gets its full budget after them (else none: the end-to-end section then says why), then
    the main call, as long as the tool and the budget allow. Without the suite (its figures in
    already) nothing but the training travels and the call trains throughout."""
    if not suite and not train:
        raise SystemExit("neither the suite nor the training: nothing to plan")
    left = budget_left - (0 if warm else COLD_START_S) - AFTER_S
    needed = INSTALL_S + CALL_MARGIN_S + SUITE_SECONDS + SUITE_OVERHEAD_S
    carried = list(extras) if suite and left - len(extras) * TRANSFER_CALL_S >= needed else []
    main_call = min(CALL_LIMIT_S, left - len(carried) * TRANSFER_CALL_S)
    seconds = main_call - INSTALL_S - CALL_MARGIN_S
    least = 2 * SUITE_OVERHEAD_S if suite else MIN_TRAIN_SECONDS + FINISH_SECONDS
    if seconds < least:
        raise SystemExit(f"{budget_left:.0f} s of device time leave {max(seconds, 0):.0f} s for the main call's "
                         f"work, under the {least} s it needs (give the machine back and report what ran)")
    calls = [Call(f"ls {folder}", (folder,), 120, "carried only: the machine keeps it while warm (30 s)")
             for folder in carried]
    # the deadline taken before the install, so that the install's time, however long, counts
    # the install inside what the log keeps: a refused wheel is in what comes back
    command = (f"set -o pipefail; UNTIL=$(( $(date +%s) + {main_call - CALL_MARGIN_S:.0f} )); {{ {install_line(wheels)} "
               "&& python3 -m benchmarks.gpu_session run --out $OUT --until $UNTIL"
               + ("" if suite else " --suite-seconds 0")
               + (f" --train-data {wheels}/train" if train else "") + f"; }} 2>&1 | tee $OUT/{LOG}")
    suite_seconds = suite_budget(seconds) if suite else 0
    window = seconds - suite_seconds - (SUITE_OVERHEAD_S if suite else 0) - FINISH_SECONDS
    calls.append(Call(command, (f"{wheels}/suite", *((f"{wheels}/train",) if train else ())), int(main_call),
                      (f"the suite in {suite_seconds:.0f} s, then " if suite else "no suite: ")
                      + (f"about {max(window, 0):.0f} s of training"
                         + (f" (skipped: under {MIN_TRAIN_SECONDS} s)" if window < MIN_TRAIN_SECONDS else "")
                         if train else "no training")
                      # the tool stops a command at the device time left: past it, the deadline above is not met
                      + f"; only if budget_left_s (status's, or the last reply's lease) is at least "
                        f"{main_call:.0f}, else first `plan --warm --no-extras --budget-left` that figure"))
    return {"budget_left_s": budget_left, "warm": warm, "extras_carried": carried,
            "extras_dropped": [e for e in extras if e not in carried], "calls": calls,
            "assumed_s": {"cold_start": 0 if warm else COLD_START_S, "transfer_call": TRANSFER_CALL_S,
                          "install": INSTALL_S, "after": AFTER_S}}


def print_plan(p: dict[str, Any]) -> None:
    assumed = ", ".join(f"{k} {v} s" for k, v in p["assumed_s"].items())
    print(f"Device calls for {p['budget_left_s']:.0f} s of device time ({'warm' if p['warm'] else 'cold'} "
          f"machine; assumed: {assumed}), back to back, each within 30 s of the last:")
    for call in p["calls"]:
        print(f"  {call.text()}\n      # {call.why}")
    if p["extras_dropped"]:
        print(f"  (left out, the budget being short: {', '.join(p['extras_dropped'])}; the suite's end-to-end "
              "section then says Beam and spaCy are missing)")
    print("Then give_back(). If a call ends with the machine gone, `plan --warm` is wrong: plan again cold. If "
          "the main call was stopped (no '=== session' summary), its variants train on: `plan --warm --no-suite` "
          "gives the call that waits for them and finishes them.")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the suite, then the training, against one deadline (there)")
    r.add_argument("--out", required=True)
    end = r.add_mutually_exclusive_group(required=True)
    end.add_argument("--seconds", type=float, help="from now to the end of everything")
    end.add_argument("--until", type=float, help="the end of everything as a Unix time (the plan's command takes "
                                                 "it before the install, whose time then counts)")
    r.add_argument("--suite-seconds", type=float, default=SUITE_SECONDS, help="0: no suite, the call trains")
    r.add_argument("--train-data", default=None, help="gpu_train_default pack's folder (absent: no training)")
    r.add_argument("--runs", default="/tmp/elmo-gpu-runs", help="a new folder for the variants")
    r.add_argument("--finish-seconds", type=float, default=FINISH_SECONDS)
    r.add_argument("--min-train-seconds", type=float, default=MIN_TRAIN_SECONDS)
    r.add_argument("--quick", action="store_true", help="the suite's quick mode (CI, CPU)")
    r.add_argument("--suite-sections", default=None, help="the suite's --sections (default: all)")
    r.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: more arguments for gpu_train_default start (its own parser checks them)")
    q = sub.add_parser("plan", help="the device calls for the budget left (here)")
    q.add_argument("--budget-left", type=float, required=True, help="status()'s budget_left_s")
    q.add_argument("--warm", action="store_true", help="a machine is held already (status()'s warm)")
    q.add_argument("--wheels", default=".whl", help="gpu_wheels.sh's folder")
    q.add_argument("--no-extras", action="store_true", help="carry no Beam and spaCy folders")
    q.add_argument("--no-train", action="store_true", help="the suite only")
    q.add_argument("--no-suite", action="store_true", help="the training only (the suite's figures are in)")
    args = p.parse_args(argv)
    if args.command == "run":
        if args.train_args[:1] == ["--"]:
            args.train_args = args.train_args[1:]
        elif args.train_args:
            p.error(f"unrecognized arguments: {' '.join(args.train_args)} (training arguments go after --)")
        if args.until is not None:
            args.seconds = args.until - time.time()
        if args.seconds <= 0 or args.suite_seconds < 0:
            p.error("--seconds must be positive (--until in the future) and --suite-seconds not negative")
        if args.suite_sections is not None:
            from .gpu_suite import SECTIONS  # imports torch: only when asked

            unknown = [name for name in args.suite_sections.split(",") if name not in SECTIONS]
            if unknown:
                p.error(f"--suite-sections: unknown {unknown}; known: {list(SECTIONS)}")
        # the training's own parser, now: a mistake found after the suite would cost its minutes
        try:
            gpu_train_default.parse_args(["start", "--data", "-", "--runs", "-", "--seconds", "1", *SESSION_START,
                                          *args.train_args])
        except SystemExit:
            p.error(f"the arguments after -- ({' '.join(args.train_args)}) are gpu_train_default start's, "
                    "which refused them (above)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "run":
        return run(args)
    wheels = Path(args.wheels)  # as the calls name it: the device runs them in the checkout's root
    if wheels.is_absolute() or ".." in wheels.parts:
        raise SystemExit(f"--wheels {args.wheels}: the device tool carries only folders inside the checkout, "
                         "named relative to it (the default is .whl)")
    here = gpu_train_default.ROOT / wheels
    if not (here / "suite").is_dir():
        raise SystemExit(f"{here / 'suite'} is missing: run benchmarks/gpu_wheels.sh first")
    extras = [] if args.no_extras else sorted((wheels / p.name).as_posix() for p in here.glob("extra-*") if p.is_dir())
    train = not args.no_train and (here / "train").is_dir()
    print_plan(plan(args.budget_left, args.warm, wheels.as_posix(), extras, train, suite=not args.no_suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
