"""benchmarks/soak_extract.py's job runner: the job's summary, progress and log, and nothing left open."""

import gc
import json
import sys
import warnings

from benchmarks.soak_extract import JobRun, memory_figures, run_job


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


def test_a_run_too_short_for_a_slope_has_none_not_a_flat_one():
    """A run whose progress bar drew no line after the warm-up (--max-mb 0.2: 42,126 tokens in 5.8 s)
    reported 'rss_slope_after_warmup_mib_per_million_tokens': 0.0, a flat RSS never measured,
    beside +504.64 MiB per minute from the same samples; with one sample after it, 0.0 per minute too."""
    summary = {"sentences": 100, "tokens": 2_000}
    samples = [(0.0, 6.0), (2.0, 370.0), (4.0, 460.0), (6.0, 487.0), (8.0, 506.0), (10.0, 511.0)]
    no_progress = memory_figures(JobRun(summary, samples, [], 565.0), 0.2)
    assert no_progress["rss_slope_after_warmup_mib_per_million_tokens"] is None
    assert no_progress["rss_slope_after_warmup_mib_per_minute"] == 516.0  # least squares over t = 4..10 s
    one_sample = memory_figures(JobRun(summary, samples[:2], [(1.0, 50), (2.0, 100)], 565.0), 0.2)
    assert one_sample["rss_slope_after_warmup_mib_per_minute"] is None
    progress = [(4.0, 25), (6.0, 50), (8.0, 75), (10.0, 100)]  # 500 tokens more at each sample
    measured = memory_figures(JobRun(summary, samples, progress, 565.0), 0.2)
    assert measured["rss_slope_after_warmup_mib_per_million_tokens"] == 34400.0
