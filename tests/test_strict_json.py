"""Everything we write is strict JSON, the `top` mix is finite and exact, and the output says
what produced it (versions, Chinese segmentation, device, kernel, precision)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import math
import sys
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
import spacy
import torch

import elmo_pipeline
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.pipelines.extract import parse_mixes, run
from elmo_pipeline.corpus.records import Sentence
from elmo_pipeline.runtime import PlannedRuntime, plan_runtime
from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix, dump_mix_specs, load_mix_specs
from elmo_pipeline.corpus.schema import METADATA_KEY
from elmo_pipeline.corpus.tokenization import build_nlp, chinese_segmenter, describe_segmenter
from elmo_pipeline.transforms.embed import ElmoModelHandler
from support import parse_extract_args, read_output, strict_json, vector_column


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def test_dumps_strict_refuses_nan_and_infinity_and_names_the_key():
    assert json.loads(dumps_strict({"a": [1, 2.5]}, "x.json")) == {"a": [1, 2.5]}
    with pytest.raises(ValueError, match=r"^Parquet metadata: mixes\.t\.weights\[0\] \(-inf\) is not a finite number"):
        dumps_strict({"mixes": {"t": {"weights": [-math.inf, 0.0]}}}, "Parquet metadata")
    with pytest.raises(ValueError, match=r"^report\.json: loss_per_epoch\[1\] \(nan\)"):
        dumps_strict({"loss_per_epoch": [0.5, math.nan]}, "report.json")


def test_a_lone_surrogate_escape_is_refused_where_a_pair_is_a_character(tmp_path):
    from elmo_pipeline.model.vocabulary import Vocabulary
    from elmo_pipeline.strict import ConfigError, parse_json_strict

    assert parse_json_strict('{"tokens": ["a", "\\ud83d\\ude00"]}', "v.json") == {"tokens": ["a", "\U0001F600"]}
    with pytest.raises(ConfigError, match=r"^vocab\.json: tokens\[4\] holds a lone surrogate escape"):
        Vocabulary.from_json('{"tokens": ["<S>", "</S>", "<UNK>", "the", "\\ud800"]}', "vocab.json")
    with pytest.raises(ConfigError, match=r"^x\.json: the key 'a\\udfff' holds a lone surrogate escape"):
        parse_json_strict(b'{"a\\uDFFF": 1}', "x.json")


def test_dumps_strict_walks_tuples_and_keys_that_are_not_strings_for_a_lone_surrogate():
    """The walk that tells a lone surrogate from a character past U+FFFF (both written as escapes)
    took dicts and lists only: a key that is not a str beside such a character failed with re's
    TypeError ('expected string or bytes-like object, got 'int''), and a lone surrogate in a
    tuple (which json writes as a list) was written, as an escape no strict reader takes."""
    assert dumps_strict({1: "\U0001F600", "a": (2, "\u00e9")}, "x.json") == '{"1": "\\ud83d\\ude00", "a": [2, "\\u00e9"]}'
    assert dumps_strict({1: "\U0001F600"}, "x.json", ensure_ascii=False) == '{"1": "\U0001F600"}'
    for ascii in (True, False):
        with pytest.raises(ValueError, match=r"^x\.json: sentences\[1\]\[0\] holds a lone surrogate"):
            dumps_strict({"sentences": [("a",), ("\ud800", "b")]}, "x.json", ensure_ascii=ascii)
        with pytest.raises(ValueError, match=r"^x\.json: 7 holds a lone surrogate"):  # two side by side: no character
            dumps_strict({7: "\ud83d\ude00", 8: "\U0001F600"}, "x.json", ensure_ascii=ascii)


def test_top_preset_is_finite_round_trips_through_a_file_and_is_the_top_layer_bit_for_bit(tmp_path):
    top = MixSpec.preset("top", 3)
    assert all(math.isfinite(w) for w in top.weights)
    path = tmp_path / "top.json"
    path.write_text(dump_mix_specs({"t": top}))
    assert load_mix_specs(strict_json_text(path), str(path)) == {"t": top}
    assert parse_mixes([f"t={path}", "u=top"], 3) == {"t": top, "u": top}

    layers = torch.randn(3, 4, 6)
    layers[2, 0, :3] = torch.tensor([-0.0, 0.0, -1e-30])  # a sum started at +0.0 would lose the sign of -0.0
    mixed = ScalarMix.from_spec(top)(layers)
    assert np.array_equal(bits(mixed.detach()), bits(layers[2]))
    assert ScalarMix.from_spec(top).normalized_weights().tolist() == [0.0, 0.0, 1.0]


def strict_json_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    strict_json(text)
    return text


def test_extract_writes_strict_json_with_what_produced_it_and_exact_top_mixes(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("The bank rose by two points. It fell again on Monday.\nA second document, short.\n",
                   encoding="utf-8")
    mix_file = tmp_path / "top.json"
    mix_file.write_text(dump_mix_specs({"t": MixSpec.preset("top", 3)}))
    out = tmp_path / "out"
    summary = run(*parse_extract_args(["--input", str(src), "--output", str(out), "--dtype", "float32",
                                       "--mix", "top=top", "--mix", f"fromfile={mix_file}"]))

    assert strict_json((out / "summary.json").read_text()) == summary
    on_cuda = torch.cuda.is_available()
    device, kernel = ("cuda", "fused") if on_cuda else ("cpu", "exact")  # the default model has no clips
    assert summary["tokens_embedded_on"] == {f"{device}/{kernel}": summary["tokens"]} and summary["tokens"] > 10
    assert summary["zh_char_fallback_documents"] == 0

    for f in sorted(out.glob("tokens-*.parquet")):
        meta = strict_json(pq.read_schema(f).metadata[METADATA_KEY])
        assert meta["versions"] == {"elmo_pipeline": elmo_pipeline.__version__, "spacy": spacy.__version__,
                                    "torch": torch.__version__, "apache_beam": beam.__version__}
        assert meta["runtime"] == {"device": device, "kernel": kernel, "precision": "fp32"}
        assert meta["tokenizer"] == {"library": "spacy", "lang": "en", "model": None, "max_sentence_tokens": 256}
        assert meta["mixes"]["top"] == meta["mixes"]["fromfile"] == MixSpec.preset("top", 3).to_dict()
    table = read_output(out)
    for name in ("mix_top", "mix_fromfile"):
        assert np.array_equal(bits(vector_column(table, name)), bits(vector_column(table, "layer_2")))


def test_model_files_are_strict_json(tmp_path):
    model = BiLM.load(None, cache_size=0)
    model.save_pretrained(str(tmp_path / "m"))
    assert strict_json((tmp_path / "m" / "config.json").read_text())["lstm"] == model.config.to_dict()["lstm"]
    assert len(strict_json((tmp_path / "m" / "vocab.json").read_text())["tokens"]) == len(model.vocab)


def test_the_plan_is_what_the_launcher_can_know(reference_model):
    default = BiLM.load(None, cache_size=0)  # no clips: exact on CPU, fused on CUDA
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert plan_runtime(default, "auto", "auto", workers_here=True) == (here, "fused" if here == "cuda" else "exact")
    assert plan_runtime(default, "auto", "auto", workers_here=False) == PlannedRuntime(None, None)  # each worker's
    assert plan_runtime(default, "cuda", "auto", workers_here=False) == ("cuda", "fused")  # named: known
    assert plan_runtime(default, "auto", "exact", workers_here=False) == (None, "exact")
    assert plan_runtime(reference_model, "auto", "auto", workers_here=False) == (None, "exact")  # clips: exact anywhere


def test_a_worker_that_would_differ_from_the_metadata_fails_its_batch(reference_model):
    sentence = Sentence("d", 0, 0, ("a", "word"), np.array([0, 2]), np.array([1, 6]))
    used = PlannedRuntime(reference_model.device.type, reference_model.resolved_kernel())
    assert len(ElmoModelHandler(planned=used).run_inference([sentence], reference_model)) == 1
    other = PlannedRuntime("cuda" if used.device == "cpu" else "cpu", used.kernel)
    with pytest.raises(RuntimeError, match=f"this worker would embed on {used.device} with the {used.kernel} kernel, "
                                           f"but the job was planned .* for device {other.device}"):
        ElmoModelHandler(planned=other).run_inference([sentence], reference_model)


def test_chinese_with_jieba_records_its_version():
    assert chinese_segmenter() == "jieba"  # the test extra installs it
    assert describe_segmenter("jieba") == {"segmenter": "jieba", "jieba_version": importlib.metadata.version("jieba")}


class BrokenJieba(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An installed jieba that cannot be imported: importlib.util.find_spec finds it, the import fails."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "jieba" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("jieba is broken here")


def test_chinese_without_jieba_falls_back_to_characters_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "jieba", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenJieba(), *sys.meta_path])
    assert chinese_segmenter() == "char"
    with pytest.raises(RuntimeError, match="jieba was planned .* install it on every worker"):
        build_nlp("zh", segmenter="jieba")  # a worker without jieba, in a job planned with it

    texts = ["我爱北京天安门。今天天气很好。", "他们在学校学习中文。"]
    src = tmp_path / "zh.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    run(*parse_extract_args(["--input", str(src), "--output", str(out), "--lang", "zh", "--layers", "top"]))
    summary = strict_json((out / "summary.json").read_text())
    assert summary["zh_char_fallback_documents"] == 2 == summary["documents_tokenized"]
    meta = strict_json(pq.read_schema(next(out.glob("tokens-*.parquet"))).metadata[METADATA_KEY])
    assert meta["tokenizer"]["segmenter"] == "char" and "jieba" in meta["tokenizer"]["fallback"]
    assert "jieba_version" not in meta["tokenizer"]
    tokens = read_output(out).column("token").to_pylist()
    assert all(len(t) == 1 for t in tokens) and "".join(tokens) == "".join(texts)
