"""The Beam stages after tokenization: EmbedSentences, MixLayers, WriteParquet/WriteErrors, and the
out-of-memory split of `embed_batch`, each under TestPipeline + assert_that on the FnApiRunner."""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import tempfile

import apache_beam as beam
import numpy as np
from apache_beam import typehints
from apache_beam.typehints.decorators import TypeCheckError
import pyarrow.parquet as pq
import pytest
import torch
from apache_beam.metrics import MetricsFilter
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import BeamAssertException, assert_that, equal_to

from elmo_pipeline.embedding.batch import embed_batch, length_sorted_batches, sentence_weight
from elmo_pipeline.corpus.records import EmbeddedSentence, ErrorRecord, Sentence
from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix, load_mix_specs
from elmo_pipeline.corpus.schema import OutputSpec, build_table, read_metadata
from elmo_pipeline.runtime import PlannedRuntime
from elmo_pipeline.transforms.embed import (SHARED_MODEL_TAG, ElmoModelHandler, EmbedSentences,
                                            remove_shared_model_files)
from elmo_pipeline.transforms.mix import MixLayers
from elmo_pipeline.transforms.pretokenized import (PretokenizedSentences, ReadTokenizedFiles, TokenizedText,
                                                   pretokenized_sentences)
from elmo_pipeline.transforms.read import FindDuplicateIds
from elmo_pipeline.transforms.tokenize import TokenizeWithSpacy
from elmo_pipeline.transforms.write import WriteErrors, WriteParquet

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
ATOL = 1e-6

TEXTS = [
    "The quick brown fox jumps over the lazy dog .",
    "Hello !",
    "ELMo vectors depend on the whole sentence , not only on the word .",
    "A",
    "Colorless green ideas sleep furiously .",
    "She said that the results , which were surprising , would be published next week in a journal .",
    "Zero state means batches never change a vector .",
    "Ünïcödé wörds and 数字 123 too .",
]


def make_sentence(doc: str, index: int, tokens: list[str]) -> Sentence:
    starts, pos = [], 0
    for token in tokens:
        starts.append(pos)
        pos += len(token) + 1
    starts_arr = np.array(starts, dtype=np.int64)
    ends = starts_arr + np.array([len(t) for t in tokens], dtype=np.int64)
    return Sentence(doc, index, 0, tuple(tokens), starts_arr, ends)


@pytest.fixture(scope="module")
def sentences() -> list[Sentence]:
    return [make_sentence(f"doc{i // 3}", i % 3, text.split()) for i, text in enumerate(TEXTS)]



@pytest.fixture(scope="module")
def expected(reference_model, sentences) -> dict[tuple, np.ndarray]:
    """Each sentence embedded alone by a direct model call: key -> (L+1, n, 2P) float32."""
    out = {}
    with torch.inference_mode():
        for s in sentences:
            out[s.key] = reference_model.embed([list(s.tokens)]).layers[:, 0].float().numpy()
    return out


def pipeline() -> BeamTestPipeline:
    return BeamTestPipeline(runner=LOCAL_RUNNER)


def counter(result, name: str) -> int:
    values = [c.committed if c.committed is not None else c.attempted
              for c in result.metrics().query(MetricsFilter().with_name(name))["counters"]
              if c.key.metric.namespace == "elmo_pipeline"]
    return sum(v or 0 for v in values)


def matches_layers(expected: dict[tuple, np.ndarray], with_mixes: dict[str, ScalarMix] | None = None):
    """A matcher: every expected sentence exactly once, with its tokens and vectors (and mixes)."""

    def check(actual: list[EmbeddedSentence]) -> None:
        keys = sorted(item.sentence.key for item in actual)
        if keys != sorted(expected):
            raise BeamAssertException(f"sentences {keys} != {sorted(expected)}")
        for item in actual:
            want = expected[item.sentence.key]
            if item.layers.dtype != np.float32 or item.layers.shape != want.shape:
                raise BeamAssertException(f"{item.sentence.key}: {item.layers.dtype} {item.layers.shape}")
            if not np.allclose(item.layers, want, rtol=0, atol=ATOL):
                raise BeamAssertException(f"{item.sentence.key}: max diff {np.abs(item.layers - want).max()}")
            for name, mix in (with_mixes or {}).items():
                with torch.inference_mode():
                    mixed = mix(torch.from_numpy(want)).numpy()
                if name not in item.mixes or not np.allclose(item.mixes[name], mixed, rtol=0, atol=ATOL):
                    raise BeamAssertException(f"{item.sentence.key}: mix {name} differs")
            if set(item.mixes) != set(with_mixes or {}):
                raise BeamAssertException(f"{item.sentence.key}: mixes {sorted(item.mixes)}")

    return check


# -- EmbedSentences -----------------------------------------------------------------------------
@pytest.mark.parametrize("batch_tokens, max_sentences", [(8192, 1024), (20, 1024), (8192, 3)])
def test_embed_sentences_matches_direct_model_calls(model_arg, sentences, expected, batch_tokens, max_sentences):
    p = pipeline()
    embedded = (p | beam.Create(sentences)
                | EmbedSentences(model_arg, device="cpu", batch_tokens=batch_tokens,
                                 max_batch_sentences=max_sentences, cache_size=0))
    assert_that(embedded, matches_layers(expected))
    result = p.run()
    result.wait_until_finish()
    lengths = [len(s.tokens) + 2 for s in sentences]
    assert counter(result, "batch_tokens") == sum(lengths)
    batches = counter(result, "batches")
    assert batches >= 1 and counter(result, "batch_padded_tokens") >= sum(lengths)
    if max_sentences == 3:
        assert batches >= -(-len(sentences) // 3)
    if batch_tokens == 20:  # the longest sentence alone is over the budget: it still goes through, alone
        assert batches > 2
    assert counter(result, "oom_splits") == 0


def test_embed_sentences_rejects_empty_budgets():
    with pytest.raises(ValueError):
        EmbedSentences(None, batch_tokens=0)
    with pytest.raises(ValueError):
        EmbedSentences(None, max_batch_sentences=0)


@pytest.mark.parametrize("option", [{"torch_threads": 2.5}, {"torch_threads": True}, {"cache_size": 10.5},
                                    {"workers": 1.5}, {"batch_tokens": "100"}, {"max_batch_sentences": 2.5},
                                    {"sort_buffer_tokens": 1e6}])
def test_embed_sentences_refuses_counts_that_are_not_ints_when_built(option):
    """torch_threads 2.5 or True and cache_size 10.5 were taken, and every worker then failed as it
    loaded the model, after the reading, naming no option; a str failed with Python's words."""
    (name, value), = option.items()
    with pytest.raises(TypeError, match=re.escape(f"{name} must be an int, got {value!r}")):
        EmbedSentences(None, **option)


@pytest.mark.parametrize("option, error, says", [
    ({"device": "gpu"}, ValueError, "device 'gpu' is not a torch device"),
    ({"precision": "fp64"}, ValueError, "precision must be one of"),
    ({"kernel": "fastest"}, ValueError, "kernel must be one of"),
    ({"cache_size": -1}, ValueError, "cache_size must be >= 0, got -1"),
    ({"torch_threads": -2}, ValueError, "torch_threads must be from 0 to"),
    ({"torch_threads": 2.5}, TypeError, "torch_threads must be an int, got 2.5")])
def test_model_handler_for_a_runinference_of_ones_own_checks_its_options_when_built(option, error, says):
    """Given to Beam's RunInference directly, the handler took these, and each worker failed as
    it loaded the model, after the reading."""
    with pytest.raises(error, match=re.escape(says)):
        ElmoModelHandler(None, **option)


@pytest.mark.parametrize("option, says", [
    ({"large_model": "no"}, "large_model must be a bool, got 'no'"),  # taken for True: one model shared
    ({"planned": "cpu"}, "planned must be a PlannedRuntime or None, got 'cpu'"),
    ({"planned": ("cpu", "exact")}, "planned must be a PlannedRuntime or None, got ('cpu', 'exact')")])
def test_a_flag_or_plan_of_the_wrong_type_is_refused_when_built(model_arg, sentences, option, says):
    """A planned device given as a str failed every worker's first batch, after the reading ("'str'
    object has no attribute 'device'"); the same plan as a PlannedRuntime embeds."""
    for build in (EmbedSentences, ElmoModelHandler):
        with pytest.raises(TypeError, match=re.escape(says)):
            build(model_arg, **option)
    p = pipeline()
    planned = PlannedRuntime("cpu", "exact")
    out = (p | beam.Create(sentences[:2]) | EmbedSentences(model_arg, device="cpu", kernel="exact", planned=planned)
           | beam.Map(lambda e: (e.sentence.key, e.layers.shape[1])))
    assert_that(out, equal_to([(s.key, len(s.tokens)) for s in sentences[:2]]))
    p.run().wait_until_finish()


def test_a_device_that_is_no_name_of_one_is_a_type_error_naming_the_option():
    """device=None (as if for the default) failed in torch.device with a TypeError listing its
    signatures ("device() received an invalid combination of arguments - got (NoneType), ...")."""
    for build in (EmbedSentences, ElmoModelHandler):
        for value in (None, True, 1.5, b"cpu"):
            with pytest.raises(TypeError, match=re.escape("device must be a str (auto, cpu, cuda, cuda:N), a "
                                                          f"torch.device or a CUDA index, got {value!r}")):
                build(None, device=value)
        assert build(None, device=torch.device("cpu")) is not None  # a torch.device, as before


@pytest.mark.parametrize("option, says", [
    ({"precision": "fp64"}, "precision must be one of ('fp32', 'bf16', 'fp16'), got 'fp64'"),
    ({"kernel": "fastest"}, "kernel must be one of"),
    ({"device": "gpu"}, "device 'gpu' is not a torch device (auto, cpu, cuda, cuda:N)"),
    # torch devices we do not run on: each failed in the worker, after the reading
    ({"device": "meta"}, "device 'meta': elmo-pipeline runs on cpu or cuda (auto picks one), not meta"),
    ({"device": "mps"}, "device 'mps': elmo-pipeline runs on cpu or cuda (auto picks one), not mps"),
    ({"device": "xpu:0"}, "device 'xpu:0': elmo-pipeline runs on cpu or cuda (auto picks one), not xpu"),
    # built without a word, then every worker failed at its first batch, after the reading
    ({"device": "cpu", "precision": "fp16"}, "fp16 autocast is for GPUs; use bf16 or fp32 on CPU"),
])
def test_embed_sentences_refuses_names_no_machine_has_when_built(option, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        EmbedSentences(None, **option)


def test_embed_sentences_refuses_the_fused_kernel_for_a_model_with_clips_when_built(model_arg, reference_model,
                                                                                     tmp_path):
    """Before any worker starts, from the config alone: the folder below has no weights file."""
    reference_model.save_pretrained(str(tmp_path / "native"))
    (tmp_path / "native" / "model.safetensors").unlink()
    for location in (model_arg, str(tmp_path / "native")):
        with pytest.raises(ValueError, match=r"kernel 'fused' .* this model clips \(cell_clip 3\.0, proj_clip 3\.0\)"):
            EmbedSentences(location, kernel="fused")
        assert EmbedSentences(location, kernel="exact").handler.kernel == "exact"
    assert EmbedSentences(None, kernel="fused").handler.kernel == "fused"  # the default model has no clips


def test_a_model_location_that_holds_no_model_is_refused_when_built(model_arg, tmp_path):
    """A folder without config.json, or a path that is not there, was taken, and every worker then
    failed as it loaded the model, after the reading and tokenizing ('.../config.json: file not
    found [while running 'EmbedSentences/RunInference/...']')."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for location in (str(empty), str(tmp_path / "missing"), f"{tmp_path}/missing.json,{tmp_path}/w.hdf5"):
        config = location.split(",")[0] if "," in location else f"{location}/config.json"
        for build in (EmbedSentences, ElmoModelHandler):
            with pytest.raises(ValueError, match=re.escape(f"{config}: file not found")):
                build(location)
    assert EmbedSentences(model_arg).handler.model_location == model_arg


# -- MixLayers ----------------------------------------------------------------------------------
def test_mix_layers_adds_each_named_mix(model_arg, sentences, expected, reference_model):
    n_layers = reference_model.config.n_output_layers
    specs = {"average": MixSpec.preset("average", n_layers), "top": MixSpec.preset("top", n_layers),
             "task": MixSpec((0.5, -1.0, 2.0)[:n_layers], gamma=0.7, layer_norm=True)}
    mixes = {name: ScalarMix.from_spec(spec).eval() for name, spec in specs.items()}
    p = pipeline()
    mixed = (p | beam.Create(sentences)
             | EmbedSentences(model_arg, device="cpu", batch_tokens=64)
             | MixLayers(specs, n_layers))
    assert_that(mixed, matches_layers(expected, mixes))

    def top_is_last_layer(actual):
        for item in actual:
            if not np.array_equal(item.mixes["top"], item.layers[-1]):
                raise BeamAssertException("the top preset is not the top layer bit for bit")
            w = np.exp(np.array(specs["task"].weights) - max(specs["task"].weights))
            w /= w.sum()
            x = item.layers
            x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-12)
            if not np.allclose(item.mixes["task"], 0.7 * np.tensordot(w, x, axes=1), atol=1e-5):
                raise BeamAssertException("the task mix is not gamma * softmax(w) . layer_norm(layers)")

    assert_that(mixed, top_is_last_layer, label="TopAndTask")
    p.run().wait_until_finish()


def test_mix_layers_without_mixes_passes_through_and_checks_weights(reference_model):
    n_layers = reference_model.config.n_output_layers
    with pytest.raises(ValueError, match="weights"):
        MixLayers({"bad": MixSpec((0.0,) * (n_layers + 1))}, n_layers)
    item = EmbeddedSentence(make_sentence("d", 0, ["a"]), np.ones((n_layers, 1, 4), np.float32), {})
    p = pipeline()
    out = p | beam.Create([item]) | MixLayers({}, n_layers) | beam.Map(lambda e: (e.sentence.key, sorted(e.mixes)))
    assert_that(out, equal_to([(("d", 0, 0), [])]))
    p.run().wait_until_finish()


def test_mix_layers_names_a_mix_it_cannot_compute_or_write_when_built():
    """A mix file's dicts (json.load of examples/mixes.json) failed with "'dict' object has no
    attribute 'weights'", and a name no Parquet column takes ('a b', '') was taken, computed on
    every sentence and never written (OutputSpec refuses such a name)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mixes.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    average = MixSpec.preset("average", 3)
    for specs, n_layers, error, says in (
            (json.loads(text), 3, TypeError, "mix 'syntax' is a dict, not a MixSpec"),
            ({"a b": average}, 3, ValueError, "mix name 'a b': use a letter"),
            ({"": average}, 3, ValueError, "mix name '': use a letter"),
            ({5: average}, 3, TypeError, "mix name 5 is not a str"),
            ([average], 3, TypeError, "specs maps each mix's name to its MixSpec, got a list"),
            ({"avg": average}, 3.0, TypeError, "n_layers must be an int, got 3.0")):
        with pytest.raises(error, match=re.escape(says)):
            MixLayers(specs, n_layers)
    loaded = load_mix_specs(text, path)  # the file read as the README says
    assert MixLayers(loaded, 3).specs == {"syntax": MixSpec((0.0, 1.0, -1.0), 1.0, False),
                                          "semantics": MixSpec((-1.0, 0.0, 1.0), 1.0, True)}


# -- WriteParquet / WriteErrors -----------------------------------------------------------------
def fake_embedded(n_layers: int = 3, width: int = 4) -> list[EmbeddedSentence]:
    rng = np.random.default_rng(0)
    items = []
    for i, text in enumerate(TEXTS[:5]):
        s = make_sentence(f"doc{i % 2}", i, text.split())
        layers = rng.standard_normal((n_layers, len(s.tokens), width)).astype(np.float32)
        items.append(EmbeddedSentence(s, layers, {"avg": layers.mean(0)}))
    return items


@pytest.mark.parametrize("layout, dtype, layers", [("token", "float32", "all"), ("token", "float16", "top"),
                                                   ("sentence", "float32", "none")])
def test_write_parquet_round_trip(tmp_path, layout, dtype, layers):
    items = fake_embedded()
    spec = OutputSpec(n_layers=3, width=4, layout=layout, layers=layers, dtype=dtype, mix_names=("avg",),
                      metadata={"package_version": "test", "note": "round trip"})
    p = pipeline()
    # a row group of one token row: every sentence becomes its own Arrow table
    _ = p | beam.Create(items) | WriteParquet(str(tmp_path / "out"), spec, num_shards=2, row_group_mb=1e-9)
    p.run().wait_until_finish()
    files = sorted((tmp_path / "out").glob(f"{layout}s-*-of-00002.parquet"))
    assert len(files) == 2
    for f in files:
        assert pq.read_schema(f).equals(spec.schema(), check_metadata=True)
        assert read_metadata(pq.read_schema(f)) == {"package_version": "test", "note": "round trip"}
    table = pq.read_table(files).to_pylist()
    np_dtype = np.dtype(dtype)
    vector_columns = {"all": ["layer_0", "layer_1", "layer_2"], "top": ["layer_2"], "none": []}[layers] + ["mix_avg"]
    if layout == "token":
        assert len(table) == sum(len(e.sentence.tokens) for e in items)
        rows = {r["token_id"]: r for r in table}
        for e in items:
            s = e.sentence
            for k, token in enumerate(s.tokens):
                row = rows[f"{s.doc_id}:{s.sentence_index}:0:{k}"]
                assert (row["doc_id"], row["sentence_index"], row["window_index"], row["token_index"], row["token"]) \
                    == (s.doc_id, s.sentence_index, 0, k, token)
                assert (row["char_start"], row["char_end"]) == (s.char_starts[k], s.char_ends[k])
                for col in vector_columns:
                    want = e.mixes["avg"][k] if col == "mix_avg" else e.layers[int(col[-1]), k]
                    np.testing.assert_array_equal(np.array(row[col], np_dtype), want.astype(np_dtype))
    else:
        assert len(table) == len(items)
        rows = {r["sentence_id"]: r for r in table}
        for e in items:
            s = e.sentence
            row = rows[f"{s.doc_id}:{s.sentence_index}:0"]
            assert row["tokens"] == list(s.tokens)
            assert row["char_starts"] == s.char_starts.tolist() and row["char_ends"] == s.char_ends.tolist()
            for col in vector_columns:
                want = e.mixes["avg"] if col == "mix_avg" else e.layers[int(col[-1])]
                np.testing.assert_array_equal(np.array(row[col], np_dtype), want.astype(np_dtype))
        assert not any(c.startswith("layer_") for c in pq.read_schema(files[0]).names)


@pytest.mark.parametrize("kwargs, says", [
    ({"num_shards": -1}, "num_shards must be an int >= 0"), ({"num_shards": 2.5}, "num_shards must be an int"),
    ({"row_group_mb": float("nan")}, "row_group_mb must be a finite number"),
    ({"row_group_mb": 0}, "row_group_mb must be a finite number"),
    ({"row_group_mb": -5.0}, "row_group_mb must be a finite number"),
    ({"output": ""}, "the output folder must be a non-empty path or URL")])
def test_write_parquet_refuses_bad_options_when_built(tmp_path, kwargs, says):
    """-1 shards ran as "the runner decides", a negative size wrote a row group per sentence, nan
    failed naming no option, and "" wrote the shards into the current folder."""
    options = {"output": str(tmp_path / "out"), "spec": OutputSpec(n_layers=3, width=4), **kwargs}
    with pytest.raises((ValueError, TypeError), match=says):
        WriteParquet(**options)
    if "output" in kwargs:
        with pytest.raises(ValueError, match=says):
            WriteErrors(kwargs["output"])


def test_an_output_spec_that_no_sentence_can_match_is_refused_when_built(tmp_path):
    """mix_names="avg" was taken as the mixes 'a', 'v' and 'g', and n_layers 0 or a width of -1 as
    given: each job then failed in the writer once the model had run ("the output spec names mixes
    ['a', 'v', 'g'] that MixLayers did not compute ... [while running 'WriteParquet/ToArrowTables']")."""
    for kwargs, error, says in (({"mix_names": "avg"}, TypeError, "mix_names is a tuple of names, not the str 'avg'"),
                                ({"n_layers": 0}, ValueError, "n_layers must be an int >= 1, got 0"),
                                ({"width": -1}, ValueError, "width must be an int >= 1, got -1"),
                                ({"width": 4.0}, ValueError, "width must be an int >= 1, got 4.0"),
                                ({"n_layers": True}, ValueError, "n_layers must be an int >= 1, got True"),
                                # "no" was taken for True: an event_timestamp column of null times
                                ({"with_timestamp": "no"}, TypeError, "with_timestamp must be a bool, got 'no'")):
        with pytest.raises(error, match=re.escape(says)):
            OutputSpec(**{"n_layers": 3, "width": 4, **kwargs})
    items = fake_embedded()  # the spec as meant, numpy counts included, writes the mix
    p = pipeline()
    _ = p | beam.Create(items) | WriteParquet(tmp_path / "out", OutputSpec(n_layers=np.int64(3), width=np.int32(4),
                                                                           mix_names=("avg",)))
    p.run().wait_until_finish()
    rows = pq.read_table(sorted((tmp_path / "out").glob("tokens-*.parquet"))).to_pylist()
    want = {f"{e.sentence.doc_id}:{e.sentence.sentence_index}:0:{j}": vector
            for e in items for j, vector in enumerate(e.mixes["avg"].astype(np.float16))}
    assert sorted(row["token_id"] for row in rows) == sorted(want)
    for row in rows:
        np.testing.assert_array_equal(np.array(row["mix_avg"], np.float16), want[row["token_id"]])


def test_mix_names_two_columns_would_share_are_refused_when_built(tmp_path):
    """("a", "a") wrote two `mix_a` columns, a file pyarrow could not read back ("Multiple matches
    for FieldRef.Name(mix_a)"); ("A", "a") two columns that DuckDB, Spark and BigQuery cannot tell
    apart (DuckDB's `mix_a` read `mix_A`'s vectors). Names that differ otherwise write and read back."""
    for names, says in ((("a", "a"), "mix 'a' is named twice"), (("A", "a"), "mix 'a' and 'A' differ only in case"),
                        (("avg", "x", "AVG"), "mix 'AVG' and 'avg' differ only in case")):
        with pytest.raises(ValueError, match=re.escape(says + ": each needs a column name of its own")):
            OutputSpec(n_layers=3, width=4, mix_names=names)
    items = [e._replace(mixes={"a": e.mixes["avg"], "a_": -e.mixes["avg"]}) for e in fake_embedded()]
    spec = OutputSpec(n_layers=3, width=4, layers="none", dtype="float32", mix_names=("a", "a_"))
    pq.write_table(build_table(items, spec), tmp_path / "mixes.parquet")
    table = pq.read_table(tmp_path / "mixes.parquet")
    assert table.column_names[-2:] == ["mix_a", "mix_a_"]
    want = np.concatenate([e.mixes["a"] for e in items])
    np.testing.assert_array_equal(np.array(table.column("mix_a").to_pylist(), np.float32), want)
    np.testing.assert_array_equal(np.array(table.column("mix_a_").to_pylist(), np.float32), -want)


def test_a_spec_or_files_of_the_wrong_type_are_named_when_built(tmp_path):
    """WriteParquet(out, None) failed on "'NoneType' object has no attribute 'vector_columns'" and
    ReadTokenizedFiles([...]) on "'list' object has no attribute 'items'", naming neither argument."""
    for spec in (None, {"n_layers": 3, "width": 4}):
        with pytest.raises(TypeError, match=re.escape(f"spec must be an OutputSpec, got {type(spec).__name__}")):
            WriteParquet(str(tmp_path / "out"), spec)
    conllu = tmp_path / "a.conllu"
    conllu.write_text("1\tHello\t_\tINTJ\t_\t_\t0\troot\t_\t_\n\n", encoding="utf-8")
    # a short name: the message cuts what it shows at 80 characters, a pytest tmp_path may be longer
    with pytest.raises(TypeError, match=re.escape("files maps each doc_id to one file, got a list (['a.conllu'])")):
        ReadTokenizedFiles(["a.conllu"])
    assert ReadTokenizedFiles({"train": str(conllu)}).files == {"train": str(conllu)}


def test_write_parquet_takes_numpy_numbers_for_its_options(tmp_path):
    write = WriteParquet(str(tmp_path / "out"), OutputSpec(n_layers=3, width=4), num_shards=np.int64(2),
                         row_group_mb=np.float32(1.0))
    assert (write.num_shards, write.rows_per_group) == (2, 11915)


def test_the_sinks_take_their_output_folder_as_a_path(tmp_path):
    """A pathlib.Path failed when the pipeline was built ('PosixPath' is not iterable)."""
    items = fake_embedded()
    p = pipeline()
    _ = p | "Vectors" >> beam.Create(items) | WriteParquet(tmp_path / "out", OutputSpec(n_layers=3, width=4))
    _ = (p | "Errors" >> beam.Create([ErrorRecord("a.txt", 1, "why", "read")]) | WriteErrors(tmp_path / "out"))
    p.run().wait_until_finish()
    assert pq.read_table(sorted((tmp_path / "out").glob("tokens-*.parquet"))).num_rows == sum(
        len(e.sentence.tokens) for e in items)
    assert [json.loads(line)["reason"] for f in (tmp_path / "out").glob("errors-*.jsonl")
            for line in f.read_text(encoding="utf-8").splitlines()] == ["why"]


def test_write_errors_one_json_line_per_record(tmp_path):
    records = [ErrorRecord("a.txt", 3, "invalid UTF-8 at byte 0: invalid start byte", "read"),
               ErrorRecord("b.parquet", None, "Parquet file has no text column 'text'", "read"),
               ErrorRecord("c.jsonl", 7, "document too long", "tokenize", "c.jsonl:7"),
               ErrorRecord("中文.txt", 1, "原因", "read"),
               # a caller's Document numbered by a pandas index: JSON could not write it, and the job failed
               ErrorRecord("frame", np.int64(5), "the text is a NoneType, not a str", "tokenize", "d"),
               ErrorRecord(tmp_path / "a.txt", 2, "the text is a bytes, not a str", "tokenize", "e")]
    p = pipeline()
    _ = p | beam.Create(records) | WriteErrors(str(tmp_path / "out"))
    p.run().wait_until_finish()
    lines = [json.loads(line) for f in sorted((tmp_path / "out").glob("errors-*.jsonl"))
             for line in f.read_text(encoding="utf-8").splitlines()]
    assert sorted(lines, key=lambda d: d["source"]) == sorted(({**r._asdict(), "source": str(r.source)} for r in records),
                                                              key=lambda d: d["source"])
    assert [type(d["line"]) for d in lines if d["source"] == "frame"] == [int]


def test_two_sinks_of_one_pipeline_writing_the_same_files_are_refused_when_built(tmp_path):
    """Two WriteParquet (or WriteErrors) of one pipeline into one folder wrote the same shard names,
    and one's files replaced the other's: one input's rows (records) were lost without a word."""
    items = fake_embedded()
    spec = OutputSpec(n_layers=3, width=4, mix_names=("avg",))
    records = [ErrorRecord("a.txt", 1, "first", "read"), ErrorRecord("b.txt", 2, "second", "tokenize")]
    for first, second in ((WriteParquet, WriteParquet), (WriteErrors, WriteErrors)):
        p = pipeline()
        args = (spec,) if first is WriteParquet else ()
        data = items if first is WriteParquet else records
        _ = p | "A" >> beam.Create(data[:2]) | "SinkA" >> first(str(tmp_path / "same"), *args)
        with pytest.raises(ValueError, match=re.escape(f"SinkB would write {tmp_path}/same/") + r".* as SinkA of this "
                           r"pipeline does: one's files would replace the other's"):
            _ = p | "B" >> beam.Create(data[2:]) | "SinkB" >> second(f"{tmp_path}/x/../same/", *args)
    # each in its own folder, and one folder's tokens beside its errors: every row and record written
    p = pipeline()
    _ = p | "A" >> beam.Create(items[:2]) | "TokensA" >> WriteParquet(str(tmp_path / "a"), spec)
    _ = p | "B" >> beam.Create(items[2:]) | "TokensB" >> WriteParquet(str(tmp_path / "b"), spec)
    _ = p | "E" >> beam.Create(records) | "ErrorsA" >> WriteErrors(str(tmp_path / "a"))
    p.run().wait_until_finish()
    for folder, part in (("a", items[:2]), ("b", items[2:])):
        table = pq.read_table(list((tmp_path / folder).glob("tokens-*.parquet")))
        assert sorted(table.column("token_id").to_pylist()) == sorted(
            f"{e.sentence.doc_id}:{e.sentence.sentence_index}:0:{k}" for e in part for k in range(len(e.sentence.tokens)))
    lines = [json.loads(line) for f in (tmp_path / "a").glob("errors-*.jsonl") for line in f.read_text().splitlines()]
    assert sorted(d["reason"] for d in lines) == ["first", "second"]


def test_the_sinks_refuse_an_unbounded_collection_when_built(tmp_path):
    """A streaming source: WriteErrors wrote a file per window, named by Beam and not as ours
    (errors-[0.0, 60.0)-00000-of-00001.jsonl), and WriteParquet was refused naming an argument it
    does not take ("triggering_frequency must be set")."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms import window

    for sink, element in ((WriteErrors(str(tmp_path)), ErrorRecord("a.txt", 1, "r", "read")),
                          (WriteParquet(str(tmp_path), OutputSpec(n_layers=3, width=4)), fake_embedded()[0])):
        for windowfn in (window.GlobalWindows(), window.FixedWindows(60)):
            p = beam.Pipeline(options=PipelineOptions(["--streaming"]))
            stream = (p | TestStream().add_elements([window.TimestampedValue(element, 10)]).advance_watermark_to_infinity()
                      | beam.WindowInto(windowfn))
            with pytest.raises(ValueError, match=re.escape(f"{sink.label} writes bounded collections only")):
                _ = stream | sink
    assert list(tmp_path.iterdir()) == []


def test_sliding_windows_that_overlap_or_leave_gaps_are_refused_by_the_writer(tmp_path):
    """Overlapping SlidingWindows wrote each sentence once per window it was in (measured: 10 rows
    of 5 token_ids for 2 sentences in SlidingWindows(20, 10)); windows with gaps drop what falls
    in them. Windows of a period equal to their size are fixed windows, written once each."""
    from apache_beam.transforms import window

    items = fake_embedded()
    spec = OutputSpec(n_layers=3, width=4, mix_names=("avg",))
    for size, period in ((20, 10), (10, 20)):
        p = pipeline()
        windowed = (p | beam.Create(items) | beam.Map(lambda e: window.TimestampedValue(e, 15))
                    | beam.WindowInto(window.SlidingWindows(size, period)))
        with pytest.raises(ValueError, match=re.escape("WriteParquet: SlidingWindows of a period other than their "
                                                       "size put a sentence in several windows")):
            _ = windowed | WriteParquet(str(tmp_path / "out"), spec)
    p = pipeline()
    _ = (p | beam.Create(items) | beam.Map(lambda e: window.TimestampedValue(e, 15))
         | beam.WindowInto(window.SlidingWindows(10, 10)) | WriteParquet(str(tmp_path / "out"), spec))
    p.run().wait_until_finish()
    token_ids = pq.read_table(list((tmp_path / "out").glob("tokens-*.parquet"))).column("token_id").to_pylist()
    assert sorted(token_ids) == sorted(f"{e.sentence.doc_id}:{e.sentence.sentence_index}:0:{k}"
                                       for e in items for k in range(len(e.sentence.tokens)))


def test_sliding_windows_that_overlap_or_leave_gaps_are_refused_by_the_errors_writer(tmp_path):
    """WriteErrors given overlapping SlidingWindows wrote each error once per window it was in
    (measured: 6 lines for 3 records in SlidingWindows(20, 10)), and with gaps none at all (0 lines).
    Windows of a period equal to their size write each record once."""
    from apache_beam.transforms import window

    items = [ErrorRecord("f.txt", line, "bad", "read") for line in range(1, 4)]

    def windowed(p: beam.Pipeline, size: int, period: int) -> beam.PCollection:
        return (p | beam.Create(items) | beam.Map(lambda e: window.TimestampedValue(e, 15))
                | beam.WindowInto(window.SlidingWindows(size, period)))

    for size, period in ((20, 10), (10, 20)):
        with pytest.raises(ValueError, match=re.escape("WriteErrors: SlidingWindows of a period other than their "
                                                       "size put a record in several windows")):
            _ = windowed(pipeline(), size, period) | WriteErrors(str(tmp_path / "out"))
    p = pipeline()
    _ = windowed(p, 10, 10) | WriteErrors(str(tmp_path / "out"))
    p.run().wait_until_finish()
    lines = [json.loads(line) for path in (tmp_path / "out").glob("errors-*.jsonl") for line in path.open()]
    assert sorted(record["line"] for record in lines) == [1, 2, 3]


ELEMENT_TYPES = {  # each transform, built (a sink writing into the test's folder), and the element type it takes
    "TokenizeWithSpacy": (lambda model, out: TokenizeWithSpacy(), "Documents"),
    "FindDuplicateIds": (lambda model, out: FindDuplicateIds(), "Documents"),
    "EmbedSentences": (lambda model, out: EmbedSentences(model, device="cpu"), "Sentences"),
    "MixLayers": (lambda model, out: MixLayers({"avg": MixSpec.preset("average", 3)}, 3), "EmbeddedSentences"),
    "WriteParquet": (lambda model, out: WriteParquet(out, OutputSpec(n_layers=3, width=4)),
                     "EmbeddedSentences"),
    "WriteErrors": (lambda model, out: WriteErrors(out), "ErrorRecords"),
}


@pytest.mark.parametrize("name", sorted(ELEMENT_TYPES))
def test_elements_of_the_wrong_type_are_refused_when_built_or_named_by_the_transform(tmp_path, model_arg, name):
    """A collection of str (a dict, bytes) given to a transform ran, and failed in the worker on an
    attribute: "'str' object has no attribute 'sentence'" (WriteParquet), 'to_json_dict'
    (WriteErrors), 'layers' (MixLayers), 'doc_id' (FindDuplicateIds)."""
    build, takes = ELEMENT_TYPES[name]
    for wrong in (["a text"], [{"text": "a text"}], [b"bytes"]):
        p = pipeline()
        with pytest.raises(TypeCheckError, match=re.escape(f"Input type hint violation at {name}: expected")):
            _ = p | beam.Create(wrong) | build(model_arg, tmp_path)
    # a collection whose element type Beam cannot know when built: named in the worker
    p = pipeline()
    _ = p | beam.Create([1]) | beam.Map(lambda _: "a text").with_output_types(typehints.Any) | build(model_arg, tmp_path)
    says = "sentences to embed are Sentences" if name == "EmbedSentences" else f"{name} takes {takes}"
    with pytest.raises(Exception, match=re.escape(f"{says}, got a str ('a text')")):
        p.run().wait_until_finish()


@pytest.mark.parametrize("name", sorted(ELEMENT_TYPES) + ["PretokenizedSentences"])
def test_a_transform_applied_to_a_dict_or_tuple_of_collections_is_named(tmp_path, model_arg, name):
    """`p | ReadDocuments(...) | TokenizeWithSpacy()` (["documents"] left out) failed inside Beam, on
    "'dict' object has no attribute 'pipeline'" ('windowing', 'element_type', 'is_bounded')."""
    from elmo_pipeline.transforms.read import ReadDocuments

    build = ELEMENT_TYPES[name][0] if name in ELEMENT_TYPES else lambda model, out: PretokenizedSentences()
    (tmp_path / "in.txt").write_text("A text.\n", encoding="utf-8")
    p = pipeline()
    outputs = p | ReadDocuments([str(tmp_path / "in.txt")])
    with pytest.raises(TypeError, match=re.escape(f"{name} is applied to one PCollection, got a dict of them "
                                                  "('documents', 'errors'): give it the one it takes by its name")):
        _ = outputs | build(model_arg, tmp_path)
    with pytest.raises(TypeError, match=re.escape(f"{name}2 is applied to one PCollection, got a tuple")
                       + r".*; Flatten several into one$"):
        _ = (outputs["documents"], outputs["errors"]) | f"{name}2" >> build(model_arg, tmp_path)
    with pytest.raises(TypeError, match=re.escape(f"{name}3 is applied to one PCollection, got a PBegin") + r"[^;]*$"):
        _ = p | f"{name}3" >> build(model_arg, tmp_path)


def test_a_reader_applied_to_a_collection_is_named(tmp_path):
    """`pcoll | ReadDocuments(...)` failed on a bare AssertionError inside Beam's Create."""
    from elmo_pipeline.transforms.read import ReadDocuments

    (tmp_path / "in.txt").write_text("A text.\n", encoding="utf-8")
    (tmp_path / "x.conllu").write_text("1\tA\ta\tDET\t_\t_\t0\troot\t_\t_\n\n", encoding="utf-8")
    for reader in (ReadDocuments([str(tmp_path / "in.txt")]), ReadTokenizedFiles({"d": str(tmp_path / "x.conllu")})):
        p = pipeline()
        name = type(reader).__name__
        with pytest.raises(TypeError, match=re.escape(f"{name} reads files: apply it to the pipeline (p | {name}(...)), "
                                                      "not to a PCollection")):
            _ = p | beam.Create(["x"]) | reader
        p = pipeline()
        assert_that(p | reader | beam.Map(lambda _: 1) if name == "ReadTokenizedFiles"
                    else (p | reader)["documents"] | beam.Map(lambda _: 1), equal_to([1]))
        p.run().wait_until_finish()


# -- out of memory ------------------------------------------------------------------------------
class OomAbove:
    """Wraps a BiLM and raises an out-of-memory error for batches of more than `limit` sentences,
    as CUDA would for a batch that does not fit; records the batch sizes it was called with."""

    def __init__(self, model, limit: int, error: type[Exception] = torch.OutOfMemoryError,
                 message: str = "CUDA out of memory. Tried to allocate 2.00 GiB") -> None:
        self.model, self.limit, self.error, self.message = model, limit, error, message
        self.calls: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.model.device

    def resolved_kernel(self) -> str:
        return self.model.resolved_kernel()

    def embed(self, sentences):
        self.calls.append(len(sentences))
        if len(sentences) > self.limit:
            raise self.error(self.message)
        return self.model.embed(sentences)


def check_embedded(out: list[EmbeddedSentence], sentences: list[Sentence], expected) -> None:
    assert [e.sentence.key for e in out] == [s.key for s in sentences]  # every one, in order
    for e in out:
        np.testing.assert_allclose(e.layers, expected[e.sentence.key], rtol=0, atol=ATOL)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_out_of_memory_splits_the_batch_and_drops_nothing(reference_model, sentences, expected, limit):
    model = OomAbove(reference_model, limit)
    splits: list[int] = []
    out = embed_batch(model, sentences, on_split=splits.append)
    check_embedded(out, sentences, expected)
    assert splits and splits[0] == len(sentences)
    assert all(n > limit for n in splits)
    assert sum(n for n in model.calls if n <= limit) == len(sentences)  # each sentence embedded once
    assert len(model.calls) == 2 * len(splits) + 1  # a binary tree: each split makes two calls


@pytest.mark.parametrize("message", [
    "CUDA error: out of memory",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
])
def test_out_of_memory_as_runtime_error_message_also_splits(reference_model, sentences, expected, message):
    model = OomAbove(reference_model, 2, RuntimeError, message)
    splits: list[int] = []
    check_embedded(embed_batch(model, sentences, on_split=splits.append), sentences, expected)
    assert splits


def test_other_errors_and_a_single_sentence_that_does_not_fit_are_raised(reference_model, sentences):
    splits: list[int] = []
    with pytest.raises(RuntimeError, match="shape mismatch"):
        embed_batch(OomAbove(reference_model, 0, RuntimeError, "shape mismatch"), sentences,
                    on_split=splits.append)
    assert splits == []
    model = OomAbove(reference_model, 0)
    with pytest.raises(torch.OutOfMemoryError):
        embed_batch(model, sentences, on_split=splits.append)
    assert model.calls[-1] == 1


def test_tokens_that_are_not_a_list_of_strings_are_refused_naming_the_sentence(reference_model):
    """Named by the sentence's key: its place in a length-sorted batch tells a user nothing; a
    string of tokens was embedded and written one character per token."""
    good = make_sentence("d", 0, ["A", "word"])
    text = make_sentence("e", 1, ["x"])._replace(tokens="The bank rose")
    with pytest.raises(TypeError, match=re.escape("sentence ('e', 1, 0) is a str, not a list of token strings")):
        embed_batch(reference_model, [good, text])
    hole = make_sentence("f", 2, ["a", "b"])._replace(tokens=("a", None))
    with pytest.raises(TypeError, match=re.escape("sentence ('f', 2, 0) has a token of type NoneType (None)")):
        embed_batch(reference_model, [good, hole])
    with pytest.raises(TypeError, match=r"d:0: tokens is a str, not a sequence of token strings"):
        pretokenized_sentences(TokenizedText("d", 0, "The bank"))
    with pytest.raises(ValueError, match=r"d:0: tokens must be strings with a character that is not whitespace"):
        pretokenized_sentences(TokenizedText("d", 0, ("a", " ")))


def test_a_blank_token_is_the_value_error_embed_raises_also_named_by_the_sentences_key(reference_model):
    """embed refuses an empty or blank token with a ValueError; renamed by its key for EmbedSentences,
    it became a TypeError (the class of every other token-list error), which the README does not say."""
    good = make_sentence("d", 0, ["A", "word"])
    blank = make_sentence("g", 3, ["a", "b", "c"])._replace(tokens=("a", "\u3000", "c"))
    with pytest.raises(ValueError, match=re.escape("sentence ('g', 3, 0) has an empty or blank token, its token 1 "
                                                   "('\\u3000')")) as caught:
        embed_batch(reference_model, [good, blank])
    assert not isinstance(caught.value, TypeError)
    hole = make_sentence("f", 2, ["a", "b"])._replace(tokens=("a", None))
    with pytest.raises(TypeError) as caught:  # the other token-list errors stay TypeErrors
        embed_batch(reference_model, [good, hole])
    assert not isinstance(caught.value, ValueError)


@pytest.mark.parametrize("item, error, says", [
    (TokenizedText("d", 0, ("ok", "\ud800x")), ValueError, "d:0: a token holds a lone surrogate"),
    (TokenizedText("d\udc00", 0, ("ok",)), ValueError, "doc_id 'd\\udc00' holds a lone surrogate, which UTF-8 cannot encode"),
    (TokenizedText("d\x00e", 0, ("ok",)), ValueError, "doc_id 'd\\x00e' contains a NUL character, which key stores refuse"),
    (TokenizedText(7, 0, ("ok",)), TypeError, "doc_id 7 is int, not a str"),
    (TokenizedText("d", "0", ("ok",)), TypeError, "d: sentence_index '0' is not an int >= 0"),
    (TokenizedText("d", -1, ("ok",)), TypeError, "d: sentence_index -1 is not an int >= 0"),
    (TokenizedText("d", True, ("ok",)), TypeError, "d: sentence_index True is not an int >= 0"),
    (TokenizedText("d", 0, ("ok",), "yesterday"), ValueError, "d:0: timestamp 'yesterday' is not ISO 8601"),
    # a datetime passed the check, then failed the writer after the model ran
    (TokenizedText("d", 0, ("ok",), datetime.datetime(2024, 5, 1, tzinfo=datetime.timezone.utc)), TypeError,
     "d:0: timestamp datetime.datetime(2024, 5, 1, 0, 0, tzinfo=datetime.timezone.utc) is a datetime, not an ISO 8601 str"),
    ({"doc_id": "d", "sentence_index": 0, "tokens": ("a",)}, TypeError,
     "an element of PretokenizedSentences is a TokenizedText or (doc_id, sentence_index, tokens[, timestamp]), "
     "not dict"),
    (("d", 0), TypeError, "not tuple: ('d', 0)"),
])
def test_pretokenized_input_the_output_could_not_hold_is_refused_where_it_enters(item, error, says):
    """The writer failed the whole job on these (a lone surrogate, an int id), after the model ran,
    naming no sentence; a dict was unpacked as its keys."""
    with pytest.raises(error, match=re.escape(says)):
        pretokenized_sentences(item)


@pytest.mark.parametrize("files, fmt, error, says", [
    ({"d": "x.conllu"}, "conll", ValueError, "fmt must be one of ('auto', 'conllu', 'conll2003'), got 'conll'"),
    ({"d\x00e": "x.conllu"}, "auto", ValueError, "doc_id 'd\\x00e' contains a NUL character"),
    ({7: "x.conllu"}, "auto", TypeError, "doc_id 7 is int, not a str")])
def test_read_tokenized_files_refuses_a_format_or_doc_id_when_built(tmp_path, files, fmt, error, says):
    """Taken when built, a worker failed on each after the reading had begun."""
    (tmp_path / "x.conllu").write_text("1\tA\ta\tDET\t_\t_\t0\troot\t_\t_\n\n", encoding="utf-8")
    with pytest.raises(error, match=re.escape(says)):
        ReadTokenizedFiles({doc_id: str(tmp_path / name) for doc_id, name in files.items()}, fmt)


def test_pretokenized_tuples_and_numpy_indexes_are_taken():
    (a,) = pretokenized_sentences(("d", np.int64(3), ["New", "York"], "2024-05-01T00:00:00Z"))
    (b,) = pretokenized_sentences(["d", 3, ("New", "York")])
    assert (a.doc_id, a.sentence_index, a.tokens, a.timestamp) == ("d", 3, ("New", "York"), "2024-05-01T00:00:00Z")
    assert type(a.sentence_index) is int and (b.sentence_index, b.tokens) == (3, ("New", "York"))


def test_a_windowed_collection_is_written_whole(model_arg, reference_model, sentences, expected, tmp_path):
    """EmbedSentences keeps its input's windows; WriteParquet failed on them ("Cannot convert
    GlobalWindow to _IntervalWindowBase")."""
    from apache_beam.transforms import window

    from support import read_output, vector_column

    n_layers, width = reference_model.config.n_output_layers, reference_model.config.output_dim
    p = pipeline()
    _ = (p | beam.Create(list(enumerate(sentences)))
         | beam.Map(lambda pair: window.TimestampedValue(pair[1], pair[0] * 100))
         | beam.WindowInto(window.FixedWindows(60))
         | EmbedSentences(model_arg, device="cpu")
         | WriteParquet(str(tmp_path / "out"), OutputSpec(n_layers=n_layers, width=width, dtype="float32")))
    p.run().wait_until_finish()
    table = read_output(tmp_path / "out")
    assert table.num_rows == sum(len(s.tokens) for s in sentences)
    written = dict(zip(table.column("token_id").to_pylist(), vector_column(table, "layer_1")))
    for s in sentences:
        for i in range(len(s.tokens)):
            assert np.array_equal(written[f"{s.doc_id}:{s.sentence_index}:{s.window_index}:{i}"], expected[s.key][1, i])


def test_windowed_sentences_are_sorted_in_the_bounded_buffer_as_global_ones(model_arg):
    """Windowed sentences went to Beam's SortAndBatchElements, which holds the whole bundle (on the
    local runner, the whole input) whatever sort_buffer_tokens says: the buffer given was ignored.
    In one window they are now batched exactly as in the global window, by the bounded buffer."""
    from apache_beam.transforms import window

    # long and short sentences in turn (weights 22 and 3): a buffer of 50 tokens is every 4 of them,
    # the whole bundle sorted puts the short ones together
    items = [make_sentence(f"d{i}", 0, ["w"] * (1 if i % 2 else 20)) for i in range(40)]

    p = pipeline()
    plain = p | beam.Create(items)
    windowed = (plain | beam.Map(lambda s: window.TimestampedValue(s, 5)) | beam.WindowInto(window.FixedWindows(60)))
    for label, sentences in (("Global", plain), ("Windowed", windowed)):
        _ = sentences | label >> EmbedSentences(model_arg, device="cpu", batch_tokens=44, sort_buffer_tokens=50)
    result = p.run()
    result.wait_until_finish()

    def batch_counts(label: str) -> tuple[int, ...]:
        return tuple(sum(c.committed for c in result.metrics().query(MetricsFilter().with_name(name))["counters"]
                         if c.key.step.startswith(f"{label}/"))
                     for name in ("batches", "batch_padded_tokens"))

    # the bounded buffer's batches: each 4 sentences sorted and cut on their own
    fours = [b for i in range(0, 40, 4) for b in length_sorted_batches(items[i:i + 4], 44, 1024)]
    bounded = (len(fours), sum(max(map(sentence_weight, b)) * len(b) for b in fours))
    assert batch_counts("Windowed") == batch_counts("Global") == bounded


def test_the_sort_buffer_holds_one_buffer_of_tokens_over_all_windows():
    from apache_beam.transforms.window import IntervalWindow

    from elmo_pipeline.transforms.embed import SortAndBatchSentences, sentence_weight

    windows = [IntervalWindow(60 * k, 60 * (k + 1)) for k in range(7)]
    items = [(make_sentence(f"d{i}", 0, ["w"] * (1 + i % 9)), windows[i % 7]) for i in range(500)]
    fn = SortAndBatchSentences(batch_tokens=30, max_batch_sentences=8, buffer_tokens=60)
    fn.start_bundle()
    out = []
    for sentence, in_window in items:
        out += fn.process(sentence, in_window)
        assert fn._weight == sum(sentence_weight(s) for held in fn._buffers.values() for s in held) < 60
    out += fn.finish_bundle()
    placed = {s.doc_id: w for s, w in items}
    assert sorted(s.doc_id for wv in out for s in wv.value) == sorted(placed)
    for wv in out:  # each batch in its sentences' window, at its end
        assert {placed[s.doc_id] for s in wv.value} == set(wv.windows) and len(wv.windows) == 1
        assert wv.timestamp == wv.windows[0].max_timestamp()


def test_the_heaviest_window_is_found_without_looking_at_every_window_held():
    """With a window a sentence (Sessions before they merge, distinct timestamps) the buffer holds
    thousands of windows, and the heaviest was found by looking at each of them at every sentence:
    quadratic (20,000 sentences: 49 s, 40,000: 173 s). Counted here in window lookups (hashes)."""
    from apache_beam.transforms.window import IntervalWindow

    from elmo_pipeline.transforms.embed import SortAndBatchSentences

    class CountedWindow(IntervalWindow):
        hashes = 0

        def __hash__(self) -> int:
            CountedWindow.hashes += 1
            return super().__hash__()

    n = 3000
    fn = SortAndBatchSentences(batch_tokens=22, max_batch_sentences=8, buffer_tokens=22 * 1000)  # 1000 held
    fn.start_bundle()
    out = []
    for i in range(n):
        out += fn.process(make_sentence(f"d{i}", 0, ["w"] * 20), CountedWindow(i, i + 1))
    out += fn.finish_bundle()
    # each sentence alone in its window's batch, the windows (all of one weight) flushed as they came
    assert [[s.doc_id for s in wv.value] for wv in out] == [[f"d{i}"] for i in range(n)]
    assert [wv.windows[0].start for wv in out] == list(range(n))
    assert CountedWindow.hashes < 20 * n  # a few lookups a sentence, not one per window held


def test_large_model_embeds_in_the_shared_process_with_the_same_values(model_arg, sentences, expected):
    """Beam serves a large_model to the workers through a proxy, which forwards method calls only
    (reading model.device through it failed every batch)."""
    p = pipeline()
    embedded = p | beam.Create(sentences) | EmbedSentences(model_arg, device="cpu", large_model=True, batch_tokens=64)
    assert_that(embedded, matches_layers(expected))
    result = p.run()
    result.wait_until_finish()
    assert counter(result, "batches") > 1
    assert shared_model_files(), "Beam's model server left no file: the removal below is not tested"
    remove_shared_model_files()
    assert shared_model_files() == []


def test_the_end_of_a_pipeline_removes_its_own_shared_model_files_only(model_arg, sentences, tmp_path):
    """Two pipelines with a large_model in one process: the end of the second (run_pipeline)
    removed the first's 4 files too, which that one, still running, reaches its model server by."""
    from elmo_pipeline.pipelines.runner import run_pipeline

    def build(p: beam.Pipeline) -> None:
        _ = p | beam.Create(sentences[:2]) | EmbedSentences(model_arg, device="cpu", large_model=True)

    before = set(shared_model_files())
    first = pipeline()
    build(first)
    first.run().wait_until_finish()  # its server goes on, and so do its files
    firsts = set(shared_model_files()) - before
    assert len(firsts) == 4, firsts  # the model's and its status's address and lock
    run_pipeline(build, [f"--runner={LOCAL_RUNNER}"], "extract", str(tmp_path))
    assert set(shared_model_files()) == before | firsts  # the second's gone, the first's kept
    remove_shared_model_files(first)
    assert set(shared_model_files()) == before


def shared_model_files() -> list[str]:
    return glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{SHARED_MODEL_TAG}{os.getpid()}-*"))


class OomHandler(ElmoModelHandler):
    """The pipeline's handler with a model that runs out of memory above `limit` sentences."""

    def __init__(self, model: str, limit: int) -> None:
        super().__init__(model, device="cpu")
        self.limit = limit

    def load_model(self):
        return OomAbove(super().load_model(), self.limit)


def test_out_of_memory_in_the_pipeline_counts_splits_and_keeps_every_sentence(model_arg, sentences, expected):
    embed = EmbedSentences(model_arg, device="cpu", batch_tokens=8192)
    embed.handler = OomHandler(model_arg, limit=2)
    p = pipeline()
    embedded = p | beam.Create(sentences) | embed
    assert_that(embedded, matches_layers(expected))
    result = p.run()
    result.wait_until_finish()
    assert counter(result, "oom_splits") > 0
