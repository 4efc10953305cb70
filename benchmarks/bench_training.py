"""Training throughput of `pretrain` (forward + backward + optimizer step) on WikiText-2 text.

    python -m benchmarks.bench_training --presets small-cpu,small --seconds 60 --threads 1

For every preset it prepares a WikiText-2 valid sample in a temporary folder, then runs the
trainer's own step (LmObjective with the training kernel, Adam, gradient clip) on
length-bucketed batches of --batch-tokens padded positions for --seconds, and prints:
- tokens/s: corpus tokens (boundaries excluded) trained per second;
- work GF/s: training FLOPs per token, counted by torch's FlopCounterMode on real batches
  (matrix products and convolutions, forward and backward; elementwise work not counted),
  times tokens/s;
- the same run's GEMM rate (benchmarks.common.MatmulProbe, sampled between steps so that both
  see the same load on a shared machine) and the ratio of the two.
On CUDA the step runs under bf16 autocast and the probe is a bf16 GEMM.
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
from elmo_pipeline.training.data import BatchStream, Position
from elmo_pipeline.training.lm import LmObjective, make_batch, run_objective
from elmo_pipeline.training.prepare import prepare_in_process, whitespace_sentences
from elmo_pipeline.training.shards import PreparedCorpus
from elmo_pipeline.training.trainer import TrainArgs, build_model

from .common import MatmulProbe, default_matmul_shape, shared_data_dir, synchronize


def _prepare(folder: str, lines: int) -> PreparedCorpus:
    path = shared_data_dir() / "wikitext2" / "wiki.valid.tokens"
    with open(path, encoding="utf-8") as f:
        text = "".join(line for i, line in enumerate(f) if i < lines)
    prepare_in_process(whitespace_sentences(Document("valid", text, str(path), 1), 128), folder,
                       tokenizer="whitespace", lang="en", max_sentence_tokens=128, unk_alias="<unk>")
    return PreparedCorpus(folder)


def bench(preset: str, corpus: PreparedCorpus, device: torch.device, seconds: float, batch_tokens: int,
          probe: MatmulProbe) -> dict:
    args = TrainArgs(data=corpus.directory, output="-", preset=preset)
    model = build_model(args, corpus, lambda m: None).to(device).train()
    objective = LmObjective(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    bf16 = device.type == "cuda"
    stream = BatchStream(corpus, seed=0, batch_tokens=batch_tokens).iterate(Position(), epochs=None)

    def step(count_flops: bool = False) -> tuple[int, int]:
        words, ids, _ = next(stream)
        batch = make_batch(model, words, ids).to(device)
        counter = FlopCounterMode(display=False) if count_flops else None
        with counter if counter is not None else contextlib.nullcontext():
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
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
    return {"preset": preset, "device": str(device), "threads": torch.get_num_threads(), "parameters": n_params,
            "steps": steps, "tokens": words, "seconds": round(measured, 2), "tokens_per_s": round(rate, 1),
            "train_flops_per_token": round(flops_per_token),
            "work_gflops": round(work, 2), "matmul_gflops": round(gemm, 2), "ratio": round(work / gemm, 3),
            "batch_tokens": batch_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="small-cpu")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--lines", type=int, default=1500, help="WikiText-2 valid lines to train on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    probe = MatmulProbe(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                        *default_matmul_shape(device))
    with tempfile.TemporaryDirectory() as tmp:
        corpus = _prepare(tmp, args.lines)
        for preset in args.presets.split(","):
            print(dumps_strict(bench(preset, corpus, device, args.seconds, args.batch_tokens, probe), preset), flush=True)


if __name__ == "__main__":
    main()
