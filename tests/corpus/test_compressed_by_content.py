"""Compressed files whose names say they are not: read by their first bytes, never as text."""

import bz2
import gzip
import importlib.util
import io
import json
import lzma
import zipfile

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from elmo_pipeline.corpus.byte_ranges import WorkItem, number_ranges, plan_work, range_newlines
from elmo_pipeline.corpus.input_files import magic_compression
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



class _StoreFile(AbstractBufferedFile):
    """A file read as s3fs's, gcsfs's and HTTP's are: by ranges of whole blocks (5 MiB unless its
    opener asks for another size), through fsspec's read-ahead cache."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        data = _ObjectStore.objects[self.path][start:end]
        _ObjectStore.fetched.append((start, start + len(data)))  # a range past the file's end is cut there
        return data


class _ObjectStore(AbstractFileSystem):
    """An object store in this process that records the byte ranges its files fetch."""

    protocol = "review-store"
    objects: dict[str, bytes] = {}
    fetched: list[tuple[int, int]] = []
    block_size: int | str = "default"  # fsspec's 5 MiB, as gcsfs's and HTTP's

    def info(self, path: str, **kwargs) -> dict:
        path = self._strip_protocol(path)
        if path not in self.objects:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(self.objects[path]), "type": "file"}

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs) -> _StoreFile:
        path = self._strip_protocol(path)
        return _StoreFile(self, path, mode, block_size=block_size or self.block_size, size=len(self.objects[path]))


def test_planning_a_split_file_on_an_object_store_fetches_its_first_bytes_only():
    # plan_work looks at a file's first 10 bytes before cutting it into ranges: opened with the
    # store's 5 MiB blocks, that fetched the first 5 MiB (here all of the file) per file planned
    fsspec.register_implementation(_ObjectStore.protocol, _ObjectStore, clobber=True)
    text = PAYLOAD * 2
    _ObjectStore.objects.update({"/corpus/a.txt": text, "/corpus/b.txt": gzip.compress(text)})
    url = "review-store:///corpus/a.txt"
    try:
        items = plan_work(url, ReadOptions(), 2**16)
        starts = list(range(0, len(text), 2**16))
        assert len(starts) > 1 and items == [WorkItem(url, a, b) for a, b in zip(starts, [*starts[1:], None])]
        assert 0 < sum(end - start for start, end in _ObjectStore.fetched) <= 64
        _, records = split_read(url, ReadOptions(), 2**16)  # the ranges read as before
        assert [r.text for r in records] == LINES * 2
        _ObjectStore.fetched.clear()
        assert magic_compression("review-store:///corpus/b.txt") == "gzip"
        assert 0 < sum(end - start for start, end in _ObjectStore.fetched) <= 64
    finally:
        _ObjectStore.objects.clear()
        _ObjectStore.fetched.clear()


def _fetched() -> int:
    """The bytes the object store sent since last asked."""
    total = sum(end - start for start, end in _ObjectStore.fetched)
    _ObjectStore.fetched.clear()
    return total


@pytest.mark.parametrize("block_size", ["default", 2**16])
def test_an_object_stores_file_is_fetched_once_whole_or_in_ranges(block_size):
    # fsspec's readline reads a block and seeks back to the line's end; the store's read-ahead cache
    # fetches a block past each read it misses and keeps its last fetch only. This 1.9 MB file in
    # 8 ranges: with 5 MiB blocks their newline counts fetched 7.8 MB and their reads 7.8 MB; with
    # 64 KiB blocks a read of it whole fetched 4.7 MB, the counts 3.6 MB and the reads 4.8 MB
    fsspec.register_implementation(_ObjectStore.protocol, _ObjectStore, clobber=True)
    _ObjectStore.block_size = block_size
    text = PAYLOAD * 30
    _ObjectStore.objects["/corpus/a.txt"] = text
    url = "review-store:///corpus/a.txt"
    try:
        whole = [(d.line, d.text) for d in read_documents([url], ReadOptions())]
        assert whole == list(enumerate(LINES * 30, 1)) and _fetched() == len(text)
        items = plan_work(url, ReadOptions(), 2**18)
        assert len(items) == 8 and _fetched() <= 20  # the first bytes, looked at for compression
        counted = [(item, range_newlines(item)) for item in items]
        assert _fetched() == items[-1].start  # the last range is not counted
        records = [r for item in number_ranges(counted) for r in read_work_item(item, ReadOptions())]
        assert [(r.line, r.text) for r in records] == whole
        # each range's bytes, the byte before it, and 64 KiB past its end for the rest of its last line
        assert len(text) < _fetched() <= len(text) + (len(items) - 1) * (1 + 2**16)
        # every split point: ranges that end inside a character, a CRLF, a blank line
        small = "\ufeff第一行 🙂\r\n\nsecond\n   \n混合 text\r\n\n\né".encode()
        _ObjectStore.objects["/corpus/small.txt"] = small
        url = "review-store:///corpus/small.txt"
        reference = list(read_documents([url], ReadOptions()))
        assert [d.text for d in reference] == ["第一行 🙂", "second", "   ", "混合 text", "é"]
        for split_bytes in range(1, len(small) + 1):
            assert split_read(url, ReadOptions(), split_bytes)[1] == reference, split_bytes
    finally:
        _ObjectStore.objects.clear()
        _ObjectStore.fetched.clear()
        _ObjectStore.block_size = "default"


class _StreamedFile(AbstractBufferedFile):
    """As fsspec's HTTPStreamFile (a server that gives no length or ranges): it says it can seek,
    then reads forward only."""

    def seek(self, loc: int, whence: int = 0) -> int:
        if (loc, whence) not in ((0, 1), (self.loc, 0)):
            raise ValueError("Cannot seek streaming HTTP file")
        return self.loc

    def read(self, length: int = -1) -> bytes:
        data = _StreamServer.objects[self.path]
        out = data[self.loc:] if length < 0 else data[self.loc:self.loc + length]
        self.loc += len(out)
        return out


class _StreamServer(_ObjectStore):
    protocol = "review-stream"
    objects: dict[str, bytes] = {}

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs) -> _StreamedFile:
        return _StreamedFile(self, self._strip_protocol(path), mode, cache_type="none", size=None)


@pytest.mark.parametrize("compress", [lambda data: data, gzip.compress], ids=["text", "gzip"])
def test_a_file_streamed_without_seeking_back_is_read(compress):
    # its first bytes read, the seek back to its start raised "Cannot seek streaming HTTP file", a
    # ValueError that no reader caught: a document-per-file read, which worked before, failed the
    # job (a read by lines failed before too, in fsspec's readline, which seeks back)
    fsspec.register_implementation(_StreamServer.protocol, _StreamServer, clobber=True)
    _StreamServer.objects["/served/a.txt"] = compress(PAYLOAD)
    try:
        url = "review-stream:///served/a.txt"
        assert [d.text for d in read_documents([url], ReadOptions())] == LINES
        (whole,) = read_documents([url], ReadOptions(doc_per="file"))
        assert whole.text == PAYLOAD.decode()
    finally:
        _StreamServer.objects.clear()


class _UnsizedServer(_StreamServer):
    """A server that says no length: fsspec's HTTP info then gives the size None."""

    protocol = "review-unsized"

    def info(self, path: str, **kwargs) -> dict:
        return {**super().info(path), "size": None}


def test_a_file_of_unknown_size_is_read_whole():
    # plan_work cut it by its size: None, a TypeError ("bad operand type for unary -") that failed the job
    fsspec.register_implementation(_UnsizedServer.protocol, _UnsizedServer, clobber=True)
    _StreamServer.objects["/served/a.txt"] = PAYLOAD * 2
    try:
        url = "review-unsized:///served/a.txt"
        items, records = split_read(url, ReadOptions(), 2**16)
        assert items == [WorkItem(url)] and [r.text for r in records] == LINES * 2
    finally:
        _StreamServer.objects.clear()
