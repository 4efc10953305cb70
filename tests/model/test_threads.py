"""One model shared by several threads, as Beam's RunInference shares it between a worker's
harness threads: every thread gets the same bits as one thread alone."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import elmo_pipeline.embedding.batch as batch_module
from elmo_pipeline import BiLM
from elmo_pipeline.pipelines.extract import run
from elmo_pipeline.runtime import autocast
from support import parse_extract_args, read_output, run_threads, thread_switches_every, ud_texts, vector_column

THREADS, BATCHES = 4, 6


@pytest.fixture(scope="module")
def batches(elmo_fixture_dir) -> list[list[list[str]]]:
    """Short batches of 1 to 4 sentences of 2 to 8 words: other shapes, partly the same words."""
    sentences = [s.split() for group in json.loads((elmo_fixture_dir / "sentences.json").read_text()) for s in group]
    return [[s[k % 5 : k % 5 + 2 + (k + i) % 7] for i, s in enumerate(sentences[k : k + 1 + k % 4])]
            for k in range(THREADS * BATCHES // 2)]


@pytest.fixture
def frequent_thread_switches():
    with thread_switches_every(1e-5):
        yield


def _embed(model: BiLM, batch: list[list[str]], precision: str = "fp32") -> torch.Tensor:
    with torch.inference_mode(), autocast(model.device, precision):
        return model.embed(batch).layers


def _run_threads(model: BiLM, batches: list[list[list[str]]], repeats: int,
                 precision: str = "fp32") -> list[tuple[int, int]]:
    """(thread, batch) of every result that differs from the single-thread result."""
    expected = [_embed(model, b, precision) for b in batches]
    mismatches, failures = [], []

    def work(thread: int, start: threading.Barrier) -> None:
        try:
            start.wait()
            for j in range(BATCHES):
                i = (thread * BATCHES // 2 + j) % len(batches)  # neighbours overlap: same words at once
                if not torch.equal(_embed(model, batches[i], precision), expected[i]):
                    mismatches.append((thread, i))
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread below
            failures.append(exc)

    for _ in range(repeats):
        model.clear_cache()
        start = threading.Barrier(THREADS)
        run_threads(lambda t: work(t, start), THREADS)
        if failures:
            raise failures[0]
    return mismatches


@pytest.mark.parametrize("kernel, precision", [("exact", "fp32"), ("fused", "fp32"), ("exact", "bf16")])
def test_threads_sharing_one_model_get_the_single_thread_bits(
        elmo_fixture_dir, batches, frequent_thread_switches, kernel, precision):
    # bf16: the layers' weights are cast once and shared (lstm._weights_as), first by whichever
    # thread gets there
    d = elmo_fixture_dir
    model = BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5"), cache_size=0).eval()
    # set, not asked at load, which refuses fused for this model's clips: the threads need its
    # code path, not the model's values
    model.kernel = kernel
    assert _run_threads(model, batches, repeats=10, precision=precision) == []


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_threads_sharing_one_word_cache_get_the_single_thread_bits(batches, frequent_thread_switches, precision):
    # Fewer slots than a round of batches has words: threads evict while others read. The
    # default model, because its char CNN gives a word the same bits in any row of a batch and
    # the cache puts a word in other rows on every run (the reference model's 124 features
    # differ in the last bit between rows).
    model = BiLM.from_pretrained(cache_size=24).eval()
    assert _run_threads(model, batches, repeats=6, precision=precision) == []
    assert model.word_cache.hits > 0 and len(model.word_cache) == 24


# -- extract on Beam's local runner with four threads ----------------------------------------------
class _CallRecorder:
    """Wraps the real embed_batch: which threads called it, how many at once, on which models."""

    def __init__(self, embed_batch) -> None:
        self.embed_batch = embed_batch
        self.lock = threading.Lock()
        self.threads: set[int] = set()
        self.models: set[int] = set()
        self.calls = self.active = self.most_at_once = 0

    def __call__(self, model, *args, **kwargs):
        with self.lock:
            self.calls += 1
            self.threads.add(threading.get_ident())
            self.models.add(id(model))
            self.active += 1
            self.most_at_once = max(self.most_at_once, self.active)
        try:
            return self.embed_batch(model, *args, **kwargs)
        finally:
            with self.lock:
                self.active -= 1


def _vectors(output: Path) -> tuple[list[str], np.ndarray]:
    """token_ids in order and their (tokens, L+1, 2P) vectors, read back from extract's Parquet."""
    table = read_output(output)
    layers = sorted((c for c in table.column_names if c.startswith("layer_")), key=lambda c: int(c[6:]))
    return table.column("token_id").to_pylist(), np.stack([vector_column(table, c) for c in layers], axis=1)


def test_extract_with_four_threads_writes_the_single_thread_vectors(tmp_path, monkeypatch, frequent_thread_switches):
    texts = ud_texts("ud_english_ewt", "en_ewt-ud-dev.conllu", n=120)
    inputs = []
    for k in range(8):  # several files, so that the runner hands the workers different ones
        path = tmp_path / f"part-{k}.txt"
        path.write_text("\n".join(texts[k::8]) + "\n", encoding="utf-8")
        inputs += ["--input", str(path)]
    # a small word cache and small batches: many calls, evictions while other threads read
    common = [*inputs, "--dtype", "float32", "--batch-tokens", "97", "--cache-size", "64", "--num-shards", "1"]
    single = run(*parse_extract_args([*common, "--output", str(tmp_path / "one")]))
    recorder = _CallRecorder(batch_module.embed_batch)
    monkeypatch.setattr(batch_module, "embed_batch", recorder)
    threaded = run(*parse_extract_args([*common, "--output", str(tmp_path / "four"),
                                        "--direct_running_mode", "multi_threading", "--direct_num_workers", "4"]))
    assert len(recorder.threads) > 1 and recorder.most_at_once > 1 and len(recorder.models) == 1
    assert threaded["tokens"] == single["tokens"] > 1000 and threaded["batches"] == recorder.calls
    (ids, one), (ids_four, four) = _vectors(tmp_path / "one"), _vectors(tmp_path / "four")
    assert ids == ids_four and len(ids) == single["tokens"]
    different = [ids[i] for i in np.flatnonzero((one != four).any(axis=(1, 2)))]
    assert different == []


def test_threads_embedding_with_the_fused_kernel_keep_the_processs_warning_filters(elmo_fixture_dir):
    # The fused kernel silenced a cuDNN warning with catch_warnings around each call, which saves the
    # process's whole filter list and puts it back: with calls overlapping in threads, a filter the
    # program added meanwhile was dropped and the silencing filter left behind.
    d = elmo_fixture_dir
    model = BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5"), cache_size=0).eval()
    model.kernel = "fused"  # its code path, as above: this model's clips make load refuse it
    batch = [["The", "bank", "rose", "."], ["A"]]
    added = [f"the program's filter {k}" for k in range(20)]
    done, failures = threading.Event(), []

    def work() -> None:
        try:
            while not done.is_set():
                _embed(model, batch)
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread below
            failures.append(exc)

    with warnings.catch_warnings():  # this test's filters go when it ends
        before = list(warnings.filters)
        threads = [threading.Thread(target=work) for _ in range(THREADS)]
        for t in threads:
            t.start()
        try:
            for message in added:  # while the threads embed
                _embed(model, batch)
                warnings.filterwarnings("error", message=message)
        finally:
            done.set()
            for t in threads:
                t.join()
        after = list(warnings.filters)
    if failures:
        raise failures[0]
    # each filter added goes first; nothing else changes
    assert [getattr(f[1], "pattern", None) for f in after[: len(added)]] == added[::-1]
    assert after[len(added):] == before
