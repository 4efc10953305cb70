"""A document past `--max-document-mb` (a line of text or JSONL, a file read whole, a Parquet text
value) is one error record naming its line and the bound, never held whole, and reading goes on.
Before the bound, a .gz of 3 MB that expands to one line of 3 GiB was read by one `readline`:
`MemoryError` under a memory limit, the kernel's OOM killer without one, and no record."""

from __future__ import annotations

import gzip
import json
import math
import re
import tracemalloc
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.cli.main import main
from elmo_pipeline.cli.training import main as training_main
from elmo_pipeline.corpus.byte_ranges import WorkItem, number_ranges, plan_work, range_newlines
from elmo_pipeline.corpus.input_files import InputError
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import _SKIP_BYTES, ReadStats, read_documents, read_text_lines, read_work_item
from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.downstream.conll import ConllError, read_labelled
from elmo_pipeline.pipelines.extract import run
from elmo_pipeline.training.evaluate import check_sentences
from elmo_pipeline.training.prepare import whitespace_text_sentences
from support import HttpServer, parse_extract_args

BOUND = 4096  # bytes: max_document_mb of 4 KiB
MB = BOUND / 2**20
REASON = "line of more than 0.00390625 MiB (--max-document-mb 0.00390625): not read"


def _row(record: Document | ErrorRecord) -> tuple:
    """A document as (line, text), an error record as (line, reason, doc_id)."""
    if isinstance(record, Document):
        return record.line, record.text
    return record.line, record.reason, record.doc_id


def _records(url: str, options: ReadOptions) -> tuple[list[tuple], int]:
    stats = ReadStats()
    got = [_row(r) for r in read_documents([url], options, stats)]
    return got, stats.bytes_read


def _ranges(url: str, options: ReadOptions, split_bytes: int) -> list[WorkItem]:
    """The work items of `url` as the Beam transform plans and numbers them."""
    return number_ranges([(item, range_newlines(item)) for item in plan_work(url, options, split_bytes)])


def _lines_around_a_long_one(fmt: str, url: str) -> tuple[bytes, list[tuple]]:
    """The bytes of the file `url` and the records expected: a line of 50 times the bound between
    short ones, a line of exactly the bound (ended by CRLF) read, one a byte past it not."""
    if fmt == "text":
        texts = ["Before the long line.", "x" * 50 * BOUND, "y" * BOUND, "z" * (BOUND + 1), "After it."]
        lines = [t.encode() for t in texts]
        ids = [f"{url}:{n}" for n in range(1, 6)]
    else:
        texts = ["Before the long line.", "x" * 50 * BOUND, "y" * (BOUND - 40), "z" * BOUND, "After it."]
        lines = [json.dumps({"id": f"d{n}", "text": t}).encode() for n, t in enumerate(texts, 1)]
        ids = [None] * 5  # the id field of a record not read is not known
    data = lines[0] + b"\n" + lines[1] + b"\n" + lines[2] + b"\r\n" + lines[3] + b"\n" + lines[4]  # no final newline
    assert len(lines[2]) <= BOUND < len(lines[3])
    expected = [(1, texts[0]), (2, REASON, ids[1]), (3, texts[2]), (4, REASON, ids[3]), (5, texts[4])]
    return data, expected


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
@pytest.mark.parametrize("compressed", [False, True])
def test_a_line_past_the_bound_is_one_error_record_and_the_lines_around_it_are_read(tmp_path, fmt, compressed):
    path = tmp_path / (f"in.{fmt}" + (".gz" if compressed else ""))
    data, expected = _lines_around_a_long_one(fmt, str(path))
    path.write_bytes(gzip.compress(data) if compressed else data)
    options = ReadOptions(fmt, id_field="id" if fmt == "jsonl" else None, max_document_mb=MB)
    got, bytes_read = _records(str(path), options)
    assert got == expected
    assert bytes_read == len(data)  # the skipped lines' bytes counted as read
    # without the bound (the default's 64 MiB) every line is a document
    assert [r.line for r in read_documents([str(path)], ReadOptions(fmt)) if isinstance(r, Document)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""])
@pytest.mark.parametrize("extra", [-1, 0, 1, 2])
def test_a_line_is_measured_without_its_line_end_at_every_size_around_the_bound(tmp_path, end, extra):
    """A line of the bound's bytes is read whether LF, CRLF or the file's end ends it, one byte
    more is not: most lines are let through on their length alone, line end included."""
    line = "x" * (BOUND + extra)
    data = b"a\n" + line.encode() + end + (b"b\n" if end else b"")
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    got, bytes_read = _records(str(path), ReadOptions(max_document_mb=MB))
    expected = (2, line) if extra <= 0 else (2, REASON, f"{path}:2")
    assert got == [(1, "a"), expected] + ([(3, "b")] if end else [])
    assert bytes_read == len(data)


@pytest.mark.parametrize("split", [1000, 3 * BOUND, 25 * BOUND, 10**6])
def test_a_range_cut_inside_the_long_line_leaves_it_to_the_range_it_starts_in(tmp_path, split):
    path = tmp_path / "in.txt"
    data, expected = _lines_around_a_long_one("text", str(path))
    path.write_bytes(data)
    options = ReadOptions(max_document_mb=MB)
    items = _ranges(str(path), options, split)
    assert len(items) == math.ceil(len(data) / split)
    got, bytes_read = [], 0
    for item in items:
        stats = ReadStats()
        got += [_row(r) for r in read_work_item(item, options, stats)]
        bytes_read += stats.bytes_read
    assert sorted(got) == expected  # each line once, the long one's error too
    assert bytes_read == len(data)


@pytest.mark.parametrize("name", ["in.txt", "in.txt.gz"])
def test_a_remote_file_has_its_long_line_skipped_as_a_local_one(tmp_path, name):
    (tmp_path / "www").mkdir()
    server = HttpServer(tmp_path / "www")
    try:
        url = f"{server.url}/ok/{name}"
        data, expected = _lines_around_a_long_one("text", url)
        (tmp_path / "www" / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        options = ReadOptions(max_document_mb=MB)
        assert _records(url, options) == (expected, len(data))
        items = _ranges(url, options, 3 * BOUND)
        assert len(items) == (1 if name.endswith(".gz") else math.ceil(len(data) / (3 * BOUND)))
        assert sorted(_row(r) for item in items for r in read_work_item(item, options)) == expected
    finally:
        server.close()


@pytest.mark.parametrize("compressed", [False, True])
def test_the_reader_holds_the_bound_and_a_chunk_not_the_long_line(tmp_path, compressed):
    bound = 256 * 2**10
    data = b"short\n" + b"x" * (50 * bound) + b"\nafter\n"
    path = tmp_path / ("long.txt.gz" if compressed else "long.txt")
    path.write_bytes(gzip.compress(data, compresslevel=1) if compressed else data)
    options = ReadOptions(max_document_mb=bound / 2**20)
    list(read_documents([str(path)], ReadOptions(max_document_mb=1.0)))  # imports and caches outside the count
    tracemalloc.start()
    try:
        got = [(r.line, type(r).__name__) for r in read_documents([str(path)], options)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [(1, "Document"), (2, "ErrorRecord"), (3, "Document")]
    # the line's first bound (and the two bytes of a line end), a chunk of the rest, and the
    # buffers of the file and of gzip (128 KiB) and readline's own: 12.5 MiB was held before
    assert peak < bound + _SKIP_BYTES + 320 * 2**10, peak


def test_a_file_past_the_bound_read_whole_is_one_error_record(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * BOUND)
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbf" + b"y" * (BOUND + 1))  # the BOM is counted
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(b"z " * BOUND))
    options = ReadOptions(doc_per="file", max_document_mb=MB)
    got = [_records(str(tmp_path / name), options)[0] for name in ("a.txt", "b.txt", "c.txt.gz")]
    reason = REASON.replace("line", "file", 1)
    assert got == [[(1, "x" * BOUND)], [(1, reason, f"{tmp_path / 'b.txt'}:1")],
                   [(1, reason, f"{tmp_path / 'c.txt.gz'}:1")]]


def test_a_parquet_text_value_past_the_bound_is_an_error_record_for_its_row(tmp_path):
    texts = ["Row one.", "é" * (BOUND // 2), "é" * (BOUND // 2) + "x", "x" * (50 * BOUND), None, "Row six."]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": texts, "id": [f"r{n}" for n in range(1, 7)]}), path, row_group_size=4)
    options = ReadOptions("parquet", text_field="body", id_field="id", max_document_mb=MB)
    got, _ = _records(str(path), options)
    reason = "column 'body': " + REASON.replace("line", "text", 1)
    assert got == [(1, "Row one."), (2, texts[1]), (3, reason, "r3"), (4, reason, "r4"),
                   (5, "text field 'body' is null, not a string", "r5"), (6, "Row six.")]


@pytest.mark.parametrize(("value", "shown"), [(0.0009765625, "0.0009765625"), (123.4567891, "123.4567891"),
                                               (1048576, "1048576"), (64.0, "64"), (1e-9, "1e-09")])
def test_the_error_record_names_the_bound_as_given(tmp_path, value, shown):
    options = ReadOptions(max_document_mb=value)
    reason = f"line of more than {shown} MiB (--max-document-mb {shown}): not read"
    assert options.too_large("line") == reason
    if value < 1:  # a line one byte past it, read
        path = tmp_path / "in.txt"
        path.write_bytes(b"s\n" + b"x" * (options.max_document_bytes + 1))
        assert _records(str(path), options)[0] == [(1, "s"), (2, reason, f"{path}:2")]


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, -math.inf, 2.0**21,
                                   pytest.param(10**400, id="10**400")])
def test_a_bound_that_is_no_size_is_refused(value):
    with pytest.raises(InputError, match="max_document_mb must be a finite number of MiB above 0"):
        ReadOptions(max_document_mb=value)


@pytest.mark.parametrize("value", ["64", True, None])
def test_a_bound_that_is_no_number_is_refused(value):
    with pytest.raises(TypeError, match="max_document_mb must be a number of MiB"):
        ReadOptions(max_document_mb=value)


@pytest.mark.parametrize("command", ["extract", "prepare"])
@pytest.mark.parametrize("value", ["0", "-3", "nan", "lots"])
def test_both_commands_refuse_a_flag_that_is_no_size_naming_it(command, value, capsys):
    from elmo_pipeline.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main([command, "--input", "x.txt", "--output", "out", "--max-document-mb", value])
    assert stop.value.code == 2
    assert "argument --max-document-mb:" in capsys.readouterr().err


def _extract(model_arg: str, inputs: list[Path], output: Path, *extra: str) -> dict:
    argv = [a for url in inputs for a in ("--input", str(url))]
    argv += ["--output", str(output), "--model", model_arg, "--dtype", "float32", *extra]
    return run(*parse_extract_args(argv))


def test_extract_writes_one_record_for_a_long_line_and_its_counts_reconcile(tmp_path, model_arg):
    data, _ = _lines_around_a_long_one("text", "")
    (tmp_path / "in").mkdir()
    plain, packed = tmp_path / "in" / "a.txt", tmp_path / "in" / "b.txt.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    out = tmp_path / "out"
    # ranges of 16 KiB: the long line of 200 KiB crosses a dozen
    summary = _extract(model_arg, [tmp_path / "in" / "*"], out, "--max-document-mb", str(MB), "--split-mb",
                       str(16 / 1024))
    errors = sorted((Path(e["source"]).name, e["line"], e["reason"], e["stage"])
                    for f in out.glob("errors-*.jsonl") for e in map(json.loads, f.read_text().splitlines()))
    assert errors == [(name, line, REASON, "read") for name in ("a.txt", "b.txt.gz") for line in (2, 4)]
    assert (summary["documents_read"], summary["read_errors"], summary["documents_tokenized"]) == (10, 4, 6)
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    table = pa.concat_tables(pq.read_table(f, columns=["doc_id", "token"]) for f in out.glob("tokens-*.parquet"))
    docs = {(Path(d.rsplit(":", 1)[0]).name, int(d.rsplit(":", 1)[1])) for d in table.column("doc_id").to_pylist()}
    assert docs == {(name, line) for name in ("a.txt", "b.txt.gz") for line in (1, 3, 5)}
    assert table.num_rows == summary["token_rows_written"] == 2 * (5 + 1 + 3)


def test_prepare_takes_the_bound_and_counts_the_long_line_as_an_error(tmp_path, capsys):
    from elmo_pipeline.cli.training import main

    data, _ = _lines_around_a_long_one("text", "")
    (tmp_path / "a.txt").write_bytes(data)
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
                 "--tokenizer", "whitespace", "--max-document-mb", str(MB)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["errors"], summary["errors_reconcile"], summary["sentences"], summary["tokens"]) == (2, True, 3, 7)
    errors = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert sorted((e["line"], e["reason"]) for e in errors) == [(2, REASON), (4, REASON)]


# --- the commands that take a file of lines whole: embed-file, similarity, probe, evaluate, pretrain --valid


def _peak_reading(read: Callable[[], object]) -> int:
    read()  # imports and caches outside the count
    tracemalloc.start()
    try:
        read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_readers_of_a_file_of_lines_read_past_a_long_line_without_holding_it(tmp_path):
    """read_text_lines (embed-file, similarity, probe) and the held-out reader (evaluate, pretrain
    --valid) held a line whole: 105.8 MB traced reading one of 50 MiB in a .gz of 76 KB."""
    path = tmp_path / "long.txt.gz"
    path.write_bytes(gzip.compress(b"short\n" + b"x" * (50 * BOUND) + b"\nafter\n", compresslevel=1))
    url, reason = str(path), REASON
    got = [(n, text if isinstance(text, str) else text.reason) for n, text in read_text_lines(url, MB)]
    assert got == [(1, "short"), (2, reason), (3, "after")]
    with pytest.raises(ValueError, match="^" + re.escape(f"{url}, line 2: {reason}") + "$"):
        list(whitespace_text_sentences(url, max_document_mb=MB))
    for read in (lambda: list(read_text_lines(url, MB)),
                 lambda: pytest.raises(ValueError, lambda: list(whitespace_text_sentences(url, max_document_mb=MB)))):
        peak = _peak_reading(read)
        assert peak < BOUND + _SKIP_BYTES + 320 * 2**10, peak  # 50 x BOUND held before


def test_embed_file_and_evaluate_refuse_a_line_past_their_max_document_mb(tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_bytes(b"x" * (BOUND + 1) + b"\nshort line\n")
    capsys.readouterr()
    said = f"{path}, line 1: {REASON}"
    assert main(["embed-file", str(path), str(tmp_path / "out.hdf5"), "--max-document-mb", str(MB), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(said)
    assert not (tmp_path / "out.hdf5").exists()
    assert training_main(["evaluate", "--data", str(path), "--max-document-mb", str(MB)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(said)
    # a line of exactly the bound is read: only the line past it is refused
    path.write_bytes(b"y " * (BOUND // 2) + b"\n")
    assert training_main(["evaluate", "--data", str(path), "--max-document-mb", str(MB), "--threads", "1"]) == 0


def test_similarity_probe_and_pretrain_valid_bound_a_line_at_extracts_default(tmp_path, capsys):
    """They have no --max-document-mb: the default bound, named without a flag."""
    path = tmp_path / "long.txt.gz"
    path.write_bytes(gzip.compress(b"one two\n" + b"x" * (64 * 2**20 + 1) + b"\nthree\n", compresslevel=1))
    url, reason = str(path), "line of more than 64 MiB: not read"
    capsys.readouterr()
    assert main(["similarity", "--word", "one", "--file", url]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{url}, line 2: {reason}")
    with pytest.raises(ConllError, match="^" + re.escape(f"{url}:2: {reason}") + "$"):
        list(read_labelled(url, "conll2003"))
    with pytest.raises(ValueError, match="^" + re.escape(f"{url}, line 2: {reason}") + "$"):
        check_sentences(url, "whitespace", "--valid", read_all=True)  # pretrain's check before training
