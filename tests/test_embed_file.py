import gzip
import json

import h5py
import numpy as np
import torch

from elmo_pipeline.cli import main


def _run(elmo_fixture_dir, *args):
    return main(["embed-file", *args, "--quiet", "--options", str(elmo_fixture_dir / "options.json"),
                 "--weights", str(elmo_fixture_dir / "lm_weights.hdf5")])


def test_empty_lines_keep_line_numbers_as_keys(elmo_fixture_dir, reference_model, tmp_path):
    text = "The cat sat .\n\nA dog barked loudly .\n"
    (tmp_path / "in.txt.gz").write_bytes(gzip.compress(text.encode()))
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt.gz"), str(tmp_path / "out.h5"), "--batch-size", "2") == 0
    out = h5py.File(tmp_path / "out.h5", "r")
    assert out["0"].shape == (3, 4, 32)
    assert out["1"].shape == (3, 0, 32)
    assert out["2"].shape == (3, 5, 32)
    index = json.loads(out["sentence_to_index"][0])
    assert index == {"The cat sat .": "0", "": "1", "A dog barked loudly .": "2"}
    with torch.no_grad():
        direct = reference_model.embed([["A", "dog", "barked", "loudly", "."]]).layers[:, 0].numpy()
    np.testing.assert_allclose(out["2"][...], direct, atol=1e-6)


def test_average_and_top_shapes(elmo_fixture_dir, tmp_path):
    (tmp_path / "in.txt").write_text("one two three\nfour\n")
    _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "all.h5"))
    _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "avg.h5"), "--average")
    _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "top.h5"), "--top")
    full = h5py.File(tmp_path / "all.h5", "r")["0"][...]
    np.testing.assert_allclose(h5py.File(tmp_path / "avg.h5", "r")["0"][...], full.mean(0), atol=1e-6)
    np.testing.assert_array_equal(h5py.File(tmp_path / "top.h5", "r")["0"][...], full[-1])


def test_missing_input_is_a_clear_error(elmo_fixture_dir, tmp_path, capsys):
    assert _run(elmo_fixture_dir, str(tmp_path / "nope.txt"), str(tmp_path / "o.h5")) == 2
    assert "nope.txt" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()
