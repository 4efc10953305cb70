"""Model configuration: reads and writes the original `options.json`, plus our own fields.

Parsing is strict: an unknown key or a value of the wrong type is an error that names the
key, because a silently ignored typo in a model config produces a different model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

TOKEN_ENCODERS = ("char_cnn", "word", "char_cnn+word")
SOFTMAX_KINDS = ("none", "full", "sampled", "adaptive")
ACTIVATIONS = ("relu", "tanh")
# No tensor's shape carries it, so it is bounded here: the char CNN's activations grow with it
# (the original uses 50; 256 already costs ~2 MB per word for 2048 filters).
MAX_CHARACTERS_PER_TOKEN = 256
NATIVE_FORMAT = "elmo-pipeline"
NATIVE_FORMAT_VERSION = 1
WEIGHTS_SHA256_KEY = "weights_sha256"

# Keys that bilm-tf writes into options.json for training; they do not change inference.
_ORIGINAL_TRAINING_KEYS = {
    "bidirectional", "dropout", "all_clip_norm_val", "n_epochs", "n_train_tokens",
    "batch_size", "n_tokens_vocab", "unroll_steps", "n_negative_samples_batch",
    "share_embedding_softmax", "sample_softmax",
}


class ConfigError(ValueError):
    """A model configuration that cannot be used, with the offending key in the message."""


def _check_keys(where: str, raw: Mapping[str, Any], allowed: set[str], required: set[str]) -> None:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(raw)
    if missing:
        raise ConfigError(f"{where}: missing field(s) {sorted(missing)}")


def _int(where: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}: must be <= {maximum}, got {value}")
    return value


def _float_or_none(where: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number or null, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{where}: a clip must be positive, got {value}")
    return float(value)


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _choice(where: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{where}: expected one of {list(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class LstmConfig:
    dim: int
    projection_dim: int
    n_layers: int = 2
    cell_clip: float | None = None
    proj_clip: float | None = None
    use_skip_connections: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "LstmConfig":
        _check_keys("lstm", raw, set(cls.__dataclass_fields__), {"dim", "projection_dim"})
        return cls(
            dim=_int("lstm.dim", raw["dim"]),
            projection_dim=_int("lstm.projection_dim", raw["projection_dim"]),
            n_layers=_int("lstm.n_layers", raw.get("n_layers", 2)),
            cell_clip=_float_or_none("lstm.cell_clip", raw.get("cell_clip")),
            proj_clip=_float_or_none("lstm.proj_clip", raw.get("proj_clip")),
            use_skip_connections=_bool("lstm.use_skip_connections", raw.get("use_skip_connections", True)),
        )

    @property
    def has_clips(self) -> bool:
        return self.cell_clip is not None or self.proj_clip is not None


@dataclass(frozen=True)
class CharCnnConfig:
    embedding_dim: int
    filters: tuple[tuple[int, int], ...]
    n_highway: int
    activation: str = "relu"
    max_characters_per_token: int = 50
    n_characters: int = 262

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)

    @classmethod
    def from_original(cls, raw: Mapping[str, Any]) -> "CharCnnConfig":
        _check_keys(
            "char_cnn", raw,
            {"embedding", "filters", "n_highway", "activation", "max_characters_per_token", "n_characters"},
            {"embedding", "filters", "n_highway"},
        )
        _check_keys("char_cnn.embedding", raw["embedding"], {"dim"}, {"dim"})
        filters = raw["filters"]
        if not isinstance(filters, list) or not filters:
            raise ConfigError(f"char_cnn.filters: expected a non-empty list of [width, count], got {filters!r}")
        parsed = []
        for i, pair in enumerate(filters):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ConfigError(f"char_cnn.filters[{i}]: expected [width, count], got {pair!r}")
            parsed.append((_int(f"char_cnn.filters[{i}][0]", pair[0]), _int(f"char_cnn.filters[{i}][1]", pair[1])))
        max_chars = _int("char_cnn.max_characters_per_token", raw.get("max_characters_per_token", 50),
                         minimum=3, maximum=MAX_CHARACTERS_PER_TOKEN)
        widest = max(w for w, _ in parsed)
        if widest > max_chars:
            raise ConfigError(f"char_cnn.filters: width {widest} exceeds max_characters_per_token {max_chars}")
        n_chars = _int("char_cnn.n_characters", raw.get("n_characters", 262))
        if n_chars not in (261, 262):
            raise ConfigError(f"char_cnn.n_characters: expected 261 or 262, got {n_chars}")
        return cls(
            embedding_dim=_int("char_cnn.embedding.dim", raw["embedding"]["dim"]),
            filters=tuple(parsed),
            n_highway=_int("char_cnn.n_highway", raw["n_highway"], minimum=0),
            activation=_choice("char_cnn.activation", raw.get("activation", "relu"), ACTIVATIONS),
            max_characters_per_token=max_chars,
            n_characters=n_chars,
        )

    def to_original(self) -> dict[str, Any]:
        return {
            "embedding": {"dim": self.embedding_dim},
            "filters": [list(f) for f in self.filters],
            "n_highway": self.n_highway,
            "activation": self.activation,
            "max_characters_per_token": self.max_characters_per_token,
            "n_characters": self.n_characters,
        }


@dataclass(frozen=True)
class SoftmaxConfig:
    """The output layer used for training and perplexity; `none` for embedding-only models."""

    kind: str = "none"
    n_samples: int = 8192  # sampled softmax: negative samples per batch
    cutoffs: tuple[int, ...] = ()  # adaptive softmax: cluster boundaries in frequency order
    div_value: float = 4.0  # adaptive softmax: how fast the tail clusters shrink

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SoftmaxConfig":
        _check_keys("softmax", raw, set(cls.__dataclass_fields__), {"kind"})
        cutoffs = raw.get("cutoffs", [])
        if not isinstance(cutoffs, list):
            raise ConfigError(f"softmax.cutoffs: expected a list, got {cutoffs!r}")
        div = raw.get("div_value", 4.0)
        if isinstance(div, bool) or not isinstance(div, (int, float)) or div <= 1:
            raise ConfigError(f"softmax.div_value: expected a number > 1, got {div!r}")
        return cls(
            kind=_choice("softmax.kind", raw["kind"], SOFTMAX_KINDS),
            n_samples=_int("softmax.n_samples", raw.get("n_samples", 8192)),
            cutoffs=tuple(_int(f"softmax.cutoffs[{i}]", c) for i, c in enumerate(cutoffs)),
            div_value=float(div),
        )


@dataclass(frozen=True)
class ElmoConfig:
    """Everything needed to build a BiLM. `char_cnn` is None only for the word encoder."""

    lstm: LstmConfig
    char_cnn: CharCnnConfig | None
    token_encoder: str = "char_cnn"
    word_embedding_dim: int | None = None
    vocab_size: int | None = None
    softmax: SoftmaxConfig = field(default_factory=SoftmaxConfig)
    name: str = "elmo"

    def __post_init__(self) -> None:
        _choice("token_encoder", self.token_encoder, TOKEN_ENCODERS)
        if self.token_encoder != "word" and self.char_cnn is None:
            raise ConfigError(f"token_encoder {self.token_encoder!r} needs a char_cnn section")
        needs_vocab = self.token_encoder != "char_cnn" or self.softmax.kind != "none"
        if needs_vocab and not self.vocab_size:
            raise ConfigError("vocab_size: required by a word encoder or a softmax")
        if self.token_encoder != "char_cnn" and not self.word_embedding_dim:
            raise ConfigError(f"word_embedding_dim: required by token_encoder {self.token_encoder!r}")

    @property
    def output_dim(self) -> int:
        """Width of every output layer: forward and backward projections concatenated."""
        return 2 * self.lstm.projection_dim

    @property
    def n_output_layers(self) -> int:
        return self.lstm.n_layers + 1

    # -- the original options.json ------------------------------------------------------
    @classmethod
    def from_options(cls, raw: Mapping[str, Any], name: str = "elmo") -> "ElmoConfig":
        _check_keys("options.json", raw, {"lstm", "char_cnn"} | _ORIGINAL_TRAINING_KEYS, {"lstm", "char_cnn"})
        return cls(
            lstm=LstmConfig.from_dict(raw["lstm"]),
            char_cnn=CharCnnConfig.from_original(raw["char_cnn"]),
            name=name,
        )

    def to_options(self) -> dict[str, Any]:
        if self.token_encoder != "char_cnn" or self.char_cnn is None:
            raise ConfigError("only a char_cnn model can be written as an original options.json")
        return {"lstm": asdict(self.lstm), "char_cnn": self.char_cnn.to_original()}

    # -- our config.json ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ElmoConfig":
        """Our config.json. Its optional `weights_sha256` (the sha256 of model.safetensors, written by
        save_pretrained) describes the weights file, not the model: it is checked here for its type
        and by `checkpoints.load_pretrained` against the file, and not kept."""
        allowed = {"format", "format_version", "name", "token_encoder", "char_cnn", "word_embedding_dim",
                   "lstm", "vocab_size", "softmax", WEIGHTS_SHA256_KEY}
        _check_keys("config.json", raw, allowed, {"format", "format_version", "lstm", "token_encoder"})
        if raw["format"] != NATIVE_FORMAT:
            raise ConfigError(f"config.json: format {raw['format']!r} is not {NATIVE_FORMAT!r}")
        if raw["format_version"] != NATIVE_FORMAT_VERSION:
            raise ConfigError(f"config.json: format_version {raw['format_version']!r} is not supported")
        weights_sha256(raw)
        char_cnn = raw.get("char_cnn")
        name = raw.get("name", "elmo")
        if not isinstance(name, str):
            raise ConfigError(f"name: expected a string, got {name!r}")
        word_dim = raw.get("word_embedding_dim")
        vocab_size = raw.get("vocab_size")
        return cls(
            lstm=LstmConfig.from_dict(raw["lstm"]),
            char_cnn=None if char_cnn is None else CharCnnConfig.from_original(char_cnn),
            token_encoder=_choice("token_encoder", raw["token_encoder"], TOKEN_ENCODERS),
            word_embedding_dim=None if word_dim is None else _int("word_embedding_dim", word_dim),
            vocab_size=None if vocab_size is None else _int("vocab_size", vocab_size),
            softmax=SoftmaxConfig.from_dict(raw.get("softmax", {"kind": "none"})),
            name=name,
        )

    def to_dict(self) -> dict[str, Any]:
        softmax = asdict(self.softmax)
        softmax["cutoffs"] = list(self.softmax.cutoffs)
        return {
            "format": NATIVE_FORMAT,
            "format_version": NATIVE_FORMAT_VERSION,
            "name": self.name,
            "token_encoder": self.token_encoder,
            "char_cnn": None if self.char_cnn is None else self.char_cnn.to_original(),
            "word_embedding_dim": self.word_embedding_dim,
            "lstm": asdict(self.lstm),
            "vocab_size": self.vocab_size,
            "softmax": softmax,
        }

    def to_json(self) -> str:
        return dumps_strict(self.to_dict(), "config.json", indent=2, sort_keys=True)


def weights_sha256(raw: Mapping[str, Any]) -> str | None:
    """config.json's `weights_sha256`: 64 lowercase hex digits, or None when absent (older files)."""
    value = raw.get(WEIGHTS_SHA256_KEY)
    if value is not None and not (isinstance(value, str) and len(value) == 64
                                  and all(c in "0123456789abcdef" for c in value)):
        raise ConfigError(f"{WEIGHTS_SHA256_KEY}: expected 64 lowercase hex digits, got {value!r}")
    return value


def dumps_strict(value: Any, where: str, **options: Any) -> str:
    """json.dumps for everything we write: NaN and infinities are not JSON (parse_json_strict and
    strict parsers in other languages refuse them), so a value holding one is an error naming
    `where` and the key, not a file that other readers cannot parse. `options` go to json.dumps."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError as exc:
        path = _non_finite_path(value)
        if path is None:
            raise
        raise ValueError(f"{where}: {path} is not a finite number, which JSON cannot hold") from exc


def _non_finite_path(value: Any, path: str = "") -> str | None:
    """Where the first NaN or infinity sits in a JSON-like value ("mixes.t.weights[0]")."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path or 'the value'} ({value})"
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for key, item in items if (found := _non_finite_path(item, key)) is not None), None)


def parse_json_strict(text: str | bytes, where: str) -> Any:
    """json.loads that refuses NaN/Infinity and duplicate keys, naming the file on failure."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{where}: duplicate key {key!r}")
            out[key] = value
        return out

    def no_constants(name: str) -> Any:
        raise ConfigError(f"{where}: {name} is not valid JSON")

    try:
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # a binary file: not text at all
        raise ConfigError(f"{where}: not valid JSON ({exc})") from exc
