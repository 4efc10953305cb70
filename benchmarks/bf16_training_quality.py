"""Does bf16 training on CPU reach the perplexity of fp32 training? Same seed, same steps.

    python -m benchmarks.bf16_training_quality --steps 300 --threads 2

Prepares WikiText-2 train (the first --train-lines lines; all by default) and valid (the
first --valid-lines lines) in a temporary folder as `prepare --tokenizer whitespace
--unk-token '<unk>' --max-sentence-tokens 128` does, then trains the --preset shape with the
trainer itself (`pretrain`'s code path: Adam, a cosine schedule after a warm-up, dropout 0.1,
--batch-tokens padded positions per step) for --steps steps, once with --precision fp32 and
once with bf16, from the same seed (the same initial weights, batches and dropout masks).
Both models are then evaluated on the valid sample with the full softmax in fp32, so the
figures differ only by how each was trained. Prints, as JSON lines and a Markdown summary:
each run's training time (wall and CPU: a machine shared with other jobs makes the wall time
a poor speed figure; use bench_training for speed) and tokens/s, the training loss at a few steps and the last
(metrics.csv: the mean over the steps since the one logged before), the valid perplexities and the relative gap
bf16 / fp32 - 1. With --control-seed S a third run trains fp32 from another seed: how far two
fp32 runs land apart, the yardstick for the bf16 gap.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import tempfile
import time

import torch

from elmo_pipeline import BiLM
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.training.evaluate import evaluate
from elmo_pipeline.training.options import TrainArgs
from elmo_pipeline.training.trainer import train

from .bench_training import prepare_wikitext

def prepare_split(name: str, lines: int, folder: str) -> dict:
    """The first `lines` lines (0: all) of WikiText-2's `name` split, prepared into `folder`."""
    corpus = prepare_wikitext(folder, lines, name)
    return {"split": name, "lines": lines or "all", "tokens": corpus.manifest.tokens, "folder": folder}


def train_args(opts: argparse.Namespace, data: str, output: str, precision: str, seed: int) -> TrainArgs:
    return TrainArgs(data=data, output=output, preset=opts.preset, precision=precision, seed=seed,
                     max_steps=opts.steps, epochs=100, batch_tokens=opts.batch_tokens, optimizer="adam", lr=opts.lr,
                     schedule="cosine", warmup_steps=opts.warmup_steps, min_lr_ratio=0.1, dropout=0.1,
                     log_every=opts.log_every, checkpoint_every=opts.steps, keep_checkpoints=1,
                     threads=opts.threads, device="cpu")


def curve(run: str) -> dict[int, float]:
    """Training loss by step, from the run's metrics.csv."""
    with open(os.path.join(run, "metrics.csv"), newline="", encoding="utf-8") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["kind"] == "train"}


def one_run(opts: argparse.Namespace, data: str, valid: str, output: str, precision: str, seed: int) -> dict:
    """Train, then evaluate in fp32; the figures of the run."""
    start, cpu = time.perf_counter(), time.process_time()
    result = train(train_args(opts, data, output, precision, seed), out=io.StringIO())
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    model = BiLM.from_pretrained(os.path.join(output, "model"))
    scores = evaluate(model, valid, batch_tokens=8192, precision="fp32")
    return {"precision": precision, "seed": seed, "steps": result["step"], "tokens": result["tokens"],
            "train_seconds": round(seconds, 1), "train_cpu_seconds": round(cpu, 1),
            "tokens_per_s": round(result["tokens"] / seconds, 1),
            "valid_perplexity": round(scores["average_perplexity"], 3),
            "valid_forward": round(scores["forward_perplexity"], 3),
            "valid_backward": round(scores["backward_perplexity"], 3), "valid_tokens": scores["tokens"],
            "loss_curve": curve(output)}


def summary(runs: list[dict], points: list[int]) -> str:
    """The runs as Markdown: perplexities and gaps, then the training loss at `points`."""
    base = runs[0]["valid_perplexity"]
    lines = ["| run | seed | train s (CPU s) | tokens/s | valid ppl (fwd / bwd / avg) | vs fp32 |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        gap = "-" if r is runs[0] else f"{100 * (r['valid_perplexity'] / base - 1):+.2f}%"
        lines.append(f"| {r['precision']} | {r['seed']} | {r['train_seconds']:.0f} ({r['train_cpu_seconds']:.0f}) | "
                     f"{r['tokens_per_s']:,.0f} | "
                     f"{r['valid_forward']:.2f} / {r['valid_backward']:.2f} / **{r['valid_perplexity']:.2f}** | "
                     f"{gap} |")
    lines += ["", "| step | " + " | ".join(f"{r['precision']} (seed {r['seed']})" for r in runs) + " |",
              "|---" * (len(runs) + 1) + "|"]
    for step in points:
        losses = [r["loss_curve"].get(step) for r in runs]
        lines.append(f"| {step} | " + " | ".join("-" if x is None else f"{x:.4f}" for x in losses) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--control-seed", type=int, default=None, help="also train fp32 from this seed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-lines", type=int, default=0, help="WikiText-2 train lines (0: all)")
    parser.add_argument("--valid-lines", type=int, default=0, help="WikiText-2 valid lines (0: all)")
    parser.add_argument("--work", default=None, help="keep the prepared data and the runs here (default: a temp dir)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = opts.work or tmp
        data = prepare_split("train", opts.train_lines, os.path.join(work, "train"))
        valid = prepare_split("valid", opts.valid_lines, os.path.join(work, "valid"))
        print(dumps_strict({"train": data, "valid": valid}, "data"), flush=True)
        plan = [("fp32", opts.seed), ("bf16", opts.seed)]
        if opts.control_seed is not None:
            plan.append(("fp32", opts.control_seed))
        runs = []
        for precision, seed in plan:
            runs.append(one_run(opts, data["folder"], valid["folder"], os.path.join(work, f"run-{precision}-{seed}"),
                                precision, seed))
            print(dumps_strict(runs[-1], "run"), flush=True)
    # the last step's loss too: a run of fewer --steps than --log-every logs no other, and its table had no row
    curve = runs[0]["loss_curve"]
    points = sorted({s for s in curve if s in (opts.log_every, 2 * opts.log_every, max(curve)) or s % 50 == 0})
    print(summary(runs, points))


if __name__ == "__main__":
    main()
