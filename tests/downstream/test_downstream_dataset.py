"""ParquetFeatureDataset: every sentence once, both layouts, several shards, fsspec URLs, bounded memory."""

import json
import os
import re
import subprocess
import sys
import tracemalloc
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline.cli.main import main
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset, expand_sources
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.corpus.schema import OutputSpec, build_table, parquet_writer
from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix
from support import skip_unless_loader_workers_fit

N_LAYERS, WIDTH = 3, 8


def make_items(doc: str, start: int, count: int, rng: np.random.Generator, width: int = WIDTH):
    items = []
    for i in range(start, start + count):
        n = int(rng.integers(1, 12))
        tokens = tuple(f"w{i}_{k}" for k in range(n))
        starts = np.arange(n, dtype=np.int64) * 10
        layers = rng.standard_normal((N_LAYERS, n, width)).astype(np.float32)
        items.append(EmbeddedSentence(Sentence(doc, i, 0, tokens, starts, starts + 3), layers, {}))
    return items


def write_shards(root: str, layout: str, files: int, groups: int, per_group: int, width: int = WIDTH,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """Files of `groups` row groups of `per_group` sentences each, as WriteParquet writes them.
    Returns sentence_id -> (L+1, n, D) float16 as stored."""
    rng = np.random.default_rng(seed)
    spec = OutputSpec(n_layers=N_LAYERS, width=width, layout=layout, dtype="float16")
    expected = {}
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    index = 0
    for f in range(files):
        with fsspec.open(f"{root}/{layout}s-{f:05d}-of-{files:05d}.parquet", "wb") as out:
            writer = pq.ParquetWriter(out, spec.schema(), compression="zstd")
            for _ in range(groups):
                items = make_items(f"doc{f}", index, per_group, rng, width)
                index += per_group
                writer.write_table(build_table(items, spec))
                for it in items:
                    expected[f"doc{f}:{it.sentence.sentence_index}:0"] = it.layers.astype(np.float16)
            writer.close()
    return expected


def collect(ds):
    seen = {}
    for batch in ds:
        assert batch.features.shape[:2] == (len(ds.columns), len(batch.sentence_ids))
        assert batch.features.dtype == torch.float32
        for row, sid in enumerate(batch.sentence_ids):
            n = int(batch.lengths[row])
            assert batch.mask[row, :n].all() and not batch.mask[row, n:].any()
            assert torch.count_nonzero(batch.features[:, row, n:]) == 0  # zero padding
            assert sid not in seen, f"{sid} twice"
            seen[sid] = batch.features[:, row, :n].numpy()
    return seen


@pytest.mark.parametrize("layout", ["token", "sentence"])
@pytest.mark.parametrize("shuffle", [0, 16])
def test_every_sentence_once_with_its_vectors(tmp_path, layout, shuffle):
    expected = write_shards(str(tmp_path), layout, files=3, groups=3, per_group=7)
    ds = ParquetFeatureDataset(str(tmp_path), batch_sentences=5, shuffle_buffer=shuffle, seed=1)
    assert ds.layout == layout and ds.columns == ("layer_0", "layer_1", "layer_2") and ds.width == WIDTH
    assert len(ds.files) == 3
    seen = collect(ds)
    assert seen.keys() == expected.keys()
    for sid, vectors in expected.items():
        np.testing.assert_array_equal(seen[sid], vectors.astype(np.float32))
    assert ds.stats.files == 3 and ds.stats.row_groups == 9 and ds.stats.sentences == 63


def test_file_order_without_shuffle_and_a_new_order_per_epoch(tmp_path):
    write_shards(str(tmp_path), "sentence", files=4, groups=2, per_group=10)
    plain = [sid for b in ParquetFeatureDataset(str(tmp_path), batch_sentences=4) for sid in b.sentence_ids]
    assert plain == sorted(plain, key=lambda s: (int(s.split(":")[0][3:]), int(s.split(":")[1])))
    ds = ParquetFeatureDataset(str(tmp_path), batch_sentences=4, shuffle_buffer=8, seed=3)
    epoch0 = [sid for b in ds for sid in b.sentence_ids]
    again = [sid for b in ds for sid in b.sentence_ids]
    ds.set_epoch(1)
    epoch1 = [sid for b in ds for sid in b.sentence_ids]
    assert epoch0 == again != epoch1 and sorted(epoch0) == sorted(epoch1) == sorted(plain)
    assert epoch0 != plain


def test_a_buffer_holding_the_whole_file_still_shuffles_and_anew_each_epoch(tmp_path):
    """One file of 10 sentences and a buffer of 16: nothing leaves the buffer before the file ends,
    so the order is all the last draw's, and one file leaves no file order to change with the epoch."""
    write_shards(str(tmp_path), "sentence", files=1, groups=1, per_group=10)
    plain = [sid for b in ParquetFeatureDataset(str(tmp_path), batch_sentences=4) for sid in b.sentence_ids]
    ds = ParquetFeatureDataset(str(tmp_path), batch_sentences=4, shuffle_buffer=16, seed=3)
    orders = []
    for epoch in (0, 1, 0):
        ds.set_epoch(epoch)
        orders.append([sid for b in ds for sid in b.sentence_ids])
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(plain) and len(plain) == 10
    assert plain != orders[0] != orders[1] != plain and orders[2] == orders[0]


def test_batch_token_budget_and_selected_columns(tmp_path):
    write_shards(str(tmp_path), "token", files=2, groups=2, per_group=10)
    ds = ParquetFeatureDataset(f"{tmp_path}/*.parquet", columns=["layer_2"], batch_sentences=100, batch_tokens=30,
                               with_tokens=True)
    batches = list(ds)
    assert all(b.features.shape[0] == 1 and b.features.shape[1] * b.features.shape[2] <= 30
               or b.features.shape[1] == 1 for b in batches)
    b = batches[0]
    assert [len(t) for t in b.tokens] == b.lengths.tolist()
    assert b.tokens[0][0] == f"w{int(b.sentence_index[0])}_0"


def test_one_column_named_by_a_string_is_that_column(tmp_path):
    # a str was taken as a list of its characters: "no column(s) ['l', 'a', 'y', ...]"
    expected = write_shards(str(tmp_path), "sentence", files=1, groups=1, per_group=5)
    ds = ParquetFeatureDataset(str(tmp_path), columns="layer_1")
    assert ds.columns == ("layer_1",)
    seen = collect(ds)
    assert seen.keys() == expected.keys()
    for sid, vectors in seen.items():
        np.testing.assert_array_equal(vectors, expected[sid][1:2].astype(np.float32))


def test_token_layout_sentence_cut_across_row_groups(tmp_path):
    """Another writer may cut row groups anywhere: a sentence split across two is joined again."""
    rng = np.random.default_rng(5)
    spec = OutputSpec(n_layers=N_LAYERS, width=WIDTH, layout="token", dtype="float32")
    items = make_items("d", 0, 20, rng)
    table = build_table(items, spec)
    pq.write_table(table, tmp_path / "tokens-00000-of-00001.parquet", row_group_size=7)
    assert pq.ParquetFile(tmp_path / "tokens-00000-of-00001.parquet").num_row_groups > 3
    seen = collect(ParquetFeatureDataset(str(tmp_path), batch_sentences=3, shuffle_buffer=4))
    assert len(seen) == 20
    for it in items:
        np.testing.assert_array_equal(seen[f"d:{it.sentence.sentence_index}:0"], it.layers)


def test_rank_and_worker_shares_are_disjoint_and_complete(tmp_path):
    expected = write_shards(str(tmp_path), "sentence", files=5, groups=1, per_group=6)
    shares = [{sid for b in ParquetFeatureDataset(str(tmp_path), rank=r, world_size=2) for sid in b.sentence_ids}
              for r in range(2)]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == expected.keys()
    skip_unless_loader_workers_fit()
    loader = torch.utils.data.DataLoader(ParquetFeatureDataset(str(tmp_path), batch_sentences=4, shuffle_buffer=4),
                                         batch_size=None, num_workers=2)
    ids = [sid for batch in loader for sid in batch.sentence_ids]
    assert sorted(ids) == sorted(expected)


def test_more_ranks_than_row_groups_is_refused_when_given(tmp_path):
    """With world_size 3 over 2 files of a row group each, rank 2 would read nothing and end its
    epoch at once, where a DistributedDataParallel step of the other ranks waits for it (until the
    process group's timeout)."""
    expected = write_shards(str(tmp_path), "sentence", files=2, groups=1, per_group=3)
    with pytest.raises(ValueError, match=re.escape("world_size 3 is more than the 2 row group(s) of the 2 file(s) to "
                                                   "read: 1 rank(s) would read nothing")):
        ParquetFeatureDataset(tmp_path, rank=2, world_size=3)
    shares = [collect(ParquetFeatureDataset(tmp_path, rank=r, world_size=2)) for r in range(2)]
    assert [len(share) for share in shares] == [3, 3] and shares[0].keys() | shares[1].keys() == expected.keys()


def test_fsspec_url_and_missing_source():
    root = f"memory://ds-{uuid.uuid4().hex}"
    try:
        expected = write_shards(root, "sentence", files=2, groups=2, per_group=4)
        ds = ParquetFeatureDataset(root, batch_sentences=3)
        assert all(f.startswith("memory://") for f in ds.files)
        assert collect(ds).keys() == expected.keys()
    finally:
        fsspec.filesystem("memory").rm(root.split("://")[1], recursive=True)
    with pytest.raises(FileNotFoundError):
        expand_sources(f"{root}/nothing-here")


_PROXY_POOLS: list[pa.MemoryPool] = []


def test_memory_stays_bounded_over_many_shards(tmp_path):
    """~30 MB of float32 features in 8 shards x 6 row groups; the stream holds about one row group
    plus the shuffle buffer (numpy memory via tracemalloc, Arrow memory via a proxy pool)."""
    width = 128
    expected = write_shards(str(tmp_path), "token", files=8, groups=6, per_group=60, width=width)
    total_bytes = sum(v.size for v in expected.values()) * 4  # as float32
    total_tokens = sum(v.shape[1] for v in expected.values())
    ds = ParquetFeatureDataset(str(tmp_path), batch_sentences=16, shuffle_buffer=32, seed=0)
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    # kept for the process's life: a buffer allocated through the proxy and freed after it was
    # destroyed (by the garbage collector, or an Arrow thread) crashed the interpreter now and then
    _PROXY_POOLS.append(pool)
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        count = 0
        for batch in ds:
            count += int(batch.lengths.sum())
            del batch
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    assert count == total_tokens
    assert ds.stats.peak_buffered_sentences == 32
    assert ds.stats.peak_row_group_rows < 60 * 12
    assert ds.stats.files == 8 and ds.stats.row_groups == 48
    assert numpy_peak < total_bytes / 10, (numpy_peak, total_bytes)
    assert pool.max_memory() < total_bytes / 10, (pool.max_memory(), total_bytes)


def test_sources_that_hold_no_parquet_file_are_named(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "b.parquet").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    assert expand_sources([str(tmp_path), str(tmp_path / "a.parquet")]) == [str(tmp_path / "a.parquet"),
                                                                             str(tmp_path / "b.parquet")]
    for source in (tmp_path / "empty", tmp_path / "missing.parquet"):
        with pytest.raises(FileNotFoundError, match=f"no Parquet files at '{source}'"):
            expand_sources(str(source))


def test_pathlib_sources_are_read_and_no_sources_or_a_file_that_is_not_parquet_are_named(tmp_path):
    expected = write_shards(str(tmp_path / "run"), "token", files=2, groups=1, per_group=3)
    # a Path failed inside expand_sources ("'PosixPath' object is not iterable" / "has no attribute 'rstrip'")
    for sources in (tmp_path / "run", [tmp_path / "run"]):
        seen = collect(ParquetFeatureDataset(sources, batch_sentences=2))
        assert seen.keys() == expected.keys()
        for sid, vectors in seen.items():
            np.testing.assert_array_equal(vectors, expected[sid].astype(np.float32))
    with pytest.raises(ValueError, match="no sources given"):  # was an IndexError
        ParquetFeatureDataset([])
    (tmp_path / "notes.parquet").write_text("not parquet\n")
    (tmp_path / "empty.parquet").write_bytes(b"")
    whole = (tmp_path / "run" / "tokens-00000-of-00002.parquet").read_bytes()
    (tmp_path / "damaged.parquet").write_bytes(whole[: len(whole) // 2] + whole[-8:])  # footer length and magic kept
    for bad in ("notes.parquet", "empty.parquet", "damaged.parquet"):  # Arrow's message named no file
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / bad}: not a readable Parquet file")):
            ParquetFeatureDataset(tmp_path / bad)
    # a later file (the files are sorted), met while iterating
    (tmp_path / "z-notes.parquet").write_text("not parquet\n")
    ds = ParquetFeatureDataset([tmp_path / "z-notes.parquet", tmp_path / "run" / "tokens-00000-of-00002.parquet"])
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'z-notes.parquet'}: not a readable Parquet file")):
        list(ds)


@pytest.mark.parametrize("metadata, says", [
    (b'{"model": {"sha256": NaN}}', "not valid JSON"),
    (b'{"model": 1, "model": 2}', "duplicate key 'model'"),
    (b'{"x": 1e999}', "1e999"),
    (b"[1, 2]", "is a JSON list, not an object"),
])
def test_run_metadata_is_read_as_strictly_as_it_is_written(tmp_path, metadata, says):
    write_shards(str(tmp_path / "f"), "sentence", files=1, groups=1, per_group=2)
    path = next((tmp_path / "f").glob("*.parquet"))
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({**(table.schema.metadata or {}), b"elmo_pipeline": metadata}), path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: metadata elmo_pipeline.*{re.escape(says)}"):
        ParquetFeatureDataset([str(path)])


@pytest.mark.parametrize("layout", ["token", "sentence"])
def test_sources_of_another_width_or_layout_are_refused_by_name(tmp_path, layout):
    write_shards(str(tmp_path / "narrow"), layout, files=1, groups=1, per_group=4, width=WIDTH)
    write_shards(str(tmp_path / "wide"), layout, files=1, groups=1, per_group=4, width=2 * WIDTH)
    wide = next((tmp_path / "wide").glob("*.parquet"))
    ds = ParquetFeatureDataset([str(tmp_path / "narrow"), str(tmp_path / "wide")])
    with pytest.raises(ValueError, match=rf"^{wide}: vectors of width \{{'layer_0': {2 * WIDTH}, .*has width {WIDTH}"):
        collect(ds)
    other = "sentence" if layout == "token" else "token"
    write_shards(str(tmp_path / "other"), other, files=1, groups=1, per_group=4)
    mixed = ParquetFeatureDataset([str(tmp_path / "narrow"), str(tmp_path / "other")])
    with pytest.raises(ValueError, match=f"{other} layout, but .* has the {layout} layout"):
        collect(mixed)


def test_an_output_spec_that_is_not_the_models_is_refused_not_cut():
    """OutputSpec(n_layers=2) for a three-layer model would leave out the top layer unnoticed."""
    items = make_items("doc", 0, 2, np.random.default_rng(0))
    for spec, says in ((OutputSpec(n_layers=N_LAYERS - 1, width=WIDTH), f"says {N_LAYERS - 1} layers of width"),
                       (OutputSpec(n_layers=N_LAYERS, width=2 * WIDTH), f"the model gives {N_LAYERS} of width {WIDTH}"),
                       (OutputSpec(n_layers=N_LAYERS, width=WIDTH, mix_names=("task",)), "mixes ['task'] that")):
        with pytest.raises(ValueError, match=re.escape(says)):
            build_table(items, spec)
    assert build_table(items, OutputSpec(n_layers=N_LAYERS, width=WIDTH)).num_rows == sum(
        len(it.sentence.tokens) for it in items)


def test_vector_rows_that_are_not_the_tokens_are_refused_not_shifted():
    """One sentence with a row too many and the next with one too few wrote vectors against the
    wrong tokens; tokens given as a string wrote its characters."""
    first, second = make_items("doc", 0, 2, np.random.default_rng(0))
    spec = OutputSpec(n_layers=N_LAYERS, width=WIDTH)
    longer = first._replace(layers=np.concatenate([first.layers, second.layers[:, :1]], axis=1))
    shorter = second._replace(layers=second.layers[:, 1:])
    with pytest.raises(ValueError, match=re.escape(f"sentence {first.sentence.key} has {len(first.sentence.tokens)} "
                                                   f"tokens but vector rows {{'layers': {len(first.sentence.tokens) + 1}}}")):
        build_table([longer, shorter], spec)
    mixed = first._replace(mixes={"avg": first.layers[0, :-1]})
    with pytest.raises(ValueError, match=r"vector rows \{\"mix 'avg'\": "):
        build_table([mixed], spec)
    text = first._replace(sentence=first.sentence._replace(tokens="The bank"))
    with pytest.raises(TypeError, match=r"tokens is a str, not a sequence of token strings"):
        build_table([text], spec)


def test_a_folder_is_the_shards_of_one_run_not_every_parquet_file(tmp_path):
    """A user's file beside the shards is not read as features; a folder whose shards lack one, or
    mix two runs' counts, is refused naming what is wrong (a glob reads them anyway)."""
    expected = write_shards(str(tmp_path), "token", files=2, groups=1, per_group=3)
    pq.write_table(pq.read_table(tmp_path / "tokens-00000-of-00002.parquet"), tmp_path / "first_sentences.parquet")
    ds = ParquetFeatureDataset(str(tmp_path))
    assert [f.rsplit("/", 1)[-1] for f in ds.files] == ["tokens-00000-of-00002.parquet", "tokens-00001-of-00002.parquet"]
    assert collect(ds).keys() == expected.keys()
    (tmp_path / "tokens-00001-of-00002.parquet").rename(tmp_path / "tokens-00000-of-00001.parquet")
    with pytest.raises(ValueError, match=rf"^{tmp_path}: its shards are not one run's whole output: shards of more "
                                         r"than one run: tokens-\*-of-00001, tokens-\*-of-00002; 1 of the 2 shards "
                                         r"missing: tokens-00001-of-00002.parquet. Name the files"):
        ParquetFeatureDataset(str(tmp_path))
    assert len(ParquetFeatureDataset(str(tmp_path / "tokens-*.parquet")).files) == 2


def _with_model(path, sha256, layers_sha256=None):
    model = {"sha256": sha256} if layers_sha256 is None else {"sha256": sha256, "layers_sha256": layers_sha256}
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({b"elmo_pipeline": json.dumps({"model": model}).encode()}), path)


@pytest.mark.parametrize("layout", ["token", "sentence"])
def test_outputs_of_two_models_of_one_width_are_refused_by_name(tmp_path, layout):
    write_shards(str(tmp_path / "a"), layout, files=1, groups=1, per_group=4)
    write_shards(str(tmp_path / "b"), layout, files=1, groups=1, per_group=4, seed=1)
    first, second = next((tmp_path / "a").glob("*.parquet")), next((tmp_path / "b").glob("*.parquet"))
    _with_model(first, "a" * 64)
    _with_model(second, "b" * 64)
    ds = ParquetFeatureDataset([str(first), str(second)])
    says = rf"^{second}: vectors of another model than {first}'s \(sha256 bbbbbbbbbbbb against aaaaaaaaaaaa\)"
    with pytest.raises(ValueError, match=says):
        ds.check_files()
    with pytest.raises(ValueError, match=says):
        collect(ds)
    _with_model(second, "a" * 64)
    ds.check_files()
    assert sum(len(batch.sentence_ids) for batch in ds) == 8  # both files: doc0 in each
    # one model read from two sets of files (options + HDF5, its import folder): other sha256s,
    # the same layers; where both files record their layers, those decide
    _with_model(first, "a" * 64, "c" * 64)
    _with_model(second, "b" * 64, "c" * 64)
    ParquetFeatureDataset([str(first), str(second)]).check_files()
    _with_model(second, "a" * 64, "d" * 64)
    with pytest.raises(ValueError, match=r"\(layers_sha256 dddddddddddd against cccccccccccc\)"):
        ParquetFeatureDataset([str(first), str(second)]).check_files()


def _write_mixed(path, layout, weights, seed):
    """A file as WriteParquet writes it, with the layers and a mix `task` of `weights`, recorded in
    the metadata as extract records it; returns sentence_id -> (2, n, D): layer_0 and the mix."""
    spec = MixSpec(weights)
    out = OutputSpec(n_layers=N_LAYERS, width=WIDTH, layout=layout, dtype="float32", mix_names=("task",),
                     metadata={"model": {"sha256": "a" * 64}, "mixes": {"task": spec.to_dict()}})
    items = [it._replace(mixes={"task": ScalarMix.from_spec(spec)(torch.from_numpy(it.layers)).detach().numpy()})
             for it in make_items("doc", 0, 3, np.random.default_rng(seed))]
    with open(path, "wb") as f, parquet_writer(f, out) as writer:
        writer.write_table(build_table(items, out))
    return {f"doc:{it.sentence.sentence_index}:0": np.stack([it.layers[0], it.mixes["task"]]) for it in items}


@pytest.mark.parametrize("layout", ["token", "sentence"])
def test_outputs_of_two_mixes_under_one_name_are_refused_by_name(tmp_path, layout):
    """Two runs whose --mix task=FILE named other weights wrote other vectors into mix_task: read
    together, every sentence came twice, once with each mix's vectors."""
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    _write_mixed(first, layout, (0.0, 1.0, -1.0), seed=0)
    _write_mixed(second, layout, (1.0, 0.0, 0.0), seed=1)
    ds = ParquetFeatureDataset([str(first), str(second)], columns=["layer_0", "mix_task"])
    says = rf"^{second}: mix_task hold another mix than {first}'s \(the weights, gamma or layer norm"
    with pytest.raises(ValueError, match=says):
        ds.check_files()
    with pytest.raises(ValueError, match=says):
        collect(ParquetFeatureDataset([str(first), str(second)], columns="mix_task"))
    layers = ParquetFeatureDataset([str(first), str(second)], columns="layer_0")  # the layers are one model's
    layers.check_files()
    assert sum(len(batch.sentence_ids) for batch in layers) == 6  # 3 sentences in each file
    expected = _write_mixed(second, layout, (0.0, 1.0, -1.0), seed=1)
    ds.check_files()
    seen = collect(ParquetFeatureDataset([str(second)], columns=["layer_0", "mix_task"]))
    assert seen.keys() == expected.keys()
    for sid, vectors in expected.items():
        np.testing.assert_array_equal(seen[sid], vectors)


@pytest.mark.parametrize("layout", ["token", "sentence"])
def test_an_output_of_mixes_only_names_its_mix_columns(tmp_path, layout):
    """`extract --layers none --mix ...` writes no layer_J: the default columns were none, and the
    refusal said only 'no vector columns to read'."""
    path = tmp_path / "tokens.parquet"
    expected = _write_mixed(path, layout, (0.0, 1.0, -1.0), seed=0)
    table = pq.read_table(path)
    pq.write_table(table.drop_columns([c for c in table.column_names if c.startswith("layer_")]), path)
    with pytest.raises(ValueError, match=rf"^{path}: no vector columns to read: it has no layer_J column \(extract "
                                         r"--layers none\); name its mixes, columns=\['mix_task'\]$"):
        ParquetFeatureDataset(str(path))
    seen = collect(ParquetFeatureDataset(str(path), columns=["mix_task"]))
    assert seen.keys() == expected.keys()
    for sid, vectors in expected.items():
        np.testing.assert_array_equal(seen[sid], vectors[1:])


@pytest.mark.parametrize("layout", ["token", "sentence"])
def test_vectors_rewritten_as_variable_size_lists_are_refused_by_name(tmp_path, layout):
    """pandas writes fixed-size list columns back as variable-size lists."""
    write_shards(str(tmp_path), layout, files=2, groups=1, per_group=3)
    later = tmp_path / f"{layout}s-00001-of-00002.parquet"
    table = pq.read_table(later)
    wanted = pa.list_(pa.float16()) if layout == "token" else pa.list_(pa.list_(pa.float16()))
    pq.write_table(table.set_column(table.schema.get_field_index("layer_0"), "layer_0",
                                    table.column("layer_0").cast(wanted)), later)
    with pytest.raises(ValueError, match=rf"^{later}: column layer_0 is list<.*but extract writes fixed_size_list"):
        ParquetFeatureDataset(str(tmp_path)).check_files()
    with pytest.raises(ValueError, match=rf"^{later}: column layer_0 is list<"):
        ParquetFeatureDataset([str(later)])


def test_float32_files_read_with_float16_files_keep_their_precision(tmp_path):
    """A batch was filled in the dtype of its first sentence: float32 vectors batched after a
    float16 file's were rounded to float16."""
    write_shards(str(tmp_path / "half"), "token", files=1, groups=1, per_group=4)
    items = make_items("full", 0, 4, np.random.default_rng(5))
    (tmp_path / "full").mkdir()
    spec = OutputSpec(n_layers=N_LAYERS, width=WIDTH, layout="token", dtype="float32")
    pq.write_table(build_table(items, spec), tmp_path / "full" / "tokens-00000-of-00001.parquet")
    ds = ParquetFeatureDataset([tmp_path / "half", tmp_path / "full"], batch_sentences=8)
    seen = collect(ds)
    assert len(seen) == 8
    for item in items:
        np.testing.assert_array_equal(seen[f"full:{item.sentence.sentence_index}:0"], item.layers)


def test_a_folder_whose_name_holds_glob_characters_is_that_folder(tmp_path):
    """A folder named `run[1]` was read as the glob `run[1]/*.parquet`, which matched no file."""
    folder = tmp_path / "run[1]"
    expected = write_shards(str(folder), "sentence", files=2, groups=1, per_group=3)
    ds = ParquetFeatureDataset(folder)
    assert ds.files == [f"{folder}/sentences-0000{i}-of-00002.parquet" for i in range(2)]
    seen = collect(ds)
    assert seen.keys() == expected.keys()
    for sid, vectors in expected.items():
        np.testing.assert_array_equal(seen[sid], vectors.astype(np.float32))


@pytest.mark.parametrize("seed, epoch, says", [(-1, 0, "seed must be an integer >= 0, got -1"),
                                               (1.5, 0, "seed must be an integer >= 0, got 1.5"),
                                               (0, -1, "epoch must be an integer >= 0, got -1")])
def test_a_seed_or_epoch_numpy_cannot_take_is_refused_when_given(tmp_path, seed, epoch, says):
    """They failed at the first batch with numpy's "expected non-negative integer", naming neither."""
    write_shards(str(tmp_path), "token", files=1, groups=1, per_group=3)
    with pytest.raises(ValueError, match=re.escape(says)):
        ds = ParquetFeatureDataset(tmp_path, shuffle_buffer=4, seed=seed)
        ds.set_epoch(epoch)
    ds = ParquetFeatureDataset(tmp_path, shuffle_buffer=4, seed=2**40)
    ds.set_epoch(3)
    assert len(collect(ds)) == 3


@pytest.mark.parametrize("option, says", [
    ({"batch_sentences": 2.5}, "batch_sentences must be an integer >= 1, got 2.5"),  # made batches of 3
    ({"batch_sentences": True}, "batch_sentences must be an integer >= 1, got True"),  # made batches of 1
    ({"batch_sentences": 0}, "batch_sentences must be an integer >= 1, got 0"),
    ({"batch_tokens": 64.0}, "batch_tokens must be an integer >= 1, got 64.0"),
    ({"shuffle_buffer": 1.5}, "shuffle_buffer must be an integer >= 0, got 1.5"),
    ({"world_size": 2.0, "rank": 1}, "world_size must be an integer >= 1, got 2.0"),
    ({"rank": 2, "world_size": 2}, "rank 2 is not in [0, 2)")])
def test_a_count_that_is_not_an_integer_is_refused_when_given(tmp_path, option, says):
    write_shards(str(tmp_path), "token", files=1, groups=1, per_group=5)
    with pytest.raises(ValueError, match=re.escape(says)):
        ParquetFeatureDataset(tmp_path, **option)
    sizes = [len(batch.sentence_ids) for batch in ParquetFeatureDataset(tmp_path, batch_sentences=np.int64(2))]
    assert sizes == [2, 2, 1]


def test_an_empty_source_is_refused_not_read_as_the_root_folder(tmp_path, monkeypatch):
    """`ParquetFeatureDataset("")` (an unset variable) was read as a folder and globbed '/*.parquet',
    the root's files; an empty source beside good ones the same."""
    write_shards(str(tmp_path), "token", files=1, groups=1, per_group=3)
    monkeypatch.chdir(tmp_path)
    for sources in ("", [str(tmp_path), ""]):
        with pytest.raises(ValueError, match=re.escape("a source is empty: name Parquet files, globs or folders")):
            ParquetFeatureDataset(sources)
    assert len(collect(ParquetFeatureDataset("."))) == 3


def test_set_epoch_reaches_persistent_dataloader_workers(tmp_path):
    """Persistent workers keep the data set they started with: set_epoch in the main process did
    not reach them, so every epoch was shuffled as the first."""
    expected = write_shards(str(tmp_path), "token", files=4, groups=1, per_group=6)
    ds = ParquetFeatureDataset(tmp_path, batch_sentences=4, shuffle_buffer=8, seed=3)
    skip_unless_loader_workers_fit()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in (0, 1, 1):
        ds.set_epoch(epoch)
        orders.append([sid for batch in loader for sid in batch.sentence_ids])
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(expected)
    assert orders[0] != orders[1] and orders[1] == orders[2]
    assert ds.epoch == 1


_READ_IN_A_CHILD = """
import os, sys
import torch
torch.set_num_threads(1)  # no OpenMP threads either: what remains to count is Arrow's
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import read_documents
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset
from elmo_pipeline.training.shards import PreparedCorpus
features, documents, prepared = sys.argv[1:]
before = len(os.listdir("/proc/self/task"))
counts = [sum(len(b.sentence_ids) for b in ParquetFeatureDataset(features, batch_sentences=2)),
          sum(1 for _ in read_documents([documents], ReadOptions(input_format="parquet"))),
          len(PreparedCorpus(prepared).read_shard(0)[0])]
print(counts, len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are counted in /proc/self/task (Linux)")
def test_parquet_read_through_python_files_starts_no_arrow_thread(tmp_path):
    # Arrow's pre-buffering (I/O pool) and column decoding (CPU pool) hold buffers of a Python
    # file object, and one freed after the interpreter began to exit aborted it: exit 134
    # ("terminate called without an active exception") after a finished read, in 3 to 5 runs of
    # 30 of a script reading features here. Read in the calling thread, no pool is started.
    write_shards(str(tmp_path / "features"), "token", files=2, groups=3, per_group=4)
    pq.write_table(pa.table({"text": ["one document", "and another", "a third"]}), tmp_path / "docs.parquet")
    (tmp_path / "corpus.txt").write_text("the cat sat\nwords here\n", encoding="utf-8")
    assert main(["prepare", "--input", str(tmp_path / "corpus.txt"), "--output", str(tmp_path / "prepared"),
                 "--tokenizer", "whitespace"]) == 0
    done = subprocess.run([sys.executable, "-c", _READ_IN_A_CHILD, str(tmp_path / "features"),
                           str(tmp_path / "docs.parquet"), str(tmp_path / "prepared")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[24,", "3,", "2]", "0"]  # every sentence, document and row; no new thread
