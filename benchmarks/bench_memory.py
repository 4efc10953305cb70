"""Peak memory of `extract`: bounded by the batch and buffer sizes, not by document or corpus size.

    python -m benchmarks.bench_memory [--doc-mb 10] [--scale 10] [--model DIR|OPTIONS,WEIGHTS] [--json out.json]

Runs `python -m elmo_pipeline.pipelines.extract` in a subprocess (the local FnApiRunner, one
process) on generated inputs and reports each run's peak RSS (the child's own ru_maxrss, from
wait4) with its RSS over time (sampled from /proc every second):

    small      the first 0.1 MB of WikiText-2 train as ordinary lines: the fixed cost (imports, model)
    one-doc    ONE document of --doc-mb MB on a single line (WikiText-2 train, newlines as spaces)
    10x        --scale such documents (10 x 10 MB = 100 MB by default) in one file

With memory bounded by the buffers, one-doc and 10x peak at about the same RSS although 10x
holds 10 times the data. The text of the document being read is held whole (a line is read
whole), so --doc-mb adds its size once, not per token.

The default model is a random-weight model of the "tiny" training preset's shape (char CNN of
12 filters, LSTM 16/8), written with save_pretrained: memory is what is measured, and with a
tiny model 20 M tokens take minutes rather than hours on a CPU. Any model can be given.
Every run uses --batch-tokens 32768 (a CPU runs this tiny model ~9x faster than at the default
8192, being bound by the LSTM's per-step overhead), --dtype float16 and the default buffers
(sort buffer 32 batches, 64 MB row groups) unless --extract-arg adds options (e.g.
--extract-arg=--sort-buffer-tokens=65536).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


from .common import RssSampler, shared_data_dir

MB = 2**20


def tiny_model(directory: Path) -> str:
    import torch

    from elmo_pipeline import BiLM
    from elmo_pipeline.config import CharCnnConfig, ElmoConfig, LstmConfig

    torch.manual_seed(0)
    config = ElmoConfig(lstm=LstmConfig(dim=16, projection_dim=8, n_layers=2),
                        char_cnn=CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 8)), n_highway=1), name="tiny")
    BiLM(config).save_pretrained(str(directory))
    return str(directory)


def one_line_document(n_bytes: int) -> str:
    """WikiText-2 train with its newlines as spaces, repeated to and cut at `n_bytes` (at a space)."""
    text = (shared_data_dir() / "wikitext2" / "wiki.train.tokens").read_text(encoding="utf-8")
    text = " ".join(text.split("\n"))
    while len(text.encode()) < n_bytes:
        text = text + " " + text
    cut = text.encode()[:n_bytes].decode("utf-8", "ignore")
    return cut[: cut.rfind(" ")]


def run_extract(inputs: list[Path], output: Path, model: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "elmo_pipeline.pipelines.extract", *[a for p in inputs for a in ("--input", str(p))],
           "--output", str(output), "--overwrite", "--model", model, *extra]
    log = output.with_suffix(".log")
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.done.set()
        sampler.join()
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"extract failed ({proc.returncode}); see {log}")
    summary = json.loads(stdout)
    peak = usage.ru_maxrss / 1024  # KiB on Linux
    return {"peak_rss_mib": round(peak, 1), "rss_over_time_mib": [(round(t, 1), round(r, 1)) for t, r in sampler.samples],
            "tokens": summary["tokens"], "token_rows_written": summary["token_rows_written"],
            "documents_read": summary["documents_read"], "seconds": summary["seconds"],
            "tokens_per_second": summary["tokens_per_second"], "reconciled": summary["tokens_reconcile"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-mb", type=float, default=10.0, help="size of the one-line document")
    parser.add_argument("--scale", type=int, default=10, help="documents in the 10x case")
    parser.add_argument("--model", default=None, help="default: a random tiny model (see above)")
    parser.add_argument("--cases", default="small,one-doc,10x")
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--work", default=None, help="folder for inputs and outputs (default: a temporary one)")
    parser.add_argument("--extract-arg", action="append", default=[], help="extra extract option; repeatable")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)

    work = Path(args.work or tempfile.mkdtemp(prefix="elmo-bench-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model(work / "tiny-model")
    document = one_line_document(int(args.doc_mb * MB))
    inputs = {}
    for case in args.cases.split(","):
        path = work / f"{case}.txt"
        if case == "small":
            lines = (shared_data_dir() / "wikitext2" / "wiki.train.tokens").read_text(encoding="utf-8")
            path.write_text(lines[: int(0.1 * MB)], encoding="utf-8")
        elif case == "one-doc":
            path.write_text(document + "\n", encoding="utf-8")
        elif case == "10x":
            with open(path, "w", encoding="utf-8") as f:
                for _ in range(args.scale):
                    f.write(document + "\n")
        else:
            raise SystemExit(f"unknown case {case!r}")
        inputs[case] = path

    results = {"model": model if args.model else "random tiny (char CNN 12 filters, LSTM 16/8)",
               "doc_mb": args.doc_mb, "scale": args.scale, "batch_tokens": args.batch_tokens,
               "extract_args": args.extract_arg, "cases": {}}
    print(f"{'case':8} {'input MB':>9} {'tokens':>11} {'seconds':>8} {'tok/s':>8} {'peak RSS MiB':>13}  "
          "RSS every 10% of the run")
    for case, path in inputs.items():
        result = run_extract([path], work / f"out-{case}", model,
                             ["--dtype", "float16", "--batch-tokens", str(args.batch_tokens), *args.extract_arg])
        result["input_mb"] = round(path.stat().st_size / MB, 1)
        results["cases"][case] = result
        series = result["rss_over_time_mib"]
        tenths = [series[min(len(series) - 1, len(series) * k // 10)][1] for k in range(1, 11)] if series else []
        print(f"{case:8} {result['input_mb']:9.1f} {result['tokens']:11,} {result['seconds']:8.1f} "
              f"{result['tokens_per_second'] or 0:8,.0f} {result['peak_rss_mib']:13.1f}  {tenths}", flush=True)
        if not result["reconciled"]:
            print(f"  {case}: tokens and rows do not reconcile!", flush=True)
    print(f"(this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
