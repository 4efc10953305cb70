"""One model shared by several threads, as Beam's RunInference shares it between a worker's
harness threads: every thread gets the same bits as one thread alone."""

from __future__ import annotations

import json
import sys
import threading

import pytest
import torch

from elmo_pipeline import BiLM

THREADS, BATCHES = 4, 6


@pytest.fixture(scope="module")
def batches(elmo_fixture_dir) -> list[list[list[str]]]:
    """Short batches of 1 to 4 sentences of 2 to 8 words: other shapes, partly the same words."""
    sentences = [s.split() for group in json.loads((elmo_fixture_dir / "sentences.json").read_text()) for s in group]
    return [[s[k % 5 : k % 5 + 2 + (k + i) % 7] for i, s in enumerate(sentences[k : k + 1 + k % 4])]
            for k in range(THREADS * BATCHES // 2)]


@pytest.fixture
def frequent_thread_switches():
    """Python hands the GIL to another thread every 5 ms; a race between two lines of Python
    then shows in few runs. Switching every 10 us shows it in most."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def _embed(model: BiLM, batch: list[list[str]]) -> torch.Tensor:
    with torch.inference_mode():
        return model.embed(batch).layers


def _run_threads(model: BiLM, batches: list[list[list[str]]], repeats: int) -> list[tuple[int, int]]:
    """(thread, batch) of every result that differs from the single-thread result."""
    expected = [_embed(model, b) for b in batches]
    mismatches, failures = [], []

    def work(thread: int, start: threading.Barrier) -> None:
        try:
            start.wait()
            for j in range(BATCHES):
                i = (thread * BATCHES // 2 + j) % len(batches)  # neighbours overlap: same words at once
                if not torch.equal(_embed(model, batches[i]), expected[i]):
                    mismatches.append((thread, i))
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread below
            failures.append(exc)

    for _ in range(repeats):
        model.clear_cache()
        start = threading.Barrier(THREADS)
        threads = [threading.Thread(target=work, args=(t, start)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
    return mismatches


@pytest.mark.parametrize("kernel", ["exact", "fused"])
def test_threads_sharing_one_model_get_the_single_thread_bits(
        elmo_fixture_dir, batches, frequent_thread_switches, kernel):
    d = elmo_fixture_dir
    model = BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5"), cache_size=0, kernel=kernel).eval()
    assert _run_threads(model, batches, repeats=10) == []


def test_threads_sharing_one_word_cache_get_the_single_thread_bits(batches, frequent_thread_switches):
    # Fewer slots than a round of batches has words: threads evict while others read. The
    # default model, because its char CNN gives a word the same bits in any row of a batch and
    # the cache puts a word in other rows on every run (the reference model's 124 features
    # differ in the last bit between rows).
    model = BiLM.from_pretrained(cache_size=24).eval()
    assert _run_threads(model, batches, repeats=6) == []
    assert model.word_cache.hits > 0 and len(model.word_cache) == 24
