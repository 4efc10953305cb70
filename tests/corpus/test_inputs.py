import codecs
import re
import bz2
import datetime
import gzip
import io
import json
import lzma
import os
import random
import tarfile
import tracemalloc
import uuid
import zipfile

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from elmo_pipeline.corpus.byte_ranges import WorkItem, number_ranges, plan_ranges, plan_work, range_newlines
from elmo_pipeline.corpus.input_files import InputError, check_inputs_outside, expand_patterns, open_input
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import ReadStats, read_documents, read_work_item
from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.corpus.schema import parse_timestamp
from elmo_pipeline.filesystems import without_userinfo
from support import damaged_gzip

TEXT = ReadOptions()
JSONL = ReadOptions("jsonl", id_field="id", timestamp_field="ts")


@pytest.fixture
def mem():
    """put(name, data) -> URL of a fresh file on fsspec's in-memory filesystem."""
    fs = fsspec.filesystem("memory")
    root = f"/test-{uuid.uuid4().hex}"

    def put(name: str, data: bytes) -> str:
        path = f"{root}/{name}"
        fs.pipe(path, data)
        return fs.unstrip_protocol(path)

    put.root = f"memory://{root}"
    yield put
    if fs.exists(root):  # a test may have removed every file
        fs.rm(root, recursive=True)


def split_read(url: str, options: ReadOptions, split_bytes: int) -> list:
    """What the Beam transform does, in one process: plan, count, number, read every range."""
    items = plan_work(url, options, split_bytes)
    numbered = number_ranges((item, range_newlines(item)) for item in items)
    return [record for item in numbered for record in read_work_item(item, options)]


# --- patterns ----------------------------------------------------------------------------------


def test_expand_patterns_sorts_dedupes_and_skips_directories(mem):
    b = mem("b.txt", b"x\n")
    a = mem("a.txt", b"x\n")
    mem("sub/c.txt", b"x\n")
    assert expand_patterns([f"{mem.root}/*.txt", f"{mem.root}/a.txt"]) == [a, b]
    assert expand_patterns(f"{mem.root}/*") == [a, b]  # "sub" is a directory


def test_pattern_matching_nothing_raises_naming_it(mem):
    mem("a.txt", b"x\n")
    pattern = f"{mem.root}/*.jsonl"
    with pytest.raises(InputError, match="matches no files") as caught:
        expand_patterns([f"{mem.root}/a.txt", pattern])
    assert pattern in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_a_folder_given_as_a_pattern_is_named_as_one(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("x\n")
    with pytest.raises(InputError, match=re.escape(f"input pattern '{tmp_path / 'docs'}' is a folder; give its "
                                                   f"files, e.g. '{tmp_path / 'docs'}/*', or '{tmp_path / 'docs'}/**' for "
                                                   "every depth")):
        expand_patterns([str(tmp_path / "docs")])
    assert expand_patterns([f"{tmp_path / 'docs'}/*"]) == [str(tmp_path / "docs" / "a.txt")]


def test_a_device_or_fifo_given_as_input_is_named_as_one(tmp_path):
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.txt")
    for name in ("zero.txt", "fifo.txt"):
        with pytest.raises(InputError, match=re.escape(f"input '{tmp_path / name}': not a regular file (a device, "
                                                       "FIFO or socket); refused unread")):
            expand_patterns([str(tmp_path / name)])
    (tmp_path / "a.txt").write_text("x\n")  # a glob takes the regular files only
    assert expand_patterns([f"{tmp_path}/*"]) == [str(tmp_path / "a.txt")]


def test_a_device_or_fifo_under_a_chain_is_refused_unread(tmp_path):
    # zip://a.txt::FIFO blocked for ever in expand_patterns (the zip file system opens its archive when
    # made) and zip://*::/dev/zero read zeros until memory ran out; embed-file blocked comparing its input
    from elmo_pipeline.corpus.readers import read_text_lines
    from elmo_pipeline.formats.atomic import check_output_file

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero.zip").symlink_to("/dev/zero")
    refused = "which is not a regular file (a device, FIFO or socket); refused unread"
    for url, under in ((f"zip://a.txt::{tmp_path / 'fifo'}", tmp_path / "fifo"),
                       (f"tar://*::{tmp_path / 'fifo'}", tmp_path / "fifo"),
                       (f"zip://*::{tmp_path / 'zero.zip'}", tmp_path / "zero.zip"),
                       (f"simplecache::zip://a.txt::file://{tmp_path / 'fifo'}", tmp_path / "fifo")):
        said = f"{url} reads {under}, {refused}"
        with pytest.raises(InputError, match=re.escape(said)):
            expand_patterns([url])
        with pytest.raises(ValueError, match=re.escape(said)):
            list(read_text_lines(url))
        with pytest.raises(ValueError, match=re.escape(said)):
            check_output_file(str(tmp_path / "out.hdf5"), [("the input file", url)])
    with zipfile.ZipFile(tmp_path / "data.zip", "w") as archive:  # a regular archive is read as before
        archive.writestr("a.txt", "one\n")
    assert [line for line in read_text_lines(f"zip://a.txt::{tmp_path / 'data.zip'}")] == [(1, "one")]


def test_a_local_file_whose_name_holds_a_chain_separator_is_named(tmp_path):
    # fsspec read "x::y.txt" as the chain y.txt over x: "matches no files", or a glob's FileNotFoundError for 'x'
    (tmp_path / "x::y.txt").write_text("x\n")
    reason = "its name holds '::', which fsspec reads as a chain of file systems (simplecache::s3://...); rename the file"
    with pytest.raises(InputError, match=re.escape(f"input pattern '{tmp_path / 'x::y.txt'}' names a local file: {reason}")):
        expand_patterns([str(tmp_path / "x::y.txt")])
    with pytest.raises(InputError, match=re.escape(f"input pattern '{tmp_path}/*' matches '{tmp_path / 'x::y.txt'}': "
                                                   f"{reason}")):
        expand_patterns([f"{tmp_path}/*"])
    # every reader opens through open_input (probe's labelled files, evaluate's text, embed-file):
    # fsspec opened another file, "x", and said that one was not found
    with pytest.raises(FileNotFoundError, match=re.escape(reason)):
        open_input(str(tmp_path / "x::y.txt"))


def test_a_chained_pattern_keeps_its_chain(tmp_path, mem):
    # expand_patterns gave each file without the chain: simplecache::memory://r/* gave memory:///r/a.txt,
    # read past the cache, and zip://in/*::data.zip gave zip://in/a.txt, which names no archive
    from elmo_pipeline.training.prepare import whitespace_text_sentences

    a = mem("a.txt", b"one\ntwo words\n")
    mem("b.txt.gz", gzip.compress(b"three\n"))
    cached = expand_patterns([f"simplecache::{mem.root}/*"])
    assert cached == [f"simplecache::{a}", f"simplecache::{a.removesuffix('a.txt')}b.txt.gz"]
    expected = [(f"{cached[0]}:1", "one"), (f"{cached[0]}:2", "two words"), (f"{cached[1]}:1", "three")]
    assert [(d.doc_id, d.text) for d in read_documents(cached, TEXT)] == expected
    assert [(d.doc_id, d.text) for d in split_read(cached[0], TEXT, 3)] == expected[:2]
    # read through the cache: its copy, taken at the first read, is what a read gives after the file changed
    mem("a.txt", b"changed\n")
    assert [d.text for d in read_documents(cached[:1], TEXT)] == ["one", "two words"]
    assert [d.text for d in read_documents([a], TEXT)] == ["changed"]

    with zipfile.ZipFile(tmp_path / "data.zip", "w") as archive:
        archive.writestr("in/a.txt", "zip one\n")
        archive.writestr("in/b.txt.gz", gzip.compress(b"zip two\n"))
    zipped = expand_patterns([f"zip://in/*::{tmp_path / 'data.zip'}"])
    assert zipped == [f"zip://in/a.txt::{tmp_path / 'data.zip'}", f"zip://in/b.txt.gz::{tmp_path / 'data.zip'}"]
    # decompressed by the name of the file read (.gz), not of its archive (.zip)
    assert [d.text for d in read_documents(zipped, TEXT)] == ["zip one", "zip two"]
    pattern = f"simplecache::zip://in/*.txt::file://{tmp_path / 'data.zip'}"  # a cache over an archive
    assert expand_patterns([pattern]) == [f"simplecache::zip://in/a.txt::file://{tmp_path / 'data.zip'}"]
    (tmp_path / "c.txt").write_text("local words\n")  # evaluate's text is found as every input is
    assert list(whitespace_text_sentences([f"filecache::file://{tmp_path}/*.txt"])) == [["local", "words"]]
    assert expand_patterns([f"filecache::file://{tmp_path}/*.txt"]) == [f"filecache::file://{tmp_path / 'c.txt'}"]


def test_no_pattern_is_an_error_not_an_empty_job():
    with pytest.raises(InputError, match="no input pattern given"):
        expand_patterns([])


def test_local_files_are_absolute_paths(tmp_path):
    (tmp_path / "doc.txt").write_text("hello\n")
    assert expand_patterns([str(tmp_path / "*.txt")]) == [str(tmp_path / "doc.txt")]


def test_links_to_files_are_files_and_names_are_taken_literally_first(tmp_path):
    data, blobs = tmp_path / "data", tmp_path / "blobs"
    data.mkdir(), blobs.mkdir()
    (data / "a.txt").write_text("a\n")
    (blobs / "c_blob").write_text("c\n")
    (data / "c.txt").symlink_to(blobs / "c_blob")  # a shared data folder, or a cache of blobs
    (data / "d.txt").symlink_to(tmp_path / "nowhere")  # a broken link is no file
    (data / "sub").symlink_to(blobs, target_is_directory=True)
    assert expand_patterns([str(data / "*")]) == [str(data / "a.txt"), str(data / "c.txt")]
    assert expand_patterns([str(data / "c*")]) == [str(data / "c.txt")]
    # a name with glob characters that exists is that file, not what the glob would match
    (data / "c[1].txt").write_text("bracket\n")
    (data / "c1.txt").write_text("other\n")
    assert expand_patterns([str(data / "c[1].txt")]) == [str(data / "c[1].txt")]
    assert expand_patterns([str(data / "c[12].txt")]) == [str(data / "c1.txt")]


def test_one_local_file_has_one_name(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "r.txt").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    spellings = ["r.txt", "in/../r.txt", f"{tmp_path}//r.txt", f"{tmp_path}/./r.txt", "./in/../*.txt"]
    assert expand_patterns(spellings) == [str(tmp_path / "r.txt")]


def test_a_file_name_that_is_not_utf8_is_refused_naming_it(tmp_path):
    os.mkdir(tmp_path / "in")
    with open(os.path.join(os.fsencode(tmp_path / "in"), b"caf\xe9.txt"), "w") as f:
        f.write("x\n")
    with pytest.raises(InputError, match=r"matches b'.*/in/caf\\xe9\.txt', a file name that is not UTF-8"):
        expand_patterns([str(tmp_path / "in" / "*")])


def test_inputs_among_a_runs_files_are_refused(tmp_path):
    out = tmp_path / "out"
    shard, temp, mine = out / "errors-00000-of-00001.jsonl", out / "beam-temp-x", out / "mine.jsonl"
    removed = [str(shard), str(temp)]
    with pytest.raises(InputError, match=r"input .*errors-00000-of-00001\.jsonl is output of an earlier run in"):
        check_inputs_outside([str(mine), str(shard)], removed, str(out))
    with pytest.raises(InputError, match=r"input .*beam-temp-x/part is output of an earlier run"):
        check_inputs_outside([str(temp / "part")], removed, str(out))
    check_inputs_outside([str(mine), str(tmp_path / "errors-00000-of-00001.jsonl")], removed, str(out))


# --- text --------------------------------------------------------------------------------------


def test_text_lines_bom_crlf_empty_and_whitespace(mem):
    data = b"\xef\xbb\xbfone\r\n\r\n\ntwo\n  \t\nlone\rcr\r\nlast"
    url = mem("a.txt", data)
    stats = ReadStats()
    docs = list(read_documents([url], TEXT, stats))
    assert [(d.doc_id, d.text, d.line) for d in docs] == [
        (f"{url}:1", "one", 1),  # BOM and CR gone
        (f"{url}:4", "two", 4),  # the empty lines 2 and 3 are no documents
        (f"{url}:5", "  \t", 5),  # whitespace-only: a document
        (f"{url}:6", "lone\rcr", 6),  # a lone CR is no line end
        (f"{url}:7", "last", 7),  # no final newline
    ]
    assert all(d.source == url and d.timestamp is None for d in docs)
    assert stats.bytes_read == len(data)


def test_a_bom_inside_a_concatenation_is_dropped_as_at_the_start(mem):
    bom = codecs.BOM_UTF8
    # `cat a.txt b.txt` and `cat a.gz b.gz` of two files saved "UTF-8 with BOM"
    text = bom + b"First file.\r\n" + bom + b"Second file.\r\n"
    jsonl = bom + b'{"text": "one", "id": "a"}\n' + bom + b'{"text": "two", "id": "b"}\n'
    for url in (mem("a.txt", text), mem("a.txt.gz", gzip.compress(text[:15]) + gzip.compress(text[15:]))):
        assert [(d.text, d.line) for d in read_documents([url], TEXT)] == [("First file.", 1), ("Second file.", 2)]
    url = mem("a.jsonl", jsonl)
    expected = [Document("a", "one", url, 1), Document("b", "two", url, 2)]
    assert list(read_documents([url], JSONL)) == expected
    for split_bytes in range(1, len(jsonl) + 1):
        assert split_read(url, JSONL, split_bytes) == expected, split_bytes


def test_invalid_utf8_and_nul_are_errors_with_reasons(mem):
    url = mem("a.txt", b"good\nab\xe4\xb8x\nnul\x00here\nalso good\n")
    records = list(read_documents([url], TEXT))
    assert [r.text for r in records if isinstance(r, Document)] == ["good", "also good"]
    errors = [r for r in records if isinstance(r, ErrorRecord)]
    assert [(e.source, e.line, e.stage) for e in errors] == [(url, 2, "read"), (url, 3, "read")]
    assert errors[0].reason.startswith("invalid UTF-8 at byte 2")
    assert "NUL" in errors[1].reason


def test_document_per_file(mem):
    a = mem("a.txt", b"\xef\xbb\xbfFirst line.\r\nSecond line.\n")
    mem("empty.txt", b"")
    b = mem("b.txt", "一个文件".encode())
    options = ReadOptions(doc_per="file")
    docs = list(read_documents(expand_patterns([f"{mem.root}/*.txt"]), options))
    assert docs == [
        Document(f"{a}:1", "First line.\r\nSecond line.\n", a, 1),  # verbatim, BOM stripped
        Document(f"{b}:1", "一个文件", b, 1),
    ]


def test_a_document_per_file_keeps_no_copy_of_its_bytes_while_it_is_processed(tmp_path):
    path = tmp_path / "a.txt"  # a local file: its bytes are read into a new object, which is traced
    path.write_bytes(codecs.BOM_UTF8 + b"word " * (2 * 2**20))
    tracemalloc.start()
    try:
        for doc in read_documents([str(path)], ReadOptions(doc_per="file")):
            held = tracemalloc.get_traced_memory()[0]  # while downstream has the document
            assert len(doc.text) == 10 * 2**20
    finally:
        tracemalloc.stop()
    assert held < 12 * 2**20  # the text; the file's 10 MiB of bytes were held beside it before


# --- byte ranges -------------------------------------------------------------------------------

MIXED = "\n".join([
    "\ufeff第一行：中文和emoji 🙂🎉",
    "",
    "second line, ascii only",
    "混合 mixed 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 text\r",
    "   ",
    "",
    "包袱很重。Apple 公司。",
    "🙂",
    "é",
]).encode()


def test_plan_ranges_cover_the_file():
    assert plan_ranges("u", 20, 7) == [WorkItem("u", 0, 7), WorkItem("u", 7, 14), WorkItem("u", 14)]
    assert plan_ranges("u", 14, 7) == [WorkItem("u", 0, 7), WorkItem("u", 7)]
    assert plan_ranges("u", 5, 7) == [WorkItem("u", 0)]
    assert plan_ranges("u", 0, 7) == [WorkItem("u", 0)]
    with pytest.raises(InputError):
        plan_ranges("u", 10, 0)


@pytest.mark.parametrize("final_newline", [False, True])
def test_byte_ranges_read_every_line_once_with_single_reader_ids(mem, final_newline):
    data = MIXED + (b"\n" if final_newline else b"")
    url = mem("mixed.txt", data)
    reference = list(read_documents([url], TEXT))
    assert [d.line for d in reference] == [1, 3, 4, 5, 7, 8, 9]
    assert reference[0].text == "第一行：中文和emoji 🙂🎉"
    assert reference[2].text == "混合 mixed 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 text"
    # with 7-byte ranges, some range edges fall inside multi-byte characters
    assert any(0x80 <= data[start] < 0xC0 for start in range(7, len(data), 7))
    for split_bytes in [1, 2, 3, 7, 11, 16, 29, len(data) - 1, len(data)]:
        assert split_read(url, TEXT, split_bytes) == reference, split_bytes


def test_range_newlines_counts_only_inside_the_range(mem):
    url = mem("a.txt", b"a\nb\n\nc\n")
    assert [range_newlines(WorkItem(url, s, s + 2)) for s in (0, 2, 4, 6)] == [1, 1, 1, 1]
    assert range_newlines(WorkItem(url, 1, 5)) == 3
    assert range_newlines(WorkItem(url, 4)) == 0  # runs to the end: no later range needs it


def test_a_split_file_that_cannot_be_counted_is_read_whole_by_one_reader(mem):
    data = "".join(f"line {i}\n" for i in range(1, 101)).encode()
    url = mem("a.txt", data)
    items = plan_work(url, TEXT, 64)
    assert len(items) > 5
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"))  # gone between planning and counting
    numbered = number_ranges((item, range_newlines(item)) for item in items)
    assert numbered == [WorkItem(url)]  # the count raised FileNotFoundError, which failed the job
    (error,) = read_work_item(numbered[0], TEXT)
    assert error.line is None and "FileNotFoundError" in error.reason  # one record for the file
    mem("a.txt", data)  # back before it is read: every line, once, numbered as one reader numbers them
    assert [(d.line, d.text) for d in read_work_item(numbered[0], TEXT)] == [(i, f"line {i}") for i in range(1, 101)]


def test_a_range_inside_a_line_longer_than_it_does_not_read_that_line(mem):
    data = b"first\n" + b"x" * (32 * 2**20) + b"\nlast\n"  # one line across 32 ranges of 1 MiB
    url = mem("a.txt", data)
    items = plan_work(url, TEXT, 2**20)
    numbered = number_ranges((item, range_newlines(item)) for item in items)
    for item in (numbered[1], numbered[16]):
        tracemalloc.start()
        try:
            assert list(read_work_item(item, TEXT)) == []
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, item  # the rest of the long line was read whole before, 16 to 31 MiB
    (last,) = read_work_item(numbered[-1], TEXT)
    assert (last.text, last.line) == ("last", 3)


def test_jsonl_ranges_match_single_reader(mem):
    lines = [json.dumps({"id": f"d{i}", "text": "字" * i + " 🙂"}, ensure_ascii=False) for i in range(30)]
    url = mem("a.jsonl", ("\n".join(lines) + "\n").encode())
    options = ReadOptions("jsonl", id_field="id")
    reference = list(read_documents([url], options))
    assert [d.doc_id for d in reference] == [f"d{i}" for i in range(30)]
    assert split_read(url, options, 13) == reference


def test_compressed_files_are_one_work_item(mem):
    url = mem("a.txt.gz", gzip.compress(b"x\n" * 100))
    assert plan_work(url, TEXT, 7) == [WorkItem(url)]
    url = mem("a.txt", b"x\n" * 100)
    assert len(plan_work(url, TEXT, 7)) == 29
    assert plan_work(url, ReadOptions(doc_per="file"), 7) == [WorkItem(url)]


def test_a_member_of_an_archive_is_one_work_item(tmp_path):
    # a zip's or tar.gz's member was cut into ranges by its size, and each range's seek read (decompressed)
    # it from its start: a 19 MB zip member in 9 ranges took 1.27 s of CPU against 1.06 s whole
    data = "".join(f"line {i}\n" for i in range(1, 2001)).encode()
    with zipfile.ZipFile(tmp_path / "data.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("in/a.txt", data)
    for mode, name in (("w:gz", "data.tar.gz"), ("w", "data.tar")):
        with tarfile.open(tmp_path / name, mode) as archive:
            member = tarfile.TarInfo("in/a.txt")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    (tmp_path / "a.txt").write_bytes(data)
    expected = [(i, f"line {i}") for i in range(1, 2001)]
    for url in (f"zip://in/a.txt::{tmp_path / 'data.zip'}", f"tar://in/a.txt::{tmp_path / 'data.tar.gz'}",
                f"simplecache::zip://in/a.txt::file://{tmp_path / 'data.zip'}"):
        assert plan_work(url, TEXT, 1024) == [WorkItem(url)], url
        assert [(d.line, d.text) for d in split_read(url, TEXT, 1024)] == expected
    # a plain tar's member seeks for real, as a file does: cut into its 19 ranges
    url = f"tar://in/a.txt::{tmp_path / 'data.tar'}"
    assert len(plan_work(url, TEXT, 1024)) == len(plan_work(str(tmp_path / "a.txt"), TEXT, 1024)) == 19
    assert [(d.line, d.text) for d in split_read(url, TEXT, 1024)] == expected


# --- JSONL -------------------------------------------------------------------------------------


def test_a_jsonl_line_of_blanks_json_does_not_know_is_an_error_record(mem):
    """Only space, tab and CR are JSON's whitespace: a line of U+00A0 or a form feed was skipped
    as an empty line, neither a document nor an error."""
    lines = ['{"id": "a", "text": "one"}', " \t\r", "\xa0", "\x0c", "\u2028\u3000", '{"id": "b", "text": "two"}']
    url = mem("blank.jsonl", "\n".join(lines).encode())
    records = list(read_documents([url], JSONL))
    assert [r.text for r in records if isinstance(r, Document)] == ["one", "two"]
    errors = {r.line: r.reason for r in records if isinstance(r, ErrorRecord)}
    assert sorted(errors) == [3, 4, 5] and all(e.startswith("malformed JSON: Expecting value") for e in errors.values())


def test_a_malformed_json_reason_says_at_column_once(mem):
    """json's messages for an unterminated string or a raw control character end in " at", and the
    reason read `malformed JSON: Unterminated string starting at at column 9`."""
    url = mem("a.jsonl", b'{"id": "b\n{"id": "\x01"}\n{"id" 1}\n')
    reasons = [r.reason for r in read_documents([url], JSONL)]
    assert reasons == ["malformed JSON: Unterminated string starting at column 8",
                       "malformed JSON: Invalid control character at column 9",
                       "malformed JSON: Expecting ':' delimiter at column 7"]


def test_jsonl_fields_and_errors(mem):
    lines = [
        '{"id": "a", "text": "Hello there.", "ts": "2024-05-01T12:00:00Z"}',
        '{"id": 7, "text": "Int id."}',
        "   ",
        '{"id": "b", "text": "unterminated',
        '["not", "an", "object"]',
        '{"id": "c"}',
        '{"id": "d", "text": 12}',
        '{"id": true, "text": "bool id"}',
        '{"id": [1], "text": "list id"}',
        '{"text": "no id"}',
        '{"id": "e", "text": "bad time", "ts": "yesterday"}',
        '{"id": "f", "text": "epoch time", "ts": 1700000000}',
        '{"id": "g", "text": "nul \\u0000 escaped"}',
        '{"id": "h", "text": "null time", "ts": null}',
        '{"id": null, "text": "null id"}',
    ]
    url = mem("a.jsonl", "\n".join(lines).encode())
    records = list(read_documents([url], JSONL))
    docs = [r for r in records if isinstance(r, Document)]
    assert docs == [
        Document("a", "Hello there.", url, 1, "2024-05-01T12:00:00Z"),
        Document("7", "Int id.", url, 2),
        Document("h", "null time", url, 14),
    ]
    reasons = {r.line: r.reason for r in records if isinstance(r, ErrorRecord)}
    assert reasons[4].startswith("malformed JSON: Unterminated string")
    assert reasons[5] == "JSON value is list, not an object"
    assert reasons[6] == "missing text field 'text'"
    assert reasons[7] == "text field 'text' is int, not a string"
    assert reasons[8] == "id field 'id' is bool, not a string or int"
    assert reasons[9] == "id field 'id' is list, not a string or int"
    assert reasons[10] == "missing id field 'id'"
    assert reasons[11] == reasons[12] == "timestamp field 'ts' is not ISO 8601"
    assert "NUL" in reasons[13]
    assert reasons[15] == "id field 'id' is null, not a string or int"
    assert len(reasons) + len(docs) == len(lines) - 1  # the blank line 3 is skipped


def test_a_field_given_twice_or_an_id_with_nul_is_an_error(mem):
    lines = ['{"id": "f", "text": "first value", "text": "second value"}',
             '{"id": "g", "id": "g2", "text": "two ids"}',
             '{"id": "h", "text": "fine", "meta": {"k": 1, "k": 2}, "other": 1, "other": 2}',
             '{"id": "u\\u0000", "text": "nul id"}']
    url = mem("a.jsonl", "\n".join(lines).encode())
    records = list(read_documents([url], JSONL))
    assert [(r.line, r.reason, r.doc_id) for r in records if isinstance(r, ErrorRecord)] == [
        (1, "field 'text' appears 2 times in the record; which value is meant is unknown", "f"),  # the id is known
        (2, "field 'id' appears 2 times in the record; which value is meant is unknown", None),
        (4, "id field 'id' contains a NUL character, which key stores refuse", None),
    ]
    assert [r for r in records if isinstance(r, Document)] == [Document("h", "fine", url, 3)]  # fields it does not read


def test_an_empty_field_name_is_a_name(mem):
    table = pa.table({"": ["id-1", "id-2"], "body": ["One.", "Two."]})
    url = mem("a.parquet", parquet_bytes(table, 10))
    assert list(read_documents([url], ReadOptions("parquet", text_field="body", id_field=""))) == [
        Document("id-1", "One.", url, 1), Document("id-2", "Two.", url, 2)]
    texts = mem("b.parquet", parquet_bytes(pa.table({"": ["One."]}), 10))
    assert list(read_documents([texts], ReadOptions("parquet", text_field=""))) == [Document(f"{texts}:1", "One.", texts, 1)]
    jsonl = mem("c.jsonl", b'{"": "x", "t": "Hi."}')
    assert list(read_documents([jsonl], ReadOptions("jsonl", text_field="t", id_field=""))) == [
        Document("x", "Hi.", jsonl, 1)]
    with pytest.raises(InputError, match="text has no fields"):
        ReadOptions(id_field="")


def test_read_errors_carry_the_id_when_it_was_parsed(mem):
    lines = ['{"id": "a", "text": 5}', '{"id": 7, "text": null}', '{"id": "b", "text": "x", "ts": "soon"}',
             '{"text": "no id"}', '{"id": [1], "text": "bad id"}', '{"id": "c", "text": "cut', 'caf\xe9 ']
    url = mem("a.jsonl", "\n".join(lines[:-1]).encode() + b"\ncaf\xe9\n")
    ids = {r.line: r.doc_id for r in read_documents([url], JSONL)}
    assert ids == {1: "a", 2: "7", 3: "b", 4: None, 5: None, 6: None, 7: None}
    # without an id field, a record's id is "<url>:<line>", rejected or not (as a tokenize error's)
    text_url = mem("a.txt", b"fine\nnul \x00\nbad \xff\n")
    errors = [r for r in read_documents([text_url], TEXT) if isinstance(r, ErrorRecord)]
    assert [(e.line, e.doc_id) for e in errors] == [(2, f"{text_url}:2"), (3, f"{text_url}:3")]


def test_timestamps_whose_utc_form_python_cannot_hold_are_rejected(mem):
    # valid ISO 8601, but in UTC past year 9999 or before year 1: pyarrow would write them and
    # no reader could convert them back (as the Parquet path already refused)
    lines = [{"id": "ok", "text": "a", "ts": "9999-12-31T18:59:59-05:00"},
             {"id": "late", "text": "b", "ts": "9999-12-31T23:00:00-05:00"},
             {"id": "early", "text": "c", "ts": "0001-01-01T00:00:00+05:00"},
             {"id": "naive", "text": "d", "ts": "9999-12-31T23:59:59"}]
    url = mem("a.jsonl", "\n".join(map(json.dumps, lines)).encode())
    records = list(read_documents([url], JSONL))
    assert [r.doc_id for r in records if isinstance(r, Document)] == ["ok", "naive"]
    assert [(r.doc_id, r.reason) for r in records if isinstance(r, ErrorRecord)] == [
        (name, "timestamp field 'ts' is outside Python's datetime range (years 1 to 9999) in UTC")
        for name in ("late", "early")]


def test_a_utc_time_ending_in_a_lower_case_z_is_read_as_utc(mem):
    """RFC 3339 lets a time end in 'z' as in 'Z' (Python's fromisoformat takes only 'Z')."""
    lines = [{"id": "upper", "text": "a", "ts": "2024-05-01T10:00:00Z"},
             {"id": "lower", "text": "b", "ts": "2024-05-01t10:00:00z"},
             {"id": "inside", "text": "c", "ts": "2024-05-01Tz10:00:00"}]
    url = mem("a.jsonl", "\n".join(map(json.dumps, lines)).encode())
    records = list(read_documents([url], JSONL))
    assert [r.doc_id for r in records if isinstance(r, Document)] == ["upper", "lower"]
    assert [(r.doc_id, r.reason) for r in records if isinstance(r, ErrorRecord)] == [
        ("inside", "timestamp field 'ts' is not ISO 8601")]
    utc = datetime.datetime(2024, 5, 1, 10, tzinfo=datetime.timezone.utc)
    assert [parse_timestamp(r.timestamp) for r in records[:2]] == [utc, utc]


def test_a_required_timestamp_that_is_missing_or_null_is_an_error(mem):
    lines = ['{"id": "a", "text": "x", "ts": "2024-01-02"}', '{"id": "b", "text": "y"}',
             '{"id": "c", "text": "z", "ts": null}']
    url = mem("a.jsonl", "\n".join(lines).encode())
    optional = list(read_documents([url], JSONL))
    assert [r.timestamp for r in optional] == ["2024-01-02", None, None]
    required = list(read_documents([url], ReadOptions("jsonl", id_field="id", timestamp_field="ts",
                                                      timestamp_required=True)))
    assert required[0] == Document("a", "x", url, 1, "2024-01-02")
    assert required[1:] == [ErrorRecord(url, 2, "missing timestamp field 'ts'", "read", "b"),
                            ErrorRecord(url, 3, "timestamp field 'ts' is null, not an ISO 8601 time", "read", "c")]
    table = pa.table({"text": ["p", "q"], "ts": pa.array([datetime.date(2024, 1, 2), None])})
    parquet_url = mem("a.parquet", parquet_bytes(table, 10))
    rows = list(read_documents([parquet_url], ReadOptions("parquet", timestamp_field="ts", timestamp_required=True)))
    assert rows == [Document(f"{parquet_url}:1", "p", parquet_url, 1, "2024-01-02"),
                    ErrorRecord(parquet_url, 2, "timestamp field 'ts' is null, not an ISO 8601 time", "read",
                                f"{parquet_url}:2")]


def test_default_ids_and_custom_text_field(mem):
    url = mem("a.jsonl", b'{"body": "x"}\n{"body": "y", "text": 3}\n')
    docs = list(read_documents([url], ReadOptions("jsonl", text_field="body")))
    assert [(d.doc_id, d.text) for d in docs] == [(f"{url}:1", "x"), (f"{url}:2", "y")]


def test_invalid_options_raise():
    with pytest.raises(InputError, match="text format"):
        ReadOptions("jsonl", doc_per="file")
    with pytest.raises(InputError, match="input format"):
        ReadOptions("csv")
    with pytest.raises(InputError, match="need the jsonl or parquet format: text has no fields"):
        ReadOptions("text", id_field="id")  # every line would be rejected for a missing id
    with pytest.raises(InputError, match="need the jsonl or parquet format"):
        ReadOptions("text", timestamp_field="ts")
    with pytest.raises(InputError, match="timestamp_required needs a timestamp_field"):
        ReadOptions("jsonl", timestamp_required=True)


# --- compression -------------------------------------------------------------------------------

LINES = [f"line {i}: 中文 🙂" for i in range(1, 2001)]
PAYLOAD = ("\n".join(LINES) + "\n").encode()


def zstd_two_frames(data: bytes) -> bytes:
    half = len(data) // 2
    return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])


@pytest.mark.parametrize("suffix, compress", [
    (".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress), (".zst", zstd_two_frames),
    (".GZ", gzip.compress), (".Xz", lzma.compress), (".ZST", zstd_two_frames), (".zstd", zstd_two_frames),
    (".ZSTD", zstd_two_frames),
])
def test_compressed_text_by_extension(mem, suffix, compress):
    url = mem("a.txt" + suffix, compress(PAYLOAD))
    stats = ReadStats()
    docs = list(read_documents([url], TEXT, stats))
    assert [d.text for d in docs] == LINES  # every zstd frame, not just the first
    assert docs[-1].doc_id == f"{url}:2000"
    assert stats.bytes_read == len(PAYLOAD)


def test_a_highly_compressible_zstd_file_is_decompressed_a_little_at_a_time(mem):
    rng = random.Random(0)
    sentences = [f"sentence {i} of a corpus with much repeated boilerplate ." for i in range(100)]
    text = ("\n".join(rng.choices(sentences, k=400_000)) + "\n").encode()  # 22 MiB, 36:1 in zstd
    url = mem("a.txt.zst", zstandard.ZstdCompressor(level=1).compress(text))
    with open_input(url) as f:
        tracemalloc.start()
        try:
            read = sum(len(block) for block in iter(lambda: f.read(2**20), b""))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert read == len(text)
    assert peak < 8 * 2**20  # the whole text at once before: 8 MiB of compressed input per step


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".zst", zstd_two_frames)])
def test_truncated_compressed_file_keeps_documents_before_the_failure(mem, suffix, compress):
    blob = compress(PAYLOAD)
    url = mem("a.txt" + suffix, blob[: len(blob) * 3 // 4])
    records = list(read_documents([url], TEXT))
    docs, error = records[:-1], records[-1]
    assert len(docs) > 100 and [d.text for d in docs] == LINES[: len(docs)]
    assert isinstance(error, ErrorRecord) and error.stage == "read"
    assert error.line == len(docs) + 1
    assert error.reason.startswith("cannot read file: ")


@pytest.mark.parametrize("suffix, compress", [
    (".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress), (".XZ", lzma.compress),
    (".lzma", lambda data: lzma.compress(data, format=lzma.FORMAT_ALONE)), (".zst", zstd_two_frames),
])
def test_bytes_after_the_last_stream_that_start_no_other_are_an_error(mem, suffix, compress):
    first, second = PAYLOAD[:1000], PAYLOAD[1000:]
    n_first = first.count(b"\n")
    # a damaged second member (its header overwritten), and a text appended to a compressed file
    for tail in (b"XXXX" + compress(second)[4:], second):
        records = list(read_documents([mem("a.txt" + suffix, compress(first) + tail)], TEXT))
        assert [d.text for d in records[:-1]] == LINES[:n_first]
        assert isinstance(records[-1], ErrorRecord) and records[-1].line == n_first + 1
        assert records[-1].reason.startswith("cannot read file: ")
    # NUL padding after a stream is skipped (xz's stream padding; gzip and bzip2 skip it too)
    if suffix != ".zst":
        url = mem("b.txt" + suffix, compress(first) + bytes(8) + compress(second) + bytes(4))
        assert [d.text for d in read_documents([url], TEXT)] == LINES


@pytest.mark.parametrize("name", ["a.txt.gz", "a.txt.zst", "a.txt.xz"])
def test_corrupt_compressed_file_is_one_error(mem, name):
    url = mem(name, b"this is not compressed data at all\n")
    (error,) = read_documents([url], TEXT)
    assert error.source == url and error.line is None and error.reason.startswith("cannot read file: ")


@pytest.mark.parametrize("name, compression", [("a.txt.gz", "gzip"), ("a.txt.zst", "zstd"), ("a.txt.bz2", "bz2"),
                                               ("a.txt.xz", "xz")])
def test_an_empty_compressed_file_is_an_error_not_an_empty_text(mem, name, compression):
    # gzip's and zstd's readers gave no line and no error for 0 bytes, as for an empty text
    url = mem(name, b"")
    (error,) = read_documents([url], TEXT)
    assert error.source == url and error.line is None
    assert error.reason == (f"cannot read file: EOFError: an empty file is not a valid {compression} file "
                            "(compressing nothing still writes a header): cut short?")


def test_a_damaged_gzip_names_zlibs_error_by_its_module(mem, tmp_path, capsys):
    # zlib's exception is named 'error': the record said "cannot read file: error: Error -3 while ..."
    from elmo_pipeline.cli.main import main

    data = damaged_gzip(b"Compressed line one.\nCompressed line two.\n" * 50)
    *_, error = read_documents([mem("a.txt.gz", data)], TEXT)  # the lines before the damage first
    assert error.reason.startswith("cannot read file: zlib.error: Error -3 while decompressing data: "), error
    path = tmp_path / "a.txt.gz"
    path.write_bytes(data)
    assert main(["embed-file", str(path), str(tmp_path / "o.h5"), "--quiet"]) == 2
    assert f"cannot read {path}: {error.reason.removeprefix('cannot read file: ')}\n" in capsys.readouterr().err


def test_vanished_file_is_an_error(mem):
    url = mem("a.txt", b"x\n")
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"))
    (error,) = read_documents([url], TEXT)
    assert error.line is None and "FileNotFoundError" in error.reason


# --- Parquet -----------------------------------------------------------------------------------


def parquet_bytes(table: pa.Table, row_group_size: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_size)
    return sink.getvalue()


def test_parquet_rows_over_row_groups(mem):
    when = datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc)
    table = pa.table({
        "key": pa.array([10, 11, 12, None, 14], pa.int64()),
        "body": ["Zero.", "一", None, "三", "four"],
        "at": pa.array([when, None, when, when, when], pa.timestamp("us", tz="UTC")),
    })
    url = mem("a.parquet", parquet_bytes(table, row_group_size=2))
    assert pq.ParquetFile(io.BytesIO(parquet_bytes(table, 2))).num_row_groups == 3
    stats = ReadStats()
    records = list(read_documents([url], ReadOptions("parquet", "line", "body", "key", "at"), stats))
    assert records == [
        Document("10", "Zero.", url, 1, "2024-05-01T12:30:00+00:00"),
        Document("11", "一", url, 2, None),
        ErrorRecord(url, 3, "text field 'body' is null, not a string", "read", "12"),  # its id was read
        ErrorRecord(url, 4, "id field 'key' is null, not a string or int", "read"),
        Document("14", "four", url, 5, "2024-05-01T12:30:00+00:00"),
    ]
    assert stats.bytes_read > 0
    default_ids = list(read_documents([url], ReadOptions("parquet", text_field="body")))
    assert default_ids[0].doc_id == f"{url}:1" and default_ids[-1].doc_id == f"{url}:5"


def test_a_large_parquet_row_group_is_read_a_batch_of_rows_at_a_time(mem):
    texts = [f"{i:06d} " + "word " * 200 for i in range(20_000)]  # 20 MB of text in one row group
    url = mem("a.parquet", parquet_bytes(pa.table({"text": texts}), row_group_size=len(texts)))
    tracemalloc.start()
    try:
        read = [(d.line, d.text[:6]) for d in read_documents([url], ReadOptions("parquet"))]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read == [(i + 1, f"{i:06d}") for i in range(len(texts))]
    assert peak < 8 * 2**20  # every row's Python string at once before


def test_parquet_missing_or_mistyped_column_is_a_file_error(mem):
    url = mem("a.parquet", parquet_bytes(pa.table({"body": ["x", "y"], "n": [1.5, 2.5]}), 10))
    (missing,) = read_documents([url], ReadOptions("parquet"))
    assert missing.line is None and missing.stage == "read"
    assert missing.reason == "Parquet file has no text column 'text' (columns: body, n)"
    (mistyped,) = read_documents([url], ReadOptions("parquet", text_field="body", id_field="n"))
    assert mistyped.line is None and mistyped.reason == "Parquet id column 'n' has type double"
    twice = pa.Table.from_arrays([pa.array(["a"]), pa.array(["x"]), pa.array(["y"])], names=["id", "text", "text"])
    url = mem("b.parquet", parquet_bytes(twice, 10))
    (doubled,) = read_documents([url], ReadOptions("parquet", id_field="id"))
    assert doubled.line is None
    assert doubled.reason == "Parquet file has 2 columns named 'text': which is the text is unknown"


def test_dictionary_encoded_columns_are_read_decoded(mem):
    # pandas categoricals and many writers store strings (and ids) dictionary-encoded
    table = pa.table({"id": pa.array([5, 7, 5]).dictionary_encode(),
                      "body": pa.array(["One.", "Two.", "One."]).dictionary_encode(),
                      "ts": pa.array(["2024-01-01", None, "2024-01-03"]).dictionary_encode()})
    url = mem("a.parquet", parquet_bytes(table, 2))
    assert pa.types.is_dictionary(pq.read_schema(io.BytesIO(parquet_bytes(table, 2))).field("body").type)
    records = list(read_documents([url], ReadOptions("parquet", text_field="body", id_field="id",
                                                     timestamp_field="ts")))
    assert records == [Document("5", "One.", url, 1, "2024-01-01"), Document("7", "Two.", url, 2),
                       Document("5", "One.", url, 3, "2024-01-03")]
    bad = pa.array([b"fine", b"bad \xff"], pa.binary()).view(pa.string()).dictionary_encode()
    bad_url = mem("b.parquet", parquet_bytes(pa.table({"text": bad}), 10))
    (doc, error) = read_documents([bad_url], ReadOptions("parquet"))
    assert doc.text == "fine" and error.reason == "column 'text': invalid UTF-8 at byte 4: invalid start byte"


def test_corrupt_parquet_is_a_file_error(mem):
    url = mem("a.parquet", b"PAR1 not really parquet")
    (error,) = read_documents([url], ReadOptions("parquet"))
    assert error.line is None and error.reason.startswith("cannot read file: ")


def test_jsonl_records_parted_by_a_lone_cr_are_named_as_such(mem):
    # a file of records ended by CR alone is one line: its one record said "Extra data at column 18" alone
    url = mem("a.jsonl", b'{"text": "One."}\r{"text": "Two."}\r{"text": "Three."}\r')
    (error,) = read_documents([url], ReadOptions("jsonl"))
    assert (error.line, error.reason) == (1, "malformed JSON: Extra data at column 18 (a lone CR before it: records "
                                             "parted by CR alone? only \\n ends a line)")
    two_on_a_line = mem("b.jsonl", b'{"text": "One."} {"text": "Two."}\r\n')  # a CRLF end is no lone CR
    (error,) = read_documents([two_on_a_line], ReadOptions("jsonl"))
    assert error.reason == "malformed JSON: Extra data at column 18"
    # a CR inside the first record, the two parted by a space: the records are not parted by CR
    cr_inside = mem("c.jsonl", b'{"text":\r"One."} {"text": "Two."}\n')
    (error,) = read_documents([cr_inside], ReadOptions("jsonl"))
    assert error.reason == "malformed JSON: Extra data at column 18"


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-32-be", "UTF-32")])
def test_a_utf16_or_utf32_file_is_named_as_one_by_its_byte_order_mark(tmp_path, capsys, encoding, name):
    # what Notepad saves as "Unicode" was "invalid UTF-8 at byte 0: invalid start byte" (UTF-32BE's
    # two NULs first: "at byte 2"), where the mark says what the file is
    from elmo_pipeline.cli.main import main

    path = tmp_path / "in.txt"
    path.write_bytes(("\ufeff" if encoding.endswith("be") else "").encode(encoding) + "Hello.\n".encode(encoding))
    said = f"a {name} byte-order mark (the file is {name}: convert it to UTF-8)"
    (first, *_) = read_documents([str(path)], TEXT)
    assert first.line == 1 and first.reason.endswith(f": {said}") and first.reason.startswith("invalid UTF-8 at byte ")
    (whole,) = read_documents([str(path)], ReadOptions(doc_per="file"))
    assert whole.reason == first.reason
    assert main(["embed-file", str(path), str(tmp_path / "o.h5"), "--quiet"]) == 2
    assert capsys.readouterr().err.endswith(f"{path}, line 1: {first.reason}\n")
    assert not (tmp_path / "o.h5").exists()


def test_a_damaged_parquet_row_group_costs_its_own_rows_only(mem):
    # Batches of 1024 rows crossed row groups: a damaged page in the second of three groups of 1000
    # lost all 3000 rows, as one record of line None, where 2000 could be read
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": [f"Row {i}." for i in range(1, 3001)]}), sink, row_group_size=1000,
                   use_dictionary=False, compression="NONE")
    data = bytearray(sink.getvalue())
    start = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(1).column(0).data_page_offset
    data[start:start + 16] = b"\xab" * 16  # the page header of group 1
    url = mem("a.parquet", bytes(data))
    records = list(read_documents([url], ReadOptions("parquet")))
    documents = [r for r in records if isinstance(r, Document)]
    assert [(d.line, d.text) for d in documents] == [(i, f"Row {i}.") for i in [*range(1, 1001), *range(2001, 3001)]]
    (error,) = [r for r in records if isinstance(r, ErrorRecord)]
    assert error.line == 1001 and records.index(error) == 1000
    assert error.reason.startswith("cannot read file: row group 1 (rows 1001-2000 not read): OSError: ")
    assert "\n" not in error.reason


@pytest.mark.parametrize("command", ["embed-file", "probe", "similarity"])
def test_a_glob_given_where_one_file_is_read_is_one_line_naming_it(tmp_path, capsys, command):
    # embed-file's input, probe's --train and similarity's --file read one file: a glob there
    # (matching a.txt) was fsspec's four lines of advice on expand=True, and probe's named neither
    # file nor option; wrapped again as a failed read it said "cannot read P: FileNotFoundError: P: ..."
    from elmo_pipeline.cli.main import main

    (tmp_path / "a.txt").write_text("w1 w2\n")
    pattern = str(tmp_path / "*.txt")
    argv = {"embed-file": ["embed-file", pattern, str(tmp_path / "o.h5"), "--quiet"],
            "probe": ["probe", "--train", pattern, "--dev", pattern, "--output", str(tmp_path / "out")],
            "similarity": ["similarity", "--word", "w1", "--file", pattern, "--pretokenized"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"elmo-pipeline {command}: error: {pattern}: no such file (one file is read, not a glob)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


@pytest.mark.parametrize("command", ["embed-file", "probe", "similarity"])
def test_a_missing_file_where_one_file_is_read_is_named_once(tmp_path, capsys, command):
    # it was "cannot read F: FileNotFoundError: [Errno 2] No such file or directory: 'F'"
    from elmo_pipeline.cli.main import main

    missing = str(tmp_path / "missing.txt")
    argv = {"embed-file": ["embed-file", missing, str(tmp_path / "o.h5"), "--quiet"],
            "probe": ["probe", "--train", missing, "--dev", missing, "--output", str(tmp_path / "out")],
            "similarity": ["similarity", "--word", "w1", "--file", missing, "--pretokenized"]}[command]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"elmo-pipeline {command}: error: {missing}: no such file\n"
    assert list(tmp_path.iterdir()) == []


def test_a_file_name_holding_a_newline_keeps_a_commands_error_on_one_line(tmp_path, capsys):
    # the name went into the message as it is: "error: .../in" on one line, "put.txt, line 2: ..." on the next
    from elmo_pipeline.cli.main import main

    named = tmp_path / "in\nput\x1b[2J.txt"  # and an ESC, which a terminal would act on (here: clear the screen)
    named.write_bytes(b"fine\nbad \xff byte\n")
    assert main(["embed-file", str(named), str(tmp_path / "o.h5"), "--quiet"]) == 2
    shown = str(tmp_path) + "/in\\nput\\x1b[2J.txt"
    assert capsys.readouterr().err == (f"elmo-pipeline embed-file: error: {shown}, line 2: invalid UTF-8 at byte 4: "
                                       "invalid start byte\n")


def test_an_at_sign_in_a_member_name_or_a_non_credential_url_stays_in_the_ids(tmp_path):
    """The user part an input URL's ids leave out was taken from every URL of the chain: the zip members
    a@x.txt and b@x.txt were both read as zip://x.txt, so their ids and the member x.txt's merged.
    Only a protocol whose URLs carry a user loses it, and nothing else of the URL changes."""
    names = ("a@x.txt", "b@x.txt", "x.txt")
    with zipfile.ZipFile(tmp_path / "f.zip", "w") as archive:
        for name in names:
            archive.writestr(name, f"{name} one\n{name} two\n")
    members = expand_patterns([f"zip://*::{tmp_path / 'f.zip'}"])
    assert members == [f"zip://{name}::{tmp_path / 'f.zip'}" for name in names]
    got = [(d.doc_id, d.source, d.text) for url in members for d in read_work_item(WorkItem(url), TEXT)]
    assert got == [(f"{url}:{n}", url, f"{name} {word}")
                   for name, url in zip(names, members) for n, word in ((1, "one"), (2, "two"))]
    for kept in ("abfs://container@account.dfs.core.windows.net/a.txt", "oci://bucket@namespace/a.txt",
                 "github://org:repo@sha/a.txt", "memory://a@b/c.txt", "tar://@types/a.txt::/d/f.tar"):
        assert without_userinfo(kept) == kept
    assert without_userinfo("zip://a@b.txt::HTTP://u:p@h/f.zip?") == "zip://a@b.txt::HTTP://h/f.zip?"
    assert without_userinfo("sftp://user@host/a@b.txt#c@d") == "sftp://host/a@b.txt#c@d"
    # HDFS connects as the URL's user: one without a password is kept (features.py lost it: Feast read as another)
    for kept in ("hdfs://alice@nn:8020/f/a.txt", "webhdfs://alice@nn:9870/f/a.txt", "arrow_hdfs://alice@nn/a.txt"):
        assert without_userinfo(kept) == kept
    assert without_userinfo("webhdfs://alice:pw@nn:9870/f/a.txt") == "webhdfs://nn:9870/f/a.txt"


def test_a_chain_over_a_missing_archive_is_named_in_one_line_by_each_command(tmp_path, capsys):
    """A chain's file system opens its archive when it is made: embed-file (its output check),
    evaluate (is it a prepared folder?), pretrain --data and feast-repo --features said only
    "[Errno 2] No such file or directory: '.../missing.zip'", naming neither the input nor the chain;
    evaluate now lists its text input as extract does, which names both."""
    from elmo_pipeline.cli.main import main

    chain = f"zip://x.txt::{tmp_path / 'missing.zip'}"
    commands = {
        "embed-file": ["embed-file", chain, str(tmp_path / "out.h5")],
        "evaluate": ["evaluate", "--data", chain],
        "pretrain": ["pretrain", "--data", chain, "--output", str(tmp_path / "run")],
        "feast-repo": ["feast-repo", "--features", chain, "--output", str(tmp_path / "repo")],
    }
    said = {}
    for name, command in commands.items():
        assert main(command) == 2, name
        said[name] = capsys.readouterr().err
    assert said == {
        "embed-file": f"elmo-pipeline embed-file: error: {chain}: no such file\n",
        "evaluate": f"elmo-pipeline evaluate: error: cannot list input pattern {chain!r}: [Errno 2] No such file or "
                    f"directory: '{tmp_path / 'missing.zip'}'\n",  # as extract and prepare name it
        "pretrain": f"elmo-pipeline pretrain: error: {chain} does not exist: training reads the folder that "
                    "`elmo-pipeline prepare --input TEXT --output FOLDER` writes; run that first and pass its FOLDER\n",
        "feast-repo": f"elmo-pipeline feast-repo: error: {chain}: no such file or folder\n",
    }
