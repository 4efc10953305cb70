"""Soak run of `extract`: millions of tokens, RSS over time, and every token accounted for.

    nice python -m benchmarks.soak_extract [--copies 3] [--model OPTIONS,WEIGHTS|DIR] [--json soak.json]

Input: --copies copies of WikiText-2 train (2.05 M whitespace tokens each; spaCy makes 2,163,180
tokens of each), one file per copy, a document per line. The job runs in a subprocess on the
local FnApiRunner (one process) with the reference model of the shared data by default,
--batch-tokens 32768 (the tiny reference model is bound by per-step overhead on a CPU at the
default 8192) and otherwise default options; its RSS, with that of any worker processes it
starts (multi_processing), is sampled from /proc every --interval seconds.

Reported:
- RSS at the end of the warm-up (the first --warmup-fraction of the run: model, caches and
  buffers filling), the highest and the last RSS after it, the median RSS of each quarter of
  the run, and the least-squares slope of RSS after the warm-up, in MiB per million tokens
  processed (from the job's progress lines) and per minute (null where the run after its warm-up
  is too short for two samples or two progress lines). RSS saw-tooths as the sort buffer
  and the row-group buffer fill and empty, so the quarter medians are the steadier measure.
- Tokens: the job's counters (tokens after tokenization = token rows written), the rows in the
  Parquet footers, the rows per input copy (the copies are identical, so they must be equal),
  and, unless --no-reference, the tokens of one copy counted independently in this process
  with the same tokenizer code, times --copies.
"""

from __future__ import annotations

import argparse
import codecs
import fcntl
import json
import os
import pty
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_pipeline.strict import dumps_strict

from .common import RssSampler, shared_data_dir

PROGRESS = re.compile(r"embed \[pid \d+\]: ([\d,]+) ?sentences")  # the workers' progress bar


def slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of y on x, rounded to 2 decimals; None for fewer than two distinct x
    (a run too short for two samples, or two progress lines, after its warm-up): no slope, not a flat one."""
    if len({x for x, _ in points}) < 2:
        return None
    xs, ys = zip(*points)
    return round(statistics.linear_regression(xs, ys).slope, 2)


def reference_tokens(path: Path) -> tuple[int, int]:
    """(documents, tokens) of one copy, by the job's own reading and tokenization code, in this process."""
    from elmo_pipeline.corpus.read_options import ReadOptions
    from elmo_pipeline.corpus.readers import read_documents
    from elmo_pipeline.corpus.records import Document
    from elmo_pipeline.corpus.tokenization import build_nlp, tokenize_documents

    nlp = build_nlp("en")
    docs, tokens, batch = 0, 0, []

    def flush():
        nonlocal tokens
        for result in tokenize_documents(nlp, batch, 256):
            tokens += sum(len(s.tokens) for s in result)

    for record in read_documents([str(path)], ReadOptions()):
        if isinstance(record, Document):
            docs += 1
            batch.append(record)
            if len(batch) == 256:
                flush()
                batch = []
    flush()
    return docs, tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the reference model of the shared data")
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--warmup-fraction", type=float, default=0.25)
    parser.add_argument("--max-mb", type=float, default=None, help="only the first MB of each copy (a quick check)")
    parser.add_argument("--work", default=None)
    parser.add_argument("--no-reference", action="store_true", help="skip the independent token count")
    parser.add_argument("--extract-arg", action="append", default=[], help="extra extract option; repeatable")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def make_copies(source: Path, folder: Path, copies: int, max_mb: float | None) -> list[Path]:
    """`copies` files `copy<i>.txt` of `source` in `folder` (its first `max_mb` MB, whole lines, if given);
    a whole copy already there is kept."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(copies):
        copy = folder / f"copy{i}.txt"
        if max_mb:
            data = source.read_bytes()[: int(max_mb * 2**20)]
            copy.write_bytes(data[: data.rfind(b"\n") + 1])
        elif not copy.exists() or copy.stat().st_size != source.stat().st_size:
            shutil.copyfile(source, copy)
        paths.append(copy)
    return paths


class JobRun(NamedTuple):
    summary: dict[str, Any]  # the job's summary (its stdout)
    samples: list[tuple[float, float]]  # (seconds since start, RSS MiB)
    progress: list[tuple[float, int]]  # (seconds since start, sentences embedded)
    peak_rss_mib: float


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal (parent's end, child's end), 200 columns wide: the job draws its progress
    bar only on a terminal, and that bar is where the tokens-over-time figures come from."""
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    return parent, child


def _terminal_lines(fd: int) -> Iterator[str]:
    """What the job writes to the terminal `fd`, cut at each carriage return or newline (a bar
    redraws its line after a carriage return), each piece with its line end; until the job exits."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer of the terminal has exited
            chunk = b""
        pending += decoder.decode(chunk, final=not chunk)
        *done, pending = re.split(r"(?<=[\r\n])", pending)
        yield from done
        if not chunk:
            if pending:
                yield pending
            return


def run_job(cmd: list[str], log_path: Path, interval: float) -> JobRun:
    """Runs `cmd`, sampling its RSS and reading its progress bar; its stderr goes to `log_path`."""
    progress: list[tuple[float, int]] = []
    terminal, child_end = _terminal()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=child_end, text=True)
        os.close(child_end)
        sampler = RssSampler(proc.pid, interval)
        sampler.start()

        def read_stderr():
            for line in _terminal_lines(terminal):
                log.write(line)
                m = PROGRESS.search(line)
                if m:
                    progress.append((time.monotonic() - sampler.t0, int(m.group(1).replace(",", ""))))

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        with proc.stdout:
            stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it
        sampler.done.set()
        sampler.join()
        reader.join()
        os.close(terminal)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"extract failed; see {log_path}")
    return JobRun(json.loads(stdout), sampler.samples, progress, round(usage.ru_maxrss / 1024, 1))


def count_rows(out: Path, copies: list[Path]) -> tuple[int, list[int]]:
    """The token rows in the Parquet footers under `out`, and the rows of each copy (by doc_id)."""
    files = sorted(out.glob("tokens-*.parquet"))
    rows_in_footers = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    per_copy = [0] * len(copies)
    for f in files:
        parquet = pq.ParquetFile(f)
        for group in range(parquet.num_row_groups):
            ids = parquet.read_row_group(group, columns=["doc_id"]).column("doc_id")
            for i, copy in enumerate(copies):
                per_copy[i] += pc.sum(pc.starts_with(ids, f"{copy}:")).as_py() or 0
    return rows_in_footers, per_copy


def memory_figures(job: JobRun, warmup_fraction: float) -> dict[str, Any]:
    """The RSS figures of the report (see the module's docstring), in its order."""
    samples, summary = job.samples, job.summary
    total = samples[-1][0] if samples else 0.0
    warm = [s for s in samples if s[0] <= warmup_fraction * total]
    after = [s for s in samples if s[0] > warmup_fraction * total]
    sentences_total = summary["sentences"]

    def tokens_at(t: float) -> float:  # tokens processed by time t, from the progress lines
        done = [n for (pt, n) in job.progress if pt <= t]
        return (done[-1] if done else 0) / max(sentences_total, 1) * summary["tokens"]

    per_minute = slope([(t / 60, r) for t, r in after])
    per_million = slope([(tokens_at(t) / 1e6, r) for t, r in after if tokens_at(t) > 0])
    return {
        "peak_rss_mib": job.peak_rss_mib,
        "rss_end_of_warmup_mib": round(warm[-1][1], 1) if warm else None,
        "rss_max_after_warmup_mib": round(max(r for _, r in after), 1) if after else None,
        "rss_last_mib": round(samples[-1][1], 1) if samples else None,
        "rss_median_by_quarter_mib": [
            round(statistics.median(r for t, r in samples if q * total / 4 < t <= (q + 1) * total / 4), 1)
            for q in range(4)] if len(samples) >= 8 else None,
        "rss_slope_after_warmup_mib_per_minute": per_minute,
        "rss_slope_after_warmup_mib_per_million_tokens": per_million,
        "rss_over_time": [(round(t), round(r)) for t, r in samples[:: max(1, len(samples) // 60)]],
    }


def tokens_lost(summary: dict[str, Any], rows_in_footers: int, per_copy: list[int],
                reference: tuple[int, int] | None, copies: int) -> bool:
    """Whether any count disagrees: the job's counters, the footers, the copies, the reference count."""
    return not (summary["tokens_reconcile"] and summary["documents_reconcile"]
                and rows_in_footers == summary["tokens"] == summary["token_rows_written"]
                and len(set(per_copy)) == 1 and sum(per_copy) == rows_in_footers
                and (reference is None or (reference[1] * copies == summary["tokens"]
                                           and reference[0] * copies == summary["documents_read"])))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = shared_data_dir() / "wikitext2" / "wiki.train.tokens"
    fixture = shared_data_dir() / "allennlp_elmo"
    model = args.model or f"{fixture / 'options.json'},{fixture / 'lm_weights.hdf5'}"
    work = Path(args.work or tempfile.mkdtemp(prefix="elmo-soak-"))
    copies = make_copies(source, work / "in", args.copies, args.max_mb)
    out = work / "out"
    cmd = [sys.executable, "-m", "elmo_pipeline.pipelines.extract", "--input", str(work / "in" / "copy*.txt"),
           "--output", str(out), "--overwrite", "--model", model, "--batch-tokens", str(args.batch_tokens),
           *args.extract_arg]
    print("running:", " ".join(cmd), flush=True)
    job = run_job(cmd, work / "extract.log", args.interval)
    summary = job.summary
    rows_in_footers, per_copy = count_rows(out, copies)
    reference = None if args.no_reference else reference_tokens(copies[0])
    result = {
        "copies": args.copies, "model": model, "batch_tokens": args.batch_tokens, "extract_args": args.extract_arg,
        "seconds": summary["seconds"], "tokens_per_second": summary["tokens_per_second"],
        "documents_read": summary["documents_read"], "tokens": summary["tokens"],
        "token_rows_written": summary["token_rows_written"], "rows_in_parquet_footers": rows_in_footers,
        "rows_per_copy": per_copy, "reference_documents_tokens_per_copy": reference,
        "documents_reconcile": summary["documents_reconcile"], "tokens_reconcile": summary["tokens_reconcile"],
        **memory_figures(job, args.warmup_fraction),
        "tokens_lost_or_duplicated": tokens_lost(summary, rows_in_footers, per_copy, reference, args.copies),
    }
    print(dumps_strict({k: v for k, v in result.items() if k != "rss_over_time"}, "result", indent=2))
    print("RSS (s, MiB):", result["rss_over_time"])
    if args.json:
        Path(args.json).write_text(dumps_strict(result, args.json, indent=2))
    return 1 if result["tokens_lost_or_duplicated"] else 0


if __name__ == "__main__":
    sys.exit(main())
