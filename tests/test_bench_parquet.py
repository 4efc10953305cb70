"""benchmarks/bench_parquet.py: every form it times holds the table it was given."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import bench_parquet


def test_every_form_reads_back_as_the_table_it_times():
    items, spec = bench_parquet.embedded(12)
    table = bench_parquet.build_table(items, spec)
    assert table.num_rows == sum(len(i.sentence.tokens) for i in items)
    written = {}
    for name, write in bench_parquet.writers(table, spec).items():
        sink = pa.BufferOutputStream()
        write(sink)
        written[name] = pq.read_table(pa.BufferReader(sink.getvalue()))
    assert written["extract's writer (zstd)"].equals(table)
    assert written["the same, uncompressed"].equals(table)
    assert written["key columns alone"].equals(table.drop_columns(spec.vector_columns))
    assert written["top layer alone (--layers top)"].column_names[-1] == f"layer_{spec.n_layers - 1}"
    assert written["top layer alone (--layers top)"].column(-1).equals(table.column(f"layer_{spec.n_layers - 1}"))
    binary = written["vectors as fixed_size_binary, zstd"]
    for name in spec.vector_columns:
        raw = np.frombuffer(b"".join(v.as_py() for v in binary.column(name)), np.float16)
        floats = table.column(name).combine_chunks().values.to_numpy(zero_copy_only=False)
        assert np.array_equal(raw.view(np.uint16), floats.view(np.uint16))
