"""Peak memory of `extract`: bounded by the batch and buffer sizes, not by document or corpus size.

    python -m benchmarks.bench_memory [--doc-mb 10 ...] [--scale 10] [--model DIR|OPTIONS,WEIGHTS|default]
        [--cases small,lines,one-doc,10x,embed-file] [--embed-lines N ...] [--embed-arg=OPTION ...]
        [--repeat N] [--json out.json]

Runs `python -m elmo_pipeline.pipelines.extract` in a subprocess (the local FnApiRunner, one
process) on generated inputs and reports each run's peak RSS (the child's own ru_maxrss, from
wait4) with its RSS over time (its own and its worker processes', sampled from /proc every second):

    small      the first 0.1 MB of WikiText-2 train as ordinary lines: the fixed cost (imports, model)
    lines      0.1 MB of the one-line text below cut into lines of about 2,000 characters
    one-doc    ONE document of --doc-mb MB on a single line (WikiText-2 train, newlines as spaces);
               once per size when --doc-mb gives several
    10x        --scale documents of the last --doc-mb size (10 x 10 MB = 100 MB by default) in one file
    embed-file `elmo-pipeline embed-file` (not extract) on the first N lines of WikiText-2 train,
               repeated, once per N of --embed-lines, with --embed-arg (default --top): it holds each
               line's text for sentence_to_index, so its peak grows with the file's text, not its tokens

wait4's peak of a child is at least this process's own RSS when it started the child (some 340
MiB once the tiny model is built): a smaller child's peak reads as that.

The "x first" column is a run's peak over the first case's (its median with --repeat: the
peak of a short run varies by some 20% from run to run with the threads' timing, so give the
cases compared a few repeats).

With memory bounded by the buffers, one-doc and 10x peak at about the same RSS although 10x
holds 10 times the data. The text of the document being read is held whole (a line is read
whole), so --doc-mb adds its size once, not per token. A --doc-mb past extract's
--max-document-mb (64) raises that bound to it, so that the document is read; a run in which
extract rejected documents anyway (an --extract-arg bound, a read error) says so with the first
reason, and the command exits 1: its peak is not that of the input given.

The default model is a random-weight model of the "tiny" training preset's shape (char CNN of
12 filters, LSTM 16/8), written with save_pretrained: memory is what is measured, and with a
tiny model 20 M tokens take minutes rather than hours on a CPU. Any model can be given;
`--model default` is the embedded default model.
Every extract run uses --batch-tokens 32768 (a CPU runs this tiny model ~9x faster than at the
default 8192, being bound by the LSTM's per-step overhead), --dtype float16 and the default
buffers (sort buffer 32 batches, 64 MB row groups) unless --extract-arg adds options (e.g.
--extract-arg=--sort-buffer-tokens=65536).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from elmo_pipeline.corpus.options import DEFAULT_MAX_DOCUMENT_MB
from elmo_pipeline.strict import dumps_strict

from .common import RssSampler, shared_data_dir

MB = 2**20


def tiny_model(directory: Path) -> str:
    import torch

    from elmo_pipeline import BiLM
    from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig

    torch.manual_seed(0)
    config = ElmoConfig(lstm=LstmConfig(dim=16, projection_dim=8, n_layers=2),
                        char_cnn=CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 8)), n_highway=1), name="tiny")
    BiLM(config).save_pretrained(str(directory))
    return str(directory)


@functools.cache
def wikitext_train() -> str:
    """The text of WikiText-2 train (shared data), read once for every case made of it."""
    return (shared_data_dir() / "wikitext2" / "wiki.train.tokens").read_text(encoding="utf-8")


def one_line_document(n_bytes: int) -> str:
    """WikiText-2 train with its newlines as spaces, repeated to and cut at `n_bytes` (at a space)."""
    text = " ".join(wikitext_train().split("\n"))
    while len(text.encode()) < n_bytes:
        text = text + " " + text
    cut = text.encode()[:n_bytes].decode("utf-8", "ignore")
    return cut[: cut.rfind(" ")]


def lines_of(text: str, n_chars: int, line_chars: int = 2000) -> str:
    """The first `n_chars` characters of `text` as lines of about `line_chars`, cut at spaces."""
    text = text[:n_chars]
    lines, start = [], 0
    while start < len(text):
        end = len(text) if start + line_chars >= len(text) else text.rfind(" ", start + 1, start + line_chars) + 1
        end = end if end > start else start + line_chars
        lines.append(text[start:end].strip())
        start = end
    return "".join(line + "\n" for line in lines if line)


class ChildRun(NamedTuple):
    exit_code: int
    stdout: str
    memory: dict  # peak_rss_mib and rss_over_time_mib, as the results give them
    seconds: float


def run_child(cmd: list[str], log: Path) -> ChildRun:
    """Runs `cmd` in a child process to its end, its stderr into `log`: its exit status, stdout, peak
    RSS (its own, from wait4), RSS over time (with its workers', RssSampler) and wall seconds."""
    with open(log, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        with proc.stdout:
            stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it
        sampler.done.set()
        sampler.join()
    memory = {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
              "rss_over_time_mib": [(round(t, 1), round(r, 1)) for t, r in sampler.samples]}
    return ChildRun(proc.returncode, stdout, memory, seconds)


def run_extract(inputs: list[Path], output: Path, model: str | None, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "elmo_pipeline.pipelines.extract", *[a for p in inputs for a in ("--input", str(p))],
           "--output", str(output), "--overwrite", *(["--model", model] if model else []), *extra]
    log = output.with_suffix(".log")
    run = run_child(cmd, log)
    if run.exit_code not in (0, 1):
        raise RuntimeError(f"extract failed ({run.exit_code}); see {log}")
    summary = json.loads(run.stdout)
    rejected = summary["documents_rejected"]
    return {**run.memory, "tokens": summary["tokens"], "token_rows_written": summary["token_rows_written"],
            "documents_read": summary["documents_read"], "documents_rejected": rejected,
            "rejected_reason": first_error_reason(output) if rejected else None, "seconds": summary["seconds"],
            "tokens_per_second": summary["tokens_per_second"], "reconciled": summary["tokens_reconcile"]}


def first_error_reason(output: Path) -> str | None:
    """The reason of the first record in the job's errors-*.jsonl files: why a document was not measured."""
    for path in sorted(output.glob("errors-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                return json.loads(line)["reason"]
    return None


def wikitext_lines(n: int) -> str:
    """The first `n` lines of WikiText-2 train, the file repeated as often as it takes."""
    lines = wikitext_train().splitlines()
    return "".join(lines[k % len(lines)] + "\n" for k in range(n))


def run_embed_file(path: Path, output: Path, model: str | None, extra: list[str]) -> dict:
    """One `embed-file` of `path` into `output` in a child process: its peak RSS (from wait4) and seconds."""
    cmd = [sys.executable, "-m", "elmo_pipeline.cli.main", "embed-file", str(path), str(output), "--quiet",
           *(["--model", model] if model else []), *extra]
    log = output.with_suffix(".log")
    run = run_child(cmd, log)
    if run.exit_code != 0:
        raise RuntimeError(f"embed-file failed; see {log}")
    output.unlink()  # with --all, 3 KB a token of the default model
    lines = path.read_text(encoding="utf-8").splitlines()
    tokens = sum(len(line.split()) for line in lines)
    return {**run.memory, "tokens": tokens, "seconds": round(run.seconds, 1),
            "tokens_per_second": round(tokens / run.seconds),
            "reconciled": f"wrote {len(lines)} sentences" in log.read_text(encoding="utf-8")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-mb", type=float, nargs="+", default=[10.0],
                        help="size of the one-line document; several sizes run one-doc once each")
    parser.add_argument("--scale", type=int, default=10, help="documents in the 10x case")
    parser.add_argument("--model", default=None, help="'default': the embedded model; none: a random tiny model (see above)")
    parser.add_argument("--cases", default="small,one-doc,10x")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the median peak is compared")
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--work", default=None, help="folder for inputs and outputs (default: a temporary one)")
    parser.add_argument("--extract-arg", action="append", default=[], help="extra extract option; repeatable")
    parser.add_argument("--embed-lines", type=int, nargs="+", default=[10_000],
                        help="lines of the embed-file case; several sizes run it once each")
    parser.add_argument("--embed-arg", action="append", default=None,
                        help="embed-file option; repeatable (default: --top)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)

    work = Path(args.work or tempfile.mkdtemp(prefix="elmo-bench-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    model = None if args.model == "default" else args.model or tiny_model(work / "tiny-model")
    documents = {mb: one_line_document(int(mb * MB)) for mb in args.doc_mb}
    inputs = {}
    for case in args.cases.split(","):
        paths = {case: work / f"{case}.txt"}
        if case == "small":
            paths[case].write_text(wikitext_train()[: int(0.1 * MB)], encoding="utf-8")
        elif case == "lines":
            paths[case].write_text(lines_of(documents[args.doc_mb[-1]], int(0.1 * MB)), encoding="utf-8")
        elif case == "one-doc":
            paths = {f"one-doc {mb:g}MB": work / f"one-doc-{mb:g}.txt" for mb in args.doc_mb}
            for (name, path), document in zip(paths.items(), documents.values()):
                path.write_text(document + "\n", encoding="utf-8")
        elif case == "embed-file":
            paths = {f"embed-file {n:,}": work / f"embed-file-{n}.txt" for n in args.embed_lines}
            for path, n in zip(paths.values(), args.embed_lines):
                path.write_text(wikitext_lines(n), encoding="utf-8")
        elif case == "10x":
            with open(paths[case], "w", encoding="utf-8") as f:
                for _ in range(args.scale):
                    f.write(documents[args.doc_mb[-1]] + "\n")
        else:
            raise SystemExit(f"unknown case {case!r}")
        inputs.update(paths)

    results = {"model": model or ("embedded default" if args.model else "random tiny (char CNN 12 filters, LSTM 16/8)"),
               "doc_mb": args.doc_mb, "scale": args.scale, "batch_tokens": args.batch_tokens,
               "extract_args": args.extract_arg, "cases": {}}
    print(f"{'case':14} {'input MB':>9} {'tokens':>11} {'seconds':>8} {'tok/s':>8} {'peak RSS MiB':>13} "
          f"{'x first':>8}  RSS every 10% of the run")
    # a document past extract's default bound would be one error record, not read, and its
    # peak that of a job without it: the bound is raised to the largest document made here
    bound = ["--max-document-mb", str(max(args.doc_mb))] if max(args.doc_mb) > DEFAULT_MAX_DOCUMENT_MB else []
    first, unmeasured = None, 0
    for case, path in inputs.items():
        runs = []
        for _ in range(args.repeat):
            if case.startswith("embed-file"):
                result = run_embed_file(path, work / f"out-{path.stem}.h5", model, args.embed_arg or ["--top"])
            else:
                result = run_extract([path], work / f"out-{path.stem}", model,
                                     ["--dtype", "float16", "--batch-tokens", str(args.batch_tokens), *bound,
                                      *args.extract_arg])
            result["input_mb"] = round(path.stat().st_size / MB, 1)
            runs.append(result)
            series = result["rss_over_time_mib"]
            tenths = [series[min(len(series) - 1, len(series) * k // 10)][1] for k in range(1, 11)] if series else []
            print(f"{case:14} {result['input_mb']:9.1f} {result['tokens']:11,} {result['seconds']:8.1f} "
                  f"{result['tokens_per_second'] or 0:8,.0f} {result['peak_rss_mib']:13.1f} "
                  f"{result['peak_rss_mib'] / (first or result['peak_rss_mib']):8.2f}  {tenths}", flush=True)
            if not result["reconciled"]:
                print(f"  {case}: tokens and rows do not reconcile!", flush=True)
            if result.get("documents_rejected"):
                unmeasured += 1
                print(f"  {case}: {result['documents_rejected']:,} of {result['documents_read']:,} documents rejected, "
                      f"not measured: {result['rejected_reason']}", flush=True)
        median = statistics.median(r["peak_rss_mib"] for r in runs)
        first = first or median
        results["cases"][case] = {"median_peak_rss_mib": median, "runs": runs}
    print("\nmedian peak RSS MiB (x first case):")
    for case, result in results["cases"].items():
        median = result["median_peak_rss_mib"]
        print(f"  {case:14} {median:9.1f}  {median / first:5.2f}  (runs: {[r['peak_rss_mib'] for r in result['runs']]})")
    print(f"(this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    if args.json:
        Path(args.json).write_text(dumps_strict(results, args.json, indent=2))
    return 1 if unmeasured else 0


if __name__ == "__main__":
    sys.exit(main())
