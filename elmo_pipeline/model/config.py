"""Model configuration: reads and writes the original `options.json`, plus our own fields.

Parsing is strict: an unknown key or a value of the wrong type is an error that names the
file and the key, because a silently ignored typo in a model config produces a different model.
The models are pydantic's; `validated` turns its errors into a `ConfigError` that reads
"config.json: lstm.dim: expected an integer, got True".
"""

from __future__ import annotations

import functools
import json
import math
import types
from typing import Annotated, Any, Literal, Mapping, Optional, Union, get_args, get_origin

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, Strict, TypeAdapter, ValidationError, ValidationInfo,
    WrapValidator, create_model, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

TokenEncoder = Literal["char_cnn", "word", "char_cnn+word"]
SoftmaxKind = Literal["none", "full", "sampled", "adaptive"]
Activation = Literal["relu", "tanh"]
TOKEN_ENCODERS: tuple[str, ...] = get_args(TokenEncoder)
SOFTMAX_KINDS: tuple[str, ...] = get_args(SoftmaxKind)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
# No tensor's shape carries it, so it is bounded here: the char CNN's activations grow with it
# (the original uses 50; 256 already costs ~2 MB per word for 2048 filters).
MAX_CHARACTERS_PER_TOKEN = 256
NATIVE_FORMAT = "elmo-pipeline"
NATIVE_FORMAT_VERSION = 1
WEIGHTS_SHA256_KEY = "weights_sha256"

# Keys that bilm-tf writes into options.json for training; they do not change inference.
_ORIGINAL_TRAINING_KEYS = (
    "all_clip_norm_val", "batch_size", "bidirectional", "dropout", "n_epochs", "n_negative_samples_batch",
    "n_tokens_vocab", "n_train_tokens", "sample_softmax", "share_embedding_softmax", "unroll_steps",
)
_FROM_FILE = "from_file"  # in the validation context of values read from a file: its name
_SHOWN_CHARS = 200  # a hostile file's huge value is cut in messages, not echoed whole


class ConfigError(ValueError):
    """A model configuration that cannot be used, with the file and the offending key in the message."""


# -- pydantic errors as messages --------------------------------------------------------------
# pydantic's own wording ("Input should be a valid integer") is replaced by the wording these
# files have always used; a type missing here keeps pydantic's message.
_EXPECTED = {
    "int_type": "expected an integer, got {input}",
    "bool_type": "expected true or false, got {input}",
    "string_type": "expected a string, got {input}",
    "float_type": "expected a number, got {input}",
    "finite_number": "expected a finite number, got {input}",
    "greater_than_equal": "must be >= {ge}, got {input}",
    "less_than_equal": "must be <= {le}, got {input}",
    "greater_than": "must be > {gt}, got {input}",
    "literal_error": "expected one of {expected}, got {input}",
    "model_type": "expected a JSON object, got {type}",
    "dict_type": "expected a JSON object, got {type}",
    "tuple_type": "expected a list, got {type}",
    "list_type": "expected a list, got {type}",
    "too_short": "expected at least {min_length} item(s), got {input}",
}
_FIELD_ERRORS = {"extra_forbidden": "unknown", "missing": "missing"}

Loc = tuple[Union[str, int], ...]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...(cut)"


def problem(text: str) -> PydanticCustomError:
    """A validation error whose message is `text` as written (pydantic would prefix "Value error")."""
    return PydanticCustomError("config", "{text}", {"text": text})


def expecting(what: str) -> WrapValidator:
    """Any error inside the annotated value becomes one "expected `what`, got <value>" about it."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise problem(f"expected {what}, got {_shown(value)}") from None

    return WrapValidator(check)


def _dotted(loc: Loc) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _model_in(kind: Any) -> type[BaseModel] | None:
    """The model class `kind` is, under Annotated or Optional, but not inside a container."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind
    origin = get_origin(kind)
    if origin is Annotated:
        return _model_in(get_args(kind)[0])
    if origin in (Union, types.UnionType):
        return next((m for m in map(_model_in, get_args(kind)) if m is not None), None)
    return None


def _model_at(kind: Any, loc: Loc) -> type[BaseModel] | None:
    """The model that validated the object at `loc` inside a value of type `kind`."""
    for part in loc:
        model = _model_in(kind)
        if model is not None and part in model.model_fields:
            kind = model.model_fields[part].annotation
        else:  # an item of a dict, list or tuple
            while get_origin(kind) is Annotated:
                kind = get_args(kind)[0]
            kind = (get_args(kind) or (None,))[-1]
    return _model_in(kind)


def _listed(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _expected_fields(model: type[BaseModel]) -> str:
    required = [name for name, info in model.model_fields.items() if info.is_required()]
    optional = [name for name in model.model_fields if name not in required]
    text = f"expected {_listed(required)}" if required else "expected"
    return f"{text} with optional {_listed(optional)}" if optional else text


def _error_text(error: Mapping[str, Any]) -> str:
    template = _EXPECTED.get(error["type"])
    if template is None:  # ours (`problem`) already say what they got
        return error["msg"]
    value = error["input"]
    return template.format(**error.get("ctx", {}), input=_shown(value), type=type(value).__name__)


def _message(exc: ValidationError, kind: Any, where: str, path: Loc) -> str:
    """One line for all of pydantic's errors; unknown and missing keys are grouped by object."""
    fields: dict[Loc, dict[str, list[str]]] = {}
    values = []
    for error in exc.errors(include_url=False):
        loc = (*path, *error["loc"])
        if error["type"] in _FIELD_ERRORS and loc:
            fields.setdefault(loc[:-1], {}).setdefault(error["type"], []).append(str(loc[-1]))
        else:
            values.append((loc, _error_text(error)))
    keys = []
    for parent, names in fields.items():
        # unknown first: a misspelt key is also reported missing under its right name
        text = ", ".join(f"{word} field(s) {sorted(names[key])}" for key, word in _FIELD_ERRORS.items() if key in names)
        model = _model_at(kind, parent[len(path):])
        keys.append((parent, f"{text}; {_expected_fields(model)}" if model else text))
    return f"{where}: " + "; ".join(f"{_dotted(loc)}: {text}" if loc else text for loc, text in keys + values)


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind)


def validated(kind: Any, raw: Any, where: str, path: Loc = ()) -> Any:
    """`raw` (parsed JSON) validated as `kind` (a model or any type pydantic validates); a
    ConfigError names `where`, then `path` (where `raw` sits in its file) + the key."""
    try:
        return _adapter(kind).validate_python(raw, context={_FROM_FILE: where})
    except ValidationError as exc:
        raise ConfigError(_message(exc, kind, where, path)) from exc


class StrictModel(BaseModel):
    """Frozen, no unknown fields. The constructor raises pydantic's ValidationError (a ValueError);
    values read from a file go through `validated`, for a ConfigError naming the file."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# -- field types --------------------------------------------------------------------------------
PositiveInt = Annotated[int, Strict(), Field(ge=1)]


def _positive_clip(clip: float | None) -> float | None:
    if clip is not None and clip <= 0:
        raise problem(f"a clip must be positive, got {clip}")
    return clip


Clip = Annotated[Optional[Annotated[float, Strict()]], expecting("a number or null"), AfterValidator(_positive_clip)]
FilterPair = Annotated[tuple[PositiveInt, PositiveInt], expecting("[width, count], two integers >= 1")]
Filters = tuple[tuple[int, int], ...]
Sha256 = Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{64}$"), expecting("64 lowercase hex digits")]


class LstmConfig(StrictModel):
    dim: PositiveInt
    projection_dim: PositiveInt
    n_layers: PositiveInt = 2
    cell_clip: Clip = None
    proj_clip: Clip = None
    use_skip_connections: Annotated[bool, Strict()] = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "LstmConfig":
        return validated(cls, raw, where, ("lstm",))

    @property
    def has_clips(self) -> bool:
        return self.cell_clip is not None or self.proj_clip is not None


class _Embedding(StrictModel):
    dim: PositiveInt


class CharCnnConfig(StrictModel):
    """The original `char_cnn` section, field for field; `embedding_dim` is its `embedding.dim`."""

    embedding: _Embedding
    # before `filters`, whose validator compares the widths with it
    max_characters_per_token: Annotated[int, Strict(), Field(ge=3, le=MAX_CHARACTERS_PER_TOKEN)] = 50
    filters: Annotated[tuple[FilterPair, ...], Field(min_length=1)]  # (width, count)
    n_highway: Annotated[int, Strict(), Field(ge=0)]
    activation: Activation = "relu"
    n_characters: Annotated[int, Strict(), Field(ge=261, le=262), expecting("261 or 262")] = 262

    @model_validator(mode="before")
    @classmethod
    def _flat_embedding_dim(cls, raw: Any, info: ValidationInfo) -> Any:
        # Python callers give `embedding_dim`; a file must nest it as options.json does
        if not (info.context or {}).get(_FROM_FILE) and isinstance(raw, dict) and "embedding_dim" in raw:
            raw = {key: value for key, value in raw.items() if key != "embedding_dim"} | {
                "embedding": {"dim": raw["embedding_dim"]}}
        return raw

    @field_validator("filters")
    @classmethod
    def _fit_in_a_token(cls, filters: Filters, info: ValidationInfo) -> Filters:
        max_chars = info.data.get("max_characters_per_token")
        widest = max(width for width, _ in filters)
        if max_chars is not None and widest > max_chars:
            raise problem(f"width {widest} exceeds max_characters_per_token {max_chars}")
        return filters

    @property
    def embedding_dim(self) -> int:
        return self.embedding.dim

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)

    @classmethod
    def from_original(cls, raw: Mapping[str, Any], where: str = "options.json") -> "CharCnnConfig":
        return validated(cls, raw, where, ("char_cnn",))

    def to_original(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class SoftmaxConfig(StrictModel):
    """The output layer used for training and perplexity; `none` for embedding-only models."""

    kind: SoftmaxKind  # required in a file: a section without it would silently mean "none"
    n_samples: PositiveInt = 8192  # sampled softmax: negative samples per batch
    cutoffs: tuple[PositiveInt, ...] = ()  # adaptive softmax: cluster boundaries in frequency order
    div_value: Annotated[float, Strict(), Field(gt=1)] = 4.0  # adaptive softmax: how fast the tail clusters shrink

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "SoftmaxConfig":
        return validated(cls, raw, where, ("softmax",))


class ElmoConfig(StrictModel):
    """Everything needed to build a BiLM. `char_cnn` is None only for the word encoder."""

    lstm: LstmConfig
    char_cnn: Optional[CharCnnConfig]
    token_encoder: TokenEncoder = "char_cnn"
    word_embedding_dim: Optional[PositiveInt] = None
    vocab_size: Optional[PositiveInt] = None
    softmax: SoftmaxConfig = Field(default_factory=lambda: SoftmaxConfig(kind="none"))
    name: Annotated[str, Strict()] = "elmo"

    @model_validator(mode="after")
    def _parts_agree(self) -> "ElmoConfig":
        if self.token_encoder != "word" and self.char_cnn is None:
            raise problem(f"token_encoder {self.token_encoder!r} needs a char_cnn section")
        needs_vocab = self.token_encoder != "char_cnn" or self.softmax.kind != "none"
        if needs_vocab and not self.vocab_size:
            raise problem("vocab_size: required by a word encoder or a softmax")
        if self.token_encoder != "char_cnn" and not self.word_embedding_dim:
            raise problem(f"word_embedding_dim: required by token_encoder {self.token_encoder!r}")
        return self

    @property
    def output_dim(self) -> int:
        """Width of every output layer: forward and backward projections concatenated."""
        return 2 * self.lstm.projection_dim

    @property
    def n_output_layers(self) -> int:
        return self.lstm.n_layers + 1

    # -- the original options.json ------------------------------------------------------
    @classmethod
    def from_options(cls, raw: Mapping[str, Any], name: str = "elmo", where: str = "options.json") -> "ElmoConfig":
        options = validated(_OptionsFile, raw, where)
        return validated(cls, {"lstm": options.lstm, "char_cnn": options.char_cnn, "name": name}, where)

    def to_options(self) -> dict[str, Any]:
        if self.token_encoder != "char_cnn" or self.char_cnn is None:
            raise ConfigError("only a char_cnn model can be written as an original options.json")
        return {"lstm": self.lstm.model_dump(mode="json"), "char_cnn": self.char_cnn.to_original()}

    # -- our config.json ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "ElmoConfig":
        """Our config.json. Its optional `weights_sha256` (the sha256 of model.safetensors, written by
        save_pretrained) describes the weights file, not the model: it is checked here for its type
        and by `load_pretrained` against the file, and not kept."""
        document = validated(_ConfigFile, raw, where)
        return validated(cls, {name: getattr(document, name) for name in cls.model_fields}, where)

    def to_dict(self) -> dict[str, Any]:
        return {"format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, **self.model_dump(mode="json")}

    def to_json(self) -> str:
        return dumps_strict(self.to_dict(), "config.json", indent=2, sort_keys=True)


class _ConfigFile(ElmoConfig):
    """config.json as written: the model's fields, what identifies the format, the weights' sha256."""

    char_cnn: Optional[CharCnnConfig] = None
    token_encoder: TokenEncoder
    format: str  # both checked by _native_format
    format_version: int
    weights_sha256: Optional[Sha256] = None

    @model_validator(mode="before")
    @classmethod
    def _native_format(cls, raw: Any) -> Any:
        # before the fields: a file of another format is named as such, not by its first odd field
        if isinstance(raw, Mapping):
            if "format" in raw and raw["format"] != NATIVE_FORMAT:
                raise problem(f"format {_shown(raw['format'])} is not {NATIVE_FORMAT!r}")
            if "format_version" in raw and raw["format_version"] != NATIVE_FORMAT_VERSION:
                raise problem(f"format_version {_shown(raw['format_version'])} is not supported")
        return raw


# options.json: the two sections we read and, allowed but not read, bilm-tf's training keys
_OPTIONS_FIELDS: dict[str, Any] = {
    "lstm": (LstmConfig, ...), "char_cnn": (CharCnnConfig, ...),
    **{key: (Any, None) for key in _ORIGINAL_TRAINING_KEYS},
}
_OptionsFile = create_model("_OptionsFile", __base__=StrictModel, **_OPTIONS_FIELDS)


def weights_sha256(raw: Mapping[str, Any], where: str = "config.json") -> str | None:
    """config.json's `weights_sha256`: 64 lowercase hex digits, or None when absent (older files)."""
    return validated(Optional[Sha256], raw.get(WEIGHTS_SHA256_KEY), where, (WEIGHTS_SHA256_KEY,))


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
