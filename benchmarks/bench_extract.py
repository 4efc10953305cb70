"""End-to-end throughput of the extract job against the model alone, and Parquet bytes per token.

    python -m benchmarks.bench_extract --model OPTIONS.json,WEIGHTS.hdf5 [--max-lines 3000]
    python -m benchmarks.bench_extract --random-shape small      # AllenNLP Small shape, random weights
    python -m benchmarks.bench_extract --sweep-workers 2         # one process against 2 local worker processes

1. Runs `extract` (the local FnApiRunner unless --beam-arg says otherwise) over the first
   --max-lines lines of WikiText-2 valid and takes its tokens/s from the job's own counters.
2. In the same process, loads the SAME model the same way the pipeline's workers do, tokenizes the
   same documents with the same spaCy code, batches the sentences as the Embed stage does
   (`length_sorted_batches`, the same --batch-tokens and --max-batch-sentences) and times
   `model.embed` alone over those batches, at the same --precision: the model-only rate.
3. Runs every stage's own code outside Beam over the same documents, one after the other, and
   prints what each costs beside the model, in microseconds per token (one process; the model's
   torch threads are the only parallel part): read, tokenize (spaCy), sentence records,
   sort/batch, embed (the handler's work around `model.embed`), mix, Arrow tables, Parquet write,
   job start (the same job on one line of input), and the rest (Beam's own per-element work:
   the pipeline's seconds less everything above).
4. Prints pipeline / model-only (target >= 85%), then Parquet bytes per token for every --dtype
   and --layers choice (zstd, as the job writes them), from runs over the first --size-lines lines;
   --layers none, which writes mixes only, with the --mix given, else the layers' average.

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
from functools import partial
from typing import Any, Callable

import torch
from apache_beam.transforms.window import GlobalWindow

from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import read_documents
from elmo_pipeline.corpus.records import Document, Sentence
from elmo_pipeline.corpus.schema import parquet_writer
from elmo_pipeline.corpus.tokenization import build_nlp, tokenize_documents
from elmo_pipeline.embedding.batch import apply_mixes, build_mixes, length_sorted_batches
from elmo_pipeline.formats.files import default_model_location
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig
from elmo_pipeline.pipelines.extract import add_extract_args, prepare_job, run
from elmo_pipeline.runtime import autocast, resolve_device
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.transforms.embed import ElmoModelHandler, SortAndBatchSentences, worker_threads
from elmo_pipeline.transforms.write import CHUNK_MB, ToArrowTables, rows_per_group

from .bench_tokenize import tokenize as spacy_tokens
from .common import shared_data_dir

TARGET_RATIO = 0.85
NONE_MIX = ["avg=average"]  # the size runs' mix for --layers none when --mix gives none
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
            "--layers", a.layers, "--dtype", a.dtype, *(f"--mix={m}" for m in a.mix), *extra]
    if model is not None:
        argv += ["--model", model]
    parser = argparse.ArgumentParser()
    add_extract_args(parser)
    args, rest = parser.parse_known_args(argv)
    return args, rest + list(a.beam_arg)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def read_and_tokenize(src: Path, max_tokens: int = 256) -> tuple[list[Sentence], dict[str, float]]:
    """The documents the job reads from `src` and their sentences, by the Read and Tokenize stages'
    own library code, with the seconds of reading, of the whole tokenize stage, of spaCy alone as
    the stage runs it (its tokenizer cache filled chunk by chunk) and of spaCy alone without that
    (what the stage ran before it), both by `bench_tokenize.tokenize`. Each run tokenizes with a
    pipeline of its own, so that none finds another's words cached."""
    documents, read_s = timed(lambda: [d for d in read_documents([str(src)], ReadOptions())
                                       if isinstance(d, Document)])

    def tokenize() -> list[Sentence]:
        nlp, sentences = build_nlp("en"), []
        for lo in range(0, len(documents), 256):
            for result in tokenize_documents(nlp, documents[lo:lo + 256], max_tokens):
                if isinstance(result, list):
                    sentences += result
        return sentences

    texts = [d.text for d in documents]

    # twice each, alternately, the faster counting: the first run also warms the process
    tokenize_s, spacy_s, unfilled_s = [], [], []
    for _ in range(2):
        sentences, seconds = timed(tokenize)
        tokenize_s.append(seconds)
        spacy_s.append(timed(lambda: spacy_tokens(texts, fill=True, keep=False))[1])
        unfilled_s.append(timed(lambda: spacy_tokens(texts, fill=False, keep=False))[1])
    return sentences, {"read": read_s, "spacy": min(spacy_s), "spacy_unfilled": min(unfilled_s),
                       "tokenize": min(tokenize_s)}


def load_model(model_location: str | None, device: str) -> BiLM:
    """The model as the pipeline's handler loads it (default cache and kernel)."""
    return BiLM.load(model_location).to(resolve_device(device)).eval()


def model_only_seconds(model_location: str | None, batches: list[list[Sentence]], device: str,
                       precision: str) -> float:
    """`model.embed` over the batches at `precision`, and the float32 copy on the host that the
    pipeline needs before it can write the vectors."""
    model = load_model(model_location, device)
    with torch.inference_mode(), autocast(model.device, precision):
        start = time.perf_counter()
        for batch in batches:
            model.embed([list(s.tokens) for s in batch]).layers.float().cpu()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return time.perf_counter() - start


class _TimedModel:
    """Wraps `model.embed` so that the seconds inside it (and in the float32 copy the model-only
    rate also counts) are summed apart from the handler's own work. Given a model, wraps that
    object only; given the class, every model of it (the local runner's workers run in this
    process) until `restore()`."""

    def __init__(self, model: BiLM | type[BiLM]) -> None:
        self.model, self.seconds, self._embed = model, 0.0, model.embed
        model.embed = self if isinstance(model, BiLM) else lambda bilm, sentences: self(sentences, bilm)

    def restore(self) -> None:
        self.model.embed = self._embed

    def __call__(self, sentences, bilm: BiLM | None = None):
        start = time.perf_counter()
        out = self._embed(sentences) if bilm is None else self._embed(bilm, sentences)
        out.layers = out.layers.float().cpu()
        device = (bilm or self.model).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - start
        return out


def stage_seconds(model_location: str | None, src: Path, sentences: list[Sentence], a: argparse.Namespace,
                  job_args: argparse.Namespace) -> dict[str, float]:
    """Each later stage's own code over the same sentences, outside Beam, in the job's settings,
    batch by batch as the fused stages run: sort/batch, the embed handler (less the model), mix,
    Arrow tables and the Parquet writer."""
    # the job's output spec and mixes, as `extract` builds them
    job = prepare_job(argparse.Namespace(**{**vars(job_args), "output": str(src.with_suffix(".stages"))}))
    costs = dict.fromkeys(("sort/batch", "embed (handler)", "mix", "Arrow tables", "Parquet write"), 0.0)
    sorter = SortAndBatchSentences(a.batch_tokens, a.max_batch_sentences, 32 * a.batch_tokens)

    def sort_and_batch() -> list[list[Sentence]]:
        sorter.start_bundle()
        batches = [wv.value for s in sentences for wv in sorter.process(s, GlobalWindow())]
        return batches + [wv.value for wv in sorter.finish_bundle()]

    batches, costs["sort/batch"] = timed(sort_and_batch)
    handler = ElmoModelHandler(model_location, a.device, a.precision)
    timer = _TimedModel(handler.load_model())
    mixes = build_mixes(job.mixes, job.spec.n_layers)
    rows = rows_per_group(job.spec, job_args.row_group_mb)
    to_tables = ToArrowTables(job.spec, rows, min(rows, rows_per_group(job.spec, CHUNK_MB)))
    to_tables.start_bundle()
    writer = parquet_writer(str(src.with_suffix(".bench.parquet")), job.spec)

    def add(stage: str, fn: Callable[[], Any]) -> Any:
        value, seconds = timed(fn)
        costs[stage] += seconds
        return value

    for batch in batches:
        before = timer.seconds
        embedded = add("embed (handler)", partial(handler.run_inference, batch, timer.model))
        costs["embed (handler)"] -= timer.seconds - before
        if mixes:
            embedded = add("mix", lambda items=embedded: [apply_mixes(e, mixes) for e in items])
        tables = add("Arrow tables", lambda items=embedded: [t for e in items for t in to_tables.process(e)])
        add("Parquet write", lambda ready=tables: [writer.write_table(t) for t in ready])
    tables = add("Arrow tables", lambda: [wv.value for wv in to_tables.finish_bundle()])
    add("Parquet write", lambda: ([writer.write_table(t) for t in tables], writer.close()))
    return costs


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder/URL or OPTIONS.json,WEIGHTS.hdf5")
    p.add_argument("--random-shape", choices=sorted(SHAPES), default=None,
                   help="benchmark a random-weight model of this released shape instead")
    p.add_argument("--data", default=None, help="text file, a document per line (default: WikiText-2 valid)")
    p.add_argument("--max-lines", type=int, default=3000, help="lines of the file to extract (blank ones included)")
    p.add_argument("--size-lines", type=int, default=300, help="lines for the Parquet size runs")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--max-batch-sentences", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads for both measurements (0: torch's default). On a shared "
                        "machine 1 avoids OpenMP spin-waiting against other people's jobs")
    p.add_argument("--precision", default="fp32", help="fp32 or bf16, for the job and the model alone")
    p.add_argument("--layers", default="all", help="extract --layers")
    p.add_argument("--dtype", default="float16", help="extract --dtype")
    p.add_argument("--mix", action="append", default=[], help="extract --mix NAME=SOURCE (repeatable)")
    p.add_argument("--beam-arg", action="append", default=[], help="extra Beam option, e.g. --beam-arg=--runner=...")
    p.add_argument("--skip-sizes", action="store_true")
    p.add_argument("--skip-stages", action="store_true", help="do not time the stages one by one")
    p.add_argument("--sweep-workers", type=int, default=0,
                   help="instead: the job in one process against N local worker processes (see above)")
    p.add_argument("--repeats", type=int, default=1, help="--sweep-workers: runs per configuration (the best counts)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def stage_table(costs: dict[str, float], tokens: int, pipeline_s: float, model_s: float) -> list[dict]:
    """The stages' costs with the model, job start and the rest, as rows: seconds, microseconds per
    token and share of the pipeline's seconds."""
    rows = [{"stage": "model alone (model.embed, the model-only rate)", "seconds": model_s}]
    rows += [{"stage": name, "seconds": value} for name, value in costs.items()]
    rows.append({"stage": "Beam and the rest (pipeline less all above)",
                 "seconds": pipeline_s - sum(r["seconds"] for r in rows)})
    for row in rows:
        row["us_per_token"] = 1e6 * row["seconds"] / tokens
        row["share"] = row["seconds"] / pipeline_s
    return rows


def throughput(model: str | None, src: Path, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    sentences, front = read_and_tokenize(src)
    n_tokens = sum(len(s.tokens) for s in sentences)
    batches = list(length_sorted_batches(sentences, a.batch_tokens, a.max_batch_sentences))
    # the model alone just before and just after the pipeline, so that a change in the
    # machine's load during the run shows; the faster of the two is the reference
    before_s = model_only_seconds(model, batches, a.device, a.precision)
    job_args, beam_args = extract_args(model, src, work / "out", a)
    # with the local runner in this process (no --beam-arg), the model's own seconds inside the job
    inside = _TimedModel(BiLM) if not a.beam_arg else None
    try:
        summary = run(job_args, beam_args)
    finally:
        if inside is not None:
            inside.restore()
    after_s = model_only_seconds(model, batches, a.device, a.precision)
    if n_tokens != summary["tokens"]:
        print(f"warning: pipeline counted {summary['tokens']} tokens, direct tokenization {n_tokens}")
    figures: dict[str, Any] = {"summary": summary, "model_only_seconds": [before_s, after_s],
                               "tokenize_seconds": front["tokenize"], "tokens": n_tokens}
    model_s = min(before_s, after_s)
    figures["pipeline_tokens_per_s"] = summary["tokens"] / summary["seconds"]
    figures["model_only_tokens_per_s"] = n_tokens / model_s
    figures["ratio"] = ratio = figures["pipeline_tokens_per_s"] / figures["model_only_tokens_per_s"]
    verdict = f"{ratio:.1%} (target >= {TARGET_RATIO:.0%}: {'met' if ratio >= TARGET_RATIO else 'NOT met'})"
    print_rows("throughput", [
        ("documents", f"{summary['documents_read']:,}"), ("sentences", f"{summary['sentences']:,}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("pipeline batches / padding", f"{summary['batches']:,} / {summary['padding_ratio']:.1%}"),
        ("model-only batches", f"{len(batches):,}"), ("pipeline seconds (end to end)", f"{summary['seconds']:.1f}"),
        ("model-only seconds (embed; before / after)", f"{before_s:.1f} / {after_s:.1f}"),
        ("pipeline tokens/s", f"{figures['pipeline_tokens_per_s']:,.0f}"),
        ("model-only tokens/s", f"{figures['model_only_tokens_per_s']:,.0f}"), ("pipeline / model-only", verdict)])
    if not a.skip_stages:
        costs = {"read": front["read"], "tokenize (spaCy)": front["spacy"],
                 "sentence records": front["tokenize"] - front["spacy"]}
        costs.update(stage_seconds(model, src, sentences, a, job_args))
        one = first_lines(src, 1, work / "one_line.txt")
        costs["job start (the job on one line)"] = run(*extract_args(model, one, work / "one", a))["seconds"]
        if inside is not None:
            costs = {"model inside the job, beyond the model alone": inside.seconds - model_s, **costs}
        figures["stages"] = stage_table(costs, n_tokens, summary["seconds"], model_s)
        figures["spacy_unfilled_seconds"] = front["spacy_unfilled"]
        print(f"\nwhere the pipeline's time goes ({n_tokens:,} tokens; microseconds per token, one process)")
        for row in figures["stages"]:
            print(f"  {row['stage']:<46} {row['seconds']:7.2f} s {row['us_per_token']:8.2f} us/token "
                  f"{row['share']:6.1%}")
        print(f"  (spaCy alone without the tokenizer cache filled: {front['spacy_unfilled']:.2f} s, "
              f"{1e6 * front['spacy_unfilled'] / n_tokens:.2f} us/token)")
    return figures


def parquet_sizes(model: str | None, data: Path, work: Path, a: argparse.Namespace) -> list[dict]:
    size_src = first_lines(data, a.size_lines, work / "size_input.txt")
    sizes = []
    for dtype in ("float16", "float32"):
        for layers in ("all", "top", "none"):
            out = work / f"size-{dtype}-{layers}"
            # extract refuses --layers none without a mix (the file would hold no vector): the
            # layers' average then, unless --mix gave the mixes of every run
            mixes = a.mix or (NONE_MIX if layers == "none" else [])
            a_size = argparse.Namespace(**{**vars(a), "dtype": dtype, "layers": layers, "mix": mixes})
            s = run(*extract_args(model, size_src, out, a_size, "--num-shards", "1"))
            sizes.append({"dtype": dtype, "layers": layers, "mixes": mixes, "tokens": s["tokens"],
                          "bytes": parquet_bytes(out)})
    print(f"\nParquet bytes per token (zstd, token layout, first {a.size_lines} lines)")
    print(f"  {'dtype':<8} {'layers':<6} {'tokens':>8} {'bytes':>12} {'bytes/token':>12}  mixes")
    for r in sizes:
        print(f"  {r['dtype']:<8} {r['layers']:<6} {r['tokens']:>8,} {r['bytes']:>12,} {r['bytes'] / r['tokens']:>12,.1f}"
              f"  {' '.join(r['mixes']) or '-'}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    data = Path(a.data) if a.data else shared_data_dir() / "wikitext2" / "wiki.valid.tokens"
    if a.threads:
        torch.set_num_threads(a.threads)  # the local runner's workers run in this process
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    try:
        model, model_name = resolve_model(a, work)
        src = first_lines(data, a.max_lines, work / "input.txt")
        print(f"model: {model_name}; input: {a.max_lines} lines of {data.name}; batch {a.batch_tokens} tokens; "
              f"device {a.device}; precision {a.precision}; --layers {a.layers} --dtype {a.dtype}; torch threads "
              f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        figures: dict[str, Any] = {"model": model_name, "max_lines": a.max_lines, "precision": a.precision}
        if a.sweep_workers:
            print(f"\nworker sweep ({src.stat().st_size:,} bytes in one file)")
            figures["sweep"] = rows = worker_sweep(model, src, work, a)
            print(f"\n  {'runner':<12} {'torch threads':<26} {'tokens/s':>10}")
            for row in rows:
                print(f"  {row['runner']:<12} {row['threads']:<26} {row['tokens_per_s']:>10,.0f}")
        else:
            figures.update(throughput(model, src, work, a))
            if not a.skip_sizes:
                figures["sizes"] = parquet_sizes(model, data, work, a)
        if a.json:
            Path(a.json).write_text(dumps_strict(figures, a.json, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
