"""Compressed files whose names say they are not: read by their first bytes, never as text."""

import bz2
import gzip
import importlib.util
import io
import json
import lzma
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from elmo_pipeline.corpus.byte_ranges import WorkItem, number_ranges, plan_work, range_newlines
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import ReadStats, read_documents, read_text_lines, read_work_item
from elmo_pipeline.corpus.records import Document, ErrorRecord

LINES = [f"line {i}: a sentence of words, 中文 {i * 7919 % 1000}" for i in range(1, 1501)]
PAYLOAD = ("\n".join(LINES) + "\n").encode()


def zip_one(data: bytes) -> bytes:
    sink = io.BytesIO()
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("corpus.txt", data)
    return sink.getvalue()


def zstd_two_frames(data: bytes) -> bytes:
    half = len(data) // 2
    return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])


COMPRESSORS = {"gzip": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress, "zstd": zstd_two_frames,
               "zip": zip_one}


def split_read(url: str, options: ReadOptions, split_bytes: int) -> tuple[list[WorkItem], list]:
    """The work items of the file and what reading them gives, as the Beam transform does in one process."""
    items = plan_work(url, options, split_bytes)
    numbered = number_ranges((item, range_newlines(item)) for item in items)
    return items, [record for item in numbered for record in read_work_item(item, options)]


@pytest.mark.parametrize("name", ["a.txt", "a.log", "a"])
@pytest.mark.parametrize("compression", sorted(COMPRESSORS))
def test_a_compressed_file_named_as_text_is_decompressed(tmp_path, compression, name):
    # a gzip file named a.txt gave 3 "invalid UTF-8" error records and no document; a larger one
    # cut into byte ranges gave junk documents ('c', 'jPj') among 8,247 error records
    path = tmp_path / name
    path.write_bytes(COMPRESSORS[compression](PAYLOAD))
    url = str(path)
    stats = ReadStats()
    docs = list(read_documents([url], ReadOptions(), stats))
    assert [d.text for d in docs] == LINES
    assert [d.doc_id for d in docs[-2:]] == [f"{url}:1499", f"{url}:1500"]
    assert stats.bytes_read == len(PAYLOAD)
    (whole,) = read_documents([url], ReadOptions(doc_per="file"))
    assert whole.text == PAYLOAD.decode()
    assert [text for _, text in read_text_lines(url)] == LINES  # embed-file, probe's labelled files


def test_a_compressed_file_named_as_text_is_not_cut_into_byte_ranges(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(gzip.compress(PAYLOAD, compresslevel=1))
    assert path.stat().st_size > 8 * 1024  # 9 ranges of 1 KiB, were it cut
    items, records = split_read(str(path), ReadOptions(), 1024)
    assert items == [WorkItem(str(path))]
    assert all(isinstance(r, Document) for r in records)
    assert [r.text for r in records] == LINES
    # an uncompressed file of the same name is still cut, and reads the same
    path.write_bytes(PAYLOAD)
    items, records = split_read(str(path), ReadOptions(), 1024)
    assert len(items) == -(-len(PAYLOAD) // 1024)
    assert [r.text for r in records] == LINES


def test_compressed_jsonl_named_as_jsonl_is_decompressed_and_not_cut(tmp_path):
    rows = [json.dumps({"id": f"d{i}", "text": text}, ensure_ascii=False) for i, text in enumerate(LINES)]
    path = tmp_path / "a.jsonl"
    path.write_bytes(zstd_two_frames(("\n".join(rows) + "\n").encode()))
    options = ReadOptions("jsonl", id_field="id")
    items, records = split_read(str(path), options, 4096)
    assert items == [WorkItem(str(path))]
    assert [(r.doc_id, r.text) for r in records] == [(f"d{i}", text) for i, text in enumerate(LINES)]


def test_a_format_that_cannot_be_decompressed_is_one_error_naming_it(tmp_path):
    # an lz4 frame (its magic, a frame descriptor, then data), read where lz4 is not installed
    if importlib.util.find_spec("lz4") is not None:
        pytest.skip("lz4 is installed: fsspec decompresses it")
    path = tmp_path / "a.txt"
    path.write_bytes(b"\x04\x22\x4d\x18\x40\x70\xdf" + bytes(range(256)) * 40)
    for options in (ReadOptions(), ReadOptions(doc_per="file"), ReadOptions("jsonl")):
        _, records = split_read(str(path), options, 4096)
        (error,) = records
        assert isinstance(error, ErrorRecord) and error.source == str(path) and error.line is None
        assert error.reason == ("cannot read file: OSError: the file holds lz4-compressed data (its first bytes say "
                                "so, its name does not), which cannot be decompressed here: decompress it first")


def test_text_that_starts_like_a_magic_number_is_text(tmp_path):
    # "BZh" alone, or "PK", is not taken for bz2 or zip: their whole markers are
    text = "BZh91AY is not a bz2 block\nPK\u0003 not a zip\nBZh9 either\n"
    path = tmp_path / "a.txt"
    path.write_text(text)
    assert [d.text for d in read_documents([str(path)], ReadOptions())] == text.splitlines()
    path.write_text("PK\u0003 not a zip\n")
    assert [d.text for d in read_documents([str(path)], ReadOptions())] == ["PK\u0003 not a zip"]


@pytest.mark.parametrize("name", ["a.parquet", "a.parquet.gz"])
def test_a_compressed_parquet_file_is_one_error_naming_the_compression(tmp_path, name):
    # Parquet is read as it is: the record said "Parquet magic bytes not found in footer. Either the
    # file is corrupted or this is not a parquet file."
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": ["a b", "c"]}), sink)
    path = tmp_path / name
    path.write_bytes(gzip.compress(sink.getvalue()))
    (error,) = read_documents([str(path)], ReadOptions("parquet"))
    assert isinstance(error, ErrorRecord) and error.source == str(path) and error.line is None
    assert error.reason == ("cannot read file: it is gzip-compressed, not Parquet (which compresses inside the "
                            "file); decompress it")
    path.write_bytes(b"PAR1 not really parquet")  # a damaged Parquet file keeps Arrow's reason
    (error,) = read_documents([str(path)], ReadOptions("parquet"))
    assert error.reason.startswith("cannot read file: ArrowInvalid: ")
