"""The model config's strict parsing: every refusal names the file, the dotted field and the value."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig, SoftmaxConfig, weights_sha256
from elmo_pipeline.model.vocabulary import Vocabulary
from elmo_pipeline.strict import ConfigError, parse_json_strict
from elmo_pipeline.training.initial_model import build_model
from elmo_pipeline.training.options import TrainArgs

_LSTM_FIELDS = ("expected 'dim' and 'projection_dim' with optional 'n_layers', 'cell_clip', 'proj_clip' and "
                "'use_skip_connections'")


def _config() -> ElmoConfig:
    return ElmoConfig(
        lstm=LstmConfig(dim=16, projection_dim=8, cell_clip=3.0, proj_clip=3.0),
        char_cnn=CharCnnConfig(embedding_dim=4, filters=((1, 4), (2, 8)), n_highway=1),
        token_encoder="char_cnn+word", word_embedding_dim=6, vocab_size=50,
        softmax=SoftmaxConfig(kind="adaptive", cutoffs=(10, 30)), name="tiny",
    )


def _refusal(raw: dict, where: str = "m/config.json") -> str:
    with pytest.raises(ConfigError) as caught:
        ElmoConfig.from_dict(raw, where)
    return str(caught.value)


def test_to_dict_from_dict_round_trip_is_equal():
    config = _config()
    raw = config.to_dict()
    assert raw["char_cnn"] == {"embedding": {"dim": 4}, "max_characters_per_token": 50, "filters": [[1, 4], [2, 8]],
                               "n_highway": 1, "activation": "relu", "n_characters": 262}
    assert raw["softmax"]["cutoffs"] == [10, 30]
    back = ElmoConfig.from_dict(raw)
    assert back == config and back.char_cnn.embedding_dim == 4 and back.char_cnn.n_filters == 12
    assert ElmoConfig.from_dict(parse_json_strict(config.to_json(), "config.json")) == config


def test_an_unknown_key_is_named_with_the_allowed_ones():
    raw = _config().to_dict()
    raw["lstm"]["hidden"] = 4
    assert _refusal(raw) == f"m/config.json: lstm: unknown field(s) ['hidden']; {_LSTM_FIELDS}"


def test_a_bool_or_a_string_is_not_an_integer():
    raw = _config().to_dict()
    raw["lstm"]["dim"] = True
    assert _refusal(raw) == "m/config.json: lstm.dim: expected an integer, got True"
    raw["lstm"]["dim"] = "x"
    assert _refusal(raw) == "m/config.json: lstm.dim: expected an integer, got 'x'"
    raw["lstm"]["dim"] = 16.0
    assert _refusal(raw) == "m/config.json: lstm.dim: expected an integer, got 16.0"


def test_an_integer_is_not_a_bool_but_is_a_number():
    raw = _config().to_dict()
    raw["lstm"]["use_skip_connections"] = 1
    raw["lstm"]["cell_clip"] = 3  # a float field takes an integer
    assert _refusal(raw) == "m/config.json: lstm.use_skip_connections: expected true or false, got 1"
    raw["lstm"]["use_skip_connections"] = True
    assert ElmoConfig.from_dict(raw).lstm.cell_clip == 3.0


def test_bounds_are_kept():
    raw = _config().to_dict()
    raw["char_cnn"]["max_characters_per_token"] = 257
    assert _refusal(raw) == "m/config.json: char_cnn.max_characters_per_token: must be <= 256, got 257"
    raw["char_cnn"]["max_characters_per_token"] = 50
    raw["lstm"]["n_layers"] = 0
    assert _refusal(raw) == "m/config.json: lstm.n_layers: must be >= 1, got 0"
    raw["lstm"]["n_layers"] = 2
    raw["softmax"]["div_value"] = 1
    assert _refusal(raw) == "m/config.json: softmax.div_value: must be > 1.0, got 1"


def test_a_nested_field_is_named_by_its_dotted_path():
    raw = _config().to_dict()
    raw["char_cnn"]["filters"] = [[1, 4], [2]]
    assert _refusal(raw) == "m/config.json: char_cnn.filters[1]: expected [width, count], two integers >= 1, got [2]"
    raw["char_cnn"]["filters"] = [[1, 4]]
    raw["softmax"]["cutoffs"] = [10, 0]
    assert _refusal(raw) == "m/config.json: softmax.cutoffs[1]: must be >= 1, got 0"
    raw["softmax"]["cutoffs"] = [10]
    raw["char_cnn"]["embedding"] = {"dim": 4, "size": 3}
    assert _refusal(raw) == "m/config.json: char_cnn.embedding: unknown field(s) ['size']; expected 'dim'"


def test_every_problem_is_reported_and_the_file_is_named():
    raw = _config().to_dict()
    raw["lstm"]["cell_clip"] = "3"
    raw["lstm"]["proj_clip"] = -3
    raw["char_cnn"]["activation"] = "gelu"
    del raw["token_encoder"]
    assert _refusal(raw, "gs://bucket/model/config.json") == (
        "gs://bucket/model/config.json: missing field(s) ['token_encoder']; expected 'lstm', 'token_encoder', "
        "'format' and 'format_version' with optional 'char_cnn', 'word_embedding_dim', 'vocab_size', 'softmax', "
        "'name', 'char_dictionary' and 'weights_sha256'; lstm.cell_clip: expected a number or null, got '3'; "
        "lstm.proj_clip: a clip must be positive, got -3.0; "
        "char_cnn.activation: expected one of 'relu' or 'tanh', got 'gelu'")


def test_fields_that_depend_on_each_other():
    raw = _config().to_dict()
    raw["vocab_size"] = None
    assert _refusal(raw) == "m/config.json: vocab_size: required by a word encoder or a softmax"
    raw = _config().to_dict()
    raw["char_cnn"]["filters"] = [[60, 4]]
    assert _refusal(raw) == "m/config.json: char_cnn.filters: width 60 exceeds max_characters_per_token 50"
    raw = _config().to_dict()
    raw["format_version"] = 2
    assert _refusal(raw) == "m/config.json: format_version 2 is not supported"


def test_the_flat_embedding_dim_is_for_python_callers_only():
    raw = _config().to_dict()
    raw["char_cnn"]["embedding_dim"] = 4
    del raw["char_cnn"]["embedding"]
    fields = ("expected 'embedding' and 'filters' with optional 'max_characters_per_token', 'n_highway', "
              "'activation' and 'n_characters'")
    assert _refusal(raw) == ("m/config.json: char_cnn: unknown field(s) ['embedding_dim'], "
                             f"missing field(s) ['embedding']; {fields}")


def test_original_options_round_trip_and_name_the_file():
    config = ElmoConfig(lstm=_config().lstm, char_cnn=_config().char_cnn, name="x")
    assert ElmoConfig.from_options(config.to_options(), name="x") == config
    options = config.to_options()
    options["char_cnn"]["n_characters"] = 300
    with pytest.raises(ConfigError) as caught:
        ElmoConfig.from_options(options, where="/o/options.json")
    assert str(caught.value) == "/o/options.json: char_cnn.n_characters: expected 261 or 262, got 300"
    options["char_cnn"]["n_characters"] = 261
    options["n_epochs"] = 10  # bilm-tf's training keys are allowed and ignored
    assert ElmoConfig.from_options(options).char_cnn.n_characters == 261


def test_a_list_whose_only_item_is_wrong_is_named_by_the_item_not_as_too_short():
    """pydantic counts a list's length after its failed items are dropped: filters [["1", 4]] also
    read "char_cnn.filters: expected at least 1 item(s)", beside the item's own error."""
    options = ElmoConfig(lstm=_config().lstm, char_cnn=_config().char_cnn, name="x").to_options()
    options["char_cnn"]["filters"] = [["1", 4]]
    with pytest.raises(ConfigError) as caught:
        ElmoConfig.from_options(options)
    assert str(caught.value) == ("options.json: char_cnn.filters[0]: expected [width, count], two integers >= 1, "
                                 "got ['1', 4]")
    options["char_cnn"]["filters"] = []  # a list too short of its own is still said to be
    with pytest.raises(ConfigError) as caught:
        ElmoConfig.from_options(options)
    assert str(caught.value) == "options.json: char_cnn.filters: expected at least 1 item(s), got []"


def test_weights_sha256_and_sections_validated_alone():
    assert weights_sha256({"weights_sha256": "ab" * 32}) == "ab" * 32 and weights_sha256({}) is None
    with pytest.raises(ConfigError) as caught:
        weights_sha256({"weights_sha256": "AB" * 32})
    assert str(caught.value) == f"config.json: weights_sha256: expected 64 lowercase hex digits, got {'AB' * 32!r}"
    with pytest.raises(ConfigError) as caught:
        SoftmaxConfig.from_dict({"kind": "sampled", "n_samples": False}, "train.json")
    assert str(caught.value) == "train.json: softmax.n_samples: expected an integer, got False"


def test_configs_are_frozen_and_the_constructor_validates():
    config = _config()
    with pytest.raises(ValidationError):
        config.lstm.dim = 3
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        LstmConfig(dim=0, projection_dim=4)
    assert config.model_copy(update={"name": "other"}).name == "other"
    assert hash(config) == hash(ElmoConfig.from_dict(config.to_dict()))


def test_a_pretraining_model_config_is_read_strictly_and_its_errors_name_it(tmp_path):
    corpus = SimpleNamespace(vocab=Vocabulary(["<S>", "</S>", "<UNK>", "the"]))
    spec = tmp_path / "my-model.json"
    spec.write_text('{"token_encoder": "char_cnn", "lstm": {"dim": 8, "projection_dim": 4, "cell_clip": NaN}}')
    args = TrainArgs(data="unused", output="unused", preset=None, model_config=str(spec))
    with pytest.raises(ConfigError, match=re.escape(f"{spec}: NaN is not valid JSON")):
        build_model(args, corpus, log=print)
    spec.write_text('{"token_encoder": "char_cnn", "lstm": {"dim": 8, "projection_dim": 4, "cell_clip": true}}')
    with pytest.raises(ConfigError, match=re.escape(f"{spec}: ") + ".*lstm.cell_clip: expected a number or null"):
        build_model(args, corpus, log=print)


def test_format_version_is_an_integer_like_every_other_integer_field():
    raw = _config().to_dict()
    raw["format_version"] = True  # equal to 1 in Python, but not the version 1
    assert _refusal(raw) == "m/config.json: format_version: expected an integer, got True"
    raw["format_version"] = 1.0
    assert _refusal(raw) == "m/config.json: format_version: expected an integer, got 1.0"
    raw["format_version"] = 1
    assert ElmoConfig.from_dict(raw) == _config()


@pytest.mark.parametrize("cutoffs", [[30, 10], [10, 10], [10, 50], [10, 60]])
def test_adaptive_cutoffs_must_fit_the_vocabulary_and_are_named_with_the_file(cutoffs):
    raw = _config().to_dict()  # vocab_size 50
    raw["softmax"]["cutoffs"] = cutoffs
    assert _refusal(raw) == (f"m/config.json: softmax.cutoffs: {cutoffs} must increase strictly within 1..49 "
                             "(vocab_size=50)")
    raw["softmax"]["cutoffs"] = [10, 49]
    assert ElmoConfig.from_dict(raw).softmax.cutoffs == (10, 49)


def test_a_div_value_whose_powers_overflow_is_refused_by_name():
    raw = _config().to_dict()
    raw["softmax"]["div_value"] = 1e300  # torch's adaptive softmax would raise OverflowError building its tails
    assert _refusal(raw) == ("m/config.json: softmax.div_value: 1e+300 is too large: its powers for the tail "
                             "clusters overflow a float")
    raw["softmax"]["div_value"] = 1e80  # 1e80 ** 4 overflows: the check allows for 4 tail clusters at least
    assert "softmax.div_value: 1e+80 is too large" in _refusal(raw)
    raw["softmax"]["div_value"] = 1e70
    assert ElmoConfig.from_dict(raw).softmax.div_value == 1e70
