"""A bundle that fails once and is retried counts once.

Beam's BundleBasedDirectRunner retries a failed bundle and keeps what its failed attempt added to
the counters: counted per element, the file planning made extract's `input_files` check fail
(exit 1 on a correct output), a retried embedding batch inflated `batches` and
`tokens_embedded_on`, and probe's token check failed on PretokenizedSentences' counts.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

import elmo_pipeline.transforms.embed as embed
import elmo_pipeline.transforms.pretokenized as pretokenized
import elmo_pipeline.transforms.read as read
from elmo_pipeline.embedding.batch import SharedEmbedder
from elmo_pipeline.pipelines.extract import main
from elmo_pipeline.transforms.metrics import NAMESPACE
from support import Terminal
from test_embed_transforms import make_sentence

RETRYING_RUNNER = "BundleBasedDirectRunner"


def fails_once(flags: Path, tag: str) -> bool:
    """True the first time for `tag`: a file, since the runner may copy the functions it calls."""
    try:
        os.close(os.open(flags / tag, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def _extract(inputs: Path, out: Path, model_arg: str) -> dict:
    assert main(["--input", str(inputs / "*.txt"), "--output", str(out), "--model", model_arg, "--batch-tokens",
                 "64", "--layers", "top", "--runner", RETRYING_RUNNER]) == 0
    return json.loads((out / "summary.json").read_text())


def test_extract_counts_a_retried_plan_and_batch_once(tmp_path, model_arg, monkeypatch):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(4):
        (inputs / f"f{i}.txt").write_text("".join(f"Sentence {j} of file {i} says little.\n" for j in range(6)))
    clean = _extract(inputs, tmp_path / "clean", model_arg)
    flags = tmp_path / "flags"
    flags.mkdir()
    plan_work, embed_sentences = read.plan_work, SharedEmbedder.embed_sentences
    batches = []

    def flaky_plan(url, *args):
        if url.endswith("f1.txt") and fails_once(flags, "plan"):
            raise OSError("503 Service Unavailable, once")
        return plan_work(url, *args)

    def flaky_embed(self, sentences, precision):
        batches.append(len(sentences))
        if len(batches) == 3 and fails_once(flags, "embed"):
            raise RuntimeError("a worker's hiccup, once")
        return embed_sentences(self, sentences, precision)

    monkeypatch.setattr(read, "plan_work", flaky_plan)
    monkeypatch.setattr(SharedEmbedder, "embed_sentences", flaky_embed)
    retried = _extract(inputs, tmp_path / "retried", model_arg)
    assert sorted(p.name for p in flags.iterdir()) == ["embed", "plan"]  # both failed once, and were retried
    assert retried["counts_verified"] and retried["input_files"] == 4
    for key in ("documents_read", "sentences", "tokens", "batches", "batch_tokens", "batch_padded_tokens",
                "tokens_embedded_on", "token_rows_written", "rows_in_files"):
        assert retried[key] == clean[key], key
    assert retried["tokens_embedded_on"] == {"cpu/exact": retried["tokens"]}


def test_pretokenized_sentences_count_a_retried_bundle_once(tmp_path, monkeypatch):
    sentences = pretokenized.pretokenized_sentences

    def flaky(item, max_sentence_tokens=None):
        if item[1] == 5 and fails_once(tmp_path, "item 5"):
            raise RuntimeError("once")
        return sentences(item, max_sentence_tokens)

    monkeypatch.setattr(pretokenized, "pretokenized_sentences", flaky)
    p = beam.Pipeline(options=PipelineOptions([f"--runner={RETRYING_RUNNER}"]))
    _ = p | beam.Create([("d", i, ("a", "b", "c")) for i in range(10)]) | pretokenized.PretokenizedSentences()
    result = p.run()
    result.wait_until_finish()
    counts = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]
              if c.key.metric.namespace == NAMESPACE}
    assert (tmp_path / "item 5").exists()
    assert counts["sentences"] == 10 and counts["tokens"] == 30


@pytest.fixture
def drawn_bars(monkeypatch) -> list:
    """The embed stage's bars, each drawn into a string at every update, as they are made."""
    import io

    from tqdm import tqdm

    bars = []

    def drawn_bar(desc, elapsed):
        bars.append(tqdm(desc=desc, file=io.StringIO(), mininterval=0))
        bars[-1].first_batch_seconds = elapsed
        return bars[-1]

    monkeypatch.setattr(embed, "progress_bar", drawn_bar)
    monkeypatch.setattr(embed, "_bar", {})
    return bars


def _forty_sentences(tmp_path: Path) -> Path:
    inputs = tmp_path / "in.txt"
    inputs.write_text("".join(f"Sentence {j} is here, and it is short.\n" for j in range(40)))
    return inputs


def test_one_progress_bar_counts_every_threads_batches(tmp_path, model_arg, drawn_bars):
    """With multi_threading, only the thread whose handler loaded the model moved the bar (102 of
    194 sentences); now every batch of the job, in any thread, moves the job's one bar."""
    inputs, out = _forty_sentences(tmp_path), tmp_path / "out"
    assert main(["--input", str(inputs), "--output", str(out), "--model", model_arg, "--batch-tokens", "64",
                 "--layers", "top", "--direct_running_mode=multi_threading", "--direct_num_workers=2",
                 "--split-mb", "0.0005"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["batches"] > 2 and len(drawn_bars) == 1
    assert drawn_bars[0].n == summary["sentences"] and drawn_bars[0].tokens_seen == summary["tokens"]
    assert 0 < drawn_bars[0].first_batch_seconds < summary["seconds"]  # made as that batch ended


def test_a_local_jobs_bar_ends_at_its_counts_and_is_dropped(tmp_path, model_arg, monkeypatch):
    """The bar redraws at most once a second and only the interpreter's exit closed it: after this job,
    run in a process that goes on, it still said 0 sentences, and a second job in the process counted
    on from the first's. As a job run here ends its bar is drawn at the job's counts and dropped (the
    next job makes its own)."""
    import sys

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(embed, "_bar", {})
    inputs, out = _forty_sentences(tmp_path), tmp_path / "out"
    assert main(["--input", str(inputs), "--output", str(out), "--model", model_arg, "--batch-tokens", "64",
                 "--layers", "top"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    drawn = [line for line in sys.stderr.getvalue().replace("\r", "\n").splitlines()
             if line.startswith(f"embed [pid {os.getpid()}]")]
    assert summary["sentences"] == 40
    assert drawn[-1].startswith(f"embed [pid {os.getpid()}]: 40sentences ")
    assert f" {summary['tokens']:,} tokens," in drawn[-1]
    assert embed._bar == {}


def test_a_batch_done_after_a_signal_closed_the_bars_draws_no_bar(monkeypatch):
    """A signal's watcher closes every bar of the process, then removes the run's folders while the
    job's threads go on: a batch done then made a new bar, drawn below the closed one, and the
    signal's line went on after its counts ('embed [pid N]: 0sentences [...]elmo-pipeline extract:
    terminated ...'). Once the bars are closed for the signal, no bar is made."""
    import sys

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(embed, "_bar", {})
    monkeypatch.setattr(embed, "_bars_ended", False, raising=False)
    batch = embed.BatchCounts("cpu/eager", sentences=3, tokens=17, weight=23, padded=27, oom_splits=0, seconds=0.5)
    embed.note_embedded(batch, "job")
    embed.close_progress_bars(None)
    closed = sys.stderr.getvalue()
    embed.note_embedded(batch, "job")  # another thread's batch, done as the run's folders are removed
    assert sys.stderr.getvalue() == closed and embed._bar == {}
    assert closed.endswith("\n") and closed.replace("\r", "\n").splitlines()[-1].startswith(
        f"embed [pid {os.getpid()}]: 3sentences "), closed


# reached, released: module-level, since Beam runs a pickled copy of the function and its arguments
_HELD = {"reached": threading.Event(), "released": threading.Event()}


def _held_at_the_last(sentence, last: int):
    """Passes `sentence` on; at sentence `last`, says so and waits until released."""
    if sentence.sentence_index == last:
        _HELD["reached"].set()
        assert _HELD["released"].wait(120)
    return sentence


def test_jobs_run_at_once_in_one_process_each_have_their_own_bar(tmp_path, model_arg, drawn_bars):
    """Job B (30 sentences) is held at its last sentence while job A (8) runs whole. With one bar per
    process, A's batches moved B's bar and A's end closed it: 36 sentences, then a bar of B's last 2.
    Each job has a bar of its own, closed as it ends."""
    from elmo_pipeline.pipelines.runner import run_pipeline
    from elmo_pipeline.transforms.embed import EmbedSentences

    reached, released = _HELD["reached"], _HELD["released"]
    reached.clear()
    released.clear()

    def job(doc: str, n: int, held: bool):
        def build(p: beam.Pipeline) -> None:
            todo = p | beam.Create([make_sentence(doc, i, ["A", "short", "one", "."]) for i in range(n)],
                                   reshuffle=False)
            if held:
                todo = todo | beam.Map(_held_at_the_last, n - 1)
            _ = todo | EmbedSentences(model_arg, device="cpu", batch_tokens=12, sort_buffer_tokens=12)
        return build

    b = threading.Thread(target=run_pipeline, args=(job("b", 30, True), [], "test", str(tmp_path / "b")))
    b.start()
    try:
        assert reached.wait(120)
        held = [bar.n for bar in drawn_bars]
        run_pipeline(job("a", 8, False), [], "test", str(tmp_path / "a"))
    finally:
        released.set()
        b.join()
    assert len(held) == 1 and 0 < held[0] < 30  # job B's bar moved before job A ran
    assert sorted((bar.n, bar.tokens_seen) for bar in drawn_bars) == [(8, 32), (30, 120)]
    assert embed._bar == {}
