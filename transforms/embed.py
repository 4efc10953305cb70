"""EmbedSentences: length-sorted token-budget batches -> RunInference with our ModelHandler."""

from __future__ import annotations

import contextlib
import copy
import glob
import heapq
import itertools
import os
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

import apache_beam as beam
import torch
from apache_beam.ml.inference.base import ModelHandler, RunInference
from apache_beam.transforms import window
from apache_beam.utils.windowed_value import WindowedValue

from elmo_pipeline.model.bilm import BiLM, check_cache_size
from elmo_pipeline.model.lstm import AUTO, FUSED, check_kernel
from elmo_pipeline.embedding.batch import SharedEmbedder, length_sorted_batches, sentence_weight
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.runtime import HeapTrimmer, PlannedRuntime, check_precision_runs, parse_device, resolve_device
from elmo_pipeline.runtime_choices import MAX_TORCH_THREADS
from elmo_pipeline.strict import check_bools, check_ints
from elmo_pipeline.transforms.checks import check_collection
from elmo_pipeline.transforms.metrics import (BATCHES, BATCH_PADDED_TOKENS, BATCH_TOKENS, EMBEDDED_ON, NAMESPACE,
                                              OOM_SPLITS, BundleCounts)


SHARED_MODEL_TAG = "elmo-pipeline-model-"  # + "<launcher pid>-<hex>": see EmbedSentences.expand
# the tags that each pipeline's EmbedSentences gave its model (expand), which name its model's files
# and its progress bars: a pipeline's end cleans up its own, not those of another still running here
_PIPELINE_TAGS: weakref.WeakKeyDictionary[beam.Pipeline, list[str]] = weakref.WeakKeyDictionary()


def remove_shared_model_files(pipeline: beam.Pipeline | None = None) -> None:
    """Removes the address and lock files that Beam's server of a `large_model` (one per tag, and
    one of its status) leaves in the temp folder, for the tags that `pipeline`'s EmbedSentences
    gave: call it after `pipeline` has run on this machine. Without `pipeline`, for every tag this
    process gave: for a process that is ending, with all of its pipelines."""
    tags = [f"{SHARED_MODEL_TAG}{os.getpid()}-"] if pipeline is None else _PIPELINE_TAGS.get(pipeline, [])
    for tag in tags:
        for path in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{glob.escape(tag)}*")):
            if path.endswith((".address", ".lock")):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def worker_threads(requested: int, workers: int) -> int | None:
    """Torch CPU threads for one of `workers` worker processes sharing this machine: `requested`
    when it is > 0, else the CPUs this process may use divided among the workers (at least 1);
    None (torch's own choice) for a lone worker. Left alone, every worker's torch would take
    every core and the workers would fight over them."""
    if requested > 0:
        return requested
    if workers <= 1:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // workers)


class BatchCounts(NamedTuple):
    """What embedding one batch counts: the job's counters of embed.py, and the progress bar."""

    runtime: str  # "<device type>/<kernel>" it ran with
    sentences: int
    tokens: int
    weight: int  # sentence_weight summed: the batch's tokens with each sentence's boundaries
    padded: int  # weight of the longest sentence x sentences
    oom_splits: int
    seconds: float  # the batch's embedding, which a bar made once it is done counts in its time

    def add_to(self, counts: BundleCounts) -> None:
        counts.add(BATCHES)
        counts.add(BATCH_TOKENS, self.weight)
        counts.add(BATCH_PADDED_TOKENS, self.padded)
        counts.add(OOM_SPLITS, self.oom_splits)
        counts.add(f"{EMBEDDED_ON}{self.runtime}", self.tokens)


_BAR_LOCK = threading.Lock()
# (pid, the job's tag; None for a handler used alone) -> that job's bar in this worker process: jobs
# run at once in one process (run_pipeline from threads) each have their own, closed as the job ends
_bar: dict[tuple[int, str | None], Any] = {}
# set as a signal ends the process (close_progress_bars(None)): a thread's batch done after it would
# make a new bar, drawn after the signal's line or on it
_bars_ended = False


def note_embedded(counts: BatchCounts, job: str | None = None) -> None:
    """Moves this worker process's progress bar of the job tagged `job` (one, whatever the threads
    that embed in it; on a terminal only: a local run; clusters report Beam's counters)."""
    with _BAR_LOCK:
        if _bars_ended:
            return
        pid = os.getpid()  # a forked worker draws bars of its own
        if (pid, job) not in _bar:
            for key in [key for key in _bar if key[0] != pid]:
                del _bar[key]
            _bar[pid, job] = progress_bar(f"embed [pid {pid}]", elapsed=counts.seconds)
        note_tokens(_bar[pid, job], counts.sentences, counts.tokens)


def close_progress_bars(pipeline: beam.Pipeline | None) -> None:
    """Draws this process's bars of `pipeline` (one per EmbedSentences) at their last counts and
    drops them, as the job run here ends: a bar redraws at most once a second, so its last line
    would lag the job's counts until the interpreter exits, and a later job in the process would
    count on from them. The bars of another job still running here are left alone. None: every bar
    of this process (a signal ending it), each then ending its line on the terminal, and none made
    after it."""
    global _bars_ended
    with _BAR_LOCK:
        _bars_ended = _bars_ended or pipeline is None
        pid = os.getpid()
        keys = [key for key in _bar if key[0] == pid] if pipeline is None else \
            [(pid, tag) for tag in _PIPELINE_TAGS.get(pipeline, [])]
        bars = [_bar.pop(key) for key in keys if key in _bar]
    for bar in bars:
        bar.close()


class ElmoModelHandler(ModelHandler[Sentence, EmbeddedSentence, BiLM]):
    """Loads the biLM once per worker process and embeds a batch of sentences in zero state.

    `model` is a native model directory/URL, `OPTIONS.json,WEIGHTS.hdf5`, or None for the
    embedded default model. The worker's torch thread count, from `torch_threads` and `workers`
    (the worker processes sharing a machine, see `worker_threads`), is set at load and in every
    thread that embeds (torch keeps one per thread).
    After a batch the C heap's free pages go back to the OS, at most every 2 s (`HeapTrimmer`).
    Each batch counts its tokens under EMBEDDED_ON + "<device type>/<kernel>", and a batch that
    would run on another device type or kernel than `planned` (what the job's metadata says)
    fails with an error that says so. Used alone (in a RunInference of your own) it counts each
    batch as it is embedded; EmbedSentences sets `counts_follow` instead, so that a batch's
    BatchCounts follow its sentences out and are counted once per bundle (`CountBatches`).
    `device`, `precision`, `kernel`, `cache_size` and `large_model`: see EmbedSentences.
    Its options are checked when it is built, as EmbedSentences' are: an unknown device,
    precision or kernel, counts that are not ints or out of range, and a `model` whose config
    cannot be read (a folder that holds none) are refused there.
    """

    counts_follow = False

    def __init__(self, model: str | None = None, device: str = "auto", precision: str = "fp32",
                 kernel: str = AUTO, cache_size: int = 100_000, large_model: bool = False,
                 torch_threads: int = 0, workers: int = 1, planned: PlannedRuntime | None = None) -> None:
        super().__init__(large_model=large_model)
        # checked here, not in each worker as it loads the model after the reading (in EmbedSentences
        # and in a RunInference of the user's own alike)
        check_cache_size(cache_size)
        check_ints(torch_threads=torch_threads, workers=workers)
        if not 0 <= torch_threads <= MAX_TORCH_THREADS or workers < 1:
            raise ValueError(f"torch_threads must be from 0 to {MAX_TORCH_THREADS} and workers >= 1, "
                             f"got {torch_threads} and {workers}")
        # a str "no" was taken for True (the model shared across processes), and a planned device
        # given as a str failed at every worker's first batch ("'str' object has no attribute 'device'")
        check_bools(large_model=large_model)
        if planned is not None and not isinstance(planned, PlannedRuntime):
            raise TypeError(f"planned must be a PlannedRuntime or None, got {planned!r}")
        check_runtime_names(device, precision, kernel)
        # the config (not the weights) read now: a location that holds no model failed in every
        # worker as it loaded, after the reading; and a model with clips refuses the fused kernel
        config = BiLM.config_of(model)
        if kernel == FUSED:
            check_kernel(kernel, config.lstm)
        self.model_location = model
        self.device = device
        self.precision = precision
        self.kernel = kernel
        self.cache_size = cache_size
        self.torch_threads = torch_threads
        self.workers = workers
        self.planned = planned
        self._trim_heap = HeapTrimmer()

    def load_model(self) -> BiLM | SharedEmbedder:
        """The biLM; with `large_model`, a SharedEmbedder of it, which Beam serves to the machine's
        processes through a proxy (a proxy forwards method calls, not attribute reads)."""
        self._use_worker_threads(at_load=True)
        model = BiLM.load(self.model_location, kernel=self.kernel, cache_size=self.cache_size)
        model = model.to(resolve_device(self.device)).eval()
        if self.share_model_across_processes():
            return SharedEmbedder(model)
        return model

    def _use_worker_threads(self, at_load: bool = False) -> None:
        """Gives the calling thread the worker's torch thread count (`worker_threads`); at load also
        the threads started later. torch keeps a count per thread (OpenMP's): set at load only, it
        missed the harness threads that had already run torch (another stage's work), which kept
        every core, so each thread that embeds sets it for itself."""
        threads = worker_threads(self.torch_threads, self.workers)
        if threads is not None and (at_load or torch.get_num_threads() != threads):
            torch.set_num_threads(threads)

    def run_inference(self, batch: Sequence[Sentence], model: BiLM | SharedEmbedder,
                      inference_args: Optional[dict[str, Any]] = None) -> Iterable[EmbeddedSentence | BatchCounts]:
        batch = list(batch)
        self._use_worker_threads()
        # a SharedEmbedder, or a proxy of one, has embed_sentences
        embedder = model if hasattr(model, "embed_sentences") else SharedEmbedder(model)
        device, kernel = embedder.runtime()
        self._check_planned(device, kernel)
        started = time.monotonic()
        embedded, splits = embedder.embed_sentences(batch, self.precision)
        seconds = time.monotonic() - started
        self._trim_heap()
        lengths = [sentence_weight(s) for s in batch]
        counts = BatchCounts(f"{device}/{kernel}", len(batch), sum(len(s.tokens) for s in batch), sum(lengths),
                             max(lengths) * len(lengths), splits, seconds)
        if self.counts_follow:
            return [*embedded, counts]
        now = BundleCounts()
        counts.add_to(now)
        now.commit()
        note_embedded(counts)
        return embedded

    def _check_planned(self, device: str, kernel: str) -> None:
        planned = self.planned
        if planned is None or (planned.device in (None, device) and planned.kernel in (None, kernel)):
            return
        raise RuntimeError(f"this worker would embed on {device} with the {kernel} kernel, but the job was planned "
                           f"(and its Parquet metadata written) for device {planned.device or 'auto'} and kernel "
                           f"{planned.kernel or 'auto'}; give --device and --kernel explicitly")

    def get_num_bytes(self, batch: Sequence[Sentence]) -> int:
        return sum(sum(len(t) for t in s.tokens) for s in batch)

    def get_metrics_namespace(self) -> str:
        return f"{NAMESPACE}.RunInference"


SORT_BUFFER_BATCHES = 32  # the default sort buffer: this many batches' worth of tokens


class SortAndBatchSentences(beam.DoFn):
    """Length-sorted batches from a bounded buffer, window by window.

    Beam's SortAndBatchElements holds a whole bundle before it sorts, and the local FnApiRunner
    makes the whole input one bundle: memory then grows with the corpus. Here sentences collect,
    each with those of its window, until all of them weigh `buffer_tokens` (`sentence_weight`);
    then the heaviest window's are sorted and cut into batches by the same rule as
    SortAndBatchElements (`length_sorted_batches`: at most `batch_tokens` tokens and
    `max_batch_sentences` sentences a batch), each batch at the end of that window, and its
    buffer starts again; the rest goes at the end of the bundle. The heaviest window is found in a
    heap of (weight, window) entries, not by scanning every window held: with a window a sentence
    (Sessions before their merge, distinct timestamps) a buffer holds thousands, and the scan at
    each sentence made the stage quadratic (20,000 such sentences: 49 s, 40,000: 173 s).
    """

    def __init__(self, batch_tokens: int, max_batch_sentences: int, buffer_tokens: int) -> None:
        self.batch_tokens = batch_tokens
        self.max_batch_sentences = max_batch_sentences
        self.buffer_tokens = max(buffer_tokens, batch_tokens)

    def start_bundle(self) -> None:
        self._buffers: dict[window.BoundedWindow, list[Sentence]] = {}
        self._weights: dict[window.BoundedWindow, int] = {}
        self._weight = 0  # of every window's buffer
        # (-weight, order, window) at each window's every weight: an entry whose weight is no longer
        # its window's is skipped when it comes up (windows have no order: `order` breaks ties)
        self._heaviest: list[tuple[int, int, window.BoundedWindow]] = []
        self._order = itertools.count()

    def process(self, sentence: Sentence, in_window: window.BoundedWindow = beam.DoFn.WindowParam):
        weight = sentence_weight(sentence)
        self._buffers.setdefault(in_window, []).append(sentence)
        held = self._weights[in_window] = self._weights.get(in_window, 0) + weight
        self._weight += weight
        heapq.heappush(self._heaviest, (-held, next(self._order), in_window))
        if len(self._heaviest) > 2 * len(self._weights) + 64:  # the stale entries, dropped
            self._heaviest = [(-total, next(self._order), w) for w, total in self._weights.items()]
            heapq.heapify(self._heaviest)
        if self._weight >= self.buffer_tokens:
            yield from self._batches(self._pop_heaviest())

    def _pop_heaviest(self) -> window.BoundedWindow:
        while True:
            held, _, heaviest = heapq.heappop(self._heaviest)
            if self._weights.get(heaviest) == -held:
                return heaviest

    def finish_bundle(self):
        for held in list(self._buffers):
            yield from self._batches(held)

    def _batches(self, held: window.BoundedWindow) -> Iterator[WindowedValue]:
        buffered = self._buffers.pop(held)
        self._weight -= self._weights.pop(held)
        for batch in length_sorted_batches(buffered, self.batch_tokens, self.max_batch_sentences):
            yield WindowedValue(batch, held.max_timestamp(), (held,))


def check_runtime_names(device: str, precision: str, kernel: str) -> None:
    """Raises ValueError for a device, precision or kernel that no machine has: checked where a
    job is built, since a worker would only find it after reading and tokenizing its input."""
    check_kernel(kernel)
    # fp16 on an explicit cpu too: every worker would fail at its first batch
    check_precision_runs(None if device == "auto" else parse_device(device), precision)


@beam.typehints.with_input_types(Sentence)
class EmbedSentences(beam.PTransform):
    """PCollection[Sentence] -> PCollection[EmbeddedSentence] (layers only; see MixLayers).

    Sentences are sorted by length (in buffers of `sort_buffer_tokens` tokens in all, by default
    SORT_BUFFER_BATCHES * `batch_tokens`; within a bundle and a window) and batched up to `batch_tokens`
    tokens (boundaries included; at most `max_batch_sentences`), so neighbours in a batch have
    similar lengths and little compute goes to padding; since every sentence starts from a zero
    state, batching never changes a vector. This stage holds at most one sort buffer of
    sentences and one batch of vectors, whatever the size of a document or of the corpus.
    `torch_threads` (0: automatic) and `workers` (the worker processes sharing a machine) set
    each worker's torch threads, see `worker_threads`. `planned`: see ElmoModelHandler.
    `model` is a model folder or URL of ours, `OPTIONS.json,WEIGHTS.hdf5`, or None for the embedded
    default model; `device` "auto" (CUDA where a worker has it), "cpu", "cuda" or "cuda:N";
    `precision` "fp32", "bf16" or "fp16" (autocast); `kernel` the LSTM's, "auto", "exact" or "fused";
    `cache_size` the words each worker's word cache holds; `large_model` loads one model per machine,
    shared by its worker processes (Beam's `large_model`).
    """

    def __init__(self, model: str | None = None, device: str = "auto", precision: str = "fp32",
                 batch_tokens: int = 8192, max_batch_sentences: int = 1024, kernel: str = AUTO,
                 cache_size: int = 100_000, large_model: bool = False,
                 sort_buffer_tokens: int | None = None, torch_threads: int = 0, workers: int = 1,
                 planned: PlannedRuntime | None = None) -> None:
        super().__init__()
        check_ints(batch_tokens=batch_tokens, max_batch_sentences=max_batch_sentences)
        if sort_buffer_tokens is None:
            sort_buffer_tokens = SORT_BUFFER_BATCHES * batch_tokens
        check_ints(sort_buffer_tokens=sort_buffer_tokens)
        if batch_tokens < 1 or max_batch_sentences < 1 or sort_buffer_tokens < 1:
            raise ValueError("batch_tokens, max_batch_sentences and sort_buffer_tokens must be >= 1")
        # the handler checks the rest when built
        self.handler = ElmoModelHandler(model, device, precision, kernel, cache_size, large_model, torch_threads,
                                        workers, planned)
        self.batch_tokens = batch_tokens
        self.max_batch_sentences = max_batch_sentences
        self.sort_buffer_tokens = sort_buffer_tokens

    def expand(self, sentences: beam.PCollection) -> beam.PCollection:
        check_collection(self.label, sentences)
        batches = sentences | "SortAndBatch" >> beam.ParDo(SortAndBatchSentences(
            self.batch_tokens, self.max_batch_sentences, self.sort_buffer_tokens))
        # the tag names the files Beam's large_model server leaves in the temp folder; this process
        # (the launcher) is in it, and the pipeline keeps it, so that run_pipeline can take its own
        # run's files away (remove_shared_model_files)
        tag = f"{SHARED_MODEL_TAG}{os.getpid()}-{uuid.uuid4().hex}"
        _PIPELINE_TAGS.setdefault(batches.pipeline, []).append(tag)
        handler = copy.copy(self.handler)
        handler.counts_follow = True
        return (batches
                | "RunInference" >> RunInference(handler.with_no_batching(), model_identifier=tag)
                | "CountBatches" >> beam.ParDo(CountBatches(tag)))


class CountBatches(beam.DoFn):
    """Passes the embedded sentences on, and adds the BatchCounts that follow each batch's
    sentences to the job's counters once the bundle has finished: a bundle that fails and is
    retried counts once. The progress bar of the job tagged `job` moves at once."""

    def __init__(self, job: str) -> None:
        self._job = job

    def start_bundle(self) -> None:
        self._counts = BundleCounts()

    def process(self, item: EmbeddedSentence | BatchCounts):
        if isinstance(item, BatchCounts):
            item.add_to(self._counts)
            note_embedded(item, self._job)
        else:
            yield item

    def finish_bundle(self) -> None:
        self._counts.commit()
