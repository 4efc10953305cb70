"""Ctrl-C on a job run here: one line, exit status 130, none of the run's temporary folders left in
the output folder, and the earlier run that --overwrite was replacing put back (before, Beam
logged a traceback per bundle, the command exited 2 with "KeyboardInterrupt [while running ...]",
and beam-temp-* folders stayed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import apache_beam as beam
import pytest

from elmo_pipeline.pipelines.runner import run_pipeline
from support import data_path


@pytest.mark.parametrize("mode", ["in_memory", "multi_threading"])
def test_ctrl_c_ends_a_local_extract_with_one_line_and_no_temporary_folder(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    (out / "beam-temp-mine").mkdir()  # not the run's: stays
    earlier = {"tokens-00000-of-00001.parquet": b"an earlier run", "summary.json": b"{}"}  # --overwrite replaces them
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    lines = [line for line in err.decode().splitlines() if not line.startswith("WARNING:")]
    assert proc.returncode == 130, err.decode()[-3000:]
    assert lines == [f"elmo-pipeline extract: interrupted; {out} holds no temporary folder of it"]
    assert sorted(p.name for p in out.iterdir()) == ["beam-temp-mine", *sorted(earlier)]  # put back, none hidden
    assert all((out / name).read_bytes() == data for name, data in earlier.items())


def test_a_run_that_ends_gives_ctrl_c_back(tmp_path):
    handler = signal.getsignal(signal.SIGINT)
    result = run_pipeline(lambda p: p | beam.Create([1, 2]) | beam.Map(lambda x: x), [], "test", str(tmp_path))
    assert result.state == "DONE"
    assert signal.getsignal(signal.SIGINT) is handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
