"""Ctrl-C or SIGTERM on a job run here: one line, exit status 130 or 143, none of the run's
temporary folders left in the output folder or in $TMPDIR, no worker process left running, and
the earlier run that --overwrite was replacing put back (before, Beam logged a traceback per
bundle, the command exited 2 with "KeyboardInterrupt [while running ...]", and beam-temp-*
folders stayed; SIGTERM left them, the earlier run hidden, and workers running). A job that
fails takes its temporary folders away too, and a --large-model run its server's files."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import apache_beam as beam
import pytest

from elmo_pipeline.commands import JobFailed
from elmo_pipeline.pipelines.earlier_run import set_aside
from elmo_pipeline.pipelines.runner import run_pipeline
from elmo_pipeline.pipelines.signals import _beam_workers
from support import data_path, run_threads


def _workers(scratch: Path) -> set[int]:
    """Beam's SDK worker processes of the job started with TMPDIR=scratch: workers it orphaned
    are no longer its descendants, and other tests' jobs may run beside it (pytest -n)."""
    mark = b"\0TMPDIR=" + os.fsencode(scratch) + b"\0"
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (b"sdk_worker_main" in Path(f"/proc/{entry}/cmdline").read_bytes()
                    and mark in b"\0" + Path(f"/proc/{entry}/environ").read_bytes()):
                found.add(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("mode, signum", [("in_memory", signal.SIGINT), ("multi_threading", signal.SIGINT),
                                          ("in_memory", signal.SIGTERM), ("multi_processing", signal.SIGTERM)])
def test_a_signal_ends_a_local_extract_with_one_line_and_nothing_left(tmp_path, mode, signum):
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    scratch.mkdir()
    (out / "beam-temp-mine").mkdir()  # not the run's: stays
    earlier = {"tokens-00000-of-00001.parquet": b"an earlier run", "summary.json": b"{}"}  # --overwrite replaces them
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elmo_pipeline.pipelines.extract", "--input",
         str(data_path("wikitext2", "wiki.valid.tokens")), "--output", str(out), "--overwrite",
         f"--direct_running_mode={mode}", "--direct_num_workers=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 120
        while not [p for p in out.iterdir() if p.name.startswith("beam-temp-tokens-")]:
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "no temporary folder appeared"
            time.sleep(0.05)
        time.sleep(1.0)  # into the embedding
        proc.send_signal(signum)  # to the command alone, as a scheduler or `kill PID` does
        # within a kill grace period such as `timeout -k 10`'s: the handler ran in the main thread
        # only once the job's wait came back, 13-30 s later with workers
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    left_running = _workers(scratch)
    lines = [line for line in err.decode().splitlines() if not line.startswith("WARNING:")]
    assert proc.returncode == -signum, err.decode()[-3000:]  # it died by the signal: a shell says 128 + signum
    said = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert lines[-1] == f"elmo-pipeline extract: {said}; {out} holds no temporary folder of it"
    if mode != "multi_processing":  # there the workers' own lines may come first
        assert len(lines) == 1, lines
    assert sorted(p.name for p in out.iterdir()) == ["beam-temp-mine", *sorted(earlier)]  # put back, none hidden
    assert all((out / name).read_bytes() == data for name, data in earlier.items())
    assert [p.name for p in scratch.iterdir()] == []  # Beam's beam-pipeline-temp* among them
    assert left_running == set()


def test_a_signal_removes_the_output_folder_the_run_made(tmp_path):
    """Ctrl-C on an extract into a new folder left that folder behind, empty, where the README
    promises what was there before: the claim's cleanup ran in a `finally` that dying by the
    signal skips."""
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elmo_pipeline.pipelines.extract", "--input",
         str(data_path("wikitext2", "wiki.valid.tokens")), "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (out.is_dir() and [p for p in out.iterdir() if p.name.startswith("beam-temp-tokens-")]):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "no temporary folder appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, err.decode()[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]


def test_on_a_terminal_the_signals_line_starts_a_line_of_its_own(tmp_path, model_arg):
    """On a terminal the progress bar's line had no end when the process died: the signal's line
    went on after the bar's counts ('...tokens/s]elmo-pipeline extract: terminated (SIGTERM); ...').
    The bar is drawn at its last counts and ends its line first."""
    out = tmp_path / "out"
    terminal, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # 0 columns: no bar
    proc = subprocess.Popen(
        [sys.executable, "-m", "elmo_pipeline.pipelines.extract", "--input",
         str(data_path("wikitext2", "wiki.valid.tokens")), "--output", str(out), "--model", model_arg,
         "--torch-threads", "1"],
        stdout=subprocess.DEVNULL, stderr=child_end, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(child_end)
    drawn = b""
    try:
        while b"embed [pid " not in drawn:  # the bar is drawn
            assert select.select([terminal], [], [], 120)[0], drawn[-3000:]
            drawn += _read_or_nothing(terminal)
            assert proc.poll() is None, drawn[-3000:]
        proc.send_signal(signal.SIGTERM)  # Ctrl-C's line is written by the same code
        while chunk := _read_or_nothing(terminal):
            drawn += chunk
        proc.wait(timeout=10)
    finally:
        proc.kill()
        os.close(terminal)
    *_, bar, last, after = drawn.decode().split("\r\n")
    assert proc.returncode == -signal.SIGTERM and after == "", drawn[-3000:]
    assert last.startswith(f"elmo-pipeline extract: terminated (SIGTERM); {out} "), drawn[-3000:]
    assert re.fullmatch(r"embed \[pid \d+\]: [\d,]+ ?sentences \[.*\]", bar.split("\r")[-1]), bar


def _read_or_nothing(fd: int) -> bytes:
    """What the terminal `fd` holds next; b"" once every writer of it has exited (EIO)."""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def test_a_failed_job_takes_away_its_temporary_folders_and_keeps_the_others(tmp_path):
    mine = tmp_path / "beam-temp-tokens-" / "keep"  # not a sink's name: stays
    mine.mkdir(parents=True)
    partial = tmp_path / f"beam-temp-tokens-{'ab' * 16}"

    def fail_midway(x):
        partial.mkdir(exist_ok=True)  # what a sink leaves when a worker dies mid-write
        (partial / "shard.parquet").write_bytes(b"partial")
        raise ValueError("a worker failed")

    with pytest.raises(JobFailed, match="a worker failed"):  # exit 1 from a command, not a user's error's 2
        run_pipeline(lambda p: p | beam.Create([1]) | beam.Map(fail_midway), [], "test", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beam-temp-tokens-"]


def test_a_run_that_ends_gives_the_signals_and_the_mask_back(tmp_path):
    handler = signal.getsignal(signal.SIGINT)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a caller that blocks SIGTERM
    try:
        result = run_pipeline(lambda p: p | beam.Create([1, 2]) | beam.Map(lambda x: x), [], "test", str(tmp_path))
        assert result.state == "DONE"
        assert signal.getsignal(signal.SIGINT) is handler
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert signal.SIGINT not in mask and signal.SIGTERM in mask  # the caller's, as it was
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_a_signal_the_caller_ignores_stays_ignored(tmp_path):
    # a job started in the background by a script ignores SIGINT; the run took it over
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        def send_sigint(x):
            os.kill(os.getpid(), signal.SIGINT)
            return x

        result = run_pipeline(lambda p: p | beam.Create([1]) | beam.Map(send_sigint), [], "test", str(tmp_path))
        assert result.state == "DONE"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_putting_back_twice_at_once_puts_back_once(tmp_path):
    # a signal during a failed job's put_back called it a second time, in another thread, which
    # deleted what the first had just put back
    out = tmp_path / "out"
    out.mkdir()
    for k in range(200):
        (out / f"shard-{k:05d}-of-00200.parquet").write_text(str(k))
    earlier = sorted(str(p) for p in out.iterdir())
    with set_aside(str(out), earlier, writes=lambda name: name.startswith("shard-")) as put_back:
        run_threads(lambda _: put_back(), 4)
    assert sorted(str(p) for p in out.iterdir()) == earlier  # and the block's success did not remove them
    assert all((out / f"shard-{k:05d}-of-00200.parquet").read_text() == str(k) for k in range(200))


def test_a_failed_job_leaves_the_folder_as_it_was_with_the_earlier_run_back(tmp_path):
    # prepare writes its shards in place: the failed run's other names stayed beside the earlier run
    out = tmp_path / "out"
    out.mkdir()
    for name in ("shard-00000-of-00002.parquet", "shard-00001-of-00002.parquet", "manifest.json", "notes.txt"):
        (out / name).write_text(f"earlier {name}")
    earlier = [str(out / n) for n in ("shard-00000-of-00002.parquet", "shard-00001-of-00002.parquet", "manifest.json")]
    with pytest.raises(RuntimeError, match="the job failed midway"):
        with set_aside(str(out), earlier, writes=lambda name: name.startswith("shard-") or name == "manifest.json"):
            for k in range(3):
                (out / f"shard-0000{k}-of-00003.parquet").write_text("partial")
            (out / "shard-00000-of-00002.parquet").write_text("partial, under an earlier name")
            (out / "mine.txt").write_text("not the job's")
            raise RuntimeError("the job failed midway")
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "shard-00000-of-00002.parquet": "earlier shard-00000-of-00002.parquet",
        "shard-00001-of-00002.parquet": "earlier shard-00001-of-00002.parquet",
        "manifest.json": "earlier manifest.json", "notes.txt": "earlier notes.txt", "mine.txt": "not the job's"}


def test_only_beam_workers_are_taken_for_the_runs_workers(tmp_path):
    # a program that calls main() may have children of its own: those must not be killed
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen(  # as Beam starts one: through a shell, whose child is the worker
        ["/bin/sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' "
                          "-m apache_beam.runners.worker.sdk_worker_main & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(_beam_workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = _beam_workers()
        assert worker.pid in found and own.pid not in found
        assert len(found) == 2  # the shell and the Python under it
    finally:
        for pid in _beam_workers():  # the shell's child outlives the shell
            os.kill(pid, signal.SIGKILL)
        for proc in (own, worker):
            proc.kill()
            proc.wait()


def test_a_large_model_run_leaves_no_file_of_its_model_server_in_the_temp_folder(tmp_path, model_arg):
    # Beam's large_model server writes an address and a lock file per tag there, and never removes them
    scratch, src = tmp_path / "tmp", tmp_path / "in.txt"
    scratch.mkdir()
    src.write_text("A first document.\nAnd a second one.\n")
    run = subprocess.run([sys.executable, "-m", "elmo_pipeline.pipelines.extract", "--input", str(src), "--output",
                          str(tmp_path / "out"), "--model", model_arg, "--large-model"],
                         capture_output=True, env={**os.environ, "TMPDIR": str(scratch)}, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    assert [p.name for p in scratch.iterdir()] == []  # nor anything else: Beam's folders go in the run
