import collections
import gzip
import io
import re
import uuid

import apache_beam as beam
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from elmo_pipeline.corpus.input_files import InputError, expand_patterns
from elmo_pipeline.corpus.read_options import ReadOptions
from elmo_pipeline.corpus.readers import read_documents
from elmo_pipeline.corpus.records import Document, ErrorRecord
from elmo_pipeline.corpus.tokenization import build_nlp, sentences_from_docs
from elmo_pipeline.transforms.pretokenized import PretokenizedSentences, ReadTokenizedFiles
from elmo_pipeline.transforms.read import ReadDocuments
from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy

# The FnApiRunner runs in this process (memory:// files are visible to it) and downloads nothing.
RUNNER = "FnApiRunner"

MIXED = b"\n".join([
    "\ufeff第一行：中文和emoji 🙂🎉. Second sentence here!".encode(),
    b"",
    "混合 mixed 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 text\r".encode(),
    b"bad \xff byte",  # invalid UTF-8
    b"   ",
    b"one two three four five six seven",
])


@pytest.fixture
def mem():
    """A fresh folder on fsspec's in-memory filesystem; returns its URL."""
    fs = fsspec.filesystem("memory")
    root = f"/beam-{uuid.uuid4().hex}"
    fs.mkdir(root)
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def put(url: str, data: bytes) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(data)


def run_and_count(p: beam.Pipeline) -> dict[str, int]:
    """Runs the pipeline (assert_that checks included); its elmo_pipeline counters summed over steps."""
    result = p.run()
    result.wait_until_finish()
    totals = collections.Counter()
    for counter in result.metrics().query(MetricsFilter())["counters"]:
        if counter.key.metric.namespace == "elmo_pipeline":
            totals[counter.key.metric.name] += counter.committed
    return totals


def sentence_key(s) -> tuple:
    return (*s.key, s.tokens, tuple(s.char_starts), tuple(s.char_ends), s.timestamp)


def test_glob_matching_nothing_raises_before_running(mem):
    with pytest.raises(InputError, match="matches no files"):
        ReadDocuments([f"{mem}/*.txt"])


def test_text_ranges_and_compressed_files_read_like_one_reader(mem):
    put(f"{mem}/a.txt", MIXED)
    put(f"{mem}/b.txt.gz", gzip.compress(MIXED))
    put(f"{mem}/c.txt.zst", zstandard.ZstdCompressor().compress(MIXED))
    pattern = f"{mem}/*"
    reference = list(read_documents(expand_patterns([pattern]), ReadOptions()))
    documents = [r for r in reference if isinstance(r, Document)]
    errors = [r for r in reference if isinstance(r, ErrorRecord)]
    assert len(documents) == 3 * 4 and len(errors) == 3
    assert {e.reason for e in errors} == {"invalid UTF-8 at byte 4: invalid start byte"}

    p = test_pipeline.TestPipeline(runner=RUNNER)
    read = p | ReadDocuments([pattern], split_bytes=7)  # edges inside lines and characters
    assert_that(read["documents"], equal_to(documents), label="documents")
    assert_that(read["errors"], equal_to(errors), label="errors")
    counters = run_and_count(p)
    assert counters["documents_read"] == 12 + 3 and counters["read_errors"] == 3  # a rejected record was read too
    assert counters["bytes_read"] == 3 * len(MIXED)


def test_jsonl_and_parquet_with_errors(mem):
    put(f"{mem}/a.jsonl", b'{"id": "x1", "text": "Hello.", "ts": "2024-01-02"}\n'
                          b'{"id": "x2", "text": \n'
                          b'{"id": 3}\n')
    sink = io.BytesIO()
    pq.write_table(pa.table({"body": ["Row one.", "Row two."]}), sink, row_group_size=1)
    put(f"{mem}/good.parquet", sink.getvalue())
    sink = io.BytesIO()
    pq.write_table(pa.table({"other": ["x"]}), sink)
    put(f"{mem}/no_body.parquet", sink.getvalue())
    jsonl, good, no_body = expand_patterns([f"{mem}/{name}" for name in ("a.jsonl", "good.parquet", "no_body.parquet")])

    p = test_pipeline.TestPipeline(runner=RUNNER)
    lines = p | "Jsonl" >> ReadDocuments([f"{mem}/*.jsonl"], "jsonl", id_field="id", timestamp_field="ts")
    rows = p | "Parquet" >> ReadDocuments([f"{mem}/*.parquet"], "parquet", text_field="body")
    assert_that(lines["documents"], equal_to([Document("x1", "Hello.", jsonl, 1, "2024-01-02")]), label="jd")
    assert_that(
        lines["errors"] | beam.Map(lambda e: (e.line, e.reason.split(":")[0])),
        equal_to([(2, "malformed JSON"), (3, "missing text field 'text'")]),
        label="je",
    )
    assert_that(rows["documents"], equal_to([
        Document(f"{good}:1", "Row one.", good, 1), Document(f"{good}:2", "Row two.", good, 2),
    ]), label="pd")
    assert_that(rows["errors"], equal_to([
        ErrorRecord(no_body, None, "Parquet file has no text column 'body' (columns: other)", "read"),
    ]), label="pe")
    counters = run_and_count(p)
    assert counters["documents_read"] == 3 + 3 and counters["read_errors"] == 3


def documents_of(url: str) -> list[Document]:
    return [r for r in read_documents(expand_patterns([url]), ReadOptions()) if isinstance(r, Document)]


def test_tokenize_transform_matches_the_library(mem):
    put(f"{mem}/en.txt", MIXED)
    put(f"{mem}/zh.txt", "包袱很重。我爱北京天安门！\n\n他背着一个包袱。\n".encode())
    en_docs, zh_docs = documents_of(f"{mem}/en.txt"), documents_of(f"{mem}/zh.txt")
    en_expected = list(sentences_from_docs(build_nlp("en"), en_docs, max_sentence_tokens=3))
    zh_expected = list(sentences_from_docs(build_nlp("zh"), zh_docs, max_sentence_tokens=3))
    assert [s.tokens for s in zh_expected] == [
        ("包袱", "很", "重"), ("。",), ("我", "爱", "北京"), ("天安门", "！"), ("他", "背着", "一个"), ("包袱", "。"),
    ]

    p = test_pipeline.TestPipeline(runner=RUNNER)
    en_read = p | "ReadEn" >> ReadDocuments([f"{mem}/en.txt"], split_bytes=16)
    en = en_read["documents"] | "En" >> TokenizeWithSpacy(max_sentence_tokens=3, batch_size=2)
    zh_read = p | "ReadZh" >> ReadDocuments([f"{mem}/zh.txt"])
    zh = zh_read["documents"] | "Zh" >> TokenizeWithSpacy("zh", max_sentence_tokens=3)
    for name, out, expected in [("en", en, en_expected), ("zh", zh, zh_expected)]:
        keys = out["sentences"] | f"Key{name}" >> beam.Map(sentence_key)
        assert_that(keys, equal_to([sentence_key(s) for s in expected]), label=f"{name}_sentences")
        assert_that(out["errors"], equal_to([]), label=f"{name}_errors")
    counters = run_and_count(p)
    assert counters["documents_tokenized"] == len(en_docs) + len(zh_docs) == 4 + 2
    assert counters["empty_documents"] == 1  # the whitespace-only line
    assert counters["tokenize_errors"] == 0
    everything = en_expected + zh_expected
    assert counters["sentences"] == len(everything)
    assert counters["tokens"] == sum(len(s.tokens) for s in everything)
    assert counters["windows_cut"] == sum(s.window_index == 1 for s in everything) > 0
    assert counters.get("long_tokens", 0) == 0


def test_tokens_of_long_whitespace_free_runs_are_counted(mem):
    from elmo_pipeline.corpus.tokenization import LONG_RUN_CHARS

    csv_like = ("ab," * LONG_RUN_CHARS)[:LONG_RUN_CHARS]  # one token, not the ~670 spaCy's affixes would give
    just_under = ("cd," * LONG_RUN_CHARS)[: LONG_RUN_CHARS - 1]
    put(f"{mem}/long.txt", f"Intro {csv_like} end.\nShort {just_under} too.\nAnd {csv_like}x again {csv_like}y\n".encode())
    p = test_pipeline.TestPipeline(runner=RUNNER)
    out = (p | ReadDocuments([f"{mem}/long.txt"]))["documents"] | TokenizeWithSpacy()
    long_ones = (out["sentences"] | beam.FlatMap(lambda s: [t for t in s.tokens if len(t) >= LONG_RUN_CHARS]))
    assert_that(long_ones, equal_to([csv_like, csv_like + "x", csv_like + "y"]))
    assert run_and_count(p)["long_tokens"] == 3


@pytest.mark.parametrize("build, name, value", [
    (lambda: TokenizeWithSpacy(max_sentence_tokens=2.5), "max_sentence_tokens", 2.5),
    (lambda: TokenizeWithSpacy(max_sentence_tokens=True), "max_sentence_tokens", True),
    (lambda: TokenizeWithSpacy(batch_size=2.5), "batch_size", 2.5),
    (lambda: PretokenizedSentences(max_sentence_tokens=2.5), "max_sentence_tokens", 2.5),
    (lambda: ReadDocuments(["memory://anything"], split_bytes=1.5), "split_bytes", 1.5),
    (lambda: ReadDocuments(["memory://anything"], min_splits=2.5), "min_splits", 2.5)])
def test_counts_that_are_not_ints_are_refused_when_the_transform_is_built(build, name, value):
    """A float passed every check and failed in each worker after the reading ("'float' object
    cannot be interpreted as an integer", naming no option); True was taken as 1 token a window."""
    with pytest.raises(TypeError, match=f"^{name} must be an int, got {value!r}$"):
        build()


@pytest.mark.parametrize("options, says", [
    ({"lang": "zh", "segmenter": "bogus"}, "Chinese segmenter must be 'jieba' or 'char', got 'bogus'"),
    ({"lang": "en", "segmenter": "jieba"}, "segmenter 'jieba' is for a blank Chinese pipeline, not lang='en'")])
def test_a_segmenter_the_pipeline_cannot_use_is_refused_when_the_transform_is_built(options, says):
    """Taken when built, it failed in every worker after the reading."""
    with pytest.raises(ValueError, match=re.escape(says)):
        TokenizeWithSpacy(**options)


def test_one_pattern_given_as_a_path_is_read_as_one_pattern(tmp_path):
    """A lone str was one pattern; a lone pathlib.Path failed ('PosixPath' object is not iterable)."""
    (tmp_path / "a.txt").write_text("one\ntwo\n", encoding="utf-8")
    assert ReadDocuments(tmp_path / "a.txt").urls == ReadDocuments(str(tmp_path / "a.txt")).urls == [
        str(tmp_path / "a.txt")]


@pytest.mark.parametrize("options, says", [
    ({"text_field": None}, "text_field None is not a str"),
    ({"text_field": 5}, "text_field 5 is not a str"),
    ({"id_field": 0}, "id_field 0 is not a str"),
    ({"timestamp_field": b"ts"}, "timestamp_field b'ts' is not a str")])
def test_a_field_name_that_names_no_field_is_refused_when_the_transform_is_built(mem, options, says):
    """text_field=None failed the job in its reader ("KeyError: None [while running
    'ReadDocuments/Read/...']"). An empty str is a name (test_an_empty_field_name_is_a_name)."""
    put(f"{mem}/a.jsonl", b'{"id": "x1", "text": "Hello.", "ts": "2024-01-02"}\n')
    with pytest.raises(TypeError, match=re.escape(says)) as refused:  # a TypeError, as the README says
        ReadDocuments([f"{mem}/a.jsonl"], "jsonl", **options)
    assert not isinstance(refused.value, ValueError)
    p = test_pipeline.TestPipeline(runner=RUNNER)  # the same file, fields named, reads its document
    read = p | ReadDocuments([f"{mem}/a.jsonl"], "jsonl", text_field="text", id_field="id", timestamp_field="ts")
    assert_that(read["documents"] | beam.Map(lambda d: (d.doc_id, d.text, d.timestamp)),
                equal_to([("x1", "Hello.", "2024-01-02")]))
    p.run().wait_until_finish()


def test_an_empty_input_pattern_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch):
    """An empty pattern (an unset variable) was the current folder: "input pattern '' is a folder;
    give its files, e.g. '/*'", which names the root; a pattern that is not a str failed in
    resolve_dots ("argument of type 'int' is not iterable")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")
    with pytest.raises(InputError, match=re.escape("input pattern '' is empty: give a file, a glob or a URL")):
        ReadDocuments(["a.txt", ""])
    with pytest.raises(TypeError, match=re.escape("an input pattern is a str or a path, got int (5)")):
        ReadDocuments(["a.txt", 5])
    with pytest.raises(InputError, match=re.escape("input pattern '' is empty")):
        ReadTokenizedFiles({"train": ""})
    assert ReadDocuments(["a.txt"]).urls == [str(tmp_path / "a.txt")]


def test_timestamp_required_given_as_a_str_is_refused_when_built(mem):
    """timestamp_required="no" was taken for True: a record without a time became an error record
    ("missing timestamp field 'ts'") instead of a document."""
    put(f"{mem}/a.jsonl", b'{"text": "Hello there.", "ts": "2024-01-02"}\n{"text": "No time here."}\n')
    with pytest.raises(TypeError, match=re.escape("timestamp_required must be a bool, got 'no'")) as refused:
        ReadDocuments([f"{mem}/a.jsonl"], "jsonl", timestamp_field="ts", timestamp_required="no")
    assert not isinstance(refused.value, ValueError)  # a TypeError, as the README says
    p = test_pipeline.TestPipeline(runner=RUNNER)
    read = p | ReadDocuments([f"{mem}/a.jsonl"], "jsonl", timestamp_field="ts", timestamp_required=False)
    assert_that(read["documents"] | beam.Map(lambda d: (d.text, d.timestamp)),
                equal_to([("Hello there.", "2024-01-02"), ("No time here.", None)]))
    p.run().wait_until_finish()



@pytest.mark.parametrize("windows", ["fixed", "sessions"])
def test_the_duplicate_id_check_of_windowed_documents_spans_the_windows(windows):
    """Documents in FixedWindows or Sessions: the ids were counted per window, so an id used in two
    windows (two documents whose token_ids collide in the one output) gave no error."""
    from apache_beam.transforms import window

    from elmo_pipeline.transforms.read import FindDuplicateIds

    docs = [Document("a", "One.", "s", 1), Document("a", "Two.", "s", 2), Document("b", "Three.", "s", 3),
            Document("b", "Four.", "s", 4), Document("b", "Five.", "s", 5), Document("c", "Six.", "s", 6),
            Document("d", 7, "s", 7)]  # a text that is not a str: the tokenizer's error, in its window
    windowfn = window.FixedWindows(60) if windows == "fixed" else window.Sessions(30)
    p = test_pipeline.TestPipeline(runner=RUNNER)
    windowed = (p | beam.Create(docs)
                | beam.Map(lambda d: window.TimestampedValue(d, d.line * 100)) | beam.WindowInto(windowfn))
    # what extract does with the errors: the checks' and the tokenizer's in one collection
    errors = (windowed | FindDuplicateIds(), (windowed | TokenizeWithSpacy())["errors"]) | beam.Flatten()
    assert_that(errors | beam.Map(lambda e: (e.doc_id, e.stage, e.line, e.reason.split(";")[0])), equal_to([
        ("a", "ids", 1, "document id 'a' is used by 2 documents (first: s:1, s:2)"),
        ("b", "ids", 3, "document id 'b' is used by 3 documents (first: s:3, s:4, s:5)"),
        ("d", "tokenize", 7, "the text is a int, not a str")]))
    # each id's error in the window of the first document it names
    assert_that(errors | beam.Filter(lambda e: e.stage == "ids")
                | beam.Map(lambda e, at=beam.DoFn.TimestampParam: (e.doc_id, at.micros // 10**6)),
                equal_to([("a", 100), ("b", 300)]), label="times")
    assert run_and_count(p)["duplicate_doc_ids"] == 2


def test_the_duplicate_id_check_of_an_unbounded_collection_goes_window_by_window():
    """A streaming source has no end at which every window could be counted as one: there Beam
    refused the whole check when built (GroupByKey cannot be applied to an unbounded PCollection
    with global windowing), so it stays per window."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms import window

    from elmo_pipeline.transforms.read import FindDuplicateIds

    stream = (TestStream().add_elements([window.TimestampedValue(Document("a", "One.", "s", 1), 10)])
              .advance_watermark_to(100)
              .add_elements([window.TimestampedValue(Document("a", "Two.", "s", 2), 130),
                             window.TimestampedValue(Document("a", "Three.", "s", 3), 131)])
              .advance_watermark_to_infinity())
    p = test_pipeline.TestPipeline(options=PipelineOptions(["--streaming"]))
    errors = p | stream | beam.WindowInto(window.FixedWindows(60)) | FindDuplicateIds()
    assert_that(errors | beam.Map(lambda e: (e.doc_id, e.line, e.reason.split(";")[0])), equal_to([
        ("a", 2, "document id 'a' is used by 2 documents (first: s:2, s:3)")]))
    p.run().wait_until_finish()
