"""Streaming speed of ParquetFeatureDataset: tokens/s from Parquet shards into padded float32 batches.

    python benchmarks/bench_probe.py [--width 1024] [--tokens 200000] [--layout token] [--shuffle 4096]

Writes synthetic float16 features (L+1 = 3 layers of `width`, as `extract` writes them) into a
temporary folder of several shards, then times full passes (no model, no training) and reports the
peak resident sizes that matter: the shuffle buffer and the largest row group.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.corpus.schema import OutputSpec, build_table


def write(root: str, layout: str, width: int, tokens: int, shards: int, rows_per_group: int) -> int:
    rng = np.random.default_rng(0)
    spec = OutputSpec(n_layers=3, width=width, layout=layout, dtype="float16")
    written, index = 0, 0
    per_shard = tokens // shards
    for shard in range(shards):
        writer = pq.ParquetWriter(f"{root}/{layout}s-{shard:05d}-of-{shards:05d}.parquet", spec.schema(),
                                  compression="zstd")
        done = 0
        while done < per_shard:
            items, rows = [], 0
            while rows < rows_per_group and done + rows < per_shard:
                n = int(rng.integers(5, 40))
                starts = np.arange(n, dtype=np.int64)
                layers = rng.standard_normal((3, n, width)).astype(np.float32)
                items.append(EmbeddedSentence(Sentence(f"d{shard}", index, 0, ("w",) * n, starts, starts + 1),
                                              layers, {}))
                rows += n
                index += 1
            writer.write_table(build_table(items, spec))
            done += rows
        writer.close()
        written += done
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="2P: 1024 for the Original shape, 256 for Small")
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows-per-group", type=int, default=10_000)
    parser.add_argument("--layout", default="token", choices=("token", "sentence"))
    parser.add_argument("--shuffle", type=int, default=4096, help="shuffle buffer, sentences")
    parser.add_argument("--batch-sentences", type=int, default=32)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        tokens = write(root, args.layout, args.width, args.tokens, args.shards, args.rows_per_group)
        write_s = time.perf_counter() - t0
        ds = ParquetFeatureDataset(root, batch_sentences=args.batch_sentences, shuffle_buffer=args.shuffle)
        times = []
        pool = pa.proxy_memory_pool(pa.default_memory_pool())
        previous = pa.default_memory_pool()
        pa.set_memory_pool(pool)
        tracemalloc.start()
        for epoch in range(args.passes):
            ds.set_epoch(epoch)
            t0 = time.perf_counter()
            seen = sum(int(b.lengths.sum()) for b in ds)
            times.append(time.perf_counter() - t0)
            assert seen == tokens
        numpy_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        pa.set_memory_pool(previous)
        float32_bytes = tokens * 3 * args.width * 4
        best = min(times)
        print(dumps_strict({
            "layout": args.layout, "width": args.width, "tokens": tokens, "shards": args.shards,
            "row_groups": ds.stats.row_groups, "shuffle_buffer": args.shuffle, "write_seconds": round(write_s, 2),
            "pass_seconds": [round(t, 3) for t in times], "tokens_per_second": round(tokens / best),
            "float32_MB_per_second": round(float32_bytes / best / 2**20, 1),
            "data_set_float32_MB": round(float32_bytes / 2**20, 1),
            "peak_numpy_MB": round(numpy_peak / 2**20, 1), "peak_arrow_MB": round(pool.max_memory() / 2**20, 1),
            "peak_buffered_tokens": ds.stats.peak_buffered_tokens,
        }, "result", indent=2))


if __name__ == "__main__":
    main()
