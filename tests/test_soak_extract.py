"""benchmarks/soak_extract.py's job runner: the job's summary, progress and log, and nothing left open."""

import gc
import json
import sys
import warnings

from benchmarks.soak_extract import run_job


def test_a_job_is_read_whole_and_leaves_no_pipe_or_process_behind(tmp_path):
    """run_job read the child's stdout without closing it and reaped the child by wait4 behind
    Popen's back: Popen warned 'subprocess ... is still running' and kept the open pipe until exit."""
    job = ("import json, sys\n"
           "sys.stderr.write('embed [pid 7]: 1,234 sentences\\n')\n"
           "print(json.dumps({'tokens': 3, 'text': 'x' * 1_000_000}))\n")
    log = tmp_path / "job.log"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = run_job([sys.executable, "-c", job], log, 0.05)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert run.summary == {"tokens": 3, "text": "x" * 1_000_000}
    assert [n for _, n in run.progress] == [1234]
    assert log.read_bytes() == b"embed [pid 7]: 1,234 sentences\r\n"  # as the terminal wrote it
    assert run.peak_rss_mib > 0
    json.dumps(run.samples)  # plain numbers
