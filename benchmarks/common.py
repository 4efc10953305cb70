"""Helpers shared by the benchmarks: real sentences, length-bucketed batches, a GEMM probe,
analytic FLOP counts, timing that is honest on both CPU and CUDA, and a child process's RSS.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig

Sentence = list[str]
DATA_ENV = "ELMO_PIPELINE_DATA"


def shared_data_dir() -> Path:
    """The public data benchmarks and tests read: `$ELMO_PIPELINE_DATA`, else `../shared/data`
    beside the checkout (this file is `<checkout>/benchmarks/common.py`; it ships in no wheel)."""
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    return Path(__file__).resolve().parents[2] / "shared" / "data"

# The released AllenNLP shapes (REFERENCE.md sections 1 and 4). Small shares the Original's
# char CNN; only the highway count and the LSTM sizes differ.
ORIGINAL_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
SHAPES: dict[str, dict] = {
    "original": {"dim": 4096, "projection_dim": 512, "n_highway": 2},
    "small": {"dim": 1024, "projection_dim": 128, "n_highway": 1},
    "medium": {"dim": 2048, "projection_dim": 256, "n_highway": 1},
    "tiny": {"dim": 64, "projection_dim": 16, "n_highway": 1},  # smoke runs only (gpu_suite --quick)
}


def shape_config(name: str, clips: float | None = 3.0) -> ElmoConfig:
    """An ElmoConfig of a released shape (weights are up to the caller)."""
    shape = SHAPES[name]
    return ElmoConfig(
        lstm=LstmConfig(dim=shape["dim"], projection_dim=shape["projection_dim"], n_layers=2,
                        cell_clip=clips, proj_clip=clips, use_skip_connections=True),
        char_cnn=CharCnnConfig(embedding_dim=16, filters=ORIGINAL_FILTERS, n_highway=shape["n_highway"]),
        name=name,
    )


# -- data -------------------------------------------------------------------------------------
def wikitext_sentences(split: str = "valid") -> list[Sentence]:
    """WikiText-2 paragraphs cut into sentences at " . " (the period is kept); headings dropped.

    Real words matter: the word cache's hit rate depends on the vocabulary's Zipf tail.
    """
    path = shared_data_dir() / "wikitext2" / f"wiki.{split}.tokens"
    sentences: list[Sentence] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or (line.startswith("=") and line.endswith("=")):
                continue
            for part in line.split(" . "):
                words = part.split()
                if words:
                    if words[-1] != ".":
                        words.append(".")
                    sentences.append(words)
    return sentences


def frequent_words(split: str, n: int) -> list[str]:
    """The n most frequent words of a WikiText-2 split, most frequent first."""
    counts = Counter(w for s in wikitext_sentences(split) for w in s)
    return [w for w, _ in counts.most_common(n)]


def batches_by_tokens(sentences: Sequence[Sentence], budget: int, seed: int = 0) -> list[list[Sentence]]:
    """Length-sorted batches whose padded size (rows x longest, boundaries included) <= budget.

    Sorting keeps padding (wasted input-projection work) and the ragged tail of the recurrence
    small, as the pipeline's SortAndBatchElements does. The batch order is then shuffled so a
    time-limited run sees the corpus' length mix instead of only its longest sentences.
    """
    ordered = sorted(sentences, key=len, reverse=True)
    batches: list[list[Sentence]] = []
    current: list[Sentence] = []
    for s in ordered:
        width = (len(current[0]) if current else len(s)) + 2
        if current and (len(current) + 1) * width > budget:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


# -- FLOPs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flops:
    """Multiply-adds x 2 for one token, split by the part of the model that does them."""

    char_cnn: int
    highway: int
    projection: int
    bilstm: int

    @property
    def encoder(self) -> int:
        """The context-free part, computed once per distinct word (what the word cache saves)."""
        return self.char_cnn + self.highway + self.projection

    @property
    def total(self) -> int:
        return self.encoder + self.bilstm


def flops_per_token(config: ElmoConfig) -> Flops:
    """Analytic FLOPs of one token (Original: ~204 M). Elementwise work is not counted; a word
    embedding fused with the char CNN adds its width to the projection's input."""
    cnn = config.char_cnn
    assert cnn is not None, "only char-CNN configs are benchmarked"
    chars, d = cnn.max_characters_per_token, cnn.embedding_dim
    char_cnn = sum(2 * d * width * n * (chars - width + 1) for width, n in cnn.filters)
    f = cnn.n_filters
    highway = cnn.n_highway * 2 * (2 * f * f)  # carry and transform matrices
    lstm = config.lstm
    p, h = lstm.projection_dim, lstm.dim
    per_direction_layer = 2 * p * 4 * h + 2 * p * 4 * h + 2 * h * p  # input, recurrent, projection
    word = (config.word_embedding_dim or 0) if config.token_encoder != "char_cnn" else 0
    projected = f + word
    return Flops(char_cnn, highway, 2 * projected * p, 2 * lstm.n_layers * per_direction_layer)


# -- timing -----------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Median wall time of `fn` after one warm-up call; synchronizes so GPU work is counted."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class MatmulProbe:
    """GFLOP/s of an (m, k) @ (k, n) GEMM: the machine's practical ceiling for this workload.

    The CPU is shared with other people's jobs, so a rate measured once before a benchmark may
    describe a different load than the benchmark saw. Call `sample()` between units of the
    measured work: the median of the samples then reflects the same conditions, and the ratio
    of the two rates stays meaningful. Each sample repeats the GEMM for >= `sample_s` seconds
    so that it is long enough to time on a GPU too.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, m: int, k: int, n: int,
                 sample_s: float = 0.05) -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.device = device
        self.a = torch.randn(m, k, generator=gen).to(device, dtype)
        self.b = torch.randn(k, n, generator=gen).to(device, dtype)
        self.out = torch.empty(m, n, device=device, dtype=dtype)
        self.flops = 2 * m * k * n
        self.rates: list[float] = []
        self.seconds = 0.0  # time spent sampling, for callers that must subtract it
        once = median_seconds(self._gemm, device, repeats=3)
        self.reps = max(1, int(sample_s / once))

    def _gemm(self) -> None:
        with torch.inference_mode():
            torch.mm(self.a, self.b, out=self.out)

    def sample(self) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(self.reps):
            self._gemm()
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        self.rates.append(self.reps * self.flops / elapsed / 1e9)
        return self.rates[-1]

    def gflops(self) -> float:
        """Median of the samples taken so far (takes five if there are none)."""
        if not self.rates:
            for _ in range(5):
                self.sample()
        return statistics.median(self.rates)


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # what a run's products are in


def precision_probe(device: torch.device, precision: str, shape: tuple[int, int, int] | None = None) -> MatmulProbe:
    """A GEMM probe in the dtype of a run at `precision` (fp32 or bf16), of `shape` (M, K, N) or
    the device's default."""
    return MatmulProbe(device, PRECISION_DTYPES[precision], *(shape or default_matmul_shape(device)))


def default_matmul_shape(device: torch.device) -> tuple[int, int, int]:
    """The Original's LSTM input projection for 512 positions (CPU) or 8192 (GPU), i.e. the
    same (K, N) = (512, 16384) as every per-step recurrent product, at a row count the device
    needs to reach its usual GEMM rate."""
    rows = 8192 if device.type == "cuda" else 512
    return rows, 512, 4 * 4096


def tree_rss_mib(pid: int) -> float | None:
    """The RSS (MiB, from /proc) of process `pid` and every process descended from it, such as the
    workers of `--direct_running_mode multi_processing`; None once `pid` has exited."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:  # "pid (name) state ppid ...": the name may hold ")"
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo, root = 0.0, [pid], True
    while todo:
        process = todo.pop()
        try:
            with open(f"/proc/{process}/status") as f:
                total += int(f.read().split("VmRSS:")[1].split()[0]) / 1024
        except (OSError, IndexError):  # exited, or a zombie without VmRSS
            if root:
                return None
        root = False
        todo += children.get(process, [])
    return total


class RssSampler(threading.Thread):
    """RSS (MiB) of process `pid` and its descendants (tree_rss_mib) every `interval` seconds, as
    (seconds since `t0`, MiB) in `samples`; set `done` to stop. A process that has exited is
    skipped, not an error. The descendants count because a multi_processing job's memory is in
    its workers (2,200 MiB, where the launching process held 484)."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float]] = []
        self.t0 = time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = tree_rss_mib(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic() - self.t0, rss))
            self.done.wait(self.interval)
