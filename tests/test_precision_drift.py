"""benchmarks/precision_drift.py: the figures the README's bf16 drift table comes from."""

from __future__ import annotations

import math

from benchmarks.common import wikitext_sentences
from benchmarks.precision_drift import main, precision_drift
from elmo_pipeline.strict import parse_json_strict
from support import data_path


def test_bf16_drift_figures_on_the_reference_model(reference_model):
    data_path("wikitext2")
    sentences = wikitext_sentences("valid")[:20]
    rows = precision_drift(reference_model, sentences, batch_tokens=512)
    assert len(rows) == 3
    for row in rows:
        assert all(math.isfinite(v) for v in row.values()), row
        assert 0.99 < row["min_cos"] <= 1 and 0 < row["rel_rms"] < 0.02, row
        assert 0 < row["mean"] <= row["p999"] <= row["max"] < 0.1 and row["scale"] > 0.3, row
    # layer 0 is the char CNN alone: its products run in bf16 too, so it drifts (measured 1.5e-2)
    assert rows[0]["max"] > 1e-3
    same = precision_drift(reference_model, sentences, batch_tokens=512, precision="fp32")
    for row, before in zip(same, rows):
        assert (row["max"], row["mean"], row["rel_rms"], row["over"], row["min_cos"]) == (0, 0, 0, 0, 1)
        assert row["scale"] == before["scale"]


def test_precision_drift_command_writes_strict_json(tmp_path, capsys):
    data_path("wikitext2")
    data_path("allennlp_elmo")
    out = tmp_path / "drift.json"
    main(["--models", "reference", "--sentences", "5", "--json", str(out)])
    report = parse_json_strict(out.read_text(), str(out))
    model = report["models"]["reference"]
    assert report["precision"] == "bf16" and model["sentences"] == 5 and len(model["layers"]) == 3
    printed = capsys.readouterr().out
    assert "5 of 8057 WikiText-2 valid sentences" in printed and "min cos" in printed
