"""Where the Parquet write's time goes: the writer's settings against the vector columns' layout.

    python -m benchmarks.bench_parquet [--sentences 2000] [--repeats 5]

Embeds the first --sentences sentences of WikiText-2 valid with the embedded default model (bf16
where the CPU has it, as `extract --precision bf16`), builds the token table `extract` writes
(`schema.build_table`, every layer: three float16 vector columns of 256), and writes it into
memory, no disk, in these forms, alternating, the best of --repeats each:
- `extract`'s writer (`schema.parquet_writer`: zstd, dictionaries and statistics on the key columns);
- the same uncompressed;
- the key columns alone (what the vectors add is the rest);
- the top layer alone (`--layers top`);
- the vectors as fixed_size_binary(512), a layout `extract` does not write (readers would get
  bytes, not lists of floats): what Arrow's list encoding costs.
Prints us per token and MiB for each.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from benchmarks.common import wikitext_sentences
from elmo_pipeline import BiLM
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.corpus.schema import OutputSpec, build_table, parquet_writer
from elmo_pipeline.runtime import autocast, native_bf16

BATCH = 128


def embedded(n: int) -> tuple[list[EmbeddedSentence], OutputSpec]:
    model = BiLM.from_pretrained(cache_size=0).eval()
    device = torch.device("cpu")
    spec = OutputSpec(n_layers=model.config.n_output_layers, width=model.config.output_dim)
    sentences = wikitext_sentences("valid")[:n]
    items = []
    precision = "bf16" if native_bf16(device) else "fp32"
    with torch.inference_mode(), autocast(device, precision):
        for lo in range(0, len(sentences), BATCH):
            batch = sentences[lo:lo + BATCH]
            out = model.embed(batch)
            for i, tokens in enumerate(batch):
                n_tok = int(out.lengths[i])
                starts = np.arange(n_tok, dtype=np.int64)
                sentence = Sentence(f"valid-{lo + i}", 0, 0, tuple(tokens), starts, starts + 1)
                items.append(EmbeddedSentence(sentence, out.layers[:, i, :n_tok].float().numpy(), {}))
    return items, spec


def as_binary(table: pa.Table, columns: list[str]) -> pa.Table:
    """`table` with each vector column's values as one fixed_size_binary per row."""
    for name in columns:
        lists = table.column(name).combine_chunks()
        raw = lists.values.to_numpy(zero_copy_only=False).view(np.uint8)
        width = raw.size // len(lists)
        binary = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(lists), [None, pa.py_buffer(raw)])
        table = table.set_column(table.column_names.index(name), name, binary)
    return table


def writers(table: pa.Table, spec: OutputSpec) -> dict[str, Callable[[pa.BufferOutputStream], None]]:
    vectors = spec.vector_columns
    keys = table.drop_columns(vectors)
    top = OutputSpec(n_layers=spec.n_layers, width=spec.width, layers="top")
    top_table = table.drop_columns([c for c in vectors if c not in top.vector_columns])
    binary = as_binary(table, vectors)

    def ours(tab: pa.Table, s: OutputSpec) -> Callable[[pa.BufferOutputStream], None]:
        def write(sink: pa.BufferOutputStream) -> None:
            with parquet_writer(sink, s) as writer:
                writer.write_table(tab)
        return write

    def plain(tab: pa.Table, compression: str) -> Callable[[pa.BufferOutputStream], None]:
        return lambda sink: pq.write_table(tab, sink, compression=compression, use_dictionary=False,
                                           write_statistics=False)

    return {
        "extract's writer (zstd)": ours(table, spec),
        "the same, uncompressed": plain(table, "none"),
        "key columns alone": plain(keys, "zstd"),
        "top layer alone (--layers top)": ours(top_table, top),
        "vectors as fixed_size_binary, zstd": plain(binary, "zstd"),
    }


def main(argv: list[str] | None = None) -> dict[str, tuple[float, int]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.sentences < 1 or a.repeats < 1:
        p.error("--sentences and --repeats must be at least 1")
    items, spec = embedded(a.sentences)
    table = build_table(items, spec)
    forms = writers(table, spec)
    best = dict.fromkeys(forms, float("inf"))
    size = dict.fromkeys(forms, 0)
    for _ in range(a.repeats):
        for name, write in forms.items():
            sink = pa.BufferOutputStream()
            start = time.perf_counter()
            write(sink)
            best[name] = min(best[name], time.perf_counter() - start)
            size[name] = sink.getvalue().size
    rows = table.num_rows
    print(f"{rows} token rows, {len(spec.vector_columns)} float16 vector columns of {spec.width}; "
          f"best of {a.repeats}, in memory")
    for name in forms:
        print(f"{name:38} {1e6 * best[name] / rows:6.2f} us/token {size[name] / 2**20:8.1f} MiB")
    return {name: (best[name], size[name]) for name in forms}


if __name__ == "__main__":
    main()
