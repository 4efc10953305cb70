"""Model configuration: reads and writes the original `options.json`, plus our own fields.

Parsing is strict: an unknown key or a value of the wrong type is an error that names the
file and the key, because a silently ignored typo in a model config produces a different model.
The models are pydantic's; `elmo_pipeline.strict.validated` turns their errors into one
`ConfigError` line that names the file and the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import AfterValidator, Field, Strict, ValidationInfo, create_model, field_validator, model_validator

from elmo_pipeline.runtime_choices import FLOAT32_MAX
from elmo_pipeline.strict import (FROM_FILE, ConfigError, StrictModel, dumps_strict, expecting, problem, shown,
                                  validated)

TokenEncoder = Literal["char_cnn", "word", "char_cnn+word"]
SoftmaxKind = Literal["none", "full", "sampled", "adaptive"]
Activation = Literal["relu", "tanh"]
# No tensor's shape carries it, so it is bounded here: the char CNN's activations grow with it
# (the original uses 50; 256 already costs ~2 MB per word for 2048 filters).
MAX_CHARACTERS_PER_TOKEN = 256
# The largest clip: the model's values are float32, and torch refuses to clamp a float32 tensor at
# a bound past float32's range ("value cannot be converted to type float without overflow").
MAX_CLIP = FLOAT32_MAX
NATIVE_FORMAT = "elmo-pipeline"
NATIVE_FORMAT_VERSION = 1
WEIGHTS_SHA256_KEY = "weights_sha256"

# Keys that bilm-tf writes into options.json for training; they do not change inference.
_ORIGINAL_TRAINING_KEYS = (
    "all_clip_norm_val", "batch_size", "bidirectional", "dropout", "n_epochs", "n_negative_samples_batch",
    "n_tokens_vocab", "n_train_tokens", "sample_softmax", "share_embedding_softmax", "unroll_steps",
)


# -- field types --------------------------------------------------------------------------------
PositiveInt = Annotated[int, Strict(), Field(ge=1)]


def _positive_clip(clip: float | None) -> float | None:
    if clip is not None and clip <= 0:
        raise problem(f"a clip must be positive, got {clip}")
    if clip is not None and clip > MAX_CLIP:  # loaded, the model failed every sentence in torch's clamp
        raise problem(f"a clip must be at most {MAX_CLIP!r}, float32's largest value (the model's), got {clip!r}")
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
    n_highway: Annotated[int, Strict(), Field(ge=0)] = 0  # optional in the original: omitted, no highway layers
    activation: Activation = "relu"
    n_characters: Annotated[int, Strict(), Field(ge=261, le=262), expecting("261 or 262")] = 262

    @model_validator(mode="before")
    @classmethod
    def _flat_embedding_dim(cls, raw: Any, info: ValidationInfo) -> Any:
        # Python callers give `embedding_dim`; a file must nest it as options.json does
        if not (info.context or {}).get(FROM_FILE) and isinstance(raw, dict) and "embedding_dim" in raw:
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

    def to_original(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class CharDictionaryConfig(StrictModel):
    """Characters looked up in a dictionary (the model folder's `chars.json`) instead of taken as
    UTF-8 bytes: the input handling of ELMoForManyLangs models, whose quirks come with it (README,
    "ELMoForManyLangs models"): a token is cut to `max_characters_per_token - 2` characters
    before both lookups, sentences are wrapped in `<bos>` ... `<eos>`, and the vocabulary's
    unknown word is `<oov>`."""

    size: PositiveInt  # entries of chars.json: the rows of the char embedding


class SoftmaxConfig(StrictModel):
    """The output layer used for training and perplexity; `none` for embedding-only models."""

    kind: SoftmaxKind  # required in a file: a section without it would silently mean "none"
    n_samples: PositiveInt = 8192  # sampled softmax: negative samples per batch
    cutoffs: tuple[PositiveInt, ...] = ()  # adaptive softmax: cluster boundaries in frequency order
    div_value: Annotated[float, Strict(), Field(gt=1)] = 4.0  # adaptive softmax: how fast the tail clusters shrink

    @field_validator("div_value")
    @classmethod
    def _tails_computable(cls, div_value: float, info: ValidationInfo) -> float:
        # tail cluster k is div_value ** k times narrower; without cutoffs there are at most 4 (default_cutoffs)
        try:
            div_value ** max(len(info.data.get("cutoffs", ())), 4)
        except OverflowError:
            raise problem(f"{div_value} is too large: its powers for the tail clusters overflow a float") from None
        return div_value

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
    char_dictionary: Optional[CharDictionaryConfig] = None  # None: characters are UTF-8 bytes

    @model_validator(mode="after")
    def _parts_agree(self) -> "ElmoConfig":
        if self.token_encoder != "word" and self.char_cnn is None:
            raise problem(f"token_encoder {self.token_encoder!r} needs a char_cnn section")
        if self.char_dictionary is not None and self.token_encoder == "word":
            raise problem("char_dictionary: needs a token encoder with characters, not 'word'")
        needs_vocab = self.token_encoder != "char_cnn" or self.softmax.kind != "none"
        if needs_vocab and not self.vocab_size:
            raise problem("vocab_size: required by a word encoder or a softmax")
        if self.token_encoder != "char_cnn" and not self.word_embedding_dim:
            raise problem(f"word_embedding_dim: required by token_encoder {self.token_encoder!r}")
        cutoffs = list(self.softmax.cutoffs)  # none: default_cutoffs, which fit any vocabulary
        if self.softmax.kind == "adaptive" and cutoffs and self.vocab_size and (
                cutoffs != sorted(set(cutoffs)) or cutoffs[-1] >= self.vocab_size):
            raise problem(f"softmax.cutoffs: {cutoffs} must increase strictly within 1..{self.vocab_size - 1} "
                          f"(vocab_size={self.vocab_size})")
        return self

    @property
    def output_dim(self) -> int:
        """Width of every output layer: forward and backward projections concatenated."""
        return 2 * self.lstm.projection_dim

    @property
    def n_output_layers(self) -> int:
        """The layers `embed` returns: the token layer and one per LSTM layer."""
        return self.lstm.n_layers + 1

    # -- the original options.json ------------------------------------------------------
    @classmethod
    def from_options(cls, raw: Mapping[str, Any], name: str = "elmo", where: str = "options.json") -> "ElmoConfig":
        """The config of the original's options.json, parsed as `raw`, for a model called `name`; a
        ConfigError names `where` and the key at fault."""
        options = validated(_OptionsFile, raw, where)
        # as our own classes: pydantic keeps an instance of a subclass as given, and _OptionsLstm's
        # compares unequal to the LstmConfig of the same values that config.json gives
        return validated(cls, {"lstm": LstmConfig(**options.lstm.model_dump()),
                               "char_cnn": CharCnnConfig(**options.char_cnn.model_dump()), "name": name}, where)

    def to_options(self) -> dict[str, Any]:
        """This config as the original's options.json: a char CNN model of UTF-8 bytes only."""
        if self.token_encoder != "char_cnn" or self.char_cnn is None or self.char_dictionary is not None:
            raise ConfigError("only a char_cnn model of UTF-8 bytes can be written as an original options.json")
        return {"lstm": self.lstm.model_dump(mode="json"), "char_cnn": self.char_cnn.to_original()}

    # -- our config.json ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "ElmoConfig":
        """Our config.json, parsed as `raw`; a ConfigError names `where`. Its optional
        `weights_sha256` (the sha256 of model.safetensors, written by save_pretrained) describes the
        weights file, not the model: it is checked here for its type and by `load_pretrained`
        against the file, and not kept."""
        document = validated(_ConfigFile, raw, where)
        return validated(cls, {name: getattr(document, name) for name in cls.model_fields}, where)

    def to_dict(self) -> dict[str, Any]:
        """Our config.json's fields, after the format's name and version."""
        fields = self.model_dump(mode="json")
        if fields["char_dictionary"] is None:  # a byte-level model's file stays as it was written before
            del fields["char_dictionary"]
        return {"format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, **fields}

    def to_json(self) -> str:
        """`to_dict` as config.json's text."""
        return dumps_strict(self.to_dict(), "config.json", indent=2, sort_keys=True)


class _ConfigFile(ElmoConfig):
    """config.json as written: the model's fields, what identifies the format, the weights' sha256."""

    char_cnn: Optional[CharCnnConfig] = None
    token_encoder: TokenEncoder
    format: str  # both checked by _native_format
    format_version: Annotated[int, Strict()]  # true or 1.0 are not the version 1
    weights_sha256: Optional[Sha256] = None

    @model_validator(mode="before")
    @classmethod
    def _native_format(cls, raw: Any) -> Any:
        # before the fields: a file of another format is named as such, not by its first odd field
        if isinstance(raw, Mapping):
            if "format" in raw and raw["format"] != NATIVE_FORMAT:
                raise problem(f"format {shown(raw['format'])} is not {NATIVE_FORMAT!r}")
            if "format_version" in raw and raw["format_version"] != NATIVE_FORMAT_VERSION:
                raise problem(f"format_version {shown(raw['format_version'])} is not supported")
        return raw


class _OptionsLstm(LstmConfig):
    """options.json's `lstm` as bilm-tf's inference reads it: without `n_layers` one layer
    (`.get('n_layers', 1)`), and `use_skip_connections` required (`['use_skip_connections']`).
    The originals disagree without it: bilm-tf fails, its training ran such a model with none,
    and the AllenNLP port adds them whatever the file says; our default of true was a guess."""

    n_layers: PositiveInt = 1
    use_skip_connections: Annotated[bool, Strict()]


class _OptionsCharCnn(CharCnnConfig):
    """options.json's `char_cnn`: bilm-tf and the AllenNLP port both read `activation` without a
    default and fail without it, so a file that leaves it out is refused, not run as relu."""

    activation: Activation


# options.json: the two sections we read and, allowed but not read, bilm-tf's training keys
_OPTIONS_FIELDS: dict[str, Any] = {
    "lstm": (_OptionsLstm, ...), "char_cnn": (_OptionsCharCnn, ...),
    **{key: (Any, None) for key in _ORIGINAL_TRAINING_KEYS},
}
_OptionsFile = create_model("_OptionsFile", __base__=StrictModel, **_OPTIONS_FIELDS)


def fields_differing(a: Mapping[str, Any], b: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
    """The top-level fields of two configs (as `ElmoConfig.to_dict` gives them) whose values
    differ, sorted, leaving out those in `ignore`."""
    return [k for k in sorted(set(a) | set(b)) if k not in ignore and a.get(k) != b.get(k)]


def weights_sha256(raw: Mapping[str, Any], where: str = "config.json") -> str | None:
    """config.json's `weights_sha256`: 64 lowercase hex digits, or None when absent (older files)."""
    return validated(Optional[Sha256], raw.get(WEIGHTS_SHA256_KEY), where, (WEIGHTS_SHA256_KEY,))
