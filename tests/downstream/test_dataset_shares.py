"""ParquetFeatureDataset's shares: ranks first, then a rank's DataLoader workers; row groups where
files are fewer than the readers, a token-layout sentence read whole by the reader of its start."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.corpus.schema import OutputSpec, build_table
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset

from support import loader_socket_name, skip_unless_loader_workers_fit
from test_downstream_dataset import N_LAYERS, WIDTH, collect, make_items, write_shards


def _float32(layout: str = "token") -> OutputSpec:
    return OutputSpec(n_layers=N_LAYERS, width=WIDTH, layout=layout, dtype="float32")


def _one_file(tmp_path, layout: str, sentences: int, rows_per_group: int, seed: int = 5):
    """One file whose row groups cut sentences anywhere (a token-layout sentence of up to 11
    tokens spans as many as four groups of 4 rows). Returns sentence_id -> (L+1, n, D)."""
    items = make_items("d", 0, sentences, np.random.default_rng(seed))
    path = tmp_path / f"{layout}s-00000-of-00001.parquet"
    pq.write_table(build_table(items, _float32(layout)), path, row_group_size=rows_per_group)
    return {f"d:{it.sentence.sentence_index}:0": it.layers for it in items}, path


def _starting_inside_a_sentence() -> pa.Table:
    """The token rows of 12 sentences less all but the last row of the first one."""
    items = make_items("d", 0, 12, np.random.default_rng(1))
    cut = len(items[0].sentence.tokens) - 1
    assert cut > 0
    return build_table(items, _float32()).slice(cut)


def _loader_ids(ds, workers: int) -> list[str]:
    skip_unless_loader_workers_fit()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    return [sid for batch in loader for sid in batch.sentence_ids]


def test_every_rank_of_several_workers_reads_a_share(tmp_path):
    """3 files for 2 ranks of 4 DataLoader workers: cut over all 8 readers at once, the 3 files went
    to rank 0's first three workers and rank 1 read nothing (its epoch over at once while a DDP step
    of rank 0 waited for it)."""
    expected = write_shards(str(tmp_path), "sentence", files=3, groups=1, per_group=5)
    shares = [_loader_ids(ParquetFeatureDataset(tmp_path, batch_sentences=4, rank=r, world_size=2), 4)
              for r in range(2)]
    assert [len(share) for share in shares] == [10, 5]
    assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == sorted(expected)


@pytest.mark.parametrize("layout", ["token", "sentence"])
@pytest.mark.parametrize("shuffle", [0, 6])
def test_one_file_is_shared_by_ranks_in_row_groups_with_every_sentence_whole(tmp_path, layout, shuffle):
    """One file for 3 ranks was refused (files were the unit of work); its row groups are shared,
    and a sentence cut across groups is read whole, once, by the rank of the group it starts in."""
    expected, path = _one_file(tmp_path, layout, sentences=40, rows_per_group=4)
    assert pq.ParquetFile(path).num_row_groups >= 10
    for epoch in (0, 1):
        shares = []
        for rank in range(3):
            ds = ParquetFeatureDataset(tmp_path, batch_sentences=3, shuffle_buffer=shuffle, seed=2, rank=rank,
                                       world_size=3)
            ds.set_epoch(epoch)
            shares.append(collect(ds))
        assert all(shares) and sum(len(share) for share in shares) == len(expected) == 40
        seen = {sid: vectors for share in shares for sid, vectors in share.items()}
        assert seen.keys() == expected.keys()
        for sid, vectors in expected.items():
            np.testing.assert_array_equal(seen[sid], vectors)


def test_one_file_is_shared_by_a_ranks_dataloader_workers(tmp_path):
    """One file and 2 DataLoader workers: the second worker read nothing and the first the whole file,
    so the second batch was the file's second sentence; now the second worker's first batch (the
    first sentence starting in row group 1) comes second."""
    expected, path = _one_file(tmp_path, "token", sentences=30, rows_per_group=16)
    starts = pq.ParquetFile(path).read_row_group(1, columns=["token_index", "sentence_index"])
    first_of_group_1 = starts["sentence_index"][int(np.flatnonzero(starts["token_index"].to_numpy() == 0)[0])].as_py()
    ids = _loader_ids(ParquetFeatureDataset(tmp_path, batch_sentences=1), 2)
    assert sorted(ids) == sorted(expected)
    assert ids[:2] == ["d:0:0", f"d:{first_of_group_1}:0"] and first_of_group_1 > 1


def test_a_shared_files_first_row_group_starting_inside_a_sentence_is_refused(tmp_path):
    """Read as row groups, rows before the first sentence's start belong to the previous group's
    reader; in a file's first group there is none, so they are refused as a whole file's read
    refuses them, not dropped."""
    pq.write_table(_starting_inside_a_sentence(), tmp_path / "tokens-00000-of-00001.parquet", row_group_size=8)
    says = re.escape("row group 0: starts inside a sentence that the previous row group did not begin")
    with pytest.raises(ValueError, match=says):
        collect(ParquetFeatureDataset(tmp_path))
    with pytest.raises(ValueError, match=says):
        collect(ParquetFeatureDataset(tmp_path, rank=0, world_size=2))


def test_rows_of_no_sentence_after_an_empty_first_row_group_are_refused_when_shared(tmp_path):
    """A file whose row group 0 holds no row and whose next one starts inside a sentence: read whole
    it was refused, but shared by 2 ranks the rows before the first start were dropped without a
    word (the 11 whole sentences read, the cut one's last row gone): only row group 0 was checked."""
    table = _starting_inside_a_sentence()
    path = tmp_path / "tokens-00000-of-00001.parquet"
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table.slice(0, 0))
        writer.write_table(table, row_group_size=8)
    assert pq.ParquetFile(path).metadata.row_group(0).num_rows == 0
    says = re.escape("row group 1: starts inside a sentence that the previous row group did not begin")
    with pytest.raises(ValueError, match=says):
        collect(ParquetFeatureDataset(tmp_path))
    with pytest.raises(ValueError, match=says):  # by the rank given row group 1
        for rank in range(2):
            collect(ParquetFeatureDataset(tmp_path, rank=rank, world_size=2))


def test_a_file_shared_by_row_groups_counts_once_in_the_stats(tmp_path):
    """stats.files counted a file once per row group read as a share: each of 2 ranks sharing one
    file of 14 row groups said it read 7 files."""
    expected, path = _one_file(tmp_path, "token", sentences=40, rows_per_group=16)
    groups = pq.ParquetFile(path).num_row_groups
    stats = []
    for rank in range(2):
        ds = ParquetFeatureDataset(tmp_path, rank=rank, world_size=2)
        stats.append((len(collect(ds)), ds.stats.files, ds.stats.row_groups))
    assert groups == 14 and stats == [(20, 1, 7), (20, 1, 7)] and len(expected) == 40


def test_row_groups_in_which_no_sentence_starts_are_no_rank_s_share(tmp_path):
    """4 sentences of 11 tokens in row groups of 8 rows: 6 groups, of which group 3 holds only the
    middle of sentence 2. Shared by 4 ranks, rank 3 was given it alone and read nothing (its epoch
    over at once while a DDP step of the others waits for it); groups of no row did the same. Such
    groups are no share (their rows are read with the sentence's start), and the refusal counts
    the groups in which a sentence starts."""
    rng = np.random.default_rng(0)
    starts = np.arange(11, dtype=np.int64)
    items = [EmbeddedSentence(Sentence("d", i, 0, ("w",) * 11, starts, starts + 1),
                              rng.standard_normal((N_LAYERS, 11, WIDTH)).astype(np.float32), {}) for i in range(4)]
    spec = _float32()
    path = tmp_path / "tokens-00000-of-00001.parquet"
    with pq.ParquetWriter(path, spec.schema()) as writer:
        writer.write_table(build_table(items, spec), row_group_size=8)
        writer.write_table(build_table(items[:0], spec))  # a row group of no row
    assert [pq.ParquetFile(path).metadata.row_group(g).num_rows for g in range(7)] == [8, 8, 8, 8, 8, 4, 0]
    shares = [collect(ParquetFeatureDataset(tmp_path, rank=r, world_size=4)) for r in range(4)]
    assert [sorted(share) for share in shares] == [["d:0:0"], ["d:1:0"], ["d:2:0"], ["d:3:0"]]
    for share in shares:
        for sid, vectors in share.items():
            np.testing.assert_array_equal(vectors, items[int(sid.split(":")[1])].layers)
    with pytest.raises(ValueError, match=re.escape("world_size 5 is more than the 4 row group(s) of the 1 file(s)")):
        ParquetFeatureDataset(tmp_path, rank=0, world_size=5)


def test_a_ranks_row_groups_of_one_file_open_it_once(tmp_path, monkeypatch):
    """A reader given several row groups of one file opened it and read its footer again for each:
    4 ranks over a file of 200 row groups (a footer of 236 kB) took 606-697 ms of CPU for an epoch
    that one reader read in 84-104. The same rows, opened once a run of the file's groups."""
    from elmo_pipeline.downstream import dataset

    expected, path = _one_file(tmp_path, "sentence", sentences=24, rows_per_group=2)
    opened = []

    def counted(url, *args, **kwargs):
        opened.append(url)
        return real_open(url, *args, **kwargs)

    real_open = dataset.open_url
    seen = []
    for rank in range(3):
        ds = ParquetFeatureDataset(path, batch_sentences=5, rank=rank, world_size=3)
        monkeypatch.setattr(dataset, "open_url", counted)
        opened.clear()
        seen += [sid for batch in ds for sid in batch.sentence_ids]
        monkeypatch.setattr(dataset, "open_url", real_open)
        assert len(opened) == 2, (rank, opened)  # its footer for the shares, then its 4 groups read
    assert sorted(seen) == sorted(expected)


def test_the_socket_room_is_measured_on_the_name_this_python_gives_the_socket(monkeypatch):
    """The check assumed CPython 3.10-3.13's name, listener-XXXXXXXX; 3.14's arbitrary_address names the
    socket sock-XXXXXXXX (Lib/multiprocessing/connection.py), so 4 bytes of room were refused there.
    This Python's own name: a folder the check passes takes the socket (a real bind), one byte more
    neither. 3.14's, which does not run here, is given by arbitrary_address as 3.14 writes it."""
    import multiprocessing.connection
    import socket

    from elmo_pipeline.downstream.dataset import _check_socket_room

    base = tempfile.mkdtemp(prefix="u")
    name = loader_socket_name()
    room = 107 - len(os.sep) - len(name)
    if len(base) + 2 > room:
        pytest.skip(f"the suite's temp folder {base} is too long to make one of {room} bytes")
    for extra, fits in ((0, True), (1, False)):
        folder = os.path.join(base, "f" * (room + extra - len(base) - 1))
        os.mkdir(folder)
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.bind(os.path.join(folder, name))
                bound = True
            except OSError:
                bound = False
        try:
            _check_socket_room(0, folder, name)
            checked = True
        except OSError:
            checked = False
        assert (bound, checked) == (fits, fits), (len(folder), name)

    def as_in_3_14(family: str) -> str:
        assert family == "AF_UNIX"
        return tempfile.mktemp(prefix="sock-", dir=base)

    monkeypatch.setattr(multiprocessing.connection, "arbitrary_address", as_in_3_14)
    fits = os.path.join(base, "g" * (107 - len("/sock-XXXXXXXX") - len(base) - 1))
    _check_socket_room(0, fits)  # 93 bytes: refused when the name was assumed
    with pytest.raises(OSError, match=re.escape(f"({fits}g{os.sep}sock-..., and a socket's path may have 107 bytes)")):
        _check_socket_room(0, fits + "g")


def test_a_temp_folder_too_long_for_a_workers_socket_is_refused_by_name(tmp_path):
    """Under a $TMPDIR of 76 bytes or more a DataLoader worker's batch was never handed over (its
    socket's path past the 107 bytes an AF_UNIX address may have: 'OSError: AF_UNIX path too long' in
    the worker's queue thread) and the loader waited for good; 75 bytes fit."""
    expected = write_shards(str(tmp_path), "sentence", files=2, groups=1, per_group=5)
    base = tempfile.mkdtemp(prefix="u")
    if len(base) >= 74:
        pytest.skip(f"the suite's temp folder {base} leaves no room to make one of 75 bytes")
    read = ("import sys, torch\n"
            "from elmo_pipeline.downstream.dataset import ParquetFeatureDataset\n"
            "ds = ParquetFeatureDataset(sys.argv[1], batch_sentences=4)\n"
            "loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, timeout=60)\n"
            "print(sum(len(batch.sentence_ids) for batch in loader))\n")
    runs = {}
    for length in (75, 76):
        temp = Path(base, "t" * (length - len(base) - 1))
        temp.mkdir()
        runs[length] = subprocess.run([sys.executable, "-c", read, str(tmp_path)], capture_output=True, text=True,
                                      env={**os.environ, "TMPDIR": str(temp)})
    assert runs[75].returncode == 0 and runs[75].stdout == f"{len(expected)}\n", runs[75].stderr[-2000:]
    long_temp = f"{base}{os.sep}{'t' * (75 - len(base))}"
    said = runs[76].stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        re.escape(f"OSError: DataLoader worker 0: the temp folder {long_temp} (76 bytes) leaves no room for the socket "
                  f"by which a worker hands its batches over ({long_temp}{os.sep}pymp-") + r"\w{8}" +
        re.escape(f"{os.sep}listener-..., and a socket's path may have 107 bytes): set TMPDIR to a folder of at most "
                  "75 bytes, or use num_workers=0"), said), runs[76].stderr[-2000:]
    assert runs[76].returncode == 1
