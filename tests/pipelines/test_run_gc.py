"""While a job runs here, the objects that existed when it started are out of Python's cyclic
collector (gc.freeze): each full collection the job's buffers set off scanned them all again."""
from __future__ import annotations

import gc
import weakref
from pathlib import Path

import apache_beam as beam

from elmo_pipeline.pipelines.runner import run_pipeline
from support import run_threads, thread_switches_every


def _note_frozen(element: int, path: str) -> int:
    Path(path).write_text(str(gc.get_freeze_count()))
    return element


def _job(note: Path):
    def build(p: beam.Pipeline) -> None:
        p | beam.Create([0]) | beam.Map(_note_frozen, str(note))
    return build


def test_the_objects_of_the_launch_are_frozen_while_a_job_runs_and_put_back(tmp_path):
    assert gc.get_freeze_count() == 0
    alive = len(gc.get_objects())
    run_pipeline(_job(tmp_path / "during"), [], "test", str(tmp_path / "out"))
    # the modules, torch, Beam's pipeline: the objects alive before it at least, less the odd one freed
    assert int((tmp_path / "during").read_text()) > 0.9 * alive
    assert gc.get_freeze_count() == 0  # collected again once the job is over


def test_a_callers_own_freeze_is_left_as_it_is(tmp_path):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        run_pipeline(_job(tmp_path / "during"), [], "test", str(tmp_path / "out"))
        # not put back by the job (a frozen object can still be freed by its count of references)
        assert frozen >= gc.get_freeze_count() > 0.9 * frozen
    finally:
        gc.unfreeze()


def _job_seen(pipelines: list):
    """A job whose pipeline is remembered by a weak reference (it dies as a cycle when the job is over)."""
    def build(p: beam.Pipeline) -> None:
        pipelines.append(weakref.ref(p))
        p | beam.Create([0, 1]) | beam.Map(lambda x: x)
    return build


def test_the_pipelines_of_earlier_jobs_are_collected_by_a_later_one(tmp_path):
    """Each job froze the earlier jobs' pipelines (garbage left for a full collection) with the
    launch's objects, and the full collections inside it never saw them: jobs run one after another
    in one process left every pipeline uncollected."""
    pipelines: list = []
    for k in range(3):
        run_pipeline(_job_seen(pipelines), [], "test", str(tmp_path / f"out{k}"))
    assert [ref() is None for ref in pipelines[:2]] == [True, True]


def test_jobs_run_from_threads_at_once_share_one_freeze_and_leave_nothing_frozen(tmp_path):
    """run_pipeline from 4 threads at once: every job runs, the freeze is put back once the last
    ends, and the next job collects every pipeline they left."""
    pipelines: list = []
    failures: list = []

    def jobs(i: int) -> None:
        for k in range(3):
            try:
                run_pipeline(_job_seen(pipelines), [], "test", str(tmp_path / f"out{i}-{k}"))
            except Exception as exc:  # noqa: BLE001 - reported by the assert below
                failures.append(repr(exc))

    with thread_switches_every(1e-6):  # the freeze's steps interleave
        run_threads(jobs, 4)
    assert failures == [] and len(pipelines) == 12
    assert gc.get_freeze_count() == 0
    run_pipeline(_job_seen([]), [], "test", str(tmp_path / "last"))
    assert sum(ref() is not None for ref in pipelines) == 0
