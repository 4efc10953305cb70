"""An imported ELMoForManyLangs model through a real `extract` Beam run on Chinese text (`--lang zh`):
the workers load it from our format with its character dictionary, and every token row equals a
direct model call on the tokens the pipeline made."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline.corpus.schema import read_metadata
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.pipelines.extract import run
from support import data_path, parse_extract_args, read_output, vector_column

LINES = ["我爱自然语言处理。", "今天天气很好，我们去公园散步吧。", "饕餮是古代神话中的怪兽龘，我用Python写代码。"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    folder = data_path("formanylangs", "fixture_small", "model")
    out = tmp_path_factory.mktemp("fml") / "model"
    BiLM.from_formanylangs(str(folder)).save_pretrained(str(out))
    return out


def test_extract_lang_zh_with_an_imported_model(tmp_path, imported):
    src = tmp_path / "zh.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    argv = ["--input", str(src), "--output", str(tmp_path / "out"), "--model", str(imported), "--lang", "zh",
            "--dtype", "float32", "--batch-tokens", "16"]
    summary = run(*parse_extract_args(argv))
    assert summary["documents_reconcile"] and summary["tokens_reconcile"] and summary["documents_read"] == len(LINES)
    table = read_output(tmp_path / "out")
    model = BiLM.from_pretrained(str(imported)).eval()
    tokens = table.column("token").to_pylist()
    keys = list(zip(*(table.column(c).to_pylist() for c in ("doc_id", "sentence_index", "window_index"))))
    layers = np.stack([vector_column(table, f"layer_{i}") for i in range(3)])
    index = table.column("token_index").to_pylist()
    sentences: dict = {}
    for row, key in sorted(enumerate(keys), key=lambda item: (item[1], index[item[0]])):
        sentences.setdefault(key, []).append(row)
    assert len(sentences) >= len(LINES)
    for key, rows in sentences.items():
        with torch.inference_mode():
            want = model.embed([[tokens[r] for r in rows]]).layers[:, 0].numpy()
        np.testing.assert_allclose(layers[:, rows], want, rtol=0, atol=1e-6, err_msg=str(key))
    assert "".join(tokens[r] for rows in sentences.values() for r in rows) == "".join(LINES)
    known = [t for t in tokens if len(t) > 1 and t in model.vocab.index]
    assert known, "jieba's words should meet the model's word vocabulary"  # e.g. 公园, 今天
    meta = read_metadata(pq.read_schema(next((tmp_path / "out").glob("tokens-*.parquet"))))
    assert meta["tokenizer"]["segmenter"] == "jieba" and "char_dictionary" in str(meta)
