"""Training throughput of `pretrain` (forward + backward + optimizer step) on WikiText-2 text.

    python -m benchmarks.bench_training --presets small-cpu,small --seconds 60 --threads 1
    python -m benchmarks.bench_training --presets small,small-cpu --precision fp32,bf16 --threads 2
    python -m benchmarks.bench_training --presets wt2-gpu,small-cpu --kernels auto,fused --precision fp32,bf16

For every preset and precision it prepares a WikiText-2 valid sample in a temporary folder
(once), then runs the trainer's own step (LmObjective with the training kernel under the
trainer's autocast, Adam, gradient clip) on length-bucketed batches of --batch-tokens padded
positions for --seconds, and prints:
- tokens/s: corpus tokens (boundaries excluded) trained per second;
- work GF/s: training FLOPs per token, counted by torch's FlopCounterMode on real batches
  (matrix products and convolutions, forward and backward; elementwise work not counted),
  times tokens/s;
- the same run's GEMM rate in the run's own dtype (benchmarks.common.MatmulProbe: float32 for
  fp32, bfloat16 for bf16; sampled between steps so that both see the same load on a shared
  machine) and the ratio of the two.
--precision auto is what `pretrain` does by default: bf16 on CUDA, fp32 on CPU. A Markdown
table of all the runs follows the JSON lines.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.corpus.records import Document
from elmo_pipeline.runtime import autocast
from elmo_pipeline.training.data import BatchStream, Position
from elmo_pipeline.training.initial_model import build_model
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.training.options import TrainArgs, training_precision
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.shards import PreparedCorpus

from .common import MatmulProbe, precision_probe, shared_data_dir, synchronize


def prepare_wikitext(folder: str, lines: int, split: str = "valid") -> PreparedCorpus:
    """The first `lines` lines (0: all) of WikiText-2's `split`, prepared into `folder` as `prepare
    --tokenizer whitespace --unk-token '<unk>' --max-sentence-tokens 128` does."""
    path = shared_data_dir() / "wikitext2" / f"wiki.{split}.tokens"
    with open(path, encoding="utf-8") as f:
        text = "".join(line for i, line in enumerate(f) if not lines or i < lines)
    prepare_in_process(whitespace_sentences(Document(split, text, str(path), 1), 128), folder,
                       tokenizer="whitespace", lang="en", max_sentence_tokens=128, unk_alias="<unk>")
    return PreparedCorpus(folder)


def bench(preset: str, corpus: PreparedCorpus, device: torch.device, seconds: float, batch_tokens: int,
          probe: MatmulProbe | None = None, precision: str = "auto", kernel: str = "auto") -> dict:
    """One preset at one precision (`pretrain`'s --precision; auto: bf16 on CUDA, fp32 elsewhere)
    and kernel (`pretrain`'s --kernel: fused trains with torch's LSTM op, else the reference
    recurrence); without `probe`, one in the precision's dtype is made."""
    args = TrainArgs(data=corpus.directory, output="-", preset=preset, precision=precision, kernel=kernel)
    precision = training_precision(args.precision, device)
    probe = probe or precision_probe(device, precision)
    model = build_model(args, corpus, lambda m: None).to(device).train()
    objective = LmObjective(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    stream = BatchStream(corpus, seed=0, batch_tokens=batch_tokens).iterate(Position(), epochs=None)

    def step(count_flops: bool = False) -> tuple[int, int]:
        words, ids, _ = next(stream)
        batch = make_batch(model, words, ids).to(device)
        counter = FlopCounterMode(display=False) if count_flops else None
        with counter if counter is not None else contextlib.nullcontext():
            with autocast(device, precision):  # the trainer's context (Trainer._setup)
                f, b, n = run_objective(objective, batch, 0.1)
                loss = (f + b) / (2 * n)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch.n_words, (counter.get_total_flops() if counter else 0)

    for _ in range(2):  # warm-up
        step()
    # FLOPs per token from two counted steps (the counter slows a step down: not timed)
    counted_words = counted_flops = 0
    for _ in range(2):
        w, fl = step(count_flops=True)
        counted_words, counted_flops = counted_words + w, counted_flops + fl
    flops_per_token = counted_flops / counted_words
    words = steps = 0
    measured = 0.0
    while measured < seconds:
        probe.sample()
        synchronize(device)
        start = time.perf_counter()
        words += step()[0]
        synchronize(device)
        measured += time.perf_counter() - start
        steps += 1
    probe.sample()
    gemm = probe.gflops()
    rate = words / measured
    work = flops_per_token * rate / 1e9
    n_params = sum(p.numel() for p in model.parameters())
    return {"preset": preset, "precision": precision, "kernel": kernel,
            "matmul_dtype": str(probe.a.dtype).replace("torch.", ""),
            "device": str(device), "threads": torch.get_num_threads(), "parameters": n_params,
            "steps": steps, "tokens": words, "seconds": round(measured, 2), "tokens_per_s": round(rate, 1),
            "train_flops_per_token": round(flops_per_token),
            "work_gflops": round(work, 2), "matmul_gflops": round(gemm, 2), "ratio": round(work / gemm, 3),
            "batch_tokens": batch_tokens}


def table(results: list[dict]) -> str:
    """The runs as the README's Markdown table."""
    lines = ["| shape | precision | kernel | tokens/s | work GFLOP/s | same-run matmul GFLOP/s (dtype) | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']} | {r['precision']} | {r['kernel']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['work_gflops']:.1f} | "
                     f"{r['matmul_gflops']:.1f} ({r['matmul_dtype']}) | {100 * r['ratio']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="small-cpu")
    parser.add_argument("--precision", default="auto",
                        help="comma-separated: auto, fp32, bf16 (each run against a probe of its own dtype)")
    parser.add_argument("--kernels", default="auto",
                        help="comma-separated pretrain --kernel values: auto (the reference recurrence), fused")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--lines", type=int, default=1500, help="WikiText-2 valid lines to train on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = prepare_wikitext(tmp, args.lines)
        for preset in args.presets.split(","):
            for precision in args.precision.split(","):
                for kernel in args.kernels.split(","):
                    results.append(bench(preset, corpus, device, args.seconds, args.batch_tokens, precision=precision,
                                         kernel=kernel))
                    print(dumps_strict(results[-1], preset), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
