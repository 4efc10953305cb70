"""The extract job on runners whose workers are separate processes: the FnApiRunner in
multi-processing mode (2 SDK worker subprocesses), and Beam's portable job API with a local job
service and an external SDK worker pool, each in its own process (the path Flink and Spark take).
Outputs must equal a single-process run and direct model calls."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from elmo_pipeline.pipelines.extract import run
from support import data_path, parse_extract_args, read_output

ATOL = 1e-6
START_TIMEOUT_S = 90



@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """JSONL with ids (stable across input orders) of 8 two-sentence UD EWT documents."""
    texts = []
    with open(data_path("ud_english_ewt", "en_ewt-ud-dev.conllu"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("# text = "):
                texts.append(line[len("# text = "):].rstrip("\n"))
            if len(texts) == 16:
                break
    path = tmp_path_factory.mktemp("corpus") / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"{texts[2 * i]} {texts[2 * i + 1]}"}) + "\n"
                            for i in range(8)), encoding="utf-8")
    return path


def shuffled_copy(src: Path, dest: Path, seed: int) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(seed).shuffle(lines)
    dest.write_text("".join(lines), encoding="utf-8")
    return dest


def extract(model_arg: str, src: Path, output: Path, *extra: str) -> dict:
    summary = run(*parse_extract_args(["--input", str(src), "--output", str(output), "--model", model_arg, "--dtype", "float32",
                          "--format", "jsonl", "--id-field", "id", "--max-sentence-tokens", "24", *extra]))
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    return summary




def vectors(table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name).combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size)


def check_against_model(table: pa.Table, model) -> None:
    """Every sentence window equals a direct model call on its tokens alone, to 1e-6."""
    cols = table.select(["doc_id", "sentence_index", "window_index", "token_index", "token"]).to_pydict()
    layers = np.stack([vectors(table, f"layer_{j}") for j in range(3)])
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, key in enumerate(zip(cols["doc_id"], cols["sentence_index"], cols["window_index"])):
        groups.setdefault(key, []).append((cols["token_index"][i], i))
    for key, items in groups.items():
        idx = [i for _, i in sorted(items)]
        with torch.inference_mode():
            want = model.embed([[cols["token"][i] for i in idx]]).layers[:, 0].numpy()
        np.testing.assert_allclose(layers[:, idx], want, rtol=0, atol=ATOL, err_msg=str(key))


def assert_same_output(a: pa.Table, b: pa.Table) -> None:
    """Same rows per token_id, same vectors to 1e-6 (see test_extract_pipeline on the last bit)."""
    assert a.column("token_id").equals(b.column("token_id"))
    keys = ["doc_id", "sentence_index", "window_index", "token_index", "token", "char_start", "char_end"]
    assert a.select(keys).equals(b.select(keys))
    for name in ("layer_0", "layer_1", "layer_2"):
        np.testing.assert_allclose(vectors(a, name), vectors(b, name), rtol=0, atol=ATOL)


def same_counts(a: dict, b: dict) -> None:
    for name in ("documents_read", "documents_tokenized", "sentences", "tokens", "windows_cut",
                 "token_rows_written", "sentences_written", "batch_tokens"):
        assert a[name] == b[name], name


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, corpus, model_arg) -> tuple[dict, pa.Table]:
    """The reference run: the default local runner, in this process."""
    out = tmp_path_factory.mktemp("single") / "out"
    summary = extract(model_arg, corpus, out, "--batch-tokens", "8192")
    return summary, read_output(out)


# -- multi-processing ---------------------------------------------------------------------------
def _children(pid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry.name))
    return kids


class WorkerWatcher:
    """Polls /proc for SDK worker processes below this one while a job runs."""

    def __init__(self) -> None:
        self.workers: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid in _descendants(os.getpid()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if cmd[0] != b"/bin/sh" and b"apache_beam.runners.worker.sdk_worker_main" in cmd:
                    self.workers.add(pid)
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="watches worker processes in /proc")
def test_multi_processing_two_workers_equal_one_process(tmp_path, corpus, model_arg, single_process,
                                                        reference_model):
    src = shuffled_copy(corpus, tmp_path / "shuffled.jsonl", seed=5)
    with WorkerWatcher() as watcher:
        summary = extract(model_arg, src, tmp_path / "out", "--batch-tokens", "64",
                          "--direct_running_mode=multi_processing", "--direct_num_workers=2")
    assert len(watcher.workers) >= 2, f"expected 2 SDK worker subprocesses, saw {watcher.workers}"
    table = read_output(tmp_path / "out")
    base_summary, base = single_process
    same_counts(summary, base_summary)  # metrics from both workers are collected
    assert summary["token_rows_written"] == table.num_rows
    assert_same_output(table, base)
    check_against_model(table, reference_model)


# -- the portable job API -----------------------------------------------------------------------
def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for kid in _children(todo.pop()) - found:
            found.add(kid)
            todo.append(kid)
    return found


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT first (the worker pool then stops its SDK workers at exit), then SIGTERM, SIGKILL;
    any worker the process left behind is then terminated by its id."""
    left = _descendants(proc.pid) if sys.platform.startswith("linux") else set()
    for action in (lambda: proc.send_signal(signal.SIGINT), proc.terminate, proc.kill):
        if proc.poll() is not None:
            break
        action()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            continue
    for pid in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_for(predicate, proc: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not start in {START_TIMEOUT_S}s: {log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="module")
def portable_services(tmp_path_factory):
    """A Beam job service and an SDK worker pool, each in its own process, on free localhost ports."""
    tmp = tmp_path_factory.mktemp("portable")
    env = dict(os.environ)
    # the pool starts each worker as `python -c ...`: make that this interpreter
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    procs = []
    try:
        port_file, job_log = tmp / "job_service.port", tmp / "job_service.log"
        with open(job_log, "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main",
                 "--port", "0", "--port_file", str(port_file), "--staging_dir", str(tmp / "staging")],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        pool_log = tmp / "worker_pool.log"
        with open(pool_log, "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "apache_beam.runners.worker.worker_pool_main", "--service_port", "0"],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        job_port = int(_wait_for(lambda: port_file.exists() and port_file.read_text().strip(), procs[0],
                                 job_log, "job service"))

        def pool_port():
            found = re.search(r"Started worker pool servicer at port: localhost:(\d+)", pool_log.read_text())
            return found and found.group(1)

        worker_port = int(_wait_for(pool_port, procs[1], pool_log, "worker pool"))
        yield {"job": job_port, "workers": worker_port, "pool_log": pool_log, "job_log": job_log,
               "pids": [p.pid for p in procs]}
    finally:
        for proc in reversed(procs):
            _stop(proc)


def test_portable_job_api_with_external_worker_pool(tmp_path, corpus, model_arg, single_process, reference_model,
                                                    portable_services):
    s = portable_services
    src = shuffled_copy(corpus, tmp_path / "shuffled.jsonl", seed=9)
    summary = extract(model_arg, src, tmp_path / "out", "--batch-tokens", "128", "--mix", "avg=average",
                      "--runner=PortableRunner", f"--job_endpoint=localhost:{s['job']}",
                      "--environment_type=EXTERNAL", f"--environment_config=localhost:{s['workers']}")
    # the given --runner replaced the local default: the job went to the job service, whose
    # environment asked the pool (another process) for an SDK worker (yet another process)
    pool_log = s["pool_log"].read_text(errors="replace")
    assert "Starting worker with command" in pool_log, pool_log[-2000:]
    assert all(pid != os.getpid() for pid in s["pids"])
    table = read_output(tmp_path / "out")
    base_summary, base = single_process
    same_counts(summary, base_summary)
    assert summary["token_rows_written"] == table.num_rows and summary["batches"] > 0
    assert_same_output(table, base)
    check_against_model(table, reference_model)
    np.testing.assert_allclose(vectors(table, "mix_avg"),
                               np.mean([vectors(table, f"layer_{j}") for j in range(3)], axis=0), rtol=0, atol=ATOL)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
