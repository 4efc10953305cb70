"""End-to-end throughput of the extract job against the model alone, and Parquet bytes per token.

    python -m benchmarks.bench_extract --model OPTIONS.json,WEIGHTS.hdf5 [--max-lines 3000]
    python -m benchmarks.bench_extract --random-shape small      # AllenNLP Small shape, random weights
    python -m benchmarks.bench_extract --sweep-workers 2         # one process against 2 local worker processes

1. Runs `extract` (the local FnApiRunner unless --beam-arg says otherwise) over the first
   --max-lines lines of WikiText-2 valid and takes its tokens/s from the job's own counters.
2. In the same process, loads the SAME model the same way the pipeline's workers do, tokenizes the
   same documents with the same spaCy code, batches the sentences as SortAndBatchElements does
   (ascending length, weight = tokens + 2, the same --batch-tokens and --max-batch-sentences) and
   times `model.embed` alone over those batches: the model-only rate.
3. Prints pipeline / model-only (target >= 70%), then Parquet bytes per token for every --dtype
   and --layers choice (zstd, as the job writes them), from runs over the first --size-lines lines.

With --sweep-workers N it instead runs the job over the same lines (one file) three ways: in one
process (the local runner's default), and with `--direct_running_mode multi_processing
--direct_num_workers N`, once with every worker at torch's default thread count (what each
worker took before --torch-threads existed) and once with the automatic share (CPUs / N). The
rate is the job's tokens over its wall time, worker start-up included.

The model is --model, or a random-weight model of a released shape saved with save_pretrained
(--random-shape; speed does not depend on the weights), or the embedded default model when the
package has one. The tiny test fixture model makes the ratio pessimistic: its forward pass is so
cheap that tokenization and Beam's per-element work dominate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from elmo_pipeline.formats.files import default_model_location
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.pipelines.extract import add_extract_args, run
from elmo_pipeline.corpus.records import Document, Sentence
from elmo_pipeline.corpus.tokenization import build_nlp, tokenize_documents
from elmo_pipeline.transforms.embed import sentence_weight, worker_threads

from .common import shared_data_dir

TARGET_RATIO = 0.70
ORIGINAL_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
SHAPES = {  # the released AllenNLP shapes: LSTM cell / projection, highway layers; the same char CNN
    "small": (1024, 128, 1),
    "medium": (2048, 256, 1),
    "original": (4096, 512, 2),
}


def random_model_dir(shape: str, directory: Path) -> str:
    dim, projection, highways = SHAPES[shape]
    config = ElmoConfig(
        lstm=LstmConfig(dim=dim, projection_dim=projection, n_layers=2, cell_clip=3.0, proj_clip=3.0,
                        use_skip_connections=True),
        char_cnn=CharCnnConfig(embedding_dim=16, filters=ORIGINAL_FILTERS, n_highway=highways),
        name=f"random-{shape}",
    )
    torch.manual_seed(0)
    BiLM(config, cache_size=0).save_pretrained(str(directory))
    return str(directory)


def resolve_model(args: argparse.Namespace, work: Path) -> tuple[str | None, str]:
    if args.model and args.random_shape:
        raise SystemExit("give --model or --random-shape, not both")
    if args.model:
        return args.model, args.model
    if args.random_shape:
        return random_model_dir(args.random_shape, work / "model"), f"random-weight {args.random_shape}"
    if Path(default_model_location(), "config.json").exists():
        return None, "embedded default"
    raise SystemExit("the package has no embedded default model: give --model or --random-shape")


def first_lines(source: Path, n: int, dest: Path) -> Path:
    with open(source, encoding="utf-8") as f, open(dest, "w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            if i == n:
                break
            out.write(line)
    return dest


def extract_args(model: str | None, src: Path, output: Path, a: argparse.Namespace, *extra: str):
    argv = ["--input", str(src), "--output", str(output), "--batch-tokens", str(a.batch_tokens),
            "--max-batch-sentences", str(a.max_batch_sentences), "--device", a.device, "--precision", a.precision,
            *extra]
    if model is not None:
        argv += ["--model", model]
    parser = argparse.ArgumentParser()
    add_extract_args(parser)
    args, rest = parser.parse_known_args(argv)
    return args, rest + list(a.beam_arg)


def same_sentences(src: Path, max_tokens: int = 256) -> tuple[list[Sentence], float]:
    """The documents the job reads from `src` (a document per non-empty line), tokenized by the
    same code as its Tokenize stage; returns them and the tokenization seconds."""
    with open(src, encoding="utf-8") as f:
        docs = [Document(f"{src}:{i}", line.rstrip("\n"), str(src), i)
                for i, line in enumerate(f, 1) if line.rstrip("\n")]
    start = time.perf_counter()
    nlp = build_nlp("en")
    sentences = []
    for lo in range(0, len(docs), 256):
        for result in tokenize_documents(nlp, docs[lo:lo + 256], max_tokens):
            if isinstance(result, list):
                sentences += result
    return sentences, time.perf_counter() - start


def sort_and_batch(sentences: list[Sentence], budget: int, max_sentences: int) -> list[list[Sentence]]:
    """SortAndBatchElements' rule: ascending weight; a batch closes before its weight would reach
    the budget or its size exceed max_sentences."""
    batches, batch, weight = [], [], 0
    for s in sorted(sentences, key=sentence_weight):
        w = sentence_weight(s)
        if batch and (len(batch) >= max_sentences or weight + w >= budget):
            batches.append(batch)
            batch, weight = [], 0
        batch.append(s)
        weight += w
    return batches + ([batch] if batch else [])


def model_only_seconds(model_location: str | None, batches: list[list[Sentence]], device: str) -> float:
    """`model.embed` over the batches, the model loaded as the pipeline's handler loads it."""
    from elmo_pipeline.runtime import resolve_device

    model = BiLM.load(model_location).to(resolve_device(device)).eval()  # default cache, default kernel
    dev = model.device
    with torch.inference_mode():
        start = time.perf_counter()
        for batch in batches:
            out = model.embed([list(s.tokens) for s in batch])
            out.layers.float().cpu()  # what the pipeline needs before it can write the vectors
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start


def worker_sweep(model: str | None, src: Path, work: Path, a: argparse.Namespace) -> list[dict]:
    """tokens/s of the job in one process and in `a.sweep_workers` worker processes, with torch's
    default threads per worker and with the automatic share; the best of `a.repeats` runs each."""
    n = a.sweep_workers
    default_threads = torch.get_num_threads()
    workers = ["--direct_running_mode=multi_processing", f"--direct_num_workers={n}"]
    auto = worker_threads(0, n)
    configs = [("1 process", f"{default_threads} (torch default)", []),
               (f"{n} workers", f"{default_threads} each (torch default)",
                ["--torch-threads", str(default_threads), *workers]),
               (f"{n} workers", f"{auto} each (automatic)", workers)]
    rows = []
    for runner, threads, extra in configs:
        rates = []
        for repeat in range(a.repeats):
            load = os.getloadavg()[0]
            summary = run(*extract_args(model, src, work / f"sweep-{len(rows)}-{repeat}", a, *extra))
            rates.append(summary["tokens"] / summary["seconds"])
            print(f"  {runner}, threads {threads}: {rates[-1]:,.0f} tokens/s ({summary['tokens']:,} tokens in "
                  f"{summary['seconds']:.1f} s; load average {load:.1f} before)", flush=True)
        rows.append({"runner": runner, "threads": threads, "tokens": summary["tokens"],
                     "tokens_per_s": max(rates), "all_tokens_per_s": rates})
    return rows


def parquet_bytes(output: Path) -> int:
    return sum(f.stat().st_size for f in output.glob("tokens-*.parquet"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder/URL or OPTIONS.json,WEIGHTS.hdf5")
    p.add_argument("--random-shape", choices=sorted(SHAPES), default=None,
                   help="benchmark a random-weight model of this released shape instead")
    p.add_argument("--data", default=None, help="WikiText-2 valid tokens file (default: the shared data)")
    p.add_argument("--max-lines", type=int, default=3000, help="lines of the file to extract (blank ones included)")
    p.add_argument("--size-lines", type=int, default=300, help="lines for the Parquet size runs")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--max-batch-sentences", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads for both measurements (0: torch's default). On a shared "
                        "machine 1 avoids OpenMP spin-waiting against other people's jobs")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--beam-arg", action="append", default=[], help="extra Beam option, e.g. --beam-arg=--runner=...")
    p.add_argument("--skip-sizes", action="store_true")
    p.add_argument("--sweep-workers", type=int, default=0,
                   help="instead: the job in one process against N local worker processes (see above)")
    p.add_argument("--repeats", type=int, default=1, help="--sweep-workers: runs per configuration (the best counts)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    a = p.parse_args(argv)

    data = Path(a.data) if a.data else shared_data_dir() / "wikitext2" / "wiki.valid.tokens"
    if a.threads:
        torch.set_num_threads(a.threads)  # the local runner's workers run in this process
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    try:
        model, model_name = resolve_model(a, work)
        src = first_lines(data, a.max_lines, work / "input.txt")
        print(f"model: {model_name}; input: {a.max_lines} lines of {data.name}; batch {a.batch_tokens} tokens; "
              f"device {a.device}; torch threads {torch.get_num_threads()}; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        if a.sweep_workers:
            print(f"\nworker sweep ({src.stat().st_size:,} bytes in one file)")
            rows = worker_sweep(model, src, work, a)
            print(f"\n  {'runner':<12} {'torch threads':<26} {'tokens/s':>10}")
            for row in rows:
                print(f"  {row['runner']:<12} {row['threads']:<26} {row['tokens_per_s']:>10,.0f}")
            if a.json:
                Path(a.json).write_text(dumps_strict({"model": model_name, "max_lines": a.max_lines, "sweep": rows},
                                                     a.json, indent=2))
            return 0

        sentences, tokenize_s = same_sentences(src)
        n_tokens = sum(len(s.tokens) for s in sentences)
        batches = sort_and_batch(sentences, a.batch_tokens, a.max_batch_sentences)
        # the model alone just before and just after the pipeline, so that a change in the
        # machine's load during the run shows; the faster of the two is the reference
        before_s = model_only_seconds(model, batches, a.device)
        summary = run(*extract_args(model, src, work / "out", a))
        after_s = model_only_seconds(model, batches, a.device)
        if n_tokens != summary["tokens"]:
            print(f"warning: pipeline counted {summary['tokens']} tokens, direct tokenization {n_tokens}")
        pipeline_rate = summary["tokens"] / summary["seconds"]
        model_s = min(before_s, after_s)
        model_rate = n_tokens / model_s
        ratio = pipeline_rate / model_rate
        verdict = f"{ratio:.1%} (target >= {TARGET_RATIO:.0%}: {'met' if ratio >= TARGET_RATIO else 'NOT met'})"

        rows = [("documents", f"{summary['documents_read']:,}"), ("sentences", f"{summary['sentences']:,}"),
                ("tokens", f"{summary['tokens']:,}"),
                ("pipeline batches / padding", f"{summary['batches']:,} / {summary['padding_ratio']:.1%}"),
                ("model-only batches", f"{len(batches):,}"),
                ("pipeline seconds (end to end)", f"{summary['seconds']:.1f}"),
                ("model-only seconds (embed; before / after)", f"{before_s:.1f} / {after_s:.1f}"),
                ("spaCy tokenization seconds (same docs, 1 core)", f"{tokenize_s:.1f}"),
                ("pipeline tokens/s", f"{pipeline_rate:,.0f}"), ("model-only tokens/s", f"{model_rate:,.0f}"),
                ("pipeline / model-only", verdict)]
        width = max(len(k) for k, _ in rows)
        print("\nthroughput")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")

        sizes = []
        if not a.skip_sizes:
            size_src = first_lines(data, a.size_lines, work / "size_input.txt")
            for dtype in ("float16", "float32"):
                for layers in ("all", "top", "none"):
                    out = work / f"size-{dtype}-{layers}"
                    s = run(*extract_args(model, size_src, out, a, "--dtype", dtype, "--layers", layers,
                                          "--num-shards", "1"))
                    sizes.append((dtype, layers, s["tokens"], parquet_bytes(out)))
            print(f"\nParquet bytes per token (zstd, token layout, first {a.size_lines} lines)")
            print(f"  {'dtype':<8} {'layers':<6} {'tokens':>8} {'bytes':>12} {'bytes/token':>12}")
            for dtype, layers, tokens, size in sizes:
                print(f"  {dtype:<8} {layers:<6} {tokens:>8,} {size:>12,} {size / tokens:>12,.1f}")

        if a.json:
            Path(a.json).write_text(dumps_strict({
                "model": model_name, "max_lines": a.max_lines, "summary": summary,
                "model_only_seconds": [before_s, after_s],
                "pipeline_tokens_per_s": pipeline_rate, "model_only_tokens_per_s": model_rate, "ratio": ratio,
                "tokenize_seconds": tokenize_s,
                "sizes": [{"dtype": d, "layers": lay, "tokens": t, "bytes": b} for d, lay, t, b in sizes],
            }, a.json, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
