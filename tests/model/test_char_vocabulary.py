"""The character dictionary and word specials of ELMoForManyLangs models, and that byte-level
models are untouched by them (same ids, same files)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.model.characters import tokens_char_ids
from elmo_pipeline.model.config import CharCnnConfig, CharDictionaryConfig, LstmConfig
from elmo_pipeline.model.vocabulary import FORMANYLANGS_SPECIALS, CharVocabulary, Vocabulary
from elmo_pipeline.strict import ConfigError

ENTRIES = ["a", "b", "我", "<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"]


def test_rows_are_built_as_the_family_builds_them():
    chars = CharVocabulary(ENTRIES)
    # <eow>'s id opens the row and <bow>'s closes it (the family's swap), <pad> fills it
    assert chars.char_ids(["ab"], 6).tolist() == [[8, 0, 1, 7, 6, 6]]
    assert chars.char_ids(["a我z"], 6).tolist() == [[8, 0, 2, 5, 7, 6]]  # z: <oov>
    assert chars.char_ids(["abab"], 5).tolist() == [[8, 0, 1, 0, 7]]  # cut to 5 - 2 characters
    assert chars.char_ids(["<eos>", ""], 5).tolist() == [[8, 4, 7, 6, 6], [8, 7, 6, 6, 6]]
    assert chars.char_ids(["<bos>"], 3).tolist() == [[8, 3, 7]]  # a boundary is never cut
    assert chars.char_ids(["<pad>"], 9).tolist() == [[8, 5, 5, 0, 5, 5, 7, 6, 6]]  # other specials are spelled


def test_the_dictionary_round_trips_and_is_checked():
    chars = CharVocabulary(ENTRIES)
    assert CharVocabulary.from_json(chars.to_json()) == chars
    with pytest.raises(ConfigError, match=r"'a' appears twice"):
        CharVocabulary(["a", *ENTRIES])
    with pytest.raises(ConfigError, match=r"special entries \['<pad>'\] are missing"):
        CharVocabulary([e for e in ENTRIES if e != "<pad>"])
    with pytest.raises(ConfigError, match=r"c\.json: expected an object with 'characters'"):
        CharVocabulary.from_json('{"characters": [1]}', "c.json")


def test_word_specials_round_trip_and_ours_stay_implied():
    family = Vocabulary(["<oov>", "<bos>", "<eos>", "<pad>", "the"], specials=FORMANYLANGS_SPECIALS)
    assert (family.start_id, family.end_id, family.unk_id) == (1, 2, 0)
    assert family.ids(["the", "zebra", "<bos>"]).tolist() == [4, 0, 1]
    again = Vocabulary.from_json(family.to_json())
    assert again.tokens == family.tokens and again.specials == FORMANYLANGS_SPECIALS
    ours = Vocabulary(["<S>", "</S>", "<UNK>", "the"])
    assert json.loads(ours.to_json()) == {"tokens": ["<S>", "</S>", "<UNK>", "the"], "counts": None}
    with pytest.raises(ConfigError, match=r"\['<bos>'\] missing"):
        Vocabulary(["<oov>", "<eos>"], specials=FORMANYLANGS_SPECIALS)
    with pytest.raises(ConfigError, match=r"v\.json: 'specials' must be a list of three strings"):
        Vocabulary.from_json('{"tokens": ["a"], "specials": ["a"]}', "v.json")


def _config(dictionary: bool, encoder: str = "char_cnn") -> ElmoConfig:
    return ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4), token_encoder=encoder,
                      char_cnn=CharCnnConfig(embedding_dim=3, filters=((1, 2), (2, 2)), n_highway=1,
                                             max_characters_per_token=6),
                      word_embedding_dim=5 if encoder != "char_cnn" else None,
                      vocab_size=5 if encoder != "char_cnn" else None,
                      char_dictionary=CharDictionaryConfig(size=len(ENTRIES)) if dictionary else None)


def test_a_byte_level_model_keeps_its_ids_and_files(tmp_path):
    model = BiLM(_config(False)).eval()
    words = ["Hi", "<S>", "naïve", "x" * 60]
    np.testing.assert_array_equal(model.char_ids(words), tokens_char_ids(words, 6))
    assert model.token_keys(words) == words and model.boundary_tokens == ("<S>", "</S>")
    assert "char_dictionary" not in model.config.to_dict()
    model.save_pretrained(str(tmp_path / "m"))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]


def test_a_dictionary_model_needs_its_dictionary_and_the_familys_word_specials():
    chars = CharVocabulary(ENTRIES)
    with pytest.raises(ValueError, match="goes with the config's char_dictionary section"):
        BiLM(_config(True))
    with pytest.raises(ValueError, match="goes with the config's char_dictionary section"):
        BiLM(_config(False), chars=chars)
    ours = Vocabulary(["<S>", "</S>", "<UNK>", "a", "b"])
    with pytest.raises(ValueError, match=r"needs the specials \['<bos>', '<eos>', '<oov>'\]"):
        BiLM(_config(True, "char_cnn+word"), ours, chars=chars)
    family = Vocabulary(["<oov>", "<bos>", "<eos>", "<pad>", "a"], specials=FORMANYLANGS_SPECIALS)
    model = BiLM(_config(True, "char_cnn+word"), family, chars=chars)
    assert model.boundary_tokens == ("<bos>", "<eos>") and model.token_keys(["abcdef"]) == ["abcd"]
    assert model.token_encoder.char_cnn.char_embedding.weight.shape == (len(ENTRIES), 3)
    with pytest.raises(ValueError, match=r"needs a token encoder with characters"):
        ElmoConfig(lstm=LstmConfig(dim=8, projection_dim=4), char_cnn=None, token_encoder="word",
                   word_embedding_dim=5, vocab_size=5, char_dictionary=CharDictionaryConfig(size=9))
