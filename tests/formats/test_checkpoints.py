import json

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
