"""Training a default-model candidate on a lent GPU inside one session's device time.

A lent machine has 15 minutes a session, one command runs at most 10 of them, and nothing of it
survives the session. So the run is planned here and done there, in the session's main call
after the measurement suite (benchmarks/gpu_session.py runs these three with one deadline):

    # here (CPU, Beam, the shared data): WikiText-2 prepared as the model card's commands do
    python -m benchmarks.gpu_train_default pack --out .whl/train
    # there (the package installed from .whl/suite; README "Training a default model on a GPU")
    python3 -m benchmarks.gpu_train_default start --data .whl/train --runs /tmp/wt2 --seconds 145
    python3 -m benchmarks.gpu_train_default wait --runs /tmp/wt2 --seconds 165
    python3 -m benchmarks.gpu_train_default finish --runs /tmp/wt2 --out $OUT
    # here again: the parts joined and checked, then evaluated and probed on this machine's CPU
    python -m benchmarks.gpu_train_default assemble --parts DIR --output runs/wt2-gpu

`start` refuses a library that is not this checkout's (a stale wheel), copies the data into
the runs folder (a later call may replace the carried one), smoke-tests each kernel the variants
name (a few steps and a validation, side by side: a kernel that fails on this GPU gives way to
one that passed), then launches one detached process per variant (a new process session, so
that it outlives the device call that started it) and returns. A variant is `pretrain` with its
dropout and kernel, run in two invocations of the same command line but for the step limit: the
warm-up steps, whose learning rate does not depend on the schedule's length, then, from their
checkpoint, as many steps as the measured rate fits before the deadline, so that the cosine
schedule ends when the time does (a resumed run restores the model, the optimizer, the data
position and the random state, so the two invocations train as one would, up to a GPU's
nondeterministic sums). `wait` prints progress until the variants end (or their processes are
gone) or its time is up. `finish` picks the variant with the lowest
validation perplexity, then the better on validation of its best/ and the mean of its last two
checkpoints, exports it in float16, evaluates validation and test, and writes the weights in
parts small enough for the device tool's 16 MiB limit per file, with summary.json (every
variant's curve and commands, the environment, the checksum). Test is read once, for the chosen
model. `finish --snapshot` does the same with the best model so far, leaving the variants
running and test unread: for a run spread over two calls, what the first brings back should the
machine be lost before the second (a checkpoint with its optimizer state is 186 MB at this shape, over what one call
brings back, so training itself cannot move to another machine; `pretrain --init` can continue
from the snapshot with a fresh optimizer). Every command is the package's own CLI, as run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
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
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
PLAN = "plan.json"
STATUS = "status.json"
SUMMARY = "summary.json"
PART_PREFIX = "model.safetensors.part-"
DEVICE_FILE_LIMIT = 16 * 2 ** 20  # the device tool brings back files of at most 16 MiB
DEVICE_FILE_COUNT = 8  # and at most 8 of them
CLI = [sys.executable, "-m", "elmo_pipeline.cli.main"]
FINISHED = ("done", "failed")


# -- small helpers ----------------------------------------------------------------------------
def _json(value: Any, **options: Any) -> str:
    """Strict JSON (no NaN or Infinity), with the standard library only: the controller starts
    before the package's dependencies are known to import."""
    return json.dumps(value, allow_nan=False, **options)


def _write_json(path: Path, value: Any) -> None:
    """Atomically: `wait` and `finish` read these files while variants write them."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_json(value, indent=2))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _run_cli(args: Sequence[Any], log: Path, in_process: bool = False) -> tuple[dict[str, Any], list[str]]:
    """An `elmo-pipeline` command: its JSON answer and the command as run. Its progress goes to
    `log`; a failure raises with the log's end. In this process (`in_process`), a GPU's start-up
    and the imports are paid once for several commands."""
    argv = [str(a) for a in args]
    with open(log, "a", encoding="utf-8") as err:
        err.write(f"$ elmo-pipeline {' '.join(argv)}\n")
        err.flush()
        if in_process:
            from elmo_pipeline.cli.main import main as cli_main

            answer = io.StringIO()
            with contextlib.redirect_stdout(answer), contextlib.redirect_stderr(err):
                code = cli_main(argv)
            stdout = answer.getvalue()
        else:
            done = subprocess.run([*CLI, *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
            code, stdout = done.returncode, done.stdout
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"elmo-pipeline {argv[0]} exited with {code}:\n{tail}")
    return json.loads(stdout), ["elmo-pipeline", *argv]


def checkout_env() -> dict[str, str]:
    """This environment with the checkout last on the path: `benchmarks` importable (also under
    PYTHONSAFEPATH=1, as on the GPU machine), the installed library first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    return env


def _child_env() -> dict[str, str]:
    env = checkout_env()
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _metrics(run: Path) -> list[dict[str, str]]:
    path = run / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _number(row: dict[str, str], column: str) -> float | None:
    """A metrics.csv cell as a number; None where it is empty (a sampled softmax's training rows
    have no perplexity) or missing."""
    cell = row.get(column) or ""
    return float(cell) if cell.strip() else None


def _train_figure(row: dict[str, str]) -> str:
    """A training row's perplexity, or its loss where the softmax gives no perplexity."""
    perplexity = _number(row, "perplexity")
    if perplexity is not None:
        return f"train ppl {perplexity:.2f}"
    loss = _number(row, "loss")
    return f"train loss {loss:.3f}" if loss is not None else "train ppl -"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a finished child of this process stays a zombie until reaped; it counts as ended
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


# -- pack (here) ------------------------------------------------------------------------------
def pack(out: Path, data: Path, max_lines: int) -> dict[str, Any]:
    """WikiText-2 train and valid prepared by `elmo-pipeline prepare` (as the model card's
    commands), and the test text, into `out`, with pack.json saying what went in."""
    if out.exists():  # an earlier pack is replaced whole; nothing else is emptied
        if not out.is_dir() or (any(out.iterdir()) and not (out / "pack.json").is_file()):
            raise SystemExit(f"{out}: exists and is not an earlier pack (no pack.json in it): not emptying it; "
                             "give a new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log = out / "pack.log"
    commands, sources = [], {}
    for split in ("train", "valid", "test"):
        source = data / "wikitext2" / f"wiki.{split}.tokens"
        text = source.read_text(encoding="utf-8")
        if max_lines:
            text = "".join(text.splitlines(keepends=True)[:max_lines])
        sources[split] = {"file": source.name, "lines": text.count("\n"), "sha256": hashlib.sha256(
            text.encode()).hexdigest()}
        copy = out / source.name
        copy.write_text(text, encoding="utf-8")
        if split == "test":
            continue
        _, command = _run_cli(["prepare", "--input", copy, "--output", out / f"wt2-{split}", "--tokenizer",
                               "whitespace", "--unk-token", "<unk>", "--max-sentence-tokens", 128], log)
        commands.append(command)
        copy.unlink()
    manifest = {"sources": sources, "max_lines": max_lines, "commands": commands}
    _write_json(out / "pack.json", manifest)
    return manifest


# -- start and the variants (there) -------------------------------------------------------------
def start(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_suite import library_source, nvidia_smi

    runs = Path(args.runs)
    if runs.exists() and any(runs.iterdir()):
        raise SystemExit(f"{runs} is not empty: give a new --runs folder (a plan runs once)")
    source = Path(args.data).resolve()
    for needed in ("wt2-train", "wt2-valid", "wiki.test.tokens"):
        if not (source / needed).exists():
            raise SystemExit(f"{source / needed} is missing: run `pack` here and carry its folder")
    library = library_source()
    if not library["matches_checkout"]:  # minutes of a lent GPU spent training old code
        raise SystemExit(f"elmo_pipeline comes from {library['library']}, whose sources differ from this "
                         f"checkout's ({', '.join(library['differs'][:5])}): rebuild its wheel (gpu_wheels.sh)")
    started = time.time()
    runs.mkdir(parents=True, exist_ok=True)
    # the variants' own copy: a later device call may replace the carried folder under them
    data = runs / "data"
    shutil.copytree(source, data)
    mode = nvidia_smi("compute_mode") if args.device == "cuda" else None  # Exclusive_Process: one at a time
    plan: dict[str, Any] = {
        "data": str(data), "started": started, "deadline": started + args.seconds,
        "reserve_s": args.reserve, "warmup_steps": args.warmup_steps, "device": args.device,
        "compute_mode": mode, "exclusive": mode is not None and mode.startswith("Exclusive"),
        "common": ["--preset", args.preset, "--optimizer", "adam", "--lr", args.lr, "--schedule", "cosine",
                   "--warmup-steps", args.warmup_steps, "--min-lr-ratio", args.min_lr_ratio, "--epochs", 100000,
                   "--batch-tokens", args.batch_tokens, "--max-batch-sentences", args.max_batch_sentences,
                   "--log-every", args.log_every, "--keep-checkpoints", 2, "--device", args.device,
                   "--threads", args.threads, "--seed", args.seed],
    }
    wanted = args.variants[:1] if plan["exclusive"] else args.variants  # one process may hold the GPU
    kernels = smoke_test(runs, plan, sorted({k for _, k in wanted}), args.smoke_steps) if args.smoke_steps else {}
    plan["smoke"] = kernels
    plan["variants"] = plan_variants(wanted, kernels)
    if not plan["variants"]:
        raise SystemExit(f"no kernel passed the smoke test: {_json(kernels, indent=1)}")
    _write_json(runs / PLAN, plan)
    for variant in plan["variants"]:
        folder = runs / variant["name"]
        folder.mkdir()
        _write_json(folder / STATUS, {"phase": "starting"})
        with open(folder / "driver.log", "ab") as log:
            child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_train_default", "variant", "--runs",
                                      str(runs), "--name", variant["name"]], cwd=ROOT, env=_child_env(),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        variant["pid"] = child.pid
    _write_json(runs / PLAN, plan)
    return plan


def smoke_test(runs: Path, plan: dict[str, Any], kernels: list[str], steps: int) -> dict[str, dict[str, Any]]:
    """A few steps and one validation of each kernel the variants name, side by side, with the
    variants' own flags, before any variant starts: a path that fails on this GPU (cuDNN's LSTM
    in training, the validations under autocast) fails here in a minute rather than in every
    variant after the warm-up. If `auto` fails, `exact` (our own recurrence everywhere) is tried."""
    from concurrent.futures import ThreadPoolExecutor

    def one(kernel: str) -> dict[str, Any]:
        folder = runs / "smoke" / kernel
        folder.mkdir(parents=True)
        began = time.time()
        try:
            _run_cli([*pretrain_command(plan, folder / "run", kernel), "--max-steps", steps, "--eval-every", steps,
                      "--checkpoint-every", steps], folder / "train.log")
            return {"ok": True, "seconds": round(time.time() - began, 1)}
        except Exception as error:
            return {"ok": False, "seconds": round(time.time() - began, 1), "error": str(error)[-1500:]}

    with ThreadPoolExecutor(1 if plan["exclusive"] else len(kernels)) as pool:
        results = dict(zip(kernels, pool.map(one, kernels)))
    # a kernel that failed needs one that passed to fall back on: auto, else exact
    for extra in FALLBACKS:
        if all(r["ok"] for r in results.values()) or fallback_kernel(results):
            break
        if extra not in results:
            results[extra] = one(extra)
    for kernel, result in results.items():
        print(f"smoke test, kernel {kernel}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.0f} s"
              + ("" if result["ok"] else f"\n{result['error']}"), flush=True)
    return results


FALLBACKS = ("auto", "exact")  # what a kernel that fails its smoke test gives way to, in order


def fallback_kernel(smoke: dict[str, dict[str, Any]]) -> str | None:
    """The first of FALLBACKS that passed its smoke test."""
    return next((k for k in FALLBACKS if smoke.get(k, {}).get("ok")), None)


def pretrain_command(plan: dict[str, Any], output: Path, kernel: str) -> list[Any]:
    """`pretrain` on the runs' data with the plan's common flags: what the smoke tests and every
    variant run, but for their step limits (and a variant's dropout)."""
    data = Path(plan["data"])
    return ["pretrain", "--data", data / "wt2-train", "--valid", data / "wt2-valid", "--output", output,
            *plan["common"], "--kernel", kernel]


def plan_variants(wanted: list[tuple[float, str]], smoke: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The variants to run: a kernel that failed its smoke test gives way to one that passed
    (auto, then exact), and the variants that then coincide run once."""
    def works(kernel: str) -> bool:
        return kernel not in smoke or smoke[kernel]["ok"]

    fallback = fallback_kernel(smoke)
    variants, names = [], set()
    for dropout, kernel in wanted:
        chosen = kernel if works(kernel) else fallback
        if chosen is None:
            continue
        name = f"dropout-{dropout:g}" + ("" if chosen == "auto" else f"-{chosen}")
        if name not in names:
            names.add(name)
            variants.append({"name": name, "dropout": dropout, "kernel": chosen, "asked": kernel})
    return variants


def parse_variants(text: str) -> list[tuple[float, str]]:
    """"0.3,0.45/fused" -> [(0.3, "auto"), (0.45, "fused")]."""
    variants = []
    for item in text.split(","):
        dropout, _, kernel = item.strip().partition("/")
        if kernel not in ("", "auto", "exact", "fused"):
            raise argparse.ArgumentTypeError(f"{item!r}: the kernel after / is auto, exact or fused")
        try:
            variants.append((float(dropout), kernel or "auto"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: a dropout, optionally /KERNEL") from None
    return variants


def steps_per_second(rows: list[dict[str, str]], fallback_steps: int, fallback_seconds: float) -> float:
    """The training rate of a run's log rows after the first (which holds the start-up)."""
    train = [r for r in rows if r["kind"] == "train"]
    if len(train) >= 3:
        first, last = train[1], train[-1]
        seconds = float(last["elapsed_s"]) - float(first["elapsed_s"])
        if seconds > 0:
            return (int(last["step"]) - int(first["step"])) / seconds
    return fallback_steps / max(fallback_seconds, 1e-6)


VALIDATIONS = 8  # along the fitted invocation, for best/ and the curve


def fitted_steps(rate: float, seconds_left: float, done: int, overhead: float, validation: float) -> int:
    """The step count whose remaining steps fit `seconds_left` at `rate`. `overhead` is what the
    warm-up invocation spent outside its steps (start-up, one validation, one checkpoint), which
    the fitted one pays once again; each of its VALIDATIONS costs `validation` more, and a
    twentieth of the rest goes to its checkpoints. At least a quarter of the time trains."""
    training = max(0.25 * seconds_left, seconds_left - overhead - VALIDATIONS * validation)
    return done + max(1, math.floor(0.95 * rate * training))


def validation_seconds(valid_tokens: int, tokens_per_s: float) -> float:
    """A validation's time, estimated as half a training pass over the same tokens: forward only
    (a third of a step's work) through the full softmax (dearer than training's adaptive one).
    The warm-up's log times no validation on its own; an estimate too high leaves time unused,
    one too low is cut by --max-time before the schedule's last steps. (Counting the warm-up's
    whole start-up once per validation, as before, trained a quarter of a short window.)"""
    return VALIDATION_SHARE * valid_tokens / max(tokens_per_s, 1e-9)


VALIDATION_SHARE = 0.5  # of a training pass: an estimate, not yet measured on a GPU


def run_variant(runs: Path, name: str) -> None:
    """One variant, detached from `start`: the warm-up invocation, then the fitted one."""
    plan = _read_json(runs / PLAN)
    variant = next(v for v in plan["variants"] if v["name"] == name)
    folder = runs / name
    status: dict[str, Any] = {"phase": "warm-up", "pid": os.getpid(), "commands": []}
    _write_json(folder / STATUS, status)
    run, log = folder / "run", folder / "train.log"
    base = [*pretrain_command(plan, run, variant["kernel"]), "--dropout", variant["dropout"]]
    warmup = int(plan["warmup_steps"])
    try:
        began = time.time()
        # a path far slower than planned (say, the exact kernel's step loop on a GPU) still ends by
        # the deadline: stopped for time, the trainer validates, so that finish has a model to export
        left = plan["deadline"] - began - plan["reserve_s"]
        result, command = _run_cli([*base, "--max-steps", warmup, "--eval-every", 0, "--checkpoint-every",
                                    warmup, "--max-time", round(max(1.0, left), 1)], log)
        status["commands"].append(command)
        rate = steps_per_second(_metrics(run), warmup, float(result["elapsed_s"]))
        overhead = max(0.0, time.time() - began - float(result["elapsed_s"]))
        validation = validation_seconds(_read_json(Path(plan["data"]) / "wt2-valid" / "manifest.json")["tokens"],
                                        int(result["tokens"]) / max(float(result["elapsed_s"]), 1e-9))
        left = plan["deadline"] - time.time() - plan["reserve_s"]
        status.update(phase="training", steps_per_s=rate, overhead_s=overhead, validation_s=validation,
                      seconds_left=left)
        if left > 0:
            total = fitted_steps(rate, left, result["step"], overhead, validation)
            status["max_steps"] = total
            _write_json(folder / STATUS, status)
            result, command = _run_cli([*base, "--max-steps", total, "--eval-every", max(1, total // VALIDATIONS),
                                        "--checkpoint-every", max(1, total // 20), "--max-time",
                                        round(left, 1)], log)
            status["commands"].append(command)
        status.update(phase="done", result=result)
    except Exception as error:  # recorded for `wait` and `finish`; the other variants go on
        status.update(phase="failed", error=str(error)[-3000:])
    _write_json(folder / STATUS, status)


# -- wait (there) -------------------------------------------------------------------------------
def progress_line(runs: Path, variant: dict[str, Any]) -> str:
    status = _read_json(runs / variant["name"] / STATUS)
    rows = _metrics(runs / variant["name"] / "run")
    train = [r for r in rows if r["kind"] == "train"]
    valid = [r for r in rows if r["kind"] == "valid"]
    phase = status["phase"]
    if phase not in FINISHED and not _alive(variant["pid"]):
        phase += " (its process is gone: killed?)"
    parts = [f"{variant['name']}: {phase}"]
    if train:
        last = train[-1]
        parts.append(f"step {last['step']}/{status.get('max_steps', '?')} epoch {last['epoch']} "
                     f"{float(last['tokens_per_s']):,.0f} tok/s {_train_figure(last)}"
                     + (f" peak {last['peak_memory_gib']} GiB" if last.get("peak_memory_gib") else ""))
    if valid:
        parts.append(f"valid {float(valid[-1]['perplexity']):.2f} (best {min(float(r['perplexity']) for r in valid):.2f})")
    if status["phase"] == "failed":
        parts.append(status.get("error", "")[-500:])
    return " | ".join(parts)


def wait(runs: Path, seconds: float, every: float = 15.0) -> bool:
    """Progress every `every` s until every variant has ended or `seconds` have passed."""
    plan = _read_json(runs / PLAN)
    until = time.time() + seconds
    while True:
        ended = not any(_running(runs, v) for v in plan["variants"])  # a killed one writes no status
        print(f"[{time.strftime('%H:%M:%S')}] {max(0, plan['deadline'] - time.time()):.0f} s to the deadline",
              flush=True)
        for variant in plan["variants"]:
            print("  " + progress_line(runs, variant), flush=True)
        if ended or time.time() >= until:
            return ended
        time.sleep(min(every, max(0.5, until - time.time())))


# -- finish (there) -----------------------------------------------------------------------------
def _running(runs: Path, variant: dict[str, Any]) -> bool:
    # the status first: an orphan's zombie may outlive its work where nothing reaps it
    phase = _read_json(runs / variant["name"] / STATUS)["phase"]
    return phase not in FINISHED and _alive(variant["pid"])


def _stop_leftovers(runs: Path, plan: dict[str, Any], grace: float) -> list[str]:
    """Variants still running `grace` s after the deadline are stopped (their whole session)."""
    until = max(time.time(), plan["deadline"]) + grace
    stopped = []
    for variant in plan["variants"]:
        while _running(runs, variant) and time.time() < until:
            time.sleep(1.0)
        if _running(runs, variant):
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                os.killpg(variant["pid"], signal.SIGKILL)
            stopped.append(variant["name"])
    return stopped


def variant_record(runs: Path, variant: dict[str, Any]) -> dict[str, Any]:
    folder = runs / variant["name"]
    status = _read_json(folder / STATUS)
    rows = _metrics(folder / "run")
    valid = [r for r in rows if r["kind"] == "valid"]
    train = [r for r in rows if r["kind"] == "train"]
    record = {"name": variant["name"], "dropout": variant["dropout"], "kernel": variant["kernel"],
              "kernel_asked": variant.get("asked", variant["kernel"]),
              "phase": status["phase"],
              "commands": status.get("commands", []), "steps_per_s_warmup": status.get("steps_per_s"),
              "overhead_s": status.get("overhead_s"), "validation_s": status.get("validation_s"),
              "max_steps": status.get("max_steps"), "error": status.get("error"),
              "valid_curve": [[int(r["step"]), float(r["perplexity"])] for r in valid]}
    if train:
        last = train[-1]
        peaks = [float(r["peak_memory_gib"]) for r in train if r.get("peak_memory_gib")]
        record["peak_memory_gib"] = max(peaks) if peaks else None
        record.update(steps=int(last["step"]), tokens=int(last["tokens"]), seconds=float(last["elapsed_s"]),
                      epochs_started=int(last["epoch"]) + 1, train_perplexity=_number(last, "perplexity"),
                      tokens_per_s=round(int(last["tokens"]) / max(float(last["elapsed_s"]), 1e-9), 1))
    if valid and (folder / "run" / "best").is_dir():
        best = min(valid, key=lambda r: float(r["perplexity"]))
        record.update(best_valid=float(best["perplexity"]), best_step=int(best["step"]))
    return record


def _candidates(run: Path, work: Path, valid: Path, log: Path, device: str) -> list[dict[str, Any]]:
    """best/ and the mean of the last two checkpoints, each with its validation perplexity in
    float32 (the trainer validated in its own precision, bf16 on a GPU)."""
    found = [{"name": "best", "sources": [str(run / "best")], "step": _read_json(run / "best" / "valid.json")["step"]}]
    checkpoints = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))[-2:]
    if len(checkpoints) == 2:
        mean = work / "mean-of-last-two"
        _, export = _run_cli(["export", *checkpoints, "--output", mean], log, in_process=True)
        found.append({"name": "mean of the last two checkpoints", "sources": [str(p) for p in checkpoints],
                      "commands": [export]})
    for candidate, model in zip(found, (run / "best", work / "mean-of-last-two")):
        result, command = _run_cli(["evaluate", "--model", model, "--data", valid, "--device", device], log,
                                   in_process=True)
        candidate["valid"] = result["average_perplexity"]
        candidate.setdefault("commands", []).append(command)
    return found


def _copy_of_best(best: Path, copy: Path, attempts: int = 3) -> None:
    """A stable copy of a best/ that its trainer may replace while it is read (the copy must load:
    its config's checksum holds it to the weights beside it)."""
    from elmo_pipeline.model.bilm import BiLM

    for attempt in range(attempts):
        shutil.rmtree(copy, ignore_errors=True)
        try:
            shutil.copytree(best, copy)
            BiLM.load(str(copy))
            return
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)


def finish(args: argparse.Namespace) -> dict[str, Any]:
    """The run's model (or, with --snapshot, the best so far while the variants go on) into `out`."""
    import torch

    from benchmarks.gpu_suite import environment, fp32_exact_mode

    runs, out = Path(args.runs), Path(args.out)
    plan = _read_json(runs / PLAN)
    data = Path(args.data or plan["data"])
    stopped = [] if args.snapshot else _stop_leftovers(runs, plan, args.grace)
    records = [variant_record(runs, v) for v in plan["variants"]]
    ranked = sorted((r for r in records if "best_valid" in r), key=lambda r: r["best_valid"])
    # under an exclusive compute mode the running variant holds the GPU: a snapshot uses the CPU
    where = "cpu" if args.snapshot and plan.get("exclusive") else plan["device"]
    device = torch.device("cuda" if where == "cuda" else "cpu")
    fp32_exact_mode()  # the evaluations below run in this process: float32 without TF32 on a GPU
    summary: dict[str, Any] = {"environment": environment(device), "plan": plan, "snapshot": args.snapshot,
                               "stopped_at_deadline": stopped, "variants": records}
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / SUMMARY, summary)  # what is known so far, should a step below fail
    if not ranked:
        raise SystemExit(f"no variant has a validated model; see {out / SUMMARY}")
    chosen = ranked[0]
    work = runs / ("snapshot" if args.snapshot else "finish")
    log = work.with_suffix(".log")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    run = runs / chosen["name"] / "run"
    splits = [("valid", data / "wt2-valid")]
    if args.snapshot:  # no test: it is read once, for the final model
        _copy_of_best(run / "best", work / "best")
        candidates = [{"name": "best so far", "sources": [str(work / "best")],
                       "step": _read_json(work / "best" / "valid.json")["step"]}]
    else:
        candidates = _candidates(run, work, data / "wt2-valid", log, where)
        splits.append(("test", data / "wiki.test.tokens"))
    pick = min(candidates, key=lambda c: c.get("valid", 0.0))
    model = work / "model"
    _, export = _run_cli(["export", *pick["sources"], "--output", model, "--dtype", "float16"], log, in_process=True)
    figures, commands = {}, [export]
    summary.update(chosen=chosen["name"], candidates=candidates, picked=pick["name"], float16=figures,
                   finish_commands=commands)
    publish(model, out, summary, args.part_bytes)  # the weights first: an evaluation cut short keeps them
    for split, source in splits:
        result, command = _run_cli(["evaluate", "--model", model, "--data", source, "--max-sentence-tokens", 128,
                                    "--device", where], log, in_process=True)
        figures[split] = result
        commands.append(command)
        _write_json(out / SUMMARY, summary)
    return summary


def publish(model: Path, out: Path, summary: dict[str, Any], part_bytes: int) -> dict[str, Any]:
    """The model folder into `out` as the device tool brings files back: weights in parts, the
    config, the vocabulary and summary.json with the checksums."""
    summary.update(sha256=_sha256(model / "model.safetensors"),
                   parts=write_parts(model / "model.safetensors", out, part_bytes))
    for name in ("config.json", "vocab.json"):
        shutil.copy(model / name, out / name)
    _write_json(out / SUMMARY, summary)
    count = sum(1 for p in out.iterdir() if p.is_file())
    if count > DEVICE_FILE_COUNT:
        raise SystemExit(f"{count} files in {out}: the device tool brings back {DEVICE_FILE_COUNT}")
    return summary


def write_parts(path: Path, out: Path, part_bytes: int) -> list[dict[str, Any]]:
    """`path` cut into numbered files of at most `part_bytes` (the device tool's size limit)."""
    if not 0 < part_bytes <= DEVICE_FILE_LIMIT:
        raise ValueError(f"parts of 1 to {DEVICE_FILE_LIMIT} bytes, got {part_bytes}")
    parts = []
    with open(path, "rb") as f:
        for index in range(DEVICE_FILE_COUNT):
            block = f.read(part_bytes)
            if not block:
                break
            name = f"{PART_PREFIX}{index:02d}"
            (out / name).write_bytes(block)
            parts.append({"file": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
        if f.read(1):
            raise ValueError(f"{path} needs more than {DEVICE_FILE_COUNT} parts of {part_bytes} bytes")
    return parts


# -- assemble (here) ----------------------------------------------------------------------------
def assemble(parts_dir: Path, output: Path) -> dict[str, Any]:
    """The model folder from `finish`'s files, every part and the whole checked against summary.json."""
    summary = _read_json(parts_dir / SUMMARY)
    if "parts" not in summary:
        raise SystemExit(f"{parts_dir / SUMMARY} names no model: the run chose none")
    output.mkdir(parents=True, exist_ok=True)
    weights = output / "model.safetensors"
    with open(weights, "wb") as f:
        for part in summary["parts"]:
            block = (parts_dir / part["file"]).read_bytes()
            if hashlib.sha256(block).hexdigest() != part["sha256"]:
                raise SystemExit(f"{part['file']} does not match its checksum in {SUMMARY}")
            f.write(block)
    if _sha256(weights) != summary["sha256"]:
        raise SystemExit(f"the joined weights do not match {SUMMARY}'s checksum")
    for name in ("config.json", "vocab.json"):
        shutil.copy(parts_dir / name, output / name)
    shutil.copy(parts_dir / SUMMARY, output.parent / f"{output.name}.{SUMMARY}")
    from elmo_pipeline.model.bilm import BiLM

    BiLM.load(str(output))  # checks the config and the weights' own checksum
    return summary


# -- the command line ---------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("pack", help="prepare WikiText-2 into a folder that travels (here)")
    s.add_argument("--out", required=True)
    s.add_argument("--max-lines", type=int, default=0, help="the first N lines of each split (0: all)")
    s = sub.add_parser("start", help="launch the variants, detached (there)")
    s.add_argument("--data", required=True)
    s.add_argument("--runs", required=True)
    s.add_argument("--seconds", type=float, required=True, help="from now to the end of training")
    s.add_argument("--variants", type=parse_variants, default=parse_variants("0.3,0.5,0.45/fused"),
                   help="DROPOUT[/KERNEL],...: one pretrain run each, side by side (KERNEL: pretrain --kernel; "
                        "fused trains with torch's LSTM op, cuDNN on a GPU)")
    s.add_argument("--preset", default="wt2-gpu")
    s.add_argument("--lr", type=float, default=0.003)
    s.add_argument("--min-lr-ratio", type=float, default=0.05)
    s.add_argument("--warmup-steps", type=int, default=100)
    s.add_argument("--batch-tokens", type=int, default=32768)
    s.add_argument("--max-batch-sentences", type=int, default=4096)
    s.add_argument("--log-every", type=int, default=10)
    s.add_argument("--reserve", type=float, default=20.0, help="seconds kept before the deadline for the end")
    s.add_argument("--device", default="cuda")
    s.add_argument("--threads", type=int, default=4)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--smoke-steps", type=int, default=2,
                   help="steps of each kernel's smoke test, with a validation, before the variants (0: none)")
    s = sub.add_parser("variant", help="(internal) one variant, as `start` launches it")
    s.add_argument("--runs", required=True)
    s.add_argument("--name", required=True)
    s = sub.add_parser("wait", help="print progress until the variants end or SECONDS pass (there)")
    s.add_argument("--runs", required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--every", type=float, default=15.0)
    s = sub.add_parser("finish", help="choose, export, evaluate and cut into parts (there)")
    s.add_argument("--data", default=None, help="the packed data (default: the runs' own copy)")
    s.add_argument("--runs", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--grace", type=float, default=60.0, help="seconds past the deadline before stopping a variant")
    s.add_argument("--part-bytes", type=int, default=15 * 2 ** 20)
    s.add_argument("--snapshot", action="store_true",
                   help="the best model so far, the variants left running (insurance against losing the machine)")
    s = sub.add_parser("assemble", help="join and check what finish wrote (here)")
    s.add_argument("--parts", required=True)
    s.add_argument("--output", required=True)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "pack":
        from benchmarks.common import shared_data_dir

        print(_json(pack(Path(args.out), shared_data_dir(), args.max_lines), indent=2))
    elif args.command == "start":
        plan = start(args)
        print(_json({"runs": args.runs, "variants": plan["variants"], "deadline_in_s": args.seconds}))
    elif args.command == "variant":
        run_variant(Path(args.runs), args.name)
    elif args.command == "wait":
        return 0 if wait(Path(args.runs), args.seconds, args.every) else 3
    elif args.command == "finish":
        summary = finish(args)
        print(_json({k: summary[k] for k in ("chosen", "picked", "float16", "sha256")}, indent=2))
    else:
        summary = assemble(Path(args.parts), Path(args.output))
        print(_json({k: summary.get(k) for k in ("chosen", "picked", "float16", "sha256")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
