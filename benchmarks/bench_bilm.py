"""Forward-pass throughput of BiLM.embed on real sentences, next to the same run's GEMM rate.

    python -m benchmarks.bench_bilm --shapes original,small,default --kernels exact,fused --precision fp32,bf16

For every (shape, kernel, word cache on/off) it embeds length-sorted WikiText-2 batches of
about --batch-tokens padded positions for --seconds and prints tokens/s, two FLOP rates and
their ratio to a same-run matrix-multiply probe:
- model GF/s: the analytic FLOPs of a token (char CNN + highways + projection + biLSTM,
  ~204 M for Original) times tokens/s, boundaries excluded: the usual "model FLOP" figure.
- work GF/s: the FLOPs the run needed: the encoder once per word it actually encoded (cache
  misses, or each distinct word of a batch without the cache) plus the biLSTM at every
  position including <S> and </S>. This is the hardware-efficiency figure.
Random weights for the released shapes (speed does not depend on the values); `default` is the
embedded default model itself. Each --precision runs the model under that autocast and samples a
GEMM probe of the same dtype (fp32 or bf16), so the ratio compares like with like; the default is
bf16 on CUDA and fp32 on CPU.

On a CPU shared with other jobs, pass --threads 1: with every core's OpenMP team member
needed at each of the thousands of small barriers per batch, a neighbour holding one core
made 2 threads 1.5-3x slower than 1 in our runs (the GEMM probe suffers less). Figures are
noisy there: use --repeats and compare ratios to the probe rather than raw tokens/s.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from elmo_pipeline.model.bilm import DEFAULT_CACHE_SIZE, BiLM
from elmo_pipeline.model.config import ElmoConfig
from elmo_pipeline.model.lstm import EXACT, FUSED
from elmo_pipeline.runtime import autocast

from .common import (
    Sentence, batches_by_tokens, default_matmul_shape, flops_per_token, frequent_words,
    precision_probe, shape_config, synchronize, wikitext_sentences,
)


@dataclass
class Result:
    shape: str
    kernel: str
    cache: bool
    tokens: int
    seconds: float
    model_flops: float
    work_flops: float
    matmul_gflops: float
    hit_rate: float | None
    precision: str = "fp32"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def model_gflops(self) -> float:
        return self.model_flops / self.seconds / 1e9

    @property
    def work_gflops(self) -> float:
        return self.work_flops / self.seconds / 1e9


DEFAULT_MODEL = "default"  # the embedded model, not a random one


def model_config(shape: str) -> ElmoConfig:
    return BiLM.from_pretrained(cache_size=0).config if shape == DEFAULT_MODEL else shape_config(shape)


def build_model(shape: str, cache: bool, device: torch.device, seed: int = 0) -> BiLM:
    cache_size = DEFAULT_CACHE_SIZE if cache else 0
    if shape == DEFAULT_MODEL:
        return BiLM.from_pretrained(cache_size=cache_size).to(device).eval()
    torch.manual_seed(seed)
    return BiLM(shape_config(shape), cache_size=cache_size).to(device).eval()


@dataclass(frozen=True)
class Settings:
    """What every config of one invocation shares."""

    device: torch.device
    precision: str  # "fp32" or "bf16" (runtime.autocast), the probe GEMM in its dtype
    seconds: float
    warmup: int
    matmul_shape: tuple[int, int, int]
    prefill: tuple[str, ...] = ()  # words encoded into the cache before timing


def prefill_cache(model: BiLM, words: Sequence[str], chunk: int = 4096) -> None:
    """Encode `words` through the word cache, as a long run would have done before."""
    for i in range(0, len(words), chunk):
        model.token_representations(words[i : i + chunk])


def run_config(shape: str, kernel: str, cache: bool, batches: list[list[Sentence]], settings: Settings) -> Result:
    device = settings.device
    model = build_model(shape, cache, device)
    model.kernel = kernel
    flops = flops_per_token(model.config)
    probe = precision_probe(device, settings.precision, settings.matmul_shape)
    tokens = positions = 0
    with torch.inference_mode(), autocast(device, settings.precision):
        if cache and settings.prefill:
            prefill_cache(model, settings.prefill)
        for batch in batches[: settings.warmup]:  # first calls pay for oneDNN/cuBLAS set-up
            model.embed(batch)
        synchronize(device)
        hits0, misses0 = model.word_cache.hits, model.word_cache.misses
        start = time.perf_counter()
        step = settings.warmup
        while True:
            batch = batches[step % len(batches)]
            model.embed(batch)
            tokens += sum(len(s) for s in batch)
            positions += sum(len(s) + 2 for s in batch)
            step += 1
            probe.sample()  # one GEMM per batch: the probe sees the same neighbours' load as the model
            if time.perf_counter() - start >= settings.seconds:
                break
        synchronize(device)
        elapsed = time.perf_counter() - start - probe.seconds
    hits = model.word_cache.hits - hits0
    misses = model.word_cache.misses - misses0  # every word the encoder ran on, cache or not
    return Result(
        shape=shape, kernel=kernel, cache=cache, tokens=tokens, seconds=elapsed, precision=settings.precision,
        model_flops=tokens * flops.total,
        work_flops=misses * flops.encoder + positions * flops.bilstm,
        matmul_gflops=probe.gflops(), hit_rate=hits / (hits + misses) if cache else None,
    )


HEADER = (f"{'shape':9} {'prec':4} {'kernel':6} {'cache':5} {'tokens/s':>9} {'model GF/s':>10} {'work GF/s':>9} "
          f"{'matmul GF/s':>11} {'model/mm':>8} {'work/mm':>7} {'hits':>5} {'tokens':>7}")


def format_row(r: Result) -> str:
    hits = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.0f}%"
    return (f"{r.shape:9} {r.precision:4} {r.kernel:6} {'on' if r.cache else 'off':5} {r.tokens_per_s:9.1f} "
            f"{r.model_gflops:10.1f} {r.work_gflops:9.1f} {r.matmul_gflops:11.1f} "
            f"{100 * r.model_gflops / r.matmul_gflops:7.0f}% {100 * r.work_gflops / r.matmul_gflops:6.0f}% "
            f"{hits:>5} {r.tokens:7d}")


def default_batch_tokens(device: torch.device) -> int:
    """Padded positions per batch. On CPU the recurrent products have one row per sentence:
    ~4096 positions (~150 WikiText sentences) ran Original at ~80% of the GEMM rate against
    ~65% for 2048 (BLAS is less efficient below ~128 rows) and ~70% for 8192 (a step's gates
    then no longer fit in the last-level cache). A GPU needs far more rows to fill."""
    return 32768 if device.type == "cuda" else 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="original,small",
                        help="comma list of original, medium, small (random weights) and default (the embedded model)")
    parser.add_argument("--kernels", default="exact,fused", help="comma list of exact, fused")
    parser.add_argument("--cache", default="off,on", help="comma list: word cache off and/or on")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="auto",
                        help="comma list of fp32, bf16 (each against a GEMM probe of its dtype); auto: bf16 on "
                             "cuda, fp32 on cpu")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="padded positions per batch (default 4096 on cpu, 32768 on cuda)")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed budget per config")
    parser.add_argument("--cache-prefill", type=int, default=0, metavar="N",
                        help="before timing, put the N most frequent WikiText-2 train words in the cache "
                             "(the steady state of a long run); 0: start cold")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per config")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (cpu)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per config; the median is reported")
    parser.add_argument("--matmul", default=None, help="probe GEMM shape M,K,N (default the LSTM's (K, N))")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    device = torch.device(args.device)
    precisions = (["bf16" if device.type == "cuda" else "fp32"] if args.precision == "auto"
                  else args.precision.split(","))
    unknown = sorted(set(precisions) - {"fp32", "bf16"})
    if unknown:
        raise SystemExit(f"--precision: unknown {unknown}; give fp32 and/or bf16")
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = args.batch_tokens or default_batch_tokens(device)
    mm_shape = tuple(int(v) for v in args.matmul.split(",")) if args.matmul else default_matmul_shape(device)
    batches = batches_by_tokens(wikitext_sentences("valid"), budget)
    prefill = tuple(frequent_words("train", args.cache_prefill)) if args.cache_prefill else ()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device {name}; precisions {','.join(precisions)}; batches of <= {budget} padded positions; "
          f"{args.seconds:g} s per config; probe GEMM {mm_shape} in each precision's dtype; "
          f"cache prefilled with {len(prefill)} frequent train words")
    for shape in args.shapes.split(","):
        f = flops_per_token(model_config(shape))
        print(f"{shape}: {f.total / 1e6:.1f} MFLOP/token = char CNN {f.char_cnn / 1e6:.1f} + highway "
              f"{f.highway / 1e6:.1f} + projection {f.projection / 1e6:.1f} + biLSTM {f.bilstm / 1e6:.1f}")
    print(HEADER, flush=True)
    results = []
    for shape in args.shapes.split(","):
        for precision in precisions:
            settings = Settings(device, precision, args.seconds, args.warmup,
                                mm_shape, prefill)
            for kernel in args.kernels.split(","):
                for cache in args.cache.split(","):
                    runs = [run_config(shape, kernel, cache == "on", batches, settings) for _ in range(args.repeats)]
                    runs.sort(key=lambda r: r.tokens_per_s)
                    result = runs[len(runs) // 2]
                    results.append(result)
                    print(format_row(result), flush=True)
    print_summary(results)
    return results


def print_summary(results: list[Result]) -> None:
    """Per shape, precision and kernel: the fastest setting's tokens/s, and the hardware efficiency
    that the targets are about (CPU: model/mm, the analytic FLOPs of the tokens over the same
    dtype's GEMM rate; GPU >= 25%, exact within 2x of fused) and work/mm of the cache-off run,
    which gets no credit for skipped encoder work."""
    print("\nsummary")
    for shape, precision in dict.fromkeys((r.shape, r.precision) for r in results):
        mine = [r for r in results if (r.shape, r.precision) == (shape, precision)]
        parts = []
        for kernel in dict.fromkeys(r.kernel for r in mine):
            runs = [r for r in mine if r.kernel == kernel]
            best = max(runs, key=lambda r: r.tokens_per_s)
            text = (f"{kernel} up to {best.tokens_per_s:.0f} tok/s "
                    f"({100 * best.model_gflops / best.matmul_gflops:.0f}% of the {precision} matmul)")
            cold = [r for r in runs if not r.cache]
            if cold:
                text += f", work {100 * cold[0].work_gflops / cold[0].matmul_gflops:.0f}% of matmul without cache"
            parts.append(text)
        by_kernel = {(r.kernel, r.cache): r for r in mine}
        for cache in (False, True):
            if (EXACT, cache) in by_kernel and (FUSED, cache) in by_kernel:
                ratio = by_kernel[FUSED, cache].tokens_per_s / by_kernel[EXACT, cache].tokens_per_s
                parts.append(f"fused/exact {ratio:.2f}x (cache {'on' if cache else 'off'})")
        print(f"  {shape} {precision}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
