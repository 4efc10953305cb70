"""While a job runs here, the objects that existed when it started are out of Python's cyclic
collector (gc.freeze): each full collection the job's buffers set off scanned them all again."""
from __future__ import annotations

import gc
from pathlib import Path

import apache_beam as beam

from elmo_pipeline.pipelines.runner import run_pipeline


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
