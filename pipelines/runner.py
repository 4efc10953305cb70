"""Running a pipeline: locally on Beam's FnApiRunner (which downloads nothing) unless a runner is named.

A job may fail or be ended by a signal after it started writing into its output folder; running
it is therefore wrapped in what undoes that: the earlier run set aside until the job succeeds
(earlier_run.py), the sinks' temporary folders taken away (temp_folders.py), and, run here, a
Ctrl-C or SIGTERM that does all of it and ends the process at once (signals.py).
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import threading
from typing import Callable, Iterator, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.runner import PipelineResult

from elmo_pipeline.commands import JobFailed
from elmo_pipeline.pipelines.beam_options import LOCAL_RUNNER, workers_run_here
from elmo_pipeline.pipelines.earlier_run import set_aside
from elmo_pipeline.pipelines.signals import Ending, interrupt_ends_local_run
from elmo_pipeline.pipelines.temp_folders import TempFolders
from elmo_pipeline.transforms.embed import close_progress_bars, remove_shared_model_files


def run_pipeline(build: Callable[[beam.Pipeline], None], beam_args: Sequence[str], command: str,
                 output: str, earlier: Sequence[str] = (),
                 writes: Callable[[str], bool] | None = None) -> PipelineResult:
    """Build a pipeline with `build`, run it to the end and return its result (with metrics).

    `earlier`: the entries of an earlier run in the folder `output` that this one replaces
    (`--overwrite`); they go only once the job succeeded (`set_aside`). `writes(name)`: whether
    a name in `output` is one the job writes there itself. A job that fails takes away, in a
    local `output`, the sinks' temporary folders it made (partial shards) and the new entries
    `writes` names, before its error goes on. Run here, a Ctrl-C or SIGTERM ends the `command`
    at once, with one line and exit status 130 or 143, after the same and after ending the
    run's worker processes."""
    args = list(beam_args)
    if not any(arg == "--runner" or arg.startswith("--runner=") for arg in args):
        args.append(f"--runner={LOCAL_RUNNER}")
    p = beam.Pipeline(options=PipelineOptions(args))
    try:
        build(p)
    except BaseException:
        shutil.rmtree(p.local_tempdir, ignore_errors=True)  # Beam removes it only in run()
        raise
    # the signals are taken first, so that one arriving while the earlier run is moved aside or
    # put back still puts it back; the cleanups register with `ending` as they start
    ending = Ending(command, p.local_tempdir)
    with (interrupt_ends_local_run(args, ending), set_aside(output, earlier, writes, ending),
          TempFolders(output) as temp):
        ending.temp = temp
        try:
            with _JOBS_FREEZE.held():
                result = p.run()
                result.wait_until_finish()
        except Exception as exc:  # the runner's own error types: a worker's, a channel's, a step's
            raise JobFailed(str(exc).strip() or type(exc).__name__) from exc
        finally:
            if workers_run_here(args):
                remove_shared_model_files(p)
                close_progress_bars(p)
    return result


class _JobsFreeze:
    """While jobs run, the objects that exist when the first starts (modules, torch, spaCy, Beam's
    pipeline) are out of Python's cyclic collector (gc.freeze), and put back when the last ends.
    The sentences and vectors that a job holds in its buffers survive the young collections and set
    off full ones, each of which scanned all of those again: 0.43 s of the 0.55 s of collection in
    a local extract of 528k tokens, 0.07 s frozen. A caller's own freeze is left as it is.

    One freeze for the jobs that run at once (run_pipeline from several threads), made after a full
    collection where an earlier one was put back: each job froze the earlier jobs' pipelines, which
    die as cycles, with the launch's objects, and the full collections it set off never saw them.
    Jobs run one after another (a notebook's, a test suite's) left all of them uncollected (64 of
    64 small jobs; 23 without a freeze), and jobs from 4 threads, each freezing where no job's
    freeze was held, 256 of 256 (581 MB against 422). A process's first job collects nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._ours = False  # whether the freeze held was made by the first job (else a caller's, left alone)
        self._made_before = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._ours = gc.get_freeze_count() == 0
                if self._ours:
                    if self._made_before:  # the earlier jobs' garbage would wait, frozen, past this one
                        gc.collect()
                    gc.freeze()
                    self._made_before = True
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and self._ours:
                    gc.unfreeze()


_JOBS_FREEZE = _JobsFreeze()
