"""Several workers on one machine: one large file spreads over all of them, and each worker's
torch takes its share of the cores rather than all of them."""

from __future__ import annotations

import json
import os
import threading

import apache_beam as beam
import numpy as np
import pytest
import torch
from apache_beam.options.pipeline_options import PipelineOptions

from elmo_pipeline.corpus.byte_ranges import MIN_SPLIT_BYTES, plan_ranges, plan_work
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.records import Sentence
from elmo_pipeline.pipelines import extract
from elmo_pipeline.pipelines.beam_options import LOCAL_RUNNER, WorkerLayout, worker_layout
from elmo_pipeline.pipelines.runner import run_pipeline
from elmo_pipeline.transforms.embed import ElmoModelHandler, EmbedSentences, worker_threads
from elmo_pipeline.transforms.read import ReadDocuments
from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy
from support import parse_extract_args

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_a_file_gives_every_worker_a_range_once_it_is_large_enough():
    big = 10 * 2**20  # below the 64 MiB --split-mb default: one range for one worker
    assert len(plan_ranges("f", big, 64 * 2**20)) == 1
    for workers in (2, 3, 16):
        ranges = plan_ranges("f", big, 64 * 2**20, min_splits=workers)
        assert len(ranges) == workers
        assert [r.start for r in ranges[1:]] == [r.end for r in ranges[:-1]] and ranges[-1].end is None
        assert max(r.end - r.start for r in ranges[:-1]) <= -(-big // workers)
    assert len(plan_ranges("f", 3 * 64 * 2**20, 64 * 2**20, min_splits=2)) == 3  # --split-mb still bounds
    assert len(plan_ranges("f", MIN_SPLIT_BYTES, 64 * 2**20, min_splits=2)) == 1  # too small to cut
    assert [r.end for r in plan_ranges("f", 3 * MIN_SPLIT_BYTES - 1, 64 * 2**20, min_splits=4)] == [
        MIN_SPLIT_BYTES, 2 * MIN_SPLIT_BYTES, None]  # no range below MIN_SPLIT_BYTES but the last


def test_worker_threads_share_the_cpus():
    assert worker_threads(0, 1) is None  # a lone worker keeps torch's own choice
    assert worker_threads(0, 2) == max(1, CPUS // 2)
    assert worker_threads(0, 4 * CPUS) == 1
    assert worker_threads(3, 2) == 3  # --torch-threads wins


@pytest.mark.parametrize("args, layout", [
    ([], WorkerLayout(1, True)),
    (["--direct_running_mode=multi_processing", "--direct_num_workers=3"], WorkerLayout(3, True)),
    (["--direct_running_mode=multi_processing", "--direct_num_workers=0"], WorkerLayout(os.cpu_count(), True)),
    (["--direct_running_mode=multi_threading", "--direct_num_workers=4"], WorkerLayout(4, False)),
    (["--direct_num_workers=4"], WorkerLayout(4, False)),  # in_memory: threads of this process
    (["--direct_num_workers=0"], WorkerLayout(os.cpu_count(), False)),
    (["--runner=PortableRunner", "--sdk_worker_parallelism=2"], WorkerLayout(2, True)),
    # options of the local runner, which another runner ignores
    (["--runner=PortableRunner", "--sdk_worker_parallelism=2", "--direct_num_workers=4"], WorkerLayout(2, True)),
    (["--runner=FlinkRunner", "--direct_running_mode=multi_threading", "--direct_num_workers=4"],
     WorkerLayout(1, True)),
    (["--runner=DirectRunner", "--direct_num_workers=3"], WorkerLayout(3, False)),
])
def test_worker_layout_from_the_options(args, layout):
    assert worker_layout(PipelineOptions(args)) == layout


_BUSY_LOCK = threading.Lock()
_BUSY = [0]  # bundles in busy() now, in this process


def busy(x: int) -> int:
    """How many calls run at once with this one (the DoFn is unpickled, module state is shared)."""
    import time

    with _BUSY_LOCK:
        _BUSY[0] += 1
        at_once = _BUSY[0]
    time.sleep(0.02)
    with _BUSY_LOCK:
        _BUSY[0] -= 1
    return at_once


def test_in_memory_mode_runs_direct_num_workers_bundles_at_once():
    """Why --direct_num_workers N without a running mode counts as N workers: Beam logs that it
    should be multi_processing or multi_threading to have an effect, but runs N bundles at once in
    this process; the layout took it for one worker (a large file was read as one range)."""
    from apache_beam.testing.util import assert_that, equal_to

    with beam.Pipeline(runner=LOCAL_RUNNER, options=PipelineOptions(["--direct_num_workers=4"])) as p:
        peak = p | beam.Create(range(80)) | beam.Reshuffle() | beam.Map(busy) | beam.CombineGlobally(max)
        assert_that(peak | beam.Map(lambda n: n > 1), equal_to([True]))


def _stages(p: beam.Pipeline, kind: type) -> list:
    found = []

    class Visitor(beam.pipeline.PipelineVisitor):
        def enter_composite_transform(self, node):
            if isinstance(node.transform, kind):
                found.append(node.transform)

    p.visit(Visitor())
    return found


@pytest.mark.parametrize("beam_args, threads, min_splits, workers", [
    (["--direct_running_mode=multi_processing", "--direct_num_workers=3"], [], 3, 3),
    (["--direct_running_mode=multi_threading", "--direct_num_workers=3"], [], 3, 1),  # threads of this process
    (["--direct_num_workers=3"], [], 3, 1),  # in_memory: threads of this process too
    (["--direct_running_mode=multi_processing", "--direct_num_workers=3"], ["--torch-threads", "2"], 3, 3),
    ([], [], 1, 1),
])
def test_extract_gives_the_worker_layout_to_reading_and_embedding(tmp_path, model_arg, beam_args, threads,
                                                                  min_splits, workers):
    src = tmp_path / "in.txt"
    src.write_text("A document.\n", encoding="utf-8")
    args, rest = parse_extract_args(["--input", str(src), "--output", str(tmp_path / "out"), "--model", model_arg,
                                     *threads, *beam_args])
    job = extract.prepare_job(args)
    p = beam.Pipeline(options=PipelineOptions([*rest, f"--runner={LOCAL_RUNNER}"]))
    extract.build(p, job)
    (reader,) = _stages(p, ReadDocuments)
    (embed,) = _stages(p, EmbedSentences)
    assert reader.min_splits == min_splits
    assert (embed.handler.workers, embed.handler.torch_threads) == (workers, int(threads[1]) if threads else 0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="counts the CPUs of this process")
def test_one_file_spreads_over_two_worker_processes_each_with_its_share_of_threads(tmp_path, model_arg):
    # one file just over 2 x MIN_SPLIT_BYTES, of very long words so that there are few tokens to embed
    line = f"{'w' * 2000} {'v' * 2000}\n"
    n_lines = 2 * MIN_SPLIT_BYTES // len(line) + 1
    src = tmp_path / "one.txt"
    src.write_text(line * n_lines, encoding="utf-8")
    assert len(plan_work(str(src), ReadOptions(), 64 * 2**20, 2)) == 2
    seen = tmp_path / "seen"

    def build(p: beam.Pipeline) -> None:
        reader = ReadDocuments([str(src)], min_splits=worker_layout(p.options).workers)
        sentences = (p | reader)["documents"] | TokenizeWithSpacy()
        (sentences["sentences"]
         | EmbedSentences(model_arg, workers=worker_layout(p.options).workers)
         | beam.Map(lambda e: json.dumps([os.getpid(), torch.get_num_threads(), e.sentence.doc_id]))
         | beam.io.WriteToText(str(seen)))

    run_pipeline(build, ["--direct_running_mode=multi_processing", "--direct_num_workers=2"], "test", str(tmp_path))
    rows = [json.loads(line) for path in tmp_path.glob("seen*") for line in path.read_text().splitlines()]
    assert sorted(doc for _, _, doc in rows) == sorted(f"{src}:{i}" for i in range(1, n_lines + 1))
    pids = {pid for pid, _, _ in rows}
    assert len(pids) == 2 and os.getpid() not in pids, pids
    assert {threads for _, threads, _ in rows} == {max(1, CPUS // 2)}


def test_a_thread_that_ran_torch_before_the_model_loaded_embeds_with_the_asked_thread_count(model_arg):
    # torch keeps a thread count per thread (OpenMP's): set_num_threads at load reached the loading
    # thread and threads started later, while a harness thread that had run torch already (an
    # earlier stage's work) embedded with every core, 2 threads here where 1 was asked
    before = torch.get_num_threads()
    asked = 1 if before > 1 else 2
    handler = ElmoModelHandler(model_arg, torch_threads=asked)
    sentence = Sentence("d", 0, 0, ("A", "tree", "."), np.array([0, 2, 7]), np.array([1, 6, 8]))
    counts: dict[str, list[int]] = {"early": [], "loader": []}
    ran_torch, loaded, failures = threading.Event(), threading.Event(), []
    models = []

    def embed() -> None:
        (embedded,) = handler.run_inference([sentence], models[0])
        assert embedded.layers.shape == (3, 3, 32)

    def early() -> None:
        try:
            torch.ones(100_000).sigmoid_()  # this thread's count is fixed here, at torch's default
            ran_torch.set()
            loaded.wait()
            embed()
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread below
            failures.append(exc)

    def loader() -> None:
        try:
            ran_torch.wait()
            models.append(handler.load_model())
            models[0].lstm.register_forward_pre_hook(
                lambda *_: counts[threading.current_thread().name].append(torch.get_num_threads()))
            loaded.set()
            embed()
        except BaseException as exc:  # noqa: BLE001
            loaded.set()
            failures.append(exc)

    threads = [threading.Thread(target=early, name="early"), threading.Thread(target=loader, name="loader")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(before)  # also the count that threads started later take
    if failures:
        raise failures[0]
    assert counts == {"early": [asked], "loader": [asked]}
