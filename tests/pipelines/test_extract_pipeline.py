"""The extract job end to end on the local FnApiRunner: inputs in every format, Parquet read back
and checked against direct model calls, errors, summary reconciliation, output options.

Every run writes float32 unless a test is about float16, so that vectors compare with the
model's to 1e-6.
"""

from __future__ import annotations

import datetime
import gzip
import json
import random
from collections import defaultdict
from pathlib import Path

import fsspec
import jieba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import elmo_pipeline
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.pipelines.extract import main, run
from elmo_pipeline.corpus.schema import layer_meanings, read_metadata
from elmo_pipeline.corpus.tokenization import build_nlp
from support import lose_the_first_text_record, parse_extract_args, read_output, ud_texts, vector_column

ATOL = 1e-6


# -- helpers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs() -> list[str]:
    """16 English documents of two UD EWT sentences each (lengths 1 to ~60 tokens)."""
    texts = ud_texts("ud_english_ewt", "en_ewt-ud-dev.conllu", n=32)
    return [f"{texts[2 * i]} {texts[2 * i + 1]}" for i in range(16)]



def extract(model_arg: str, inputs: list[str], output: Path | str, *extra: str) -> dict:
    argv = [arg for url in inputs for arg in ("--input", str(url))]
    argv += ["--output", str(output), "--model", model_arg, "--dtype", "float32", *extra]
    summary = run(*parse_extract_args(argv))
    assert summary["documents_reconcile"] and summary["tokens_reconcile"], summary
    # the shards' footers hold what the sink counted
    counted = summary["token_rows_written" if "sentence" not in extra else "sentences_written"]
    assert summary["files_reconcile"] and summary["rows_in_files"] == summary["rows_counted"] == counted, summary
    return summary


def read_errors(output: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(Path(output).glob("errors-*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines()]


def sentences_of(table: pa.Table) -> dict[tuple[str, int, int], dict]:
    """Token rows grouped by sentence window: key -> tokens, offsets and (L+1, n, 2P) layers."""
    layer_names = sorted((c for c in table.column_names if c.startswith("layer_")), key=lambda c: int(c[6:]))
    layers = np.stack([vector_column(table, c) for c in layer_names]) if layer_names else None
    rows = defaultdict(list)
    cols = table.select(["doc_id", "sentence_index", "window_index", "token_index"]).to_pydict()
    for i, key in enumerate(zip(cols["doc_id"], cols["sentence_index"], cols["window_index"])):
        rows[key].append((cols["token_index"][i], i))
    tokens = table.column("token").to_pylist()
    starts, ends = table.column("char_start").to_pylist(), table.column("char_end").to_pylist()
    out = {}
    for key, items in rows.items():
        items.sort()
        assert [k for k, _ in items] == list(range(len(items))), f"{key}: token indices not 0..n-1"
        idx = [i for _, i in items]
        out[key] = {"tokens": [tokens[i] for i in idx], "starts": [starts[i] for i in idx],
                    "ends": [ends[i] for i in idx], "layers": None if layers is None else layers[:, idx]}
    return out


_REFERENCE_CACHE: dict[tuple[str, ...], np.ndarray] = {}


def direct_embedding(model, tokens: list[str]) -> np.ndarray:
    """(L+1, n, 2P) float32 from a direct model call on the sentence alone."""
    key = tuple(tokens)
    if key not in _REFERENCE_CACHE:
        with torch.inference_mode():
            _REFERENCE_CACHE[key] = model.embed([list(tokens)]).layers[:, 0].float().numpy()
    return _REFERENCE_CACHE[key]


def check_against_model(table: pa.Table, model) -> dict:
    """Every sentence window's vectors equal a direct model call on its tokens, to 1e-6."""
    sentences = sentences_of(table)
    assert sentences
    for key, s in sentences.items():
        want = direct_embedding(model, s["tokens"])
        assert s["layers"].dtype == np.float32 and s["layers"].shape == want.shape, key
        np.testing.assert_allclose(s["layers"], want, rtol=0, atol=ATOL, err_msg=str(key))
    return sentences


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


# -- vectors: batch size, input order, splitting ------------------------------------------------
def test_vectors_equal_direct_model_calls_whatever_the_batch_size_or_order(tmp_path, docs, model_arg,
                                                                           reference_model):
    records = [{"id": f"d{i:02d}", "text": text} for i, text in enumerate(docs[:10])]
    runs = {}
    for seed, batch_tokens, split_mb in ((None, 16, 64.0), (1, 64, 64.0), (2, 8192, 0.001)):
        ordered = list(records)
        if seed is not None:
            random.Random(seed).shuffle(ordered)
        src = write_jsonl(tmp_path / f"in{batch_tokens}.jsonl", ordered)
        summary = extract(model_arg, [src], tmp_path / f"out{batch_tokens}", "--format", "jsonl",
                          "--id-field", "id", "--batch-tokens", str(batch_tokens), "--max-sentence-tokens", "24",
                          "--split-mb", str(split_mb))
        table = read_output(tmp_path / f"out{batch_tokens}")
        sentences = check_against_model(table, reference_model)
        assert summary["tokens"] == summary["token_rows_written"] == table.num_rows
        assert summary["sentences"] == summary["sentences_written"] == len(sentences)
        assert summary["windows_cut"] > 0 and any(key[2] > 0 for key in sentences)
        assert all(len(s["tokens"]) <= 24 for s in sentences.values())
        assert summary["documents_read"] == len(records) and summary["oom_splits"] == 0
        assert 0 <= summary["padding_ratio"] < 1
        runs[batch_tokens] = (summary, table)

    # smaller budgets make more, fuller batches; the padding they cost is what the ratio reports
    assert runs[16][0]["batches"] > runs[64][0]["batches"] > runs[8192][0]["batches"]
    assert runs[16][0]["batch_tokens"] == runs[8192][0]["batch_tokens"]
    # the same rows per token_id, and the same vectors to 1e-6. (Not always bit for bit with this
    # fixture: its 124 CNN filters are not a multiple of the CPU's vector width, and the highway's
    # sigmoid computes a tensor's unaligned tail with a scalar formula that can differ in the last
    # bit. Released shapes, 2048 filters, give identical bits.)
    base = runs[16][1]
    for batch_tokens in (64, 8192):
        other = runs[batch_tokens][1]
        assert other.column("token_id").equals(base.column("token_id"))
        keys = ["token", "char_start", "char_end"]
        assert other.select(keys).equals(base.select(keys))
        for name in ("layer_0", "layer_1", "layer_2"):
            a, b = vector_column(other, name), vector_column(base, name)
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


# -- input formats ------------------------------------------------------------------------------
def test_each_input_format(tmp_path, docs, model_arg, reference_model):
    """A document per file, JSONL with ids and event times, Parquet with ids (and a Parquet file
    without the text column, which becomes one error record). A document per line: the other tests."""
    few = docs[:4]
    files = tmp_path / "files"
    files.mkdir()
    for i, doc in enumerate(few):
        (files / f"doc{i}.txt").write_text(doc.replace(". ", ".\n"), encoding="utf-8")
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"id": f"j{i}", "text": d, "ts": f"2024-05-0{i + 1}T12:00:00Z"}
                                               for i, d in enumerate(few)])
    (tmp_path / "pq").mkdir()
    parquet, no_text = tmp_path / "pq" / "a.parquet", tmp_path / "pq" / "b.parquet"
    pq.write_table(pa.table({"doc": pa.array([10, 11, 12, 13], pa.int64()), "body": few}), parquet)
    pq.write_table(pa.table({"doc": pa.array([99], pa.int64()), "text": ["Not read: no 'body' column."]}), no_text)

    cases = {
        "files": ([files / "*.txt"], ["--doc-per", "file"],
                  {f"{files / f'doc{i}.txt'}:1": d.replace(". ", ".\n") for i, d in enumerate(few)}),
        "jsonl": ([jsonl],
                  ["--format", "jsonl", "--id-field", "id", "--timestamp-field", "ts", "--event-time", "field"],
                  {f"j{i}": d for i, d in enumerate(few)}),
        "parquet": ([tmp_path / "pq" / "*.parquet"],
                    ["--format", "parquet", "--text-field", "body", "--id-field", "doc"],
                    {str(10 + i): d for i, d in enumerate(few)}),
    }
    tokens_per_case = {}
    for name, (inputs, extra, expected_docs) in cases.items():
        summary = extract(model_arg, inputs, tmp_path / f"out-{name}", *extra)
        assert summary["documents_read"] == 4 + (name == "parquet")  # b.parquet's error is a record read
        table = read_output(tmp_path / f"out-{name}")
        sentences = check_against_model(table, reference_model)
        assert {key[0] for key in sentences} == set(expected_docs)
        for (doc_id, _, _), s in sentences.items():
            text_of_doc = expected_docs[doc_id]
            assert [text_of_doc[a:b] for a, b in zip(s["starts"], s["ends"])] == s["tokens"]
        tokens_per_case[name] = sorted(t for s in sentences.values() for t in s["tokens"])
        if name == "jsonl":
            stamps = dict(zip(table.column("doc_id").to_pylist(), table.column("event_timestamp").to_pylist()))
            assert stamps["j2"].isoformat() == "2024-05-03T12:00:00+00:00"
        else:
            assert "event_timestamp" not in table.column_names
        errors = read_errors(tmp_path / f"out-{name}")
        if name == "parquet":
            assert summary["read_errors"] == summary["documents_rejected"] == 1 and len(errors) == 1
            assert (errors[0]["source"], errors[0]["line"], errors[0]["stage"]) == (str(no_text), None, "read")
            assert "no text column 'body'" in errors[0]["reason"]
        else:
            assert summary["documents_rejected"] == 0 and errors == []
    # the same texts give the same tokens whatever the format
    assert len({tuple(t) for t in tokens_per_case.values()}) == 1


def test_memory_filesystem_and_gzip_input(tmp_path, docs, model_arg, reference_model):
    fs = fsspec.filesystem("memory")
    root = f"memory://elmo-test-{tmp_path.name}"
    with fsspec.open(f"{root}/corpus/part-0.txt.gz", "wb") as f:
        f.write(gzip.compress("\n".join(docs[:3]).encode()))
    with fsspec.open(f"{root}/corpus/part-1.txt.gz", "wb") as f:
        f.write(gzip.compress("\n".join(docs[3:5]).encode()))
    try:
        summary = extract(model_arg, [f"{root}/corpus/*.txt.gz"], tmp_path / "out")
        assert summary["documents_read"] == 5
        table = read_output(tmp_path / "out")
        sentences = check_against_model(table, reference_model)
        part = fs.unstrip_protocol(f"/elmo-test-{tmp_path.name}/corpus/part")
        assert {key[0] for key in sentences} == {f"{part}-0.txt.gz:{n}" for n in (1, 2, 3)} | {
            f"{part}-1.txt.gz:{n}" for n in (1, 2)}
        # Beam's sinks cannot write to memory://: refused before the job starts, not after the work
        with pytest.raises(ValueError, match="cannot write"):
            run(*parse_extract_args(["--input", f"{root}/corpus/*.gz", "--output", f"{root}/out", "--model", model_arg]))
    finally:
        fs.rm(f"/elmo-test-{tmp_path.name}", recursive=True)


def test_chinese_text(tmp_path, model_arg, reference_model):
    texts = ud_texts("ud_chinese_gsd", "zh_gsd-ud-dev.conllu", n=6)
    src = tmp_path / "zh.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    summary = extract(model_arg, [src], tmp_path / "out", "--lang", "zh")
    assert summary["documents_read"] == len(texts)
    sentences = check_against_model(read_output(tmp_path / "out"), reference_model)
    by_doc = defaultdict(list)
    for (doc_id, sentence_index, window), s in sorted(sentences.items()):
        by_doc[doc_id] += s["tokens"]
        text = texts[int(doc_id.rsplit(":", 1)[1]) - 1]
        assert [text[a:b] for a, b in zip(s["starts"], s["ends"])] == s["tokens"]
    for doc_id, tokens in by_doc.items():
        text = texts[int(doc_id.rsplit(":", 1)[1]) - 1]
        assert "".join(tokens) == "".join(text.split())
    all_tokens = [t for tokens in by_doc.values() for t in tokens]
    assert any(len(t) > 1 for t in all_tokens), "expected word segmentation (jieba), not single characters"
    meta = read_metadata(pq.read_schema(next((tmp_path / "out").glob("tokens-*.parquet"))))
    assert meta["tokenizer"]["segmenter"] == "jieba" and meta["tokenizer"]["jieba_version"] == jieba.__version__
    assert summary["zh_char_fallback_documents"] == 0


def test_chinese_named_by_another_code_is_segmented_as_zh(tmp_path, model_arg):
    """spaCy takes `zho` (and `chi`) for Chinese: it was then segmented into single characters,
    with jieba installed, while the metadata said lang zh and named no segmenter."""
    texts = ud_texts("ud_chinese_gsd", "zh_gsd-ud-dev.conllu", n=3)
    src = tmp_path / "zh.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    summary = extract(model_arg, [src], tmp_path / "out", "--lang", "zho", "--layers", "top")
    table = read_output(tmp_path / "out")
    got = defaultdict(list)
    for row in sorted(table.select(["doc_id", "sentence_index", "token_index", "token"]).to_pylist(),
                      key=lambda r: (r["doc_id"], r["sentence_index"], r["token_index"])):
        got[int(row["doc_id"].rsplit(":", 1)[1])].append(row["token"])
    nlp = build_nlp("zh")
    expected = {line: [t.text for t in nlp(text) if not t.is_space] for line, text in enumerate(texts, 1)}
    assert dict(got) == expected and sum(map(len, expected.values())) < sum(len("".join(t.split())) for t in texts)
    meta = read_metadata(pq.read_schema(next((tmp_path / "out").glob("tokens-*.parquet"))))
    assert meta["tokenizer"]["lang"] == "zh" and meta["tokenizer"]["segmenter"] == "jieba"
    assert summary["zh_char_fallback_documents"] == 0


# -- bad inputs, errors and reconciliation ------------------------------------------------------
def test_bad_inputs_go_to_the_error_files_and_counts_reconcile(tmp_path, model_arg, reference_model):
    lines = [
        json.dumps({"id": "ok1", "text": "A good line."}).encode(),
        b'{"id": "latin1", "text": "caf\xe9"}',  # invalid UTF-8
        b'{"id": "malformed", "text": "no closing brace"',
        json.dumps({"id": "num\u2028b\x85e\u2029r", "text": 42}).encode(),  # line breaks to str.splitlines
        b"",  # blank: not a document
        json.dumps({"id": "blank", "text": "   "}).encode(),  # a document without tokens
        json.dumps({"id": "ok2", "text": "Another good one. It has two sentences."}).encode(),
    ]  # documents over spaCy's max_length give rows: tests/test_hardening_inputs.py
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    summary = extract(model_arg, [src], tmp_path / "out", "--format", "jsonl", "--id-field", "id")
    records = 6
    assert summary["documents_read"] == 6 and summary["read_errors"] == 3
    assert summary["tokenize_errors"] == 0 and summary["empty_documents"] == 1
    assert summary["documents_rejected"] == 3
    # README's identity, with the file's own fields
    assert summary["documents_read"] == summary["documents_tokenized"] + summary["documents_rejected"]
    table = read_output(tmp_path / "out")
    embedded = set(table.column("doc_id").to_pylist())
    assert embedded == {"ok1", "ok2"}
    # documents read = embedded + empty + rejected; tokens after tokenization = token rows written
    assert summary["documents_read"] == records
    assert len(embedded) + summary["empty_documents"] + summary["documents_rejected"] == records
    assert summary["tokens"] == summary["token_rows_written"] == table.num_rows
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
    check_against_model(table, reference_model)

    errors = sorted(read_errors(tmp_path / "out"), key=lambda e: e["line"])
    assert [(e["source"], e["line"], e["stage"]) for e in errors] == [
        (str(src), 2, "read"), (str(src), 3, "read"), (str(src), 4, "read")]
    reasons = [e["reason"] for e in errors]
    assert "invalid UTF-8" in reasons[0] and "malformed JSON" in reasons[1]
    assert "not a string" in reasons[2]
    assert [e["doc_id"] for e in errors] == [None, None, "num\u2028b\x85e\u2029r"]  # the id, where parsed


def test_event_times_in_the_output_convert_back_and_untimed_records_are_errors(tmp_path, model_arg):
    # "9999-12-31T23:00:00-05:00" is year 10000 in UTC: pyarrow wrote it, and reading the file
    # back with to_pylist() raised OverflowError. With --event-time field a record without a time
    # is an error, as one without an id (its rows would never be materialized by a feature store).
    records = [{"id": "a", "text": "First one.", "ts": "2024-05-01T12:00:00+02:00"},
               {"id": "late", "text": "Too late.", "ts": "9999-12-31T23:00:00-05:00"},
               {"id": "early", "text": "Too early.", "ts": "0001-01-01T00:00:00+05:00"},
               {"id": "none", "text": "No time."},
               {"id": "null", "text": "Null time.", "ts": None}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    summary = extract(model_arg, [src], tmp_path / "out", "--format", "jsonl", "--id-field", "id",
                      "--timestamp-field", "ts", "--event-time", "field")
    rows = read_output(tmp_path / "out").select(["doc_id", "event_timestamp"]).to_pylist()  # converts every value
    assert {(r["doc_id"], r["event_timestamp"]) for r in rows} == {
        ("a", datetime.datetime(2024, 5, 1, 10, tzinfo=datetime.timezone.utc))}
    range_reason = "timestamp field 'ts' is outside Python's datetime range (years 1 to 9999) in UTC"
    assert {e["doc_id"]: (e["line"], e["reason"]) for e in read_errors(tmp_path / "out")} == {
        "late": (2, range_reason), "early": (3, range_reason), "none": (4, "missing timestamp field 'ts'"),
        "null": (5, "timestamp field 'ts' is null, not an ISO 8601 time")}
    assert (summary["documents_read"], summary["documents_tokenized"], summary["documents_rejected"]) == (5, 1, 4)


def test_dictionary_encoded_parquet_columns_are_embedded(tmp_path, model_arg, reference_model):
    # what pandas writes for categoricals: every row was dropped with "has type dictionary<...>"
    texts = ["Dict encoded one.", "Dict two.", "Dict encoded one."]
    pq.write_table(pa.table({"id": pa.array(["y1", "y2", "y3"]).dictionary_encode(),
                             "text": pa.array(texts).dictionary_encode()}), tmp_path / "in.parquet")
    summary = extract(model_arg, [tmp_path / "in.parquet"], tmp_path / "out", "--format", "parquet",
                      "--id-field", "id")
    assert summary["read_errors"] == 0 and summary["documents_tokenized"] == 3
    sentences = check_against_model(read_output(tmp_path / "out"), reference_model)
    assert {key[0]: s["tokens"] for key, s in sentences.items()} == {
        "y1": ["Dict", "encoded", "one", "."], "y2": ["Dict", "two", "."], "y3": ["Dict", "encoded", "one", "."]}


def test_a_mix_that_overflows_float16_is_counted_and_fails_the_command(tmp_path, model_arg, capsys):
    # the largest gamma a mix file may have, on layer 0 alone: in float32 the mix is exactly
    # 10000 x layer_0 (the other weights are 0 after the softmax), and some values pass float16's range
    mix = tmp_path / "loud.json"
    mix.write_text(json.dumps({"loud": {"weights": [0, -10000, -10000], "gamma": 10000}}))
    src = tmp_path / "in.txt"
    src.write_text("Hello world. This is a test.\nSecond line here.\n", encoding="utf-8")
    wide = extract(model_arg, [src], tmp_path / "f32", "--mix", f"loud={mix}")
    table = read_output(tmp_path / "f32")
    loud = vector_column(table, "mix_loud")
    np.testing.assert_array_equal(loud, np.float32(10000) * vector_column(table, "layer_0"))
    overflowing = int((np.abs(loud) >= 65520).sum())  # what rounds to inf in float16
    assert overflowing > 0 and wide["vectors_finite"] is True and wide["nonfinite_values"] == 0

    argv = ["--input", str(src), "--output", str(tmp_path / "f16"), "--model", model_arg, "--mix", f"loud={mix}"]
    assert main(argv) == 1  # float16, the default
    summary = json.loads((tmp_path / "f16" / "summary.json").read_text())
    assert (summary["nonfinite_values"], summary["nonfinite_values_by_column"], summary["vectors_finite"]) == (
        overflowing, {"mix_loud": overflowing}, False)
    assert summary["documents_reconcile"] and summary["tokens_reconcile"]  # every row is still written
    narrow = vector_column(read_output(tmp_path / "f16"), "mix_loud")
    assert int(np.isinf(narrow).sum()) == overflowing
    assert f"extract: {overflowing} vector values written are not finite" in capsys.readouterr().err


# -- output: metadata, layouts, layers, dtypes, mixes -------------------------------------------
@pytest.fixture(scope="module")
def mixed_runs(tmp_path_factory, docs, model_arg):
    """The same input written with mixes as token and sentence layouts (float32)."""
    tmp = tmp_path_factory.mktemp("mixed")
    src = tmp / "in.txt"
    src.write_text("\n".join(docs[:6]) + "\n", encoding="utf-8")
    mix_file = tmp / "mixes.json"
    mix_file.write_text(json.dumps({"task": {"weights": [0.2, -0.5, 1.0], "gamma": 0.5},
                                    "other": {"weights": [1, 1, 1], "layer_norm": True}}))
    mixes = ["--mix", "avg=average", "--mix", f"task={mix_file}"]
    summaries = {layout: extract(model_arg, [src], tmp / layout, "--layout", layout, *mixes)
                 for layout in ("token", "sentence")}
    return tmp, summaries


def test_metadata_describes_the_run(mixed_runs, model_arg, reference_model):
    tmp, _ = mixed_runs
    files = sorted((tmp / "token").glob("tokens-*.parquet"))
    model = BiLM.load(model_arg, cache_size=0)
    for f in files:
        meta = read_metadata(pq.read_schema(f))
        assert meta["package_version"] == elmo_pipeline.__version__
        assert meta["model"]["sha256"] == model.checksum and len(model.checksum) == 64
        assert meta["model"]["config"] == json.loads(json.dumps(model.config.to_dict()))
        assert meta["model"]["location"] == model_arg
        assert meta["mixes"] == {"avg": {"weights": [0.0, 0.0, 0.0], "gamma": 1.0, "layer_norm": False},
                                 "task": {"weights": [0.2, -0.5, 1.0], "gamma": 0.5, "layer_norm": False}}
        assert meta["tokenizer"] == {"library": "spacy", "lang": "en", "model": None, "max_sentence_tokens": 256}
        assert meta["layers"] == layer_meanings(3) and set(meta["layers"]) == {"layer_0", "layer_1", "layer_2"}
        assert meta["dtype"] == "float32"


def test_token_layout_schema_values_and_mixes(mixed_runs, reference_model):
    tmp, summaries = mixed_runs
    table = read_output(tmp / "token")
    width = 2 * reference_model.config.lstm.projection_dim
    vector = pa.list_(pa.float32(), width)
    expected_fields = [("token_id", pa.string()), ("doc_id", pa.string()), ("sentence_index", pa.int32()),
                       ("window_index", pa.int32()), ("token_index", pa.int32()), ("token", pa.string()),
                       ("char_start", pa.int64()), ("char_end", pa.int64()), ("layer_0", vector),
                       ("layer_1", vector), ("layer_2", vector), ("mix_avg", vector), ("mix_task", vector)]
    assert [(f.name, f.type) for f in table.schema] == expected_fields
    assert table.num_rows == summaries["token"]["tokens"]
    ids = table.column("token_id").to_pylist()
    assert len(set(ids)) == len(ids)
    cols = table.select(["doc_id", "sentence_index", "window_index", "token_index"]).to_pydict()
    assert ids == sorted(f"{d}:{s}:{w}:{k}" for d, s, w, k in zip(*cols.values()))
    check_against_model(table, reference_model)
    layers = np.stack([vector_column(table, f"layer_{j}") for j in range(3)])
    np.testing.assert_allclose(vector_column(table, "mix_avg"), layers.mean(0), rtol=0, atol=ATOL)
    w = np.exp([0.2, -0.5, 1.0]) / np.exp([0.2, -0.5, 1.0]).sum()
    np.testing.assert_allclose(vector_column(table, "mix_task"), 0.5 * np.tensordot(w, layers, axes=1),
                               rtol=0, atol=ATOL)


def test_sentence_layout_lines_up_with_token_layout(mixed_runs):
    tmp, summaries = mixed_runs
    tokens = read_output(tmp / "token")
    sentences = read_output(tmp / "sentence", "sentence")
    assert summaries["sentence"]["sentences_written"] == sentences.num_rows == summaries["token"]["sentences"]
    assert summaries["sentence"]["token_rows_written"] == tokens.num_rows
    names = ["layer_0", "layer_1", "layer_2", "mix_avg", "mix_task"]
    assert sentences.schema.names == ["sentence_id", "doc_id", "sentence_index", "window_index", "tokens",
                                      "char_starts", "char_ends", *names]
    assert sentences.schema.field("layer_0").type == pa.list_(pa.list_(pa.float32(), 32))
    by_token = {tid: i for i, tid in enumerate(tokens.column("token_id").to_pylist())}
    token_cols = {c: tokens.column(c).to_pylist() for c in ("token", "char_start", "char_end")}
    token_vectors = {c: vector_column(tokens, c) for c in names}
    for row in sentences.to_pylist():
        idx = [by_token[f"{row['sentence_id']}:{k}"] for k in range(len(row["tokens"]))]
        assert row["sentence_id"] == f"{row['doc_id']}:{row['sentence_index']}:{row['window_index']}"
        assert row["tokens"] == [token_cols["token"][i] for i in idx]
        assert row["char_starts"] == [token_cols["char_start"][i] for i in idx]
        assert row["char_ends"] == [token_cols["char_end"][i] for i in idx]
        for c in names:
            np.testing.assert_array_equal(np.array(row[c], np.float32), token_vectors[c][idx])
    assert sum(len(t) for t in sentences.column("tokens").to_pylist()) == tokens.num_rows


@pytest.mark.parametrize("layers, dtype", [("top", "float16"), ("none", "float32")])
def test_layers_and_dtype_options(tmp_path, mixed_runs, model_arg, layers, dtype):
    tmp, _ = mixed_runs
    base = read_output(tmp / "token")
    extract(model_arg, [tmp / "in.txt"], tmp_path / "out", "--layers", layers, "--dtype", dtype,
            "--mix", "avg=average")
    table = read_output(tmp_path / "out")
    vector = pa.list_(pa.float16() if dtype == "float16" else pa.float32(), 32)
    expected_vectors = (["layer_2"] if layers == "top" else []) + ["mix_avg"]
    assert table.schema.names[:8] == base.schema.names[:8]
    assert table.schema.names[8:] == expected_vectors
    assert all(table.schema.field(c).type == vector for c in expected_vectors)
    assert read_metadata(table.schema)["dtype"] == dtype
    assert table.column("token_id").equals(base.column("token_id"))
    for c in expected_vectors:
        # float16 is the float32 result rounded once
        np.testing.assert_array_equal(vector_column(table, c), vector_column(base, c).astype(dtype))


# -- output folder and the command line ---------------------------------------------------------
def test_main_prints_the_summary_and_refuses_to_reuse_the_output_folder(tmp_path, model_arg, capsys):
    src = tmp_path / "in.txt"
    src.write_text("First document. It has two sentences.\nSecond document.\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--input", str(src), "--output", str(out), "--model", model_arg]
    assert main([*argv, "--num-shards", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "summary.json").read_text())
    for name in ("documents_read", "sentences", "tokens", "padding_ratio", "batches", "oom_splits",
                 "documents_rejected", "token_rows_written", "seconds", "tokens_per_second"):
        assert name in printed
    assert (printed["documents_read"], printed["sentences"], printed["tokens"]) == (2, 3, 11)
    assert printed["documents_rejected"] == printed["oom_splits"] == 0 and printed["batches"] >= 1
    assert 0 <= printed["padding_ratio"] < 1
    table = read_output(out)
    assert table.schema.field("layer_0").type == pa.list_(pa.float16(), 32)  # the default dtype
    assert np.isfinite(vector_column(table, "layer_2").astype(np.float32)).all()

    (out / "notes.txt").write_text("not ours")
    before = sorted(p.name for p in out.iterdir())
    assert "tokens-00001-of-00002.parquet" in before
    assert main(argv) == 2
    assert "already holds output of an earlier run (4 files); use --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before  # nothing touched
    summary = extract(model_arg, [src], out, "--overwrite", "--num-shards", "1")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["errors-00000-of-00001.jsonl", "notes.txt", "summary.json", "tokens-00000-of-00001.parquet"]
    assert read_output(out).num_rows == summary["tokens"] == 11


def test_error_records_lost_after_they_were_counted_fail_the_command(tmp_path, model_arg, monkeypatch, capsys):
    """The rejected records were counted but never checked against the errors-*.jsonl files: a
    record lost on its way to the error sink left its document in no file, and the run passed."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "One."}\n{"id": "a", "text": "Two."}\n{"text": "No id."}\n{bad\n')
    argv = ["--input", str(src), "--format", "jsonl", "--id-field", "id", "--model", model_arg]
    assert main([*argv, "--output", str(tmp_path / "whole")]) == 1  # an id used twice exits 1 on its own
    assert ("extract: 1 document id(s) are used by several documents, each named in errors-*.jsonl: their "
            "token_ids are not unique") in capsys.readouterr().err
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert whole["read_errors"] == 2 and whole["duplicate_doc_ids"] == 1 and whole["ids_unique"] is False
    assert whole["errors_reconcile"] and whole["error_records_in_files"] == whole["error_records_counted"] == 3
    assert len(read_errors(tmp_path / "whole")) == 3
    lose_the_first_text_record(monkeypatch)
    out = tmp_path / "out"
    assert main([*argv, "--output", str(out), "--skip-id-check"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["documents_reconcile"] and summary["tokens_reconcile"] and summary["files_reconcile"]
    assert summary["errors_reconcile"] is False and summary["error_records_counted"] == 2
    assert summary["error_records_in_files"] == len(read_errors(out)) == 1
    assert ("the errors-*.jsonl files hold 1 records, but the job counted 2 into its sink"
            in capsys.readouterr().err)


def _failed_jsonl_extract(model_arg: str, src: Path, out: Path) -> dict:
    """extract of JSONL documents with ids, which must exit 1; the summary it wrote."""
    assert main(["--input", str(src), "--format", "jsonl", "--id-field", "id", "--model", model_arg,
                 "--output", str(out)]) == 1
    return json.loads((out / "summary.json").read_text())


def test_a_document_lost_between_reading_and_tokenizing_fails_documents_reconcile(tmp_path, model_arg, monkeypatch,
                                                                                    capsys):
    """documents_reconcile is documents_read == documents_tokenized + read and tokenize errors: a
    document that left the tokenizer with neither sentences nor an error record (a read error beside
    it, so that the errors take part) is unaccounted for, and the command exits 1."""
    from elmo_pipeline.transforms import tokenize

    kept = tokenize.tokenize_documents

    def lose_the_first(nlp, docs, max_sentence_tokens=256):
        return kept(nlp, [d for d in docs if d.doc_id != "a"], max_sentence_tokens)

    monkeypatch.setattr(tokenize, "tokenize_documents", lose_the_first)
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "One."}\n{"id": "b", "text": "Two words."}\n{bad\n')
    summary = _failed_jsonl_extract(model_arg, src, tmp_path / "out")
    assert (summary["documents_read"], summary["documents_tokenized"], summary["read_errors"]) == (3, 1, 1)
    assert summary["documents_reconcile"] is False
    assert summary["tokens_reconcile"] and summary["files_reconcile"] and summary["errors_reconcile"]
    # exit 1 said why, as the other checks do (it printed nothing)
    assert ("extract: 3 documents were read, but 1 were tokenized and 1 rejected (read and tokenize errors): "
            "documents were lost or doubled between reading and tokenizing") in capsys.readouterr().err


def test_a_sentence_lost_between_tokenizing_and_writing_fails_tokens_reconcile(tmp_path, model_arg, monkeypatch,
                                                                                 capsys):
    """tokens_reconcile is tokens == token_rows_written: a sentence the embedding stage never passed
    on leaves its tokens counted and unwritten, and the command exits 1 saying so."""
    from elmo_pipeline.transforms.embed import ElmoModelHandler

    kept = ElmoModelHandler.run_inference

    def lose_a_sentence(self, batch, model, inference_args=None):
        out = list(kept(self, batch, model, inference_args))
        return [e for e in out if getattr(getattr(e, "sentence", None), "doc_id", None) != "b"]

    monkeypatch.setattr(ElmoModelHandler, "run_inference", lose_a_sentence)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "One two."}, {"id": "b", "text": "Three."}])
    summary = _failed_jsonl_extract(model_arg, src, tmp_path / "out")
    assert (summary["tokens"], summary["token_rows_written"], summary["tokens_reconcile"]) == (5, 3, False)
    assert summary["documents_reconcile"] and summary["files_reconcile"]
    assert ("extract: 5 tokens were tokenized, but 3 token rows were written: tokens were lost or doubled between "
            "tokenizing and writing") in capsys.readouterr().err


def test_padding_ratio_is_the_share_of_padded_tokens_in_the_batch(tmp_path, model_arg):
    """Two sentences in one batch: each weighs its tokens + 2 boundaries and is padded to the
    heavier one; the ratio is 1 - weight / padded, recomputed here from the rows written."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "Hi."},
                                               {"id": "b", "text": "The cat sat on the mat all day."}])
    summary = extract(model_arg, [src], tmp_path / "out", "--format", "jsonl", "--id-field", "id")
    lengths = [len(s["tokens"]) for s in sentences_of(read_output(tmp_path / "out")).values()]
    assert summary["batches"] == 1 and len(lengths) == 2
    weight, padded = sum(n + 2 for n in lengths), 2 * (max(lengths) + 2)
    assert (summary["batch_tokens"], summary["batch_padded_tokens"]) == (weight, padded)
    assert summary["padding_ratio"] == round(1 - weight / padded, 4) > 0


def test_rows_lost_after_they_were_counted_fail_the_command(tmp_path, model_arg, monkeypatch, capsys):
    """The sink's counts come before its shuffle: a runner that drops a table after them (as
    Beam's multi_threading workers could, transforms/data_plane.py) must not pass for a whole run."""
    from elmo_pipeline.transforms import write

    src = tmp_path / "in.txt"
    src.write_text("\n".join(f"Document {k} has a sentence. And a second one." for k in range(6)) + "\n")
    kept = write._ParquetSink.write_record
    tables = []

    def drop_the_second(self, opened, table):
        tables.append(table.num_rows)
        if len(tables) != 2:
            kept(self, opened, table)

    monkeypatch.setattr(write._ParquetSink, "write_record", drop_the_second)
    out = tmp_path / "out"
    # a row group of about one sentence: several tables
    assert main(["--input", str(src), "--output", str(out), "--model", model_arg, "--row-group-mb", "0.0001"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_reconcile"] and len(tables) > 2  # every count upstream of the sink still holds
    assert summary["files_reconcile"] is False and summary["rows_counted"] == summary["tokens"]
    assert summary["rows_in_files"] == summary["tokens"] - tables[1] == read_output(out).num_rows
    assert (f"the Parquet shards hold {summary['rows_in_files']} rows, but the job counted {summary['tokens']}"
            in capsys.readouterr().err)
