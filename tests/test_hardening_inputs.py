"""Bad input through `extract`: every record gives correct rows or lands in errors-*.jsonl with
a reason, the counts reconcile, and no record can hang or kill the run.

What is covered elsewhere and not repeated here: the reader's handling of BOM, CRLF, lone CR,
empty and whitespace-only lines, invalid UTF-8, NUL, JSONL field types, truncated and corrupt
compressed files, vanished files and Parquet schema problems (tests/corpus/test_inputs.py), a glob
matching nothing in ReadDocuments (tests/transforms/test_read_transform.py) and a Parquet file without
the named column end to end (tests/pipelines/test_extract_pipeline.py::test_each_input_format). Here the
same shapes go through the whole job, together with the ones only the later stages see.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import time
import uuid
import zipfile
from collections import defaultdict
from pathlib import Path

import apache_beam as beam
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to
from spacy.language import Language

import elmo_pipeline.transforms.tokenize as tokenize_transform
from elmo_pipeline.cli.main import main as cli_main
from elmo_pipeline.corpus.byte_ranges import WorkItem, plan_work
from elmo_pipeline.corpus.input_files import InputError
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import read_documents
from elmo_pipeline.pipelines.extract import run
from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.corpus.tokenization import (LONG_RUN_CHARS, build_nlp, sentences_from_docs, tokenize_documents,
                                              tokenizer_text)
from support import PrivateMemoryFileSystem, long_text, parse_extract_args

SMALL_MAX_LENGTH = 5000  # spaCy's max_length inside the job, so that "too long" documents stay cheap to embed


# -- helpers ------------------------------------------------------------------------------------

def extract(model_arg: str, inputs: list, output: Path, *extra: str) -> dict:
    argv = [a for url in inputs for a in ("--input", str(url))]
    argv += ["--output", str(output), "--model", model_arg, "--dtype", "float32", *extra]
    return run(*parse_extract_args(argv))


def rows_by_doc(output: Path) -> dict[str, list[dict]]:
    """Token rows grouped by document, in (sentence, window, token) order, vectors left out."""
    files = sorted(output.glob("tokens-*.parquet"))
    table = pa.concat_tables(pq.read_table(f, columns=["doc_id", "sentence_index", "window_index", "token_index",
                                                       "token", "char_start", "char_end", "layer_2"])
                             for f in files)
    assert table.column("layer_2").null_count == 0
    out = defaultdict(list)
    for row in table.drop_columns(["layer_2"]).to_pylist():
        out[row["doc_id"]].append(row)
    for rows in out.values():
        rows.sort(key=lambda r: (r["sentence_index"], r["window_index"], r["token_index"]))
    return dict(out)


def read_errors(output: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(output.glob("errors-*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines()]


def check_rows_cover_text(text: str, rows: list[dict]) -> None:
    """Offsets point at the tokens, and the tokens are the text but for its whitespace (and the
    invisible separators the tokenizer reads as spaces), in order."""
    assert [text[r["char_start"]:r["char_end"]] for r in rows] == [r["token"] for r in rows]
    assert "".join(r["token"] for r in rows) == "".join(tokenizer_text(text).split())
    assert [r["char_start"] for r in rows] == sorted(r["char_start"] for r in rows)


def reference_tokens(text: str) -> list[str]:
    """The tokens of the whole text in one spaCy call (no pieces)."""
    nlp = build_nlp("en")
    nlp.max_length = len(text) + 1
    return [t for s in sentences_from_docs(nlp, [Document("ref", text, "ref", 1)]) for t in s.tokens]


@pytest.fixture
def small_max_length(monkeypatch):
    """The job's tokenizer gets spaCy's max_length = SMALL_MAX_LENGTH (the FnApiRunner runs in this process)."""
    def build(lang="en", model=None, segmenter=None):
        nlp = build_nlp(lang, model, segmenter)
        nlp.max_length = SMALL_MAX_LENGTH
        return nlp

    monkeypatch.setattr(tokenize_transform, "build_nlp", build)


# -- tokenization of hostile shapes -------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [7, 256])
def test_over_long_document_gives_the_sentences_of_the_whole_text(max_tokens):
    text = long_text(40_000)
    nlp = build_nlp("en")
    nlp.max_length = len(text) + 1
    whole = list(sentences_from_docs(nlp, [Document("d", text, "s", 1)], max_tokens))

    def key(s):
        return s.sentence_index, s.window_index, s.tokens, s.char_starts.tolist(), s.char_ends.tolist()

    for limit in (40, 333, 5000):  # pieces cut inside sentences, at sentence ends, everywhere
        nlp.max_length = limit
        (result,) = tokenize_documents(nlp, [Document("d", text, "s", 1)], max_tokens)
        assert not isinstance(result, list)  # lazy
        pieces = list(result)
        assert [key(s) for s in pieces] == [key(s) for s in whole], limit
    assert any(s.window_index > 0 for s in whole)  # sentences longer than max_tokens run over pieces too


def test_over_long_document_is_tokenized_lazily_piece_by_piece():
    class Counting:
        """An nlp that counts its calls; pieces of at most 1000 characters."""

        def __init__(self):
            self.nlp, self.calls, self.max_length = build_nlp("en"), 0, 1000

        def make_doc(self, text):
            assert len(text) <= self.max_length
            return self.nlp.make_doc(text)

        def __getattr__(self, name):  # the tokenizer: spaCy's
            return getattr(self.nlp, name)

        def __call__(self, doc):  # the tokens of one piece, from make_doc
            self.calls += 1
            return self.nlp(doc)

    nlp = Counting()
    text = long_text(50_000, seed=1)
    (result,) = tokenize_documents(nlp, [Document("d", text, "s", 1)])
    first = next(result)
    assert nlp.calls == 1 and first.sentence_index == 0  # the rest is not tokenized yet
    rest = list(result)
    assert nlp.calls >= 50
    tokens = [t for s in [first, *rest] for t in s.tokens]
    assert tokens == reference_tokens(text)


def test_run_without_whitespace_longer_than_max_length_is_cut_at_the_limit():
    nlp = build_nlp("en")
    nlp.max_length = 1500
    text = "start " + "y" * 4000 + " end."
    (result,) = tokenize_documents(nlp, [Document("d", text, "s", 1)])
    sentences = list(result)
    tokens = [t for s in sentences for t in s.tokens]
    # the only inexact case: a piece ends after "start ", then the run is cut every 1500 characters
    assert tokens == ["start", "y" * 1500, "y" * 1500, "y" * 1000, "end", "."]
    starts = [int(a) for s in sentences for a in s.char_starts]
    assert [text[a:a + len(t)] for a, t in zip(starts, tokens)] == tokens


@pytest.mark.parametrize("run", ["(" * 100_000 + "a", "a" + ")" * 100_000, "'" * 100_000, "$" * 100_000,
                                 "x" * 100_000, "🙂" * 100_000, "a-" * 50_000],
                         ids=["prefixes", "suffixes", "quotes", "symbols", "letters", "emoji", "infixes"])
def test_a_100000_character_word_is_one_token_in_linear_time(run):
    # Unguarded, spaCy strips affixes one at a time, copying the rest: 8,000 "(" took ~15 s here,
    # 100,000 would take ~40 minutes.
    nlp = build_nlp("en")
    started = time.perf_counter()
    (sentences,) = tokenize_documents(nlp, [Document("d", f"Before {run} after.", "s", 1)])
    assert time.perf_counter() - started < 5
    tokens = [t for s in sentences for t in s.tokens]
    assert tokens == ["Before", run, "after", "."]


def test_runs_shorter_than_the_guard_keep_spacy_rules():
    nlp = build_nlp("en")
    run = "(" * (LONG_RUN_CHARS - 2) + "a"
    (sentences,) = tokenize_documents(nlp, [Document("d", run, "s", 1)])
    assert [t for s in sentences for t in s.tokens] == ["("] * (LONG_RUN_CHARS - 2) + ["a"]


@Language.component("fail_on_piece_with_boom")
def _fail_on_boom(parsed):
    if "boom" in parsed.text:
        raise RuntimeError("boom seen")
    return parsed


def test_a_failing_piece_keeps_the_sentences_before_and_counts_the_document_as_an_error(monkeypatch):
    def build(lang="en", model=None, segmenter=None):
        nlp = build_nlp(lang, model, segmenter)
        nlp.add_pipe("fail_on_piece_with_boom")
        nlp.max_length = 200
        return nlp

    text = "First part is fine. " * 20 + "Then boom here. " + "Never reached. " * 20
    docs = [Document("long", text, "s", 1), Document("short", "A short one.", "s", 2)]
    (alone, _) = tokenize_documents(build(), docs)
    *before, error = list(alone)
    assert before and all(s.tokens == ("First", "part", "is", "fine", ".") for s in before)
    assert error.reason.startswith("spaCy failed on characters ") and f"of {len(text)} (the sentences" in error.reason

    monkeypatch.setattr(tokenize_transform, "build_nlp", build)
    p = test_pipeline.TestPipeline(runner="FnApiRunner")
    out = p | beam.Create(docs) | tokenize_transform.TokenizeWithSpacy()
    assert_that(out["sentences"] | "Keys" >> beam.Map(lambda s: (s.doc_id, s.sentence_index)),
                equal_to([("long", i) for i in range(len(before))] + [("short", 0)]), label="sentences")
    assert_that(out["errors"] | beam.Map(lambda e: (e.doc_id, e.stage, e.reason)),
                equal_to([("long", "tokenize", error.reason)]), label="errors")
    result = p.run()
    result.wait_until_finish()
    counters = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]
                if c.key.metric.namespace == "elmo_pipeline"}
    # 2 documents in: one tokenized, one error (its first sentences are out, and counted)
    assert counters["documents_tokenized"] == 1 and counters["tokenize_errors"] == 1
    assert counters["sentences"] == len(before) + 1


# -- values only the reader can reject ----------------------------------------------------------
def test_lone_surrogates_from_json_escapes_are_errors_not_a_crash_at_write_time(tmp_path):
    # json.loads turns "\ud800" into a lone surrogate, which no UTF-8 file can hold: before the
    # check, the job died when Parquet (or the error file) tried to encode it.
    lines = [r'{"id": "a", "text": "pair \ud83d\ude42 is fine"}', r'{"id": "b", "text": "lone \ud800 here"}',
             r'{"id": "c\udfff", "text": "fine text, bad id"}', r'{"id": "d", "text": "ok"}']
    src = tmp_path / "a.jsonl"
    src.write_text("\n".join(lines), encoding="utf-8")
    records = list(read_documents([str(src)], ReadOptions("jsonl", id_field="id")))
    assert [r.doc_id for r in records if isinstance(r, Document)] == ["a", "d"]
    assert records[0].text == "pair 🙂 is fine"
    reasons = {r.line: r.reason for r in records if isinstance(r, ErrorRecord)}
    assert reasons == {2: "text field 'text' holds a lone surrogate, which UTF-8 cannot encode",
                       3: "id field 'id' holds a lone surrogate, which UTF-8 cannot encode"}
    for r in records:  # everything that goes on can be written
        json.dumps(r._asdict(), ensure_ascii=False).encode("utf-8")


def test_parquet_strings_that_are_not_utf8_are_row_errors(tmp_path):
    # Parquet writers do not all validate UTF-8; pyarrow then raises on the whole column.
    text = pa.array([b"Good row.", b"bad \xff\xfe row", None, b"Also good."], pa.binary()).view(pa.string())
    ids = pa.array([b"r1", b"r2", b"r3", b"r\xc3"], pa.binary()).view(pa.string())
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": text, "id": ids}), path)
    records = list(read_documents([str(path)], ReadOptions("parquet", id_field="id")))
    assert records == [
        Document("r1", "Good row.", str(path), 1),
        ErrorRecord(str(path), 2, "column 'text': invalid UTF-8 at byte 4: invalid start byte", "read", "r2"),
        ErrorRecord(str(path), 3, "text field 'text' is null, not a string", "read", "r3"),
        ErrorRecord(str(path), 4, "column 'id': invalid UTF-8 at byte 1: unexpected end of data", "read"),
    ]


def test_parquet_times_python_cannot_hold_are_row_errors(tmp_path):
    # pyarrow converts a whole column at once; one timestamp past year 9999, one date past
    # datetime's range or an unknown time zone made the conversion, and the job, fail.
    path = tmp_path / "times.parquet"
    pq.write_table(pa.table({
        "text": ["First.", "Far future.", "Third."],
        "ts": pa.array([0, 10**15, 5], pa.timestamp("s")),
        "day": pa.array([0, 1, 10**9], pa.date32()),
    }), path)
    records = list(read_documents([str(path)], ReadOptions("parquet", timestamp_field="ts")))
    assert [type(r).__name__ for r in records] == ["Document", "ErrorRecord", "Document"]
    assert records[0].timestamp == "1970-01-01T00:00:00" and records[2].timestamp == "1970-01-01T00:00:05"
    assert records[1].line == 2 and records[1].reason.startswith("column 'ts': timestamp[ms] value cannot be converted")
    by_day = list(read_documents([str(path)], ReadOptions("parquet", timestamp_field="day")))
    assert [r.timestamp for r in by_day[:2]] == ["1970-01-01", "1970-01-02"]
    assert by_day[2].line == 3 and "OverflowError" in by_day[2].reason

    zoned = tmp_path / "zoned.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "ts": pa.array([0, 1], pa.timestamp("s", tz="Mars/Olympus"))}),
                   zoned)
    reasons = [r.reason for r in read_documents([str(zoned)], ReadOptions("parquet", timestamp_field="ts"))]
    assert len(reasons) == 2 and all("Mars/Olympus" in reason for reason in reasons)


def test_zip_inputs_hold_exactly_one_file_and_bad_archives_are_errors(tmp_path):
    def archive(name: str, members: dict[str, str]) -> str:
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as z:
            for member, text in members.items():
                z.writestr(member, text)
        return str(path)

    one = archive("one.txt.zip", {"a.txt": "First line.\nSecond line.\n"})
    two = archive("two.txt.zip", {"a.txt": "Kept?\n", "b.txt": "Dropped?\n"})  # fsspec read a.txt only
    empty = archive("empty.txt.zip", {})  # fsspec: IndexError
    cut = tmp_path / "cut.txt.zip"
    cut.write_bytes(Path(one).read_bytes()[:40])  # fsspec: BadZipFile, neither escaped as a record
    records = list(read_documents([one, two, empty, str(cut)], ReadOptions()))
    assert [r.text for r in records[:2]] == ["First line.", "Second line."]
    assert [(r.source, r.line, r.stage) for r in records[2:]] == [(two, None, "read"), (empty, None, "read"),
                                                                   (str(cut), None, "read")]
    assert records[2].reason == "cannot read file: BadZipFile: a zip input must hold exactly one file, this one holds 2"
    assert records[3].reason.endswith("this one holds 0")
    assert records[4].reason.startswith("cannot read file: BadZipFile")


def test_a_zip_member_zipfile_cannot_open_is_an_error_record_not_a_failed_job(tmp_path):
    stored = io.BytesIO()
    with zipfile.ZipFile(stored, "w") as z:
        z.writestr("a.txt", "First line.\n")
    central = stored.getvalue().find(b"PK\x01\x02")

    def patched(name: str, offsets: tuple[int, int], value: int) -> str:
        data = bytearray(stored.getvalue())
        for offset in offsets:  # the local header's field and the central directory's
            data[offset:offset + 2] = value.to_bytes(2, "little")
        (tmp_path / name).write_bytes(bytes(data))
        return str(tmp_path / name)

    deflate64 = patched("d64.txt.zip", (8, central + 10), 9)  # as Windows zips files over 2 GB
    encrypted = patched("enc.txt.zip", (6, central + 8), 1)  # flag bit 0: needs a password
    records = list(read_documents([deflate64, encrypted], ReadOptions()))  # NotImplementedError, RuntimeError
    assert [(r.source, r.line, r.stage) for r in records] == [(deflate64, None, "read"), (encrypted, None, "read")]
    assert records[0].reason == ("cannot read file: BadZipFile: a.txt cannot be read: That compression method is "
                                 "not supported")
    assert "password required" in records[1].reason


def test_a_file_gone_before_planning_is_read_as_one_error(tmp_path):
    gone = tmp_path / "gone.txt"
    assert plan_work(str(gone), ReadOptions(), 10) == [WorkItem(str(gone))]
    (error,) = read_documents([str(gone)], ReadOptions())
    assert error.line is None and "FileNotFoundError" in error.reason


# -- the whole job ------------------------------------------------------------------------------
class LockedFileSystem(PrivateMemoryFileSystem):
    """memory:// whose files under a "locked" folder cannot be opened (as a chmod 000 file for a
    non-root user, or an object store that refuses the read)."""

    protocol = "lockedmem"
    store: dict = {}

    def _open(self, path, mode="rb", **kwargs):
        if "locked" in path and "r" in mode:
            raise PermissionError(13, "Permission denied", path)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(LockedFileSystem.protocol, LockedFileSystem, clobber=True)

ZWJ_FAMILY = "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466"  # one grapheme, 7 code points
TEXT_LINES = {  # line number -> (raw bytes, expected: "rows" or the error reason's start)
    1: ("\ufeffA byte-order mark starts the file.".encode(), "rows"),
    2: (b"CRLF line end.\r", "rows"),
    3: (b"A lone\rCR stays inside the line.", "rows"),
    4: (b"NUL \x00 inside.", "text contains NUL characters"),
    5: (b"Invalid \xc3\x28 UTF-8.", "invalid UTF-8 at byte 8"),
    6: (b"", None),  # empty line: not a document
    7: (b" \t \xe3\x80\x80 ", "empty"),  # whitespace only (an ideographic space too): a document without tokens
    8: (f"Family {ZWJ_FAMILY} and flags \U0001F1EB\U0001F1F7 with skin tone \U0001F44B\U0001F3FD.".encode(), "rows"),
    9: ("שלום עולם! مرحبا بالعالم. Mixed \u202Bembedded\u202C RTL \u200Fmark.".encode(), "rows"),
    10: ("Combining: e\u0301 n\u0303 Z\u0351\u0352\u0353a\u0300\u0301\u0302l\u0303g\u0304o\u0305.".encode(), "rows"),
    11: ("Controls: bell\x07 esc\x1b[31mred\x1b[0m vt\x0bff\x0c fs\x1cgs\x1drs\x1eus\x1f del\x7f nel\x85 "
         "ls\u2028ps\u2029 zwsp\u200b bom\ufeffmid.".encode(), "rows"),
    12: (long_text(3 * SMALL_MAX_LENGTH + 1234, seed=7).encode(), "rows"),  # over max_length: in pieces
    13: (b"   ", "empty"),
    14: (b"Last line without a newline.", "rows"),
}  # the 100,000-character word: in the JSONL test, where spaCy's max_length is the real one


def test_bad_text_input_end_to_end(tmp_path, model_arg, small_max_length):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    src = corpus / "hostile.txt"
    src.write_bytes(b"\n".join(raw for raw, _ in TEXT_LINES.values()))
    (corpus / "empty.txt").write_bytes(b"")
    good = "\n".join(f"Line {i} of the compressed file." for i in range(2000)).encode()
    blob = gzip.compress(good)
    (corpus / "truncated.txt.gz").write_bytes(blob[: len(blob) // 2])
    locked = f"lockedmem://{uuid.uuid4().hex}/locked/secret.txt"
    with fsspec.open(locked, "wb") as f:
        f.write(b"Never read.\n")
    inputs = [corpus / "*", locked]
    if os.geteuid() != 0:  # root reads a chmod 000 file anyway
        (tmp_path / "perm").mkdir()
        unreadable = tmp_path / "perm" / "unreadable.txt"
        unreadable.write_text("Never read either.\n")
        unreadable.chmod(0)
        inputs.append(unreadable)

    started = time.perf_counter()
    summary = extract(model_arg, inputs, tmp_path / "out")
    seconds = time.perf_counter() - started
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary

    rows = rows_by_doc(tmp_path / "out")
    errors = read_errors(tmp_path / "out")
    by_line = {e["line"]: e for e in errors if e["source"] == str(src)}
    texts = {line: raw.decode("utf-8", "replace").removeprefix("\ufeff").removesuffix("\r")
             for line, (raw, _) in TEXT_LINES.items()}
    for line, (_, expected) in TEXT_LINES.items():
        doc_id = f"{src}:{line}"
        if expected == "rows":
            assert doc_id in rows, line
            check_rows_cover_text(texts[line], rows[doc_id])
            assert line not in by_line
        elif expected == "empty" or expected is None:
            assert doc_id not in rows and line not in by_line, line
        else:
            assert doc_id not in rows, line
            assert by_line[line]["stage"] == "read" and by_line[line]["reason"].startswith(expected), by_line[line]
    long_rows = rows[f"{src}:12"]
    assert [r["token"] for r in long_rows] == reference_tokens(texts[12])  # as if tokenized whole
    assert len({r["sentence_index"] for r in long_rows}) > 10
    assert [r["token"] for r in rows[f"{src}:9"]][:4] == ["שלום", "עולם", "!", "مرحبا"]
    # spaCy's affix rules cut a ZWJ sequence into its emoji and joiners, a flag and a skin tone
    # apart: the tokens are joined again, one per grapheme cluster, and the period after the skin
    # tone split off
    assert [r["token"] for r in rows[f"{src}:8"]] == ["Family", ZWJ_FAMILY, "and", "flags", "\U0001F1EB\U0001F1F7",
                                                      "with", "skin", "tone", "\U0001F44B\U0001F3FD", "."]

    # the truncated .gz: the documents before the failure, then one error at the line it failed on
    gz_rows = [d for d in rows if d.startswith(str(corpus / "truncated.txt.gz"))]
    (gz_error,) = [e for e in errors if e["source"].endswith("truncated.txt.gz")]
    assert gz_error["line"] == len(gz_rows) + 1 and gz_error["reason"].startswith("cannot read file: EOFError")
    (locked_error,) = [e for e in errors if e["source"].startswith("lockedmem://")]
    assert locked_error["line"] is None and "PermissionError" in locked_error["reason"]
    if os.geteuid() != 0:
        assert any(e["source"] == str(inputs[-1]) and "Permission" in e["reason"] for e in errors)
    assert not any(d.startswith(str(corpus / "empty.txt")) for d in rows)

    # counts: every non-empty line is a document or a read error; documents are tokenized (with or
    # without tokens) or tokenize errors; every token is a row
    text_docs = sum(1 for _, expected in TEXT_LINES.values() if expected is not None)
    text_read_errors = sum(1 for _, e in TEXT_LINES.values() if e not in ("rows", "empty", None))
    unreadable_files = 1 + (os.geteuid() != 0)
    assert summary["read_errors"] == text_read_errors + 1 + unreadable_files == len(errors)
    assert summary["documents_read"] == text_docs + len(gz_rows) + 1 + unreadable_files  # rejected ones included
    assert summary["documents_read"] == summary["documents_tokenized"] + summary["documents_rejected"]
    assert {by_line[line]["doc_id"] for line in (4, 5)} == {f"{src}:4", f"{src}:5"}  # the id it would have had
    assert summary["empty_documents"] == 2 and summary["tokenize_errors"] == 0
    assert summary["token_rows_written"] == sum(len(r) for r in rows.values())
    assert seconds < 120


JSON_LINES = [  # (record, expected: "rows", "empty" or the error reason)
    ({"id": "ok", "text": "A fine document."}, "rows"),
    ({"id": "obj", "text": {"nested": "object"}}, "text field 'text' is dict, not a string"),
    ({"id": "list", "text": ["a", "b"]}, "text field 'text' is list, not a string"),
    ({"id": "num", "text": 3.5}, "text field 'text' is float, not a string"),
    ({"id": "bool", "text": True}, "text field 'text' is bool, not a string"),
    ({"id": "null", "text": None}, "text field 'text' is null, not a string"),
    ({"id": 1.5, "text": "float id"}, "id field 'id' is float, not a string or int"),
    ({"id": {"a": 1}, "text": "object id"}, "id field 'id' is dict, not a string or int"),
    ({"id": 10**30, "text": "A huge integer id is fine."}, "rows"),
    ({"id": "empty", "text": ""}, "empty"),
    ({"id": "spaces", "text": " \n\t "}, "empty"),
    ({"id": "emoji🙂", "text": "Unicode in the id is data."}, "rows"),
    ({"id": "ts", "text": "bad time", "ts": 17}, "timestamp field 'ts' is not ISO 8601"),
    ({"id": "extra", "text": "Unknown fields are ignored.", "more": [1, 2]}, "rows"),
    ({"id": "word", "text": "Before " + "w" * 100_000 + " after."}, "rows"),  # a 100,000-character word
]


def test_bad_jsonl_input_end_to_end(tmp_path, model_arg):
    # a good time for every record that gives none: --event-time field needs one
    lines = [json.dumps({"ts": "2024-05-01T12:00:00Z", **record}, ensure_ascii=False) for record, _ in JSON_LINES]
    lines += [r'{"id": "sur", "text": "lone \udc00", "ts": "2024-05-01T12:00:00Z"}', '{"id": "cut", "text": "trunc',
              "[1, 2]", "null", "   "]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = extract(model_arg, [src], tmp_path / "out", "--format", "jsonl", "--id-field", "id",
                      "--timestamp-field", "ts", "--event-time", "field")
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    rows, errors = rows_by_doc(tmp_path / "out"), read_errors(tmp_path / "out")
    reasons = {e["line"]: e["reason"] for e in errors}
    for line, (record, expected) in enumerate(JSON_LINES, 1):
        doc_id = str(record["id"])
        if expected == "rows":
            check_rows_cover_text(record["text"], rows[doc_id])
        elif expected == "empty":
            assert doc_id not in rows and line not in reasons
        else:
            assert reasons[line] == expected
    n = len(JSON_LINES)
    assert reasons[n + 1].startswith("text field 'text' holds a lone surrogate")
    assert reasons[n + 2].startswith("malformed JSON")
    assert reasons[n + 3] == "JSON value is list, not an object"
    assert reasons[n + 4] == "JSON value is null, not an object"
    assert set(rows) == {"ok", str(10**30), "emoji🙂", "extra", "word"}
    assert [r["token"] for r in rows["word"]] == ["Before", "w" * 100_000, "after", "."]
    assert summary["documents_read"] == len(lines) - 1  # every record but the blank line, rejected ones included
    assert summary["empty_documents"] == 2


def test_bad_parquet_input_end_to_end(tmp_path, model_arg):
    folder = tmp_path / "pq"
    folder.mkdir()
    text = pa.array([b"Row one is fine.", b"Row \xe9 two.", None, b"Row four."], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"body": text}), folder / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"body": pa.array([1, 2], pa.int64())}), folder / "b.parquet")  # wrong type
    pq.write_table(pa.table({"other": ["no body column"]}), folder / "c.parquet")
    (folder / "d.parquet").write_bytes(b"PAR1 but not Parquet")
    sink = io.BytesIO()
    pq.write_table(pa.table({"body": ["Cut short."] * 1000}), sink)
    (folder / "e.parquet").write_bytes(sink.getvalue()[:-100])  # truncated: no footer
    summary = extract(model_arg, [folder / "*.parquet"], tmp_path / "out", "--format", "parquet",
                      "--text-field", "body")
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    rows, errors = rows_by_doc(tmp_path / "out"), read_errors(tmp_path / "out")
    a = str(folder / "a.parquet")
    assert set(rows) == {f"{a}:1", f"{a}:4"}
    got = sorted((Path(e["source"]).name, e["line"], e["reason"]) for e in errors)
    assert got[:4] == [
        ("a.parquet", 2, "column 'body': invalid UTF-8 at byte 4: invalid continuation byte"),
        ("a.parquet", 3, "text field 'body' is null, not a string"),
        ("b.parquet", None, "Parquet text column 'body' has type int64"),
        ("c.parquet", None, "Parquet file has no text column 'body' (columns: other)"),
    ]
    assert [(name, line) for name, line, _ in got[4:]] == [("d.parquet", None), ("e.parquet", None)]
    assert all(reason.startswith("cannot read file: ") for _, _, reason in got[4:])
    assert summary["documents_read"] == 2 + 6 and summary["read_errors"] == 6


def test_one_hostile_jsonl_line_costs_only_itself(tmp_path, model_arg):
    # Before: the 100,000-deep line raised RecursionError out of the reader and the job wrote
    # nothing; the 5000-digit id raised ValueError (not a JSONDecodeError) the same way.
    good = [{"id": f"d{i}", "text": f"Document number {i} is fine."} for i in range(6)]
    deep = '{"id": "deep", "text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    long_int = '{"id": ' + "7" * 5000 + ', "text": "An id of 5000 digits."}'
    lines = [json.dumps(good[0]), deep, *map(json.dumps, good[1:4]), long_int, *map(json.dumps, good[4:])]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = extract(model_arg, [src], tmp_path / "out", "--format", "jsonl", "--id-field", "id")
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    errors = read_errors(tmp_path / "out")
    assert sorted((e["line"], e["stage"], e["reason"][:30]) for e in errors) == [
        (2, "read", "JSON nested too deeply to pars"), (6, "read", "JSON cannot be parsed: Exceeds")]
    rows = rows_by_doc(tmp_path / "out")
    assert set(rows) == {d["id"] for d in good}
    for doc in good:
        check_rows_cover_text(doc["text"], rows[doc["id"]])
    assert summary["documents_read"] == 6 + 2 and summary["read_errors"] == 2
    assert summary["token_rows_written"] == sum(map(len, rows.values()))


def test_document_ids_used_twice_are_reported_and_every_document_is_still_embedded(tmp_path, model_arg):
    first = tmp_path / "a.jsonl"
    second = tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        {"id": "dup", "text": "First copy."}, {"id": "solo", "text": "Alone."}, {"id": "dup", "text": "Second copy."},
        {"id": 7, "text": "An integer id."}]) + "\n", encoding="utf-8")
    second.write_text("\n".join(json.dumps(r) for r in [
        {"id": "7", "text": "A string id equal to it."}, {"id": "dup", "text": "Third copy, other file."}]) + "\n",
        encoding="utf-8")
    out = tmp_path / "out"
    summary = extract(model_arg, [tmp_path / "*.jsonl"], out, "--format", "jsonl", "--id-field", "id")
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    assert summary["duplicate_doc_ids"] == 2 and summary["ids_unique"] is False
    rows = rows_by_doc(out)
    def n_tokens(*texts: str) -> int:
        return sum(len(reference_tokens(t)) for t in texts)

    # nothing dropped: the rows of every document, duplicates included
    assert len(rows["dup"]) == n_tokens("First copy.", "Second copy.", "Third copy, other file.")
    assert len(rows["7"]) == n_tokens("An integer id.", "A string id equal to it.")
    assert len(rows["solo"]) == 2 and summary["token_rows_written"] == sum(map(len, rows.values()))
    errors = sorted(read_errors(out), key=lambda e: e["doc_id"])
    assert [(e["doc_id"], e["stage"], Path(e["source"]).name, e["line"]) for e in errors] == [
        ("7", "ids", "a.jsonl", 4), ("dup", "ids", "a.jsonl", 1)]
    assert errors[1]["reason"] == (f"document id 'dup' is used by 3 documents (first: {first}:1, {first}:3, "
                                   f"{second}:2); their token_ids are not unique")
    assert "used by 2 documents" in errors[0]["reason"]

    skipped = extract(model_arg, [tmp_path / "*.jsonl"], tmp_path / "skipped", "--format", "jsonl",
                      "--id-field", "id", "--skip-id-check")
    assert skipped["ids_unique"] is None and skipped["duplicate_doc_ids"] == 0
    assert read_errors(tmp_path / "skipped") == []
    assert skipped["token_rows_written"] == summary["token_rows_written"]


def test_duplicate_id_places_do_not_depend_on_order_or_grouping():
    from elmo_pipeline.transforms.read import _IdUses

    places = [("s3://b/x.jsonl", n) for n in (9, 2, 5, 1, 7)]
    combine = _IdUses()
    expected = (5, [("s3://b/x.jsonl", 1), ("s3://b/x.jsonl", 2), ("s3://b/x.jsonl", 5)])
    for seed in range(5):
        shuffled = random.Random(seed).sample(places, len(places))
        cut = seed % 4 + 1
        parts = []
        for chunk in (shuffled[:cut], shuffled[cut:]):
            acc = combine.create_accumulator()
            for place in chunk:
                acc = combine.add_input(acc, place)
            parts.append(acc)
        assert combine.extract_output(combine.merge_accumulators(parts)) == expected


def test_glob_matching_nothing_fails_before_any_work(tmp_path, model_arg):
    src = tmp_path / "in.txt"
    src.write_text("An earlier run.\n")
    out = tmp_path / "out"
    extract(model_arg, [src], out)
    before = sorted(p.name for p in out.iterdir())
    args = parse_extract_args(["--input", str(src), "--input", str(tmp_path / "nothing-*.txt"),
                                    "--output", str(out), "--overwrite", "--model", str(tmp_path / "no-model")])
    with pytest.raises(InputError, match=r"nothing-\*\.txt' matches no files"):
        run(*args)  # not the missing model: the patterns are checked first
    assert sorted(p.name for p in out.iterdir()) == before  # --overwrite cleared nothing


ONE_LABELLED = "1\tHello\thello\tINTJ\tUH\t_\t0\troot\t_\t_\n\n"


@pytest.mark.parametrize("command", ["extract", "prepare", "probe", "pretrain"])
def test_an_output_folder_that_is_an_existing_file_is_refused_before_any_work(tmp_path, model_arg, capsys,
                                                                              command):
    # Before: extract and prepare failed only inside Beam's InitializeWrite ("OSError: Not a
    # directory" once the job was running), probe likewise after reading its files, pretrain with
    # "File exists" from mkdir.
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder\n")
    text, labelled = tmp_path / "in.txt", tmp_path / "t.conllu"
    text.write_text("Hello world.\n")
    labelled.write_text(ONE_LABELLED)
    for output, says in [(taken, f"--output {taken} is an existing file; it must name a folder"),
                         (taken / "sub", f"--output {taken / 'sub'} cannot be created as a folder: {taken} is an "
                                         "existing file")]:
        argv = {"extract": ["extract", "--input", str(text), "--model", model_arg],
                "prepare": ["prepare", "--input", str(text), "--overwrite"],
                "probe": ["probe", "--train", str(labelled), "--dev", str(labelled), "--model", model_arg],
                "pretrain": ["pretrain", "--data", str(tmp_path)]}[command]
        assert cli_main([*argv, "--output", str(output)]) == 2
        assert f"elmo-pipeline {command}: error: {says}" in capsys.readouterr().err
    assert taken.read_text() == "a file, not a folder\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "t.conllu", "taken"]


@pytest.mark.parametrize("empty", ["train", "dev"])
def test_probe_on_a_file_without_labelled_tokens_is_a_clear_error(tmp_path, model_arg, capsys, empty):
    # Before: the extraction ran, then training or scoring ended in an IndexError traceback.
    files = {"train": tmp_path / "train.conllu", "dev": tmp_path / "dev.conllu"}
    for split, path in files.items():
        path.write_text("# sent_id = nothing here\n\n" if split == empty else ONE_LABELLED)
    argv = ["probe", "--train", str(files["train"]), "--dev", str(files["dev"]), "--output", str(tmp_path / "out"),
            "--model", model_arg, "--epochs", "1"]
    assert cli_main(argv) == 2
    assert (f"elmo-pipeline probe: error: {empty} file {files[empty]} has no labelled tokens"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # refused before the extraction


# -- bounded buffers: what the job holds does not grow with a document or the corpus ----------
def _sentences(lengths: list[int]) -> list:
    import numpy as np

    from elmo_pipeline.corpus.records import Sentence

    return [Sentence(f"d{i}", 0, 0, ("w",) * n, np.zeros(n, np.int64), np.ones(n, np.int64))
            for i, n in enumerate(lengths)]


def test_sort_buffer_emits_batches_before_the_bundle_ends():
    from apache_beam.transforms.window import GlobalWindow

    from elmo_pipeline.transforms.embed import SortAndBatchSentences, sentence_weight

    lengths = random.Random(5).choices(range(1, 60), k=2000)
    fn = SortAndBatchSentences(batch_tokens=256, max_batch_sentences=16, buffer_tokens=2000)
    fn.start_bundle()
    during, held = [], []
    for sentence in _sentences(lengths):
        during += [wv.value for wv in fn.process(sentence, GlobalWindow())]
        held.append(sum(map(len, fn._buffers.values())))
    at_end = [wv.value for wv in fn.finish_bundle()]
    assert len(during) > 10 * len(at_end)  # most batches leave while the bundle goes on
    assert max(held) * 2 <= 2000  # never more than one buffer's worth (2000 tokens, >= 2 per sentence)
    batches = during + at_end
    assert sorted(s.doc_id for b in batches for s in b) == sorted(f"d{i}" for i in range(len(lengths)))
    for batch in batches:  # the SortAndBatchElements rule
        weights = [sentence_weight(s) for s in batch]
        assert len(batch) <= 16 and (len(batch) == 1 or sum(weights) < 256) and weights == sorted(weights)


def test_sort_buffer_holding_everything_batches_like_sort_and_batch_elements():
    from apache_beam.transforms.util import _SortAndBatchElementsDoFn
    from apache_beam.transforms.window import GlobalWindow

    from elmo_pipeline.transforms.embed import SortAndBatchSentences, sentence_weight

    sentences = _sentences(random.Random(6).choices(range(1, 300), k=500))
    ours = SortAndBatchSentences(batch_tokens=1024, max_batch_sentences=64, buffer_tokens=10**9)
    beams = _SortAndBatchElementsDoFn(1, 64, 1024, sentence_weight)
    for fn in (ours, beams):
        fn.start_bundle()
        for s in sentences:
            assert not list((fn.process(s, GlobalWindow()) if fn is ours else fn.process(s)) or [])

    def ids(batches):
        return [[s.doc_id for s in wv.value] for wv in batches]

    assert ids(ours.finish_bundle()) == ids(beams.finish_bundle())


def test_long_documents_are_batched_alone_for_tokenization():
    from elmo_pipeline.transforms.tokenize import document_weight

    assert document_weight(Document("a", "x" * 100, "s", 1)) == 1
    assert document_weight(Document("a", "x" * 10 * 2**20, "s", 1)) > 256  # a batch of its own
    assert sum(document_weight(Document("a", "x" * 4000, "s", 1)) for _ in range(256)) == 256


@pytest.mark.parametrize("argv", [
    ["extract", "--input", "{text}"],
    ["prepare", "--input", "{text}", "--tokenizer", "whitespace"],
    ["probe", "{conllu}", "--epochs", "1"],
    ["export", "{options},{weights}"],
    ["import-allennlp", "--options", "{options}", "--weights", "{weights}"],
])
@pytest.mark.parametrize("output", ["", "file://"])
def test_an_empty_output_is_refused_not_taken_for_the_current_folder(elmo_fixture_dir, tmp_path, monkeypatch, capsys,
                                                                      argv, output):
    """An unset variable as --output: `extract` wrote its shards and summary.json into the
    current folder; the others said the current folder was not empty."""
    (tmp_path / "in.txt").write_text("The bank rose .\n", encoding="utf-8")
    (tmp_path / "in.conllu").write_text("1\tThe\t_\tDET\t_\t_\t_\t_\t_\t_\n2\tbank\t_\tNOUN\t_\t_\t_\t_\t_\t_\n\n",
                                        encoding="utf-8")
    empty = tmp_path / "cwd"
    empty.mkdir()
    monkeypatch.chdir(empty)
    values = {"text": tmp_path / "in.txt", "conllu": tmp_path / "in.conllu",
              "options": elmo_fixture_dir / "options.json", "weights": elmo_fixture_dir / "lm_weights.hdf5"}
    assert cli_main([arg.format(**values) for arg in argv] + ["--output", output]) == 2
    err = capsys.readouterr().err
    # file:// alone is refused by Beam's sinks first where the command runs a Beam job
    beam_job = argv[0] in ("extract", "prepare", "probe")
    said = "Beam's file sinks cannot write there" if output and beam_job else "names no folder; give a folder or URL"
    assert f"--output {output!r}" in err or f"--output {output}:" in err
    assert said in err and "Traceback" not in err
    assert list(empty.iterdir()) == []
