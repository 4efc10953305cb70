import errno
import json
import os
import re
import shutil
import signal
import stat
import uuid
from pathlib import Path

import fsspec
import h5py
import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.formats.files import CheckpointError
from elmo_pipeline.model.config import CharCnnConfig, LstmConfig
from elmo_pipeline.strict import ConfigError
from elmo_pipeline.model.vocabulary import Vocabulary

SENTS = [["The", "bank", "of", "the", "river"], ["He", "went", "to", "the", "bank"], ["包袱"]]


def _embed(model):
    with torch.no_grad():
        return model.embed(SENTS).layers.numpy()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_allennlp_to_native_round_trip_is_identical(reference_model, tmp_path, where):
    target = str(tmp_path / "m") if where == "local" else "memory://roundtrip/m"
    reference_model.save_pretrained(target)
    loaded = BiLM.from_pretrained(target).eval()
    assert loaded.config == reference_model.config
    np.testing.assert_array_equal(_embed(loaded), _embed(reference_model))


def test_import_allennlp_command(elmo_fixture_dir, tmp_path, reference_model):
    from elmo_pipeline.cli.main import main

    assert main(["import-allennlp", "--options", str(elmo_fixture_dir / "options.json"),
                 "--weights", str(elmo_fixture_dir / "lm_weights.hdf5"), "--output", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(_embed(BiLM.from_pretrained(str(tmp_path / "out"))), _embed(reference_model))


@pytest.mark.parametrize("encoder", ["word", "char_cnn+word"])
def test_word_and_fused_encoders_round_trip_with_their_vocabulary(tmp_path, encoder):
    vocab = Vocabulary.from_counts({"the": 5, "bank": 3, "river": 2, "went": 1})
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1)
    cfg = ElmoConfig(lstm=LstmConfig(dim=16, projection_dim=8, cell_clip=3.0, proj_clip=3.0),
                     char_cnn=cnn if encoder != "word" else None, token_encoder=encoder,
                     word_embedding_dim=6, vocab_size=len(vocab))
    model = BiLM(cfg, vocab).eval()
    model.save_pretrained(str(tmp_path / encoder))
    assert (tmp_path / encoder / "vocab.json").exists()
    loaded = BiLM.from_pretrained(str(tmp_path / encoder)).eval()
    assert loaded.vocab.tokens == vocab.tokens
    np.testing.assert_array_equal(_embed(loaded), _embed(model))
    # unknown words share <UNK>'s embedding in the word part
    ids = vocab.ids(["bank", "zebra", "<S>"])
    assert ids.tolist() == [vocab.index["bank"], vocab.unk_id, 0]


def test_original_format_with_a_262_row_char_table(elmo_fixture_dir, tmp_path, reference_model):
    src = h5py.File(elmo_fixture_dir / "lm_weights.hdf5", "r")
    with h5py.File(tmp_path / "w262.hdf5", "w") as dst:
        for name in _datasets(src):
            data = src[name][...]
            if name == "char_embed":
                data = np.concatenate([np.zeros((1, data.shape[1]), np.float32), data])
            dst.create_dataset(name, data=data)
    model = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(tmp_path / "w262.hdf5")).eval()
    np.testing.assert_array_equal(_embed(model), _embed(reference_model))


def _datasets(f):
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


def _copy_weights(elmo_fixture_dir, path, skip=(), reshape=None, extra=None):
    src = h5py.File(elmo_fixture_dir / "lm_weights.hdf5", "r")
    with h5py.File(path, "w") as dst:
        for name in _datasets(src):
            if name in skip:
                continue
            data = src[name][...]
            if reshape and name == reshape:
                data = data[:-1]
            dst.create_dataset(name, data=data)
        if extra:
            extra(dst)


def test_missing_tensor_in_hdf5_is_named(elmo_fixture_dir, tmp_path):
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, skip={"CNN_high_1/W_carry"})
    with pytest.raises(CheckpointError, match=r"CNN_high_1/W_carry.*missing"):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


@pytest.mark.parametrize("tensor, why", [
    ("CNN_proj/W_proj", "lstm.projection_dim=16 (the filters' count is 124)"),
    ("RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0", "lstm.projection_dim=16 (lstm.dim is 64)"),
])
def test_a_missing_projection_names_the_sizes_that_ask_for_it(elmo_fixture_dir, tmp_path, tensor, why):
    # the char CNN's projection was missing with no reason given, and a cell's was said to be asked for by
    # lstm.n_layers, where sizes that differ ask for both (bilm-tf leaves them out where the sizes are equal)
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, skip={tensor})
    options = elmo_fixture_dir / "options.json"
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: tensor '{tensor}' is missing; {why} in {options} "
                                                        "asks for it")):
        BiLM.from_allennlp(str(options), str(path))


def test_wrong_shape_in_hdf5_is_named(elmo_fixture_dir, tmp_path):
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, reshape="CNN_proj/W_proj")
    with pytest.raises(CheckpointError, match=r"CNN_proj/W_proj.*shape"):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


def test_external_links_are_refused(elmo_fixture_dir, tmp_path):
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, skip={"char_embed"},
                  extra=lambda f: f.__setitem__("char_embed", h5py.ExternalLink("/etc/other.h5", "x")))
    with pytest.raises(CheckpointError, match="char_embed.*ExternalLink"):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


def test_truncated_safetensors_is_a_clear_error(reference_model, tmp_path):
    reference_model.save_pretrained(str(tmp_path / "m"))
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        BiLM.from_pretrained(str(tmp_path / "m"))


def test_config_that_does_not_match_the_tensors_names_the_tensor(reference_model, tmp_path):
    reference_model.save_pretrained(str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["lstm"]["dim"] = 32
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"lstm\.layers\.0\.\w+.*shape"):
        BiLM.from_pretrained(str(tmp_path / "m"))


def test_unknown_config_field_is_an_error(reference_model, tmp_path):
    reference_model.save_pretrained(str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["lstm"]["dimm"] = 4
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="dimm"):
        BiLM.from_pretrained(str(tmp_path / "m"))


def test_options_json_round_trip(elmo_fixture_dir):
    raw = json.loads((elmo_fixture_dir / "options.json").read_text())
    cfg = ElmoConfig.from_options(raw)
    assert ElmoConfig.from_options(cfg.to_options()) == cfg
    assert cfg.lstm.cell_clip == 3.0 and cfg.char_cnn.n_filters == 124
    with pytest.raises(ConfigError, match="n_highway"):
        ElmoConfig.from_options({**raw, "char_cnn": {**raw["char_cnn"], "n_highway": "2"}})


def test_load_model_accepts_the_original_pair(elmo_fixture_dir, reference_model):
    model = BiLM.load(f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}").eval()
    np.testing.assert_array_equal(_embed(model), _embed(reference_model))


# -- the original format: every dataset checked before any is read --------------------------------
def _replace(name, make):
    """An `extra` for _copy_weights that puts `make(f)`'s value at `name` in place of the dataset."""
    def apply(f):
        del f[name]
        made = make(f)
        if made is not None:
            f[name] = made
    return apply


@pytest.mark.parametrize("make, message", [
    (lambda f: f.create_group("char_embed") and None, r"'char_embed' is not a dataset"),
    (lambda f: np.float32(1), r"tensor 'char_embed' has shape \(\), but char_cnn\.embedding\.dim=4 in .*options\.json "
                              r"needs \(261, 4\)"),
    # the rows are the byte alphabet's, which no options field sets: not blamed on the width
    (lambda f: np.zeros((263, 4), np.float32), r"tensor 'char_embed' has shape \(263, 4\), but .*options\.json needs "
                                               r"\(261, 4\); axis 0 has a fixed size, 261\Z"),
], ids=["group", "scalar", "rows"])
def test_a_char_embed_that_is_not_a_table_is_named(elmo_fixture_dir, tmp_path, make, message):
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, extra=_replace("char_embed", make))
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ": " + message):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


@pytest.mark.parametrize("scale, message", [
    (np.float64(1e300), r"holds values beyond float32's range, which would be infinite in the model"),
    (np.float64("inf"), r"holds NaN or infinite values"),
], ids=["float64 past float32", "infinite"])
def test_float64_datasets_past_float32_are_named_as_such(elmo_fixture_dir, tmp_path, scale, message):
    # 1e300 is finite in the file; the float32 model would hold infinities
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, extra=_replace("CNN_proj/b_proj", lambda f: np.full(16, scale)))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: tensor 'CNN_proj/b_proj' ") + message):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


@pytest.mark.parametrize("edit, message", [
    (lambda o: o["char_cnn"].update(n_highway=1), r"unexpected entry 'CNN_high_1' \(5 in all\)"),
    (lambda o: o["char_cnn"].update(n_highway=0), r"unexpected entry 'CNN_high_0' \(10 in all\)"),
    (lambda o: o["lstm"].update(n_layers=1), r"unexpected entry 'RNN_0/RNN/MultiRNNCell/Cell1' \(10 in all\)"),
], ids=["one highway fewer", "no highway", "one layer fewer"])
def test_datasets_the_options_do_not_ask_for_are_refused(elmo_fixture_dir, tmp_path, edit, message):
    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    edit(options)
    (tmp_path / "options.json").write_text(json.dumps(options))
    weights = elmo_fixture_dir / "lm_weights.hdf5"
    with pytest.raises(CheckpointError, match=re.escape(str(weights)) + ": " + message + ".*options\\.json does not ask"):
        BiLM.from_allennlp(str(tmp_path / "options.json"), str(weights))


def test_an_extra_dataset_or_link_is_refused(elmo_fixture_dir, tmp_path):
    path = tmp_path / "w.hdf5"
    _copy_weights(elmo_fixture_dir, path, extra=lambda f: f.create_dataset("junk", data=np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected entry 'junk' \(1 in all\)"):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))
    _copy_weights(elmo_fixture_dir, path, extra=lambda f: f.__setitem__("CNN/alias", h5py.SoftLink("/char_embed")))
    with pytest.raises(CheckpointError, match=r"unexpected entry 'CNN/alias' \(1 in all\)"):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


def test_a_training_softmax_in_the_weights_is_left_unread(elmo_fixture_dir, tmp_path, reference_model):
    # bilm-tf names its output layer softmax/W (vocabulary x projection) and softmax/b; a dump that keeps them
    # is the same model for embedding
    path = tmp_path / "w.hdf5"

    def softmax(f):
        f.create_dataset("softmax/W", data=np.ones((50, 16), np.float32))
        f.create_dataset("softmax/b", data=np.zeros(50, np.float32))

    _copy_weights(elmo_fixture_dir, path, extra=softmax)
    model = BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path)).eval()
    np.testing.assert_array_equal(_embed(model), _embed(reference_model))
    assert model.softmax is None
    # a link is refused there as anywhere else, even though nothing of the group is read
    _copy_weights(elmo_fixture_dir, path, extra=lambda f: (softmax(f), f.__setitem__(
        "softmax/alias", h5py.ExternalLink("other.hdf5", "/W"))))
    with pytest.raises(CheckpointError, match=r"unexpected entry 'softmax/alias' \(1 in all\)"):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


def _write_original(folder: Path, options: dict, weights: dict[str, np.ndarray]) -> tuple[str, str]:
    folder.mkdir(exist_ok=True)
    (folder / "options.json").write_text(json.dumps(options))
    with h5py.File(folder / "weights.hdf5", "w") as f:
        for name, value in weights.items():
            f.create_dataset(name, data=value)
    return str(folder / "options.json"), str(folder / "weights.hdf5")


def test_bilm_tf_files_without_highways_or_projections_load(tmp_path):
    # bilm-tf omits what its options make useless: no n_highway key means no highway layer, no CNN_proj when
    # the filters' count is lstm.projection_dim, no W_P_0 when projection_dim is lstm.dim (its cell then
    # ignores proj_clip). Such a file is the model whose missing projections are identities.
    rng = np.random.default_rng(0)
    size = 8
    options = {"lstm": {"dim": size, "projection_dim": size, "n_layers": 2, "cell_clip": 3.0, "proj_clip": 0.05,
                        "use_skip_connections": True},
               "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 4], [2, 4]], "activation": "relu",
                            "max_characters_per_token": 50, "n_characters": 261}}
    weights = {"char_embed": rng.normal(size=(261, 4)).astype(np.float32)}
    for k, (width, n) in enumerate(options["char_cnn"]["filters"]):
        weights[f"CNN/W_cnn_{k}"] = rng.normal(size=(1, width, 4, n)).astype(np.float32)
        weights[f"CNN/b_cnn_{k}"] = rng.normal(size=n).astype(np.float32)
    cells = [f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell" for d in (0, 1) for layer in (0, 1)]
    for cell in cells:
        weights[f"{cell}/W_0"] = rng.normal(size=(2 * size, 4 * size)).astype(np.float32)
        weights[f"{cell}/B"] = rng.normal(size=4 * size).astype(np.float32)
    model = BiLM.from_allennlp(*_write_original(tmp_path / "bilm_tf", options, weights)).eval()
    assert model.config.lstm.proj_clip is None and model.config.char_cnn.n_highway == 0

    explicit = json.loads(json.dumps(options))
    explicit["char_cnn"]["n_highway"] = 0
    explicit["lstm"]["proj_clip"] = None
    identities = {"CNN_proj/W_proj": np.eye(size, dtype=np.float32), "CNN_proj/b_proj": np.zeros(size, np.float32),
                  **{f"{cell}/W_P_0": np.eye(size, dtype=np.float32) for cell in cells}}
    with_identities = BiLM.from_allennlp(*_write_original(tmp_path / "explicit", explicit, weights | identities)).eval()
    np.testing.assert_array_equal(_embed(model), _embed(with_identities))

    # layer 0 of "a" is the char CNN alone: relu of the max over positions of each convolution
    with torch.no_grad():
        layer0 = model.embed([["a"]]).layers[0, 0, 0, :size].numpy()
    ids = [259, ord("a") + 1, 260] + [261] * 47  # [BOW, a, EOW, PAD...], shifted by one
    table = np.concatenate([np.zeros((1, 4)), weights["char_embed"].astype(np.float64)])[ids]
    features = []
    for k, (width, _) in enumerate(options["char_cnn"]["filters"]):
        w = weights[f"CNN/W_cnn_{k}"][0].astype(np.float64)
        conv = [np.einsum("wd,wdn->n", table[p:p + width], w) for p in range(50 - width + 1)]
        features.append(np.maximum(np.max(conv, axis=0) + weights[f"CNN/b_cnn_{k}"], 0))
    np.testing.assert_allclose(layer0, np.concatenate(features), rtol=1e-6, atol=1e-6)


def test_options_without_n_layers_are_one_layer_as_bilm_tf_reads_them(elmo_fixture_dir, tmp_path):
    # bilm-tf's options.get('n_layers', 1): such a file with one layer's weights was refused, as if it asked for two
    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    weights = tmp_path / "w.hdf5"
    with h5py.File(elmo_fixture_dir / "lm_weights.hdf5", "r") as f:
        second_layer = {name for name in _datasets(f) if "/Cell1/" in name}
    _copy_weights(elmo_fixture_dir, weights, skip=second_layer)
    del options["lstm"]["n_layers"]
    (tmp_path / "implicit.json").write_text(json.dumps(options))
    options["lstm"]["n_layers"] = 1
    (tmp_path / "explicit.json").write_text(json.dumps(options))
    implicit = BiLM.from_allennlp(str(tmp_path / "implicit.json"), str(weights)).eval()
    assert implicit.config.lstm.n_layers == 1 and implicit.config.n_output_layers == 2
    explicit = BiLM.from_allennlp(str(tmp_path / "explicit.json"), str(weights)).eval()
    np.testing.assert_array_equal(_embed(implicit), _embed(explicit))


def test_bilm_tfs_dump_of_one_layer_names_its_cell_without_a_stack_and_loads(elmo_fixture_dir, tmp_path):
    # bilm-tf trains one layer without a MultiRNNCell, and its dump_weights names that cell RNN_0/RNN/LSTMCell/W_0:
    # such a file was refused ('RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0' is missing)
    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    options["lstm"]["n_layers"] = 1
    (tmp_path / "options.json").write_text(json.dumps(options))
    with h5py.File(elmo_fixture_dir / "lm_weights.hdf5", "r") as f:
        weights = {name: f[name][...] for name in _datasets(f) if "/Cell1/" not in name}
    unstacked = {name.replace("/MultiRNNCell/Cell0/", "/"): value for name, value in weights.items()}
    assert "RNN_1/RNN/LSTMCell/W_P_0" in unstacked
    loaded = {}
    for layout, datasets in (("stacked", weights), ("unstacked", unstacked)):
        with h5py.File(tmp_path / f"{layout}.hdf5", "w") as f:
            for name, value in datasets.items():
                f.create_dataset(name, data=value)
        loaded[layout] = _embed(BiLM.from_allennlp(str(tmp_path / "options.json"), str(tmp_path / f"{layout}.hdf5")))
    assert loaded["unstacked"].shape == (2, 3, 5, 32) and np.abs(loaded["unstacked"][1]).max() > 0.1
    np.testing.assert_array_equal(loaded["unstacked"], loaded["stacked"])
    # both names at once: the stacked one is read and the other refused as a dataset nobody asked for
    with h5py.File(tmp_path / "stacked.hdf5", "a") as f:
        f.create_dataset("RNN_0/RNN/LSTMCell/B", data=weights["RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/B"])
    with pytest.raises(CheckpointError, match=r"unexpected entry 'RNN_0/RNN/LSTMCell'"):
        BiLM.from_allennlp(str(tmp_path / "options.json"), str(tmp_path / "stacked.hdf5"))


@pytest.mark.parametrize("section, field", [("lstm", "use_skip_connections"), ("char_cnn", "activation")])
def test_options_without_a_field_bilm_tf_requires_are_refused_naming_it(elmo_fixture_dir, tmp_path, capsys, section,
                                                                         field):
    # bilm-tf's inference reads both without a default and fails without them. They were guessed: skip connections
    # on (2.3 away, in layer 2, from a synthesized model without them, as bilm-tf trains when the key is absent),
    # and relu (a tanh model's char CNN run wrong; the AllenNLP port fails too)
    from elmo_pipeline.cli.main import main

    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    del options[section][field]
    path = tmp_path / "options.json"
    path.write_text(json.dumps(options))
    weights = str(elmo_fixture_dir / "lm_weights.hdf5")
    message = f"{path}: {section}: missing field(s) ['{field}']"
    with pytest.raises(ConfigError, match=re.escape(message)):
        BiLM.from_allennlp(str(path), weights)
    assert main(["import-allennlp", "--options", str(path), "--weights", weights, "--output", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def test_datasets_declaring_more_than_the_limit_are_refused_before_any_is_read(elmo_fixture_dir, tmp_path,
                                                                               monkeypatch):
    # an lstm.dim of 2**14 in options.json, and LSTM datasets of that shape that were never written: chunked and
    # compressed, they cost nothing on disk (tests/test_security.py holds the real limit to a bomb of 5 GB)
    from elmo_pipeline.formats import allennlp

    options = json.loads((elmo_fixture_dir / "options.json").read_text())
    dim = 1 << 14
    options["lstm"].update(dim=dim, n_layers=1)
    (tmp_path / "options.json").write_text(json.dumps(options))
    path = tmp_path / "w.hdf5"

    def unwritten_lstm(f):
        del f["RNN_0"], f["RNN_1"]
        for direction in (0, 1):
            base = f"RNN_{direction}/RNN/MultiRNNCell/Cell0/LSTMCell"
            f.create_dataset(f"{base}/W_0", shape=(32, 4 * dim), dtype="f4", chunks=(32, 4096), compression="gzip")
            f.create_dataset(f"{base}/B", shape=(4 * dim,), dtype="f4", chunks=(4096,), compression="gzip")
            f.create_dataset(f"{base}/W_P_0", shape=(dim, 16), dtype="f4", chunks=(4096, 16), compression="gzip")

    _copy_weights(elmo_fixture_dir, path, extra=unwritten_lstm)
    declared = 4 * (2 * (32 * 4 * dim + 4 * dim + dim * 16) + 261 * 4 + 4 * 124 * 124 + 4 * 124 + 124 * 16 + 16
                    + sum(w * 4 * n + n for w, n in [[1, 4], [2, 8], [3, 16], [4, 32], [5, 64]]))
    assert path.stat().st_size * 40 < declared
    monkeypatch.setattr(allennlp, "MAX_FILE_BYTES", declared - 1)
    monkeypatch.setattr(allennlp, "_read", lambda *args: pytest.fail("a dataset was read"))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: its datasets declare {declared:,} bytes, more than "
                                                        f"the {declared - 1:,} a weight file may hold")):
        BiLM.from_allennlp(str(tmp_path / "options.json"), str(path))


def test_a_damaged_compressed_chunk_names_the_file_and_tensor(elmo_fixture_dir, tmp_path):
    path = tmp_path / "w.hdf5"

    def compressed(f):
        data = f["CNN_proj/W_proj"][...]
        del f["CNN_proj/W_proj"]
        f.create_dataset("CNN_proj/W_proj", data=data, chunks=data.shape, compression="gzip")

    _copy_weights(elmo_fixture_dir, path, extra=compressed)
    with h5py.File(path, "r") as f:
        offset = f["CNN_proj/W_proj"].id.get_chunk_info(0).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 64] = bytes(64)  # the deflate stream's start, zeroed
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: tensor 'CNN_proj/W_proj' cannot be read (")):
        BiLM.from_allennlp(str(elmo_fixture_dir / "options.json"), str(path))


def test_import_allennlp_refuses_a_busy_folder_and_overwrites_a_model_folder(elmo_fixture_dir, tmp_path, capsys,
                                                                           reference_model):
    from elmo_pipeline.cli.main import main

    pair = ["--options", str(elmo_fixture_dir / "options.json"), "--weights", str(elmo_fixture_dir / "lm_weights.hdf5")]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["import-allennlp", *pair, "--output", str(tmp_path / "busy")]) == 2
    assert f"{tmp_path / 'busy'} is not empty; give a new folder, or --overwrite" in capsys.readouterr().err
    assert main(["import-allennlp", *pair, "--output", str(tmp_path / "busy"), "--overwrite"]) == 2
    assert "holds files but no config.json: not a model folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]
    reference_model.save_pretrained(str(tmp_path / "old"))
    (tmp_path / "old" / "vocab.json").write_text("{}")  # a file of the model it replaces
    assert main(["import-allennlp", *pair, "--output", str(tmp_path / "old")]) == 2
    assert main(["import-allennlp", *pair, "--output", str(tmp_path / "old"), "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(_embed(BiLM.from_pretrained(str(tmp_path / "old"))), _embed(reference_model))
    # original files kept in the model folder, named by URL: replacing the folder would delete them
    for name in ("options.json", "lm_weights.hdf5"):
        shutil.copy(elmo_fixture_dir / name, tmp_path / "old" / name)
    held = ["--options", f"file://{tmp_path / 'old' / 'options.json'}", "--weights", str(tmp_path / "old" / "lm_weights.hdf5")]
    assert main(["import-allennlp", *held, "--output", f"file://{tmp_path / 'old'}", "--overwrite"]) == 2
    assert "which this command reads: replacing the folder would delete it" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["config.json", "lm_weights.hdf5", "model.safetensors",
                                                                    "options.json"]


# -- our format ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "vocab.json"])
def test_a_model_file_that_is_a_folder_is_refused_by_name(tmp_path, name):
    BiLM.from_pretrained().save_pretrained(str(tmp_path / "m"))
    (tmp_path / "m" / name).unlink()
    (tmp_path / "m" / name).mkdir()
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'm' / name}: cannot be read (")):
        BiLM.from_pretrained(str(tmp_path / "m"))


def test_an_empty_model_location_is_an_error_not_the_default_model():
    for location in ("", "  "):
        with pytest.raises(CheckpointError, match="the model location is an empty string"):
            BiLM.from_pretrained(location)
        with pytest.raises(CheckpointError, match="the model location is an empty string"):
            BiLM.load(location)
    assert BiLM.load(None).config.name == BiLM.from_pretrained().config.name  # None is the default model


def test_an_empty_original_file_is_named_not_read_as_the_current_folder(elmo_fixture_dir):
    """BiLM.from_allennlp('', WEIGHTS) said ': cannot be read ([Errno 21] Is a directory: <cwd>)'."""
    options, weights = str(elmo_fixture_dir / "options.json"), str(elmo_fixture_dir / "lm_weights.hdf5")
    for given, what in (((" ", weights), "options"), ((options, ""), "weights")):
        with pytest.raises(CheckpointError, match=rf"^the {what} file is an empty string; name the original {what}"):
            BiLM.from_allennlp(*given)
    with pytest.raises(CheckpointError, match=r"^the weights file is an empty string"):
        BiLM.config_of(f"{options},")


@pytest.mark.parametrize("name, edit, message", [
    ("vocab.json", lambda t: t.update(tokens=t["tokens"][:-1]),
     r"vocab\.json: has 42 tokens, but vocab_size=43 in .*config\.json needs 43"),
    ("chars.json", lambda t: t.update(characters=t["characters"][:-1]),
     r"chars\.json: has 8 entries, but char_dictionary\.size=9 in .*config\.json needs 9"),
])
def test_a_vocabulary_one_entry_short_names_its_file_and_the_field(tmp_path, name, edit, message):
    from elmo_pipeline.model.config import CharDictionaryConfig
    from elmo_pipeline.model.vocabulary import FORMANYLANGS_SPECIALS, CharVocabulary

    vocab = Vocabulary(["<bos>", "<eos>", "<oov>", "<pad>", *(f"w{i}" for i in range(39))], specials=FORMANYLANGS_SPECIALS)
    chars = CharVocabulary(["<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>", "a", "b", "c"])
    cfg = ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4), char_cnn=CharCnnConfig(embedding_dim=4, filters=((1, 4),),
                     n_highway=0), token_encoder="char_cnn+word", word_embedding_dim=6, vocab_size=len(vocab),
                     char_dictionary=CharDictionaryConfig(size=len(chars)))
    BiLM(cfg, vocab, chars=chars).save_pretrained(str(tmp_path / "m"))
    raw = json.loads((tmp_path / "m" / name).read_text())
    edit(raw)
    (tmp_path / "m" / name).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        BiLM.from_pretrained(str(tmp_path / "m"))


@pytest.mark.parametrize("retype, problem", [
    (lambda t: t.to(torch.float8_e4m3fn), "has dtype torch.float8_e4m3fn, expected floating point"),
    # finite in float64, infinite in the float32 model: the model would give infinite vectors
    (lambda t: t.double() * 1e300, "holds values beyond float32's range, which would be infinite in the model"),
], ids=["float8", "float64 past float32"])
def test_weights_the_model_cannot_hold_are_refused_by_tensor(reference_model, tmp_path, retype, problem):
    from safetensors.torch import load_file, save_file

    reference_model.save_pretrained(str(tmp_path / "m"))
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(weights)
    state["lstm.layers.0.bias"] = retype(state["lstm.layers.0.bias"])
    save_file(state, weights)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["weights_sha256"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(f"{weights}: tensor 'lstm.layers.0.bias' {problem}")):
        BiLM.from_pretrained(str(tmp_path / "m"))


@pytest.mark.parametrize("size, torch_says", [
    (10**12, "Storage size calculation overflowed"),  # the highways' (F, F) matrices overflow a storage size
    (2**63, ""),  # past int64: torch cannot even take it as a size
])
def test_a_config_whose_sizes_torch_cannot_address_names_the_file(reference_model, tmp_path, size, torch_says):
    reference_model.save_pretrained(str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["char_cnn"]["filters"][-1][1] = size
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'm' / 'config.json'}: describes a model that "
                                                        f"cannot be built ({torch_says}")):
        BiLM.from_pretrained(str(tmp_path / "m"))


def test_a_failed_publish_leaves_no_folder_behind(reference_model, tmp_path, monkeypatch):
    from elmo_pipeline.formats import native

    def fail_midway(model, directory):
        (Path(directory)).mkdir(exist_ok=True)
        (Path(directory) / "model.safetensors").write_bytes(b"partial")
        raise ValueError("config.json: lstm.cell_clip (inf) is not a finite number")

    monkeypatch.setattr(native, "save_pretrained", fail_midway)
    with pytest.raises(ValueError, match="not a finite number"):
        native.publish_pretrained(reference_model, str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging copy


def test_a_publish_the_disk_cannot_hold_names_the_folder_asked_for(reference_model, tmp_path, monkeypatch):
    """The error named the hidden staging folder, which no longer exists, not the --output given."""
    from elmo_pipeline.formats import native

    def full_disk(model, directory):
        with open(Path(directory) / "model.safetensors", "wb"):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(native, "save_pretrained", full_disk)
    with pytest.raises(OSError, match=rf"^\[Errno 28\] cannot write {re.escape(str(tmp_path / 'out'))}: No space left "
                                      r"on device$"):
        native.publish_pretrained(reference_model, str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no folder can be made")
def test_an_output_where_no_folder_can_be_made_is_named(elmo_fixture_dir, capsys):
    """The error named the hidden staging folder it could not make ('.m.<hex>.partial'), not
    --output: the case of a read-only parent folder."""
    from elmo_pipeline.cli.main import main

    pair = ["--options", str(elmo_fixture_dir / "options.json"), "--weights", str(elmo_fixture_dir / "lm_weights.hdf5")]
    for output in ("/proc/self/m", "/proc/self/a/m"):
        assert main(["import-allennlp", *pair, "--output", output]) == 2
        assert capsys.readouterr().err.strip() == (f"elmo-pipeline import-allennlp: error: [Errno {errno.ENOENT}] "
                                                   f"cannot write {output}: No such file or directory")


def test_publishing_touches_nothing_beside_the_folder_and_keeps_an_existing_one(reference_model, tmp_path):
    """A user's my-model.old/ and my-model.tmp/ were deleted by export and import (exit 0); an
    existing empty folder was replaced by a new one, which a mount point refuses (EBUSY) and
    which lost the folder's mode and group."""
    from elmo_pipeline.formats import native

    for sibling in ("m.old", "m.tmp"):
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "notes.txt").write_text("precious")
    previous = os.umask(0o022)
    try:
        native.publish_pretrained(reference_model, str(tmp_path / "m"))
    finally:
        os.umask(previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.old", "m.tmp"]  # no staging folder left
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o755  # the umask's, not a temporary folder's 0700
    assert all((tmp_path / s / "notes.txt").read_text() == "precious" for s in ("m.old", "m.tmp"))
    np.testing.assert_array_equal(_embed(BiLM.from_pretrained(str(tmp_path / "m"))), _embed(reference_model))

    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o2750)
    inode = volume.stat().st_ino
    native.publish_pretrained(reference_model, str(volume))
    assert (volume.stat().st_ino, volume.stat().st_mode & 0o7777) == (inode, 0o2750)  # the same folder, written in
    (volume / "stale.txt").write_text("from before")
    native.publish_pretrained(reference_model, str(volume), overwrite=True)
    assert volume.stat().st_ino == inode
    assert sorted(p.name for p in volume.iterdir()) == ["config.json", "model.safetensors"]  # replaced whole



def test_a_file_written_whole_is_never_moved_into_a_folder_of_its_name(tmp_path):
    """The rename put `<name>.partial` inside an existing folder `<name>` and reported success."""
    from elmo_pipeline.formats.atomic import write_url_atomically

    (tmp_path / "report.json").mkdir()
    with pytest.raises(IsADirectoryError, match=r"cannot write .*report\.json: it is an existing folder"):
        write_url_atomically(str(tmp_path / "report.json"), b"{}")
    assert list((tmp_path / "report.json").iterdir()) == []
    write_url_atomically(str(tmp_path / "ok.json"), b"{}")
    assert (tmp_path / "ok.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json", "report.json"]  # no partial file left


def test_two_writes_of_one_file_at_once_never_share_a_temporary_file(tmp_path):
    """Both wrote `<final>.partial`: the one that renamed last published the other's bytes mixed
    with its own (embed-file: 512 of 800 datasets wrong, and the run that wrote them said
    success)."""
    from elmo_pipeline.formats.atomic import replace_atomically

    fs = fsspec.filesystem("file")
    final = str(tmp_path / "out.bin")
    inner_partial = []

    def outer(partial):
        with open(partial, "wb") as f:
            f.write(b"A" * 1000)
            replace_atomically(fs, final, inner)  # a second run, start to end, while the first writes
            f.write(b"A" * 1000)

    def inner(partial):
        inner_partial.append(partial)
        with open(partial, "wb") as f:
            f.write(b"B" * 10)

    replace_atomically(fs, final, outer)
    assert (tmp_path / "out.bin").read_bytes() == b"A" * 2000  # the last rename, whole
    assert inner_partial[0] != final + ".partial" and os.path.dirname(inner_partial[0]) == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_a_rename_that_fails_leaves_the_earlier_file_as_it_was(tmp_path, monkeypatch):
    """fsspec's local mv falls back to copying onto the final name in place when the rename
    fails (a full disk, a folder made read-only): the earlier good file was half overwritten."""
    from elmo_pipeline.formats import atomic

    final = tmp_path / "out.hdf5"
    final.write_bytes(b"the earlier, good file")

    def no_rename(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    with pytest.raises(OSError, match=rf"cannot write {re.escape(str(final))}: .*No space left on device"):
        atomic.write_url_atomically(str(final), b"the new file, much longer than the earlier one")
    assert final.read_bytes() == b"the earlier, good file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.hdf5"]


@pytest.mark.parametrize("base, joined", [
    ("gs://b", "gs://b/config.json"), ("gs://b//", "gs://b/config.json"), ("memory://", "memory://config.json"),
    ("memory:///", "memory:///config.json"), ("file:///", "file:///config.json"),
    ("file:///tmp/", "file:///tmp/config.json"), ("blockcache::file:///m", "blockcache::file:///m/config.json"),
    ("out/", os.path.join("out", "config.json")), ("/", "/config.json"),
])
def test_join_url_keeps_a_url_a_url(base, joined):
    """`memory://` + name was `memory:/config.json`, which fsspec reads as a local relative path."""
    from elmo_pipeline.formats.files import join_url

    assert join_url(base, "config.json") == joined


def test_a_model_saved_at_the_root_of_a_file_system_loads_from_there(reference_model, tmp_path, monkeypatch):
    import fsspec

    memory = fsspec.filesystem("memory")
    assert not memory.exists("/config.json")
    monkeypatch.chdir(tmp_path)
    os.makedirs("memory:")  # the folder the old join read instead, had it existed
    reference_model.save_pretrained("memory://")
    try:
        assert not os.listdir("memory:")
        np.testing.assert_array_equal(_embed(BiLM.from_pretrained("memory://").eval()), _embed(reference_model))
    finally:
        for name in ("config.json", "model.safetensors"):
            memory.rm(f"/{name}")


def test_every_loader_takes_a_pathlib_path(reference_model, elmo_fixture_dir, tmp_path):
    folder = tmp_path / "m"
    reference_model.save_pretrained(folder)
    expected = _embed(reference_model)
    for loaded in (BiLM.from_pretrained(folder), BiLM.load(folder),
                   BiLM.from_allennlp(elmo_fixture_dir / "options.json", elmo_fixture_dir / "lm_weights.hdf5")):
        np.testing.assert_array_equal(_embed(loaded.eval()), expected)
    assert BiLM.config_of(folder) == reference_model.config


def test_every_loader_gives_a_model_in_eval_mode_whose_embed_uses_the_word_cache(elmo_fixture_dir):
    """A loaded model was in training mode (an nn.Module's default), where embed computes every word
    afresh: left without .eval(), as a hurried user leaves it, it embedded 40 WikiText-2 sentences
    2.2 times slower (3.02 s against 1.38 s), with the same values."""
    from support import data_path

    options, weights = elmo_fixture_dir / "options.json", elmo_fixture_dir / "lm_weights.hdf5"
    sentences = [["a", "rose", "is", "a", "rose"]]
    for model in (BiLM.from_pretrained(), BiLM.load(f"{options},{weights}"), BiLM.from_allennlp(options, weights),
                  BiLM.from_formanylangs(data_path("formanylangs", "fixture_small") / "model")):
        assert model.training is False
        with torch.inference_mode():
            cached = model.embed(sentences).layers
            assert len(model.word_cache) == 5  # the boundaries and the three words
            assert torch.equal(cached, model.train().embed(sentences).layers)  # training mode: the same values
        assert model.training is True


def test_a_location_that_is_no_path_is_named_by_its_parameter(reference_model, elmo_fixture_dir, tmp_path):
    """BiLM.from_pretrained(5) said only "expected str, bytes or os.PathLike object, not int" (as did
    save_pretrained(None) and from_allennlp(None, ...)), and a location given as bytes failed inside
    fsspec: "a bytes-like object is required, not 'str'"."""
    options, weights = elmo_fixture_dir / "options.json", elmo_fixture_dir / "lm_weights.hdf5"
    for call, name, value in ((lambda v: BiLM.from_pretrained(v), "location", 5),
                              (lambda v: BiLM.from_pretrained(v), "location", bytes(tmp_path)),
                              (lambda v: BiLM.load(v), "location", 5),
                              (lambda v: BiLM.config_of(v), "location", ["m"]),
                              (lambda v: BiLM.from_allennlp(v, weights), "options", None),
                              (lambda v: BiLM.from_allennlp(options, v), "weights", 3),
                              (lambda v: BiLM.from_formanylangs(v), "location", None),
                              (lambda v: BiLM.from_formanylangs(tmp_path, v), "network_config", 7),
                              (lambda v: reference_model.save_pretrained(v), "directory", None)):
        with pytest.raises(TypeError, match=re.escape(f"{name} is a path or URL, a str or pathlib.Path; got "
                                                      f"{value!r}")):
            call(value)
    assert list(tmp_path.iterdir()) == []
    reference_model.save_pretrained(tmp_path / "m")  # a str and a Path go on as before
    assert BiLM.config_of(str(tmp_path / "m")) == BiLM.config_of(tmp_path / "m") == reference_model.config


def test_a_file_or_an_unconverted_elmoformanylangs_folder_as_the_model_says_what_to_give(elmo_fixture_dir):
    from support import data_path

    options = elmo_fixture_dir / "options.json"
    with pytest.raises(CheckpointError, match=re.escape(
            f"{options} is a file, not a model folder: a model of ours is a folder or URL holding config.json and "
            "model.safetensors; the original weights are given as OPTIONS.json,WEIGHTS.hdf5")):
        BiLM.from_pretrained(str(options))
    folder = data_path("formanylangs", "fixture_small") / "model"
    with pytest.raises(CheckpointError, match=re.escape(
            f"{folder} is an ELMoForManyLangs model folder (its config.json names config_path "
            "'cnn_16_32_32_64_fixture.json'): convert it once with `elmo-pipeline import-formanylangs`")):
        BiLM.load(str(folder))


def test_a_folder_of_the_original_files_as_the_model_says_how_to_give_them(elmo_fixture_dir, reference_model,
                                                                          tmp_path):
    """A folder holding an AllenNLP download (options.json and weights.hdf5) given as a model of
    ours said only "DIR/config.json: file not found"."""
    folder = tmp_path / "elmo"
    folder.mkdir()
    shutil.copy(elmo_fixture_dir / "options.json", folder / "elmo_2x16_options.json")
    shutil.copy(elmo_fixture_dir / "lm_weights.hdf5", folder / "elmo_2x16_weights.hdf5")
    said = (f"{folder} holds no config.json but the original's files: give them as OPTIONS.json,WEIGHTS.hdf5 "
            "(BiLM.from_allennlp(OPTIONS, WEIGHTS) in Python), or convert them once with `elmo-pipeline "
            "import-allennlp`")
    pair = f"{folder}/elmo_2x16_options.json,{folder}/elmo_2x16_weights.hdf5"
    for load in (BiLM.from_pretrained, BiLM.load, BiLM.config_of):
        with pytest.raises(CheckpointError, match=f"^{re.escape(f'{said}; here {pair}')}$"):
            load(str(folder))
    np.testing.assert_array_equal(_embed(BiLM.load(pair).eval()), _embed(reference_model))  # what it names loads
    shutil.copy(folder / "elmo_2x16_weights.hdf5", folder / "elmo_2x16_old_weights.hdf5")  # two: none named
    with pytest.raises(CheckpointError, match=f"^{re.escape(said)}$"):
        BiLM.from_pretrained(folder)
    for name in ("elmo_2x16_options.json", "elmo_2x16_weights.hdf5", "elmo_2x16_old_weights.hdf5"):
        (folder / name).unlink()
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(folder / 'config.json'))}: file not found$"):
        BiLM.from_pretrained(folder)  # a folder of neither kind: as before


def test_the_original_pair_given_weights_first_is_named_in_the_right_order(elmo_fixture_dir, tmp_path):
    options, weights = elmo_fixture_dir / "options.json", elmo_fixture_dir / "lm_weights.hdf5"
    with pytest.raises(CheckpointError, match=re.escape(
            f"{weights},{options} is no model folder; the original weights are given as OPTIONS.json,WEIGHTS.hdf5, "
            f"the options first: {options},{weights}")):
        BiLM.load(f"{weights},{options}")
    # a model folder whose name has a comma and ends in .json is still a folder
    folder = tmp_path / "a,b.json"
    BiLM.load(f"{options},{weights}").save_pretrained(folder)
    np.testing.assert_array_equal(_embed(BiLM.load(str(folder)).eval()), _embed(BiLM.load(f"{options},{weights}")))


def _tiny_model(seed):
    torch.manual_seed(seed)
    cnn = CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1)
    return BiLM(ElmoConfig(lstm=LstmConfig(dim=16, projection_dim=8), char_cnn=cnn)).eval()


def test_a_save_into_a_folder_another_save_is_writing_waits_for_it(tmp_path):
    """Two save_pretrained into one folder at once interleaved their renames: one model's
    config.json beside the other's weights, a folder refused by its checksum (1 in 30 tries)."""
    import fcntl
    import threading

    first, second = _tiny_model(0), _tiny_model(1)
    folder = str(tmp_path / "m")
    first.save_pretrained(folder)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save in progress, as another process or thread holds it
    saving = threading.Thread(target=second.save_pretrained, args=(folder,))
    try:
        saving.start()
        saving.join(0.5)
        assert saving.is_alive()  # it waits for the other save to end
        np.testing.assert_array_equal(_embed(BiLM.from_pretrained(folder)), _embed(first))
    finally:
        os.close(fd)
        saving.join()
    np.testing.assert_array_equal(_embed(BiLM.from_pretrained(folder)), _embed(second))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("directory", ["", "file://"])
def test_save_pretrained_to_an_empty_name_is_refused_not_written_to_the_current_folder(tmp_path, monkeypatch,
                                                                                         directory):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"save_pretrained: .* names no folder"):
        _tiny_model(0).save_pretrained(directory)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("under", [False, True])
def test_save_pretrained_onto_an_existing_file_is_refused_naming_the_file(tmp_path, under):
    # Python's own FileExistsError ("[Errno 17] File exists: ...") or NotADirectoryError before
    (tmp_path / "notes.txt").write_text("mine\n")
    directory = str(tmp_path / "notes.txt" / "model") if under else str(tmp_path / "notes.txt")
    with pytest.raises(ValueError) as caught:
        _tiny_model(0).save_pretrained(directory)
    assert str(caught.value) == (
        f"save_pretrained: {directory} cannot be created as a folder: {tmp_path / 'notes.txt'} is an existing file"
        if under else f"save_pretrained: {directory} is an existing file; it must name a folder (new or existing)")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    memory = fsspec.filesystem("memory")
    memory.pipe("/save-onto-a-file/notes.txt", b"mine\n")
    try:
        with pytest.raises(ValueError, match=r"^save_pretrained: memory://save-onto-a-file/notes.txt is an existing"):
            _tiny_model(0).save_pretrained("memory://save-onto-a-file/notes.txt")
        assert memory.cat("/save-onto-a-file/notes.txt") == b"mine\n"
    finally:
        memory.rm("/save-onto-a-file", recursive=True)


def test_a_model_saved_to_a_url_with_dot_dot_is_where_the_url_points(tmp_path):
    # memory://ROOT/runs/../m was written under the keys "ROOT/runs/../m/...": a load from
    # memory://ROOT/m said "config.json: file not found"
    model = _tiny_model(0)
    memory = fsspec.filesystem("memory")
    root = f"/dots-{uuid.uuid4().hex}"
    try:
        model.save_pretrained(f"memory://{root}/runs/../m")
        assert sorted(memory.find(root)) == [f"{root}/m/config.json", f"{root}/m/model.safetensors"]
        np.testing.assert_array_equal(_embed(BiLM.from_pretrained(f"memory://{root}/m")), _embed(model))
        np.testing.assert_array_equal(_embed(BiLM.from_pretrained(f"memory://{root}/x/./../m")), _embed(model))
    finally:
        memory.rm(root, recursive=True)


def test_export_to_a_local_path_through_a_missing_folder_writes_where_it_points(tmp_path, capsys):
    # `export M --output new/../out` failed after reading M: "cannot write new/../out: No such file
    # or directory" (the rename into new/../out, new not existing); save_pretrained made `new` too
    from elmo_pipeline.cli.main import main

    model = _tiny_model(0)
    model.save_pretrained(str(tmp_path / "src"))
    assert main(["export", str(tmp_path / "src"), "--output", str(tmp_path / "new" / ".." / "out")]) == 0
    model.save_pretrained(str(tmp_path / "also-new" / ".." / "saved"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "saved", "src"]
    for folder in ("out", "saved"):
        np.testing.assert_array_equal(_embed(BiLM.from_pretrained(str(tmp_path / folder))), _embed(model))


def test_a_load_in_the_middle_of_a_save_reads_the_model_the_save_leaves(tmp_path):
    """A load between a save's new model.safetensors and its new config.json read the new
    weights with the old config's checksum and was refused as tampered with."""
    import fcntl
    import threading

    first, second = _tiny_model(0), _tiny_model(1)
    folder, other = tmp_path / "m", tmp_path / "other"
    first.save_pretrained(str(folder))
    second.save_pretrained(str(other))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save of `second` in progress: its weights are in place, its config not yet
    shutil.copy(other / "model.safetensors", folder / "model.safetensors")
    loaded = []
    loading = threading.Thread(target=lambda: loaded.append(BiLM.from_pretrained(str(folder)).eval()))
    try:
        loading.start()
        loading.join(0.5)
        assert loading.is_alive()  # it waits for the save to end
        shutil.copy(other / "config.json", folder / "config.json")
    finally:
        os.close(fd)
        loading.join()
    np.testing.assert_array_equal(_embed(loaded[0]), _embed(second))


def test_a_damaged_model_at_a_url_is_fetched_once_before_it_is_refused(monkeypatch):
    """The read again after a save (above) is for local folders, where a save can be waited for:
    a damaged model at a URL was fetched twice before its refusal."""
    from elmo_pipeline.formats import native

    _tiny_model(0).save_pretrained("memory://damaged-once")
    fs = fsspec.filesystem("memory")
    weights = bytearray(fs.cat("/damaged-once/model.safetensors"))
    weights[-1] ^= 1
    fs.pipe("/damaged-once/model.safetensors", bytes(weights))
    reads = []
    read = native._read_model_files
    monkeypatch.setattr(native, "_read_model_files", lambda location: reads.append(location) or read(location))
    try:
        for url, why in (("memory://damaged-once", "does not match weights_sha256"),
                         ("memory://no-such-model", "config.json: file not found")):
            reads.clear()
            with pytest.raises(CheckpointError, match=why):
                BiLM.from_pretrained(url)
            assert reads == [url]
    finally:
        fs.rm("/damaged-once", recursive=True)


# A save over a model folder, stopped by a real signal just after its new model.safetensors is in
# place and before its config.json: the folder held the new weights beside the old config, which
# its checksum refused (neither model loaded).
_STOPPED_SAVE = """
import os, signal, sys
from elmo_pipeline.formats import native
write = native.write_bytes_atomically
def write_then_signal(fs, final, data):
    write(fs, final, data)
    if final.endswith("/model.safetensors"):
        os.kill(os.getpid(), {signum})
native.write_bytes_atomically = write_then_signal
from elmo_pipeline.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_overwrite_puts_the_earlier_model_back(elmo_fixture_dir, tmp_path, signum):
    import subprocess
    import sys
    from elmo_pipeline.formats.files import default_model_location

    earlier = tmp_path / "m"
    shutil.copytree(default_model_location(), earlier)
    files = {p.name: p.read_bytes() for p in earlier.iterdir()}
    run = subprocess.run([sys.executable, "-c", _STOPPED_SAVE.format(signum=int(signum)), "import-allennlp",
                          "--options", str(elmo_fixture_dir / "options.json"),
                          "--weights", str(elmo_fixture_dir / "lm_weights.hdf5"), "--output", str(earlier),
                          "--overwrite"], capture_output=True, text=True, timeout=60)
    said = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert (run.returncode, run.stderr) == (128 + signum, f"elmo-pipeline import-allennlp: {said}\n")
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == files  # every file as it was, no other
    BiLM.from_pretrained(str(earlier))  # loads: its config.json and weights agree again
