"""Import of ELMoForManyLangs (HIT-SCIR) models: a folder, or its archive (`sources.py`), local or at any
fsspec URL, holding `config.json` (the training options, of which only `config_path` is read),
the network config it names, `char.dic`, `word.dic`, `token_embedder.pkl` and `encoder.pkl`.

The two `.pkl` files are torch.save'd state dicts, that is pickles. They are read only by torch's
restricted loader (`weights_only=True`) from bytes already in memory: its unpickler admits
tensors and plain containers and refuses everything else (a class, a function call), and then
only string keys with tensor values are accepted. JSON is parsed strictly; an archive is never
extracted (`sources.py`).

How their modules map onto ours (the input handling is `CharVocabulary` and `BiLM.token_keys`):
- token embedder: a char CNN whose convolutions, max-pool and activation are ours; a highway
  `g * x + (1 - g) * relu(A x)` with `g = sigmoid(B x)`, where ours computes
  `t * relu(A x) + (1 - t) * x` with `t = sigmoid(C x)`: C = -B (its highways use relu whatever
  "activation" says); the word embedding comes first in the concatenation that is projected
  (ours puts it last: the projection's columns are swapped).
- encoder `elmo`: an LSTM cell with projection and clips per layer and direction, gates in
  torch's order (i, f, g, o) split over `input_linearity` (no bias) and `state_linearity` (the
  bias). Its forget gate has no constant +1 (ours adds it at run time, so it is taken off the
  stored bias); a clip of 0 or null means none; layers after the first add their input.
"""

from __future__ import annotations

import hashlib
import io
import pickletools
import posixpath
import re
import zipfile
from typing import Annotated, Any, Callable, Literal, NamedTuple, Optional, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from elmo_pipeline.formats.files import MAX_CONFIG_BYTES, MAX_FILE_BYTES, CheckpointError, read_bytes
from elmo_pipeline.formats.shapes import (FLOAT_DTYPES, Dim, check_config_against_shapes, check_counts, check_tensors,
                                          check_values, load_state)
from elmo_pipeline.formats.sources import ModelSource, source_name
from elmo_pipeline.model.config import (MAX_CHARACTERS_PER_TOKEN, MAX_CLIP, CharCnnConfig, CharDictionaryConfig,
                                        ElmoConfig, FilterPair, LstmConfig, PositiveInt)
from elmo_pipeline.model.vocabulary import FORMANYLANGS_SPECIALS, CharVocabulary, Vocabulary
from elmo_pipeline.strict import ConfigError, parse_json_strict, problem, validated

M = TypeVar("M", bound=nn.Module)
TRAINING_CONFIG, CHAR_DIC, WORD_DIC = "config.json", "char.dic", "word.dic"
TOKEN_EMBEDDER, ENCODER = "token_embedder.pkl", "encoder.pkl"

# The network configs that ELMoForManyLangs ships (`elmoformanylangs/configs/`); both files hold
# the same network. A released model whose `config_path` leads nowhere is read with these.
_STANDARD_NETWORK = {
    "encoder": {"name": "elmo", "projection_dim": 512, "cell_clip": 3, "proj_clip": 3, "dim": 4096, "n_layers": 2},
    "token_embedder": {"name": "cnn", "activation": "relu",
                       "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
                       "n_highway": 2, "word_dim": 100, "char_dim": 50, "max_characters_per_token": 50},
    "classifier": {"name": "sampled_softmax", "n_samples": 8192},
    "dropout": 0.1,
}
STANDARD_NETWORK_CONFIGS = {name: _STANDARD_NETWORK for name in
                            ("cnn_50_100_512_4096_sample.json", "cnn_0_100_512_4096_sample.json")}


# -- their network config ---------------------------------------------------------------------
class _Their(BaseModel):
    """Keys their code does not read are ignored, as it ignores them; the ones it reads are checked."""

    model_config = ConfigDict(extra="ignore", frozen=True)


Count = Annotated[int, Field(strict=True, ge=0)]
ClipValue = Optional[Annotated[float, Field(strict=True, ge=0, le=MAX_CLIP)]]  # the bound: as ours


class _Encoder(_Their):
    name: str
    projection_dim: PositiveInt
    dim: PositiveInt
    n_layers: PositiveInt
    cell_clip: ClipValue  # 0 or null: no clip, as their cell tests the value's truth
    proj_clip: ClipValue


class _TokenEmbedder(_Their):
    name: str
    activation: Literal["relu", "tanh"]
    max_characters_per_token: Annotated[int, Field(strict=True, ge=3, le=MAX_CHARACTERS_PER_TOKEN)]
    filters: Annotated[tuple[FilterPair, ...], Field(min_length=1)]
    n_highway: Count
    word_dim: Count
    char_dim: Count

    @model_validator(mode="after")
    def _fits(self) -> "_TokenEmbedder":
        widest = max(width for width, _ in self.filters)
        if widest > self.max_characters_per_token:
            raise problem(f"filter width {widest} exceeds max_characters_per_token {self.max_characters_per_token}")
        return self


class _Network(_Their):
    encoder: _Encoder
    token_embedder: _TokenEmbedder


def _clip(value: float | None) -> float | None:
    return float(value) if value else None


def check_network(raw: Any, where: str) -> _Network:
    """Their network config, refused with a message that says why where we cannot run it."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    for section, wanted, what in (("token_embedder", "cnn", "the character CNN"), ("encoder", "elmo", "the ELMo biLSTM")):
        name = raw.get(section, {}).get("name") if isinstance(raw.get(section), dict) else None
        if isinstance(name, str) and name.lower() != wanted:
            detail = " (the character LSTM)" if (section, name.lower()) == ("token_embedder", "lstm") else ""
            raise CheckpointError(f"{where}: {section} {name!r}{detail} is not supported: only models with "
                                  f"{section} {wanted!r} ({what}) can be imported")
    try:
        network = validated(_Network, raw, where)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    if network.token_embedder.char_dim == 0:
        raise CheckpointError(f"{where}: token_embedder.char_dim 0 (a model without characters) is not supported: "
                              "only models with a character CNN can be imported")
    return network


def _json(data: bytes, where: str) -> Any:
    try:
        return parse_json_strict(data, where)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc


def network_config(source: ModelSource, explicit: str | None = None) -> tuple[dict, str, bytes]:
    """(parsed network config, where it was found, its bytes). As the original: `config_path` of
    config.json relative to the model folder, else the file of that name beside config.json or in
    a configs/ folder beside it; then, as a released model expects, the standard config of that
    name. A `\\` in `config_path` is a separator: a config.json written on Windows."""
    if explicit is not None:
        data = read_bytes(explicit, MAX_CONFIG_BYTES, "a model config")
        return _json(data, explicit), explicit, data
    training = source.read(TRAINING_CONFIG, MAX_CONFIG_BYTES, "a model config")  # not read whole to be refused
    if training is None:
        raise CheckpointError(f"{source.where(TRAINING_CONFIG)}: not found; an ELMoForManyLangs model folder "
                              "holds config.json, char.dic, word.dic, token_embedder.pkl and encoder.pkl")
    where = source.where(TRAINING_CONFIG)
    options = _json(training, where)
    path = options.get("config_path") if isinstance(options, dict) else None
    if not isinstance(path, str) or not path:
        raise CheckpointError(f"{where}: expected an object with 'config_path', the network config's file name")
    separated = path.replace("\\", "/")
    base = posixpath.basename(separated)
    for name in dict.fromkeys((path, separated, base, f"configs/{base}")):
        data = source.read(name, MAX_CONFIG_BYTES, "a model config")
        if data is not None:
            return _json(data, source.where(name)), source.where(name), data
    standard = STANDARD_NETWORK_CONFIGS.get(base)
    if standard is not None:
        return standard, f"the standard {base} (ELMoForManyLangs' configs/)", b""
    raise CheckpointError(f"{where}: config_path {path!r} names no file in the model, and no standard config "
                          f"({', '.join(STANDARD_NETWORK_CONFIGS)}); give the network config with --network-config")


# -- dictionaries -------------------------------------------------------------------------------
_ID = re.compile(r"[0-9]{1,18}")  # an id of more digits is no id of a real dictionary (and Python caps int())


def parse_dictionary(data: bytes, where: str) -> list[str]:
    """The entries of a `token<TAB>id` file in id order. As their loader reads it (after a byte-order
    mark): lines end where Python's str.splitlines ends them, each line is stripped of surrounding
    whitespace, and a line left with one field is the full-width space U+3000 (whose own line strips
    down to its id). Ids must be 0..N-1, each once, and a token may not appear twice (their loader
    would then build a table smaller than the weights)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    # A leading U+FEFF is the byte-order mark an editor saving "UTF-8 with BOM" adds (the first
    # entry would be another token, and its own one unknown), unless it is the entry of the
    # character U+FEFF itself: that line is U+FEFF, a tab and its id.
    if text.startswith("\ufeff") and not text.startswith("\ufeff\t"):
        text = text[1:]
    by_id: dict[int, str] = {}
    line_of: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.strip().split("\t")
        if len(fields) == 1:
            fields.insert(0, "\u3000")
        if len(fields) != 2 or not _ID.fullmatch(fields[1]):
            raise CheckpointError(f"{where}: line {number}: expected token<TAB>id, got {line[:80]!r}")
        token, index = fields[0], int(fields[1])
        if token in line_of:
            raise CheckpointError(f"{where}: line {number}: {token!r} is already on line {line_of[token]}")
        if index in by_id:
            raise CheckpointError(f"{where}: line {number}: id {index} is already given to {by_id[index]!r}")
        by_id[index], line_of[token] = token, number
    if not by_id:
        raise CheckpointError(f"{where}: empty dictionary")
    if max(by_id) != len(by_id) - 1:
        missing = next(i for i in range(len(by_id)) if i not in by_id)
        raise CheckpointError(f"{where}: ids must be 0..{len(by_id) - 1}, each once; id {missing} is missing")
    return [by_id[i] for i in range(len(by_id))]


# -- state dicts --------------------------------------------------------------------------------
def _restricted_load(data: bytes, where: str, location: str) -> Any:
    """The pickle `data` unpickled by torch's restricted loader only (tensors and plain containers)
    onto the device `location`, whatever device its tensors were saved from (a model trained on a
    GPU records it, and their loader maps it to the CPU too); anything else in it is refused and
    nothing of it runs. With "meta" no storage is kept, and those of torch's zip format (members
    that may be compressed) are not even read."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location=location)
    except Exception as exc:  # noqa: BLE001 - the restricted unpickler and a bad file raise many types
        raise CheckpointError(f"{where}: refused, not a plain PyTorch state dict of tensors "
                              f"(torch.load with weights_only=True: {_torch_reason(exc)})") from exc


# torch's refusal says how to load the file anyway (unrestricted, or by allow-listing what it
# names): advice that runs the file's code, which is not ours to pass on.
_ADVICE = ("weights_only", "weights only load failed", "trusted source", "check the documentation")


def _torch_reason(exc: Exception) -> str:
    """What torch's loader found wrong, without its advice on loading the file regardless."""
    lines = [line.strip() for line in str(exc).splitlines()]
    reasons = [line for line in lines if line and not any(a in line.lower() for a in _ADVICE)]
    if not reasons:
        return type(exc).__name__
    first_sentence = reasons[0].removeprefix("WeightsUnpickler error: ").split(". ")[0].rstrip(".")
    if "safe_globals" in first_sentence:
        return "it holds something other than tensors and plain containers"
    return first_sentence


def load_state_dict(data: bytes, where: str) -> dict[str, torch.Tensor]:
    """A torch.save'd state dict, unpickled by torch's restricted loader only (tensors and plain
    containers). It is first loaded onto the meta device, so that what its storages would take is
    known and bounded before a compressed one is inflated (the legacy format's storages are raw
    bytes of the file, which its size bounds)."""
    records = _zip_records(data)
    _check_pickle_size(data, records, where)
    declared = _check_state_dict(_restricted_load(data, where, "meta"), where)
    _check_zip_records(data, records, declared, where)
    loaded = _restricted_load(data, where, "cpu")
    for key, value in loaded.items():  # the same entries, now with their values
        check_values(value, key, where)
    return dict(loaded)


# The pickled structure of a state dict, its names and its tensors' records without their values,
# takes some 200 bytes a tensor. Anything else in it is refused, but once unpickled, at some 15
# times its bytes: a list of 10 million ints in a 50 MB token_embedder.pkl took 0.74 GB and 10 s.
MAX_PICKLE_BYTES = 16 << 20


def _zip_records(data: bytes) -> list[zipfile.ZipInfo] | Exception | None:
    """The records of torch's zip format, read from its central directory once for both checks;
    None for the legacy format; the error of a zip that cannot be read, raised only once torch's
    own loader has had its say on the file (_check_zip_records)."""
    if not data.startswith(b"PK\x03\x04"):
        return None
    try:
        return zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, ValueError) as exc:
        return exc


def _check_pickle_size(data: bytes, records: list[zipfile.ZipInfo] | Exception | None, where: str) -> None:
    """Refuses, before it is unpickled, a state dict whose pickled structure is larger than
    MAX_PICKLE_BYTES."""
    if _pickled_size(data, records) > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{where}: its pickled structure holds more than {MAX_PICKLE_BYTES:,} bytes, beyond "
                              "a state dict's names and tensor records; refused before it is unpickled")


def _pickled_size(data: bytes, records: list[zipfile.ZipInfo] | Exception | None) -> int:
    """The bytes of a torch.save'd file's pickled structure (torch's zip format, its `records`: its
    data.pkl record; the legacy format: the pickles before the storages' bytes), counted up to just
    past MAX_PICKLE_BYTES; 0 for a file neither format reads, left to torch's loader to name."""
    if isinstance(records, Exception):
        return 0
    if records is not None:
        return max((r.file_size for r in records if posixpath.basename(r.filename) == "data.pkl"), default=0)
    stream = io.BytesIO(data)
    try:  # the magic number, the protocol, the system's information, then the state dict
        for _ in range(4):
            for _op in pickletools.genops(stream):
                if stream.tell() > MAX_PICKLE_BYTES:
                    return stream.tell()
    except ValueError:
        return 0
    return stream.tell()


def _check_state_dict(loaded: Any, where: str) -> int:
    """String keys with dense floating-point tensors whose storages hold no more than they view
    (a view of a huge, well-compressed storage would inflate it whole) and no less (an expanded
    view, its elements sharing bytes, would be as large as it looks once checked or converted),
    and MAX_FILE_BYTES in all, which is returned."""
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{where}: expected a state dict (a mapping of names to tensors), "
                              f"got {type(loaded).__name__}")
    total = 0
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: entry {key!r} is a {type(value).__name__}, not a tensor under a name")
        if value.layout != torch.strided or value.dtype not in FLOAT_DTYPES:
            check_values(value, key, where)  # names the layout or dtype
        stored, viewed = value.untyped_storage().nbytes(), value.numel() * value.element_size()
        if stored > _reach(value):
            raise CheckpointError(f"{where}: tensor {key!r} ({viewed:,} bytes) is a view into a storage of {stored:,} "
                                  "bytes; refused (a state dict's storages hold their tensors only)")
        if viewed > stored:
            raise CheckpointError(f"{where}: tensor {key!r} views {viewed:,} bytes in a storage of {stored:,} bytes (its "
                                  "elements share bytes, an expanded view); refused (a state dict's tensors are "
                                  "dense)")
        total += stored
        if total > MAX_FILE_BYTES:
            raise CheckpointError(f"{where}: its tensors hold more than {MAX_FILE_BYTES:,} bytes; refused")
    return total


def _check_zip_records(data: bytes, records: list[zipfile.ZipInfo] | Exception | None, declared: int,
                       where: str) -> None:
    """In torch's zip format, records that would inflate to more than the storages the pickle
    declares (`declared` bytes) and the file's own size: torch reads a record whole, at the size
    its zip entry gives, before comparing it with the storage's."""
    if records is None:
        return  # the legacy format: storages are raw bytes of the file
    if isinstance(records, Exception):
        raise CheckpointError(f"{where}: refused, its zip container cannot be read ({records})") from records
    inflated = sum(record.file_size for record in records)
    if inflated > declared + len(data):
        raise CheckpointError(f"{where}: its zip records inflate to {inflated:,} bytes, more than its tensors "
                              f"({declared:,} bytes) and the file ({len(data):,} bytes) account for; refused")


def _reach(value: torch.Tensor) -> int:
    """How far into its storage a dense tensor reaches, in bytes."""
    if value.numel() == 0:
        return 0
    last = value.storage_offset() + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
    return (last + 1) * value.element_size()


def _token_embedder_shapes(te: _TokenEmbedder, p: int, n_chars: int, n_words: int) -> dict[str, tuple]:
    d = Dim(te.char_dim, f"token_embedder.char_dim={te.char_dim}")
    n_filters = sum(n for _, n in te.filters)
    f = Dim(n_filters, f"token_embedder.filters (counts summing to {n_filters})")
    f2 = Dim(2 * n_filters, f.field)
    shapes: dict[str, tuple] = {"char_emb_layer.embedding.weight": (Dim(n_chars, f"the {n_chars} entries of {CHAR_DIC}"), d)}
    if te.word_dim:
        shapes["word_emb_layer.embedding.weight"] = (Dim(n_words, f"the {n_words} entries of {WORD_DIC}"),
                                                     Dim(te.word_dim, f"token_embedder.word_dim={te.word_dim}"))
    for k, (width, n) in enumerate(te.filters):
        field = f"token_embedder.filters[{k}]={[width, n]}"
        shapes[f"convolutions.{k}.weight"] = (Dim(n, field), d, Dim(width, field))
        shapes[f"convolutions.{k}.bias"] = (Dim(n, field),)
    for k in range(te.n_highway):
        shapes[f"highways._layers.{k}.weight"], shapes[f"highways._layers.{k}.bias"] = (f2, f), (f2,)
    projected = Dim(te.word_dim + n_filters, f"token_embedder.word_dim={te.word_dim} + token_embedder.filters")
    shapes["projection.weight"] = (Dim(p, f"encoder.projection_dim={p}"), projected)
    shapes["projection.bias"] = (Dim(p, f"encoder.projection_dim={p}"),)
    return shapes


def _encoder_shapes(enc: _Encoder) -> dict[str, tuple]:
    p, h = Dim(enc.projection_dim, f"encoder.projection_dim={enc.projection_dim}"), Dim(enc.dim, f"encoder.dim={enc.dim}")
    four_h = Dim(4 * enc.dim, h.field)
    shapes: dict[str, tuple] = {}
    for layer in range(enc.n_layers):
        for direction in ("forward", "backward"):
            base = f"{direction}_layer_{layer}"
            shapes[f"{base}.input_linearity.weight"] = (four_h, p)
            shapes[f"{base}.state_linearity.weight"] = (four_h, p)
            shapes[f"{base}.state_linearity.bias"] = (four_h,)
            shapes[f"{base}.state_projection.weight"] = (p, h)
    return shapes


def check_shapes(state: dict[str, torch.Tensor], expected: Callable[[], dict[str, tuple]],
                 counts: list[tuple[str, str, int]], where: str, net: str) -> None:
    """Every tensor present with the shape the network config asks for (`expected()`: name ->
    Dims), and nothing else; numbered groups are counted before `expected()` expands them."""
    check_counts(state, counts, where, net)
    dims = expected()
    check_tensors({k: tuple(v.shape) for k, v in state.items()}, {k: tuple(d.size for d in v) for k, v in dims.items()},
                  where, net, lambda name, _: dims[name])


def _converted(te: dict[str, torch.Tensor], enc: dict[str, torch.Tensor], net: _Network) -> dict[str, torch.Tensor]:
    """Their tensors under our names and layouts (module docstring)."""
    te = {k: v.float() for k, v in te.items()}
    enc = {k: v.float() for k, v in enc.items()}
    spec, word_dim = net.token_embedder, net.token_embedder.word_dim
    n_filters = sum(n for _, n in spec.filters)
    state = {"token_encoder.char_cnn.char_embedding.weight": te["char_emb_layer.embedding.weight"]}
    for k in range(len(spec.filters)):
        for part in ("weight", "bias"):
            state[f"token_encoder.char_cnn.convs.{k}.{part}"] = te[f"convolutions.{k}.{part}"]
    for k in range(spec.n_highway):
        w, b = te[f"highways._layers.{k}.weight"], te[f"highways._layers.{k}.bias"]
        ours = f"token_encoder.char_cnn.highways.{k}"
        state[f"{ours}.transform.weight"], state[f"{ours}.transform.bias"] = w[:n_filters], b[:n_filters]
        state[f"{ours}.carry.weight"], state[f"{ours}.carry.bias"] = -w[n_filters:], -b[n_filters:]
    projection = te["projection.weight"]  # columns [word ; char] -> ours [char ; word]
    state["token_encoder.projection.weight"] = torch.cat([projection[:, word_dim:], projection[:, :word_dim]], 1)
    state["token_encoder.projection.bias"] = te["projection.bias"]
    if word_dim:
        state["token_encoder.word_embedding.weight"] = te["word_emb_layer.embedding.weight"]
    h = net.encoder.dim
    for layer in range(net.encoder.n_layers):
        directions = [f"{d}_layer_{layer}" for d in ("forward", "backward")]
        bias = torch.stack([enc[f"{d}.state_linearity.bias"] for d in directions]).clone()
        bias[:, h : 2 * h] -= 1.0  # ours adds the forget gate's +1 at run time
        state[f"lstm.layers.{layer}.input_weight"] = torch.stack([enc[f"{d}.input_linearity.weight"] for d in directions])
        state[f"lstm.layers.{layer}.recurrent_weight"] = torch.stack([enc[f"{d}.state_linearity.weight"] for d in directions])
        state[f"lstm.layers.{layer}.bias"] = bias
        state[f"lstm.layers.{layer}.projection"] = torch.stack([enc[f"{d}.state_projection.weight"] for d in directions])
    return {k: v.contiguous() for k, v in state.items()}


# -- the whole model ----------------------------------------------------------------------------
class Converted(NamedTuple):
    config: ElmoConfig
    vocab: Vocabulary | None
    chars: CharVocabulary
    state: dict[str, torch.Tensor]  # our names and layouts
    network_where: str  # where the network config came from
    checksum: str  # sha256 of the files read


def _required(source: ModelSource, name: str, why: str) -> bytes:
    data = source.read(name)
    if data is None:
        raise CheckpointError(f"{source.where(name)}: not found; {why}")
    return data


# What ends a line for str.splitlines (and so for their loader and parse_dictionary), in UTF-8.
_LINE_ENDS = tuple(end.encode("utf-8") for end in ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85",
                                                   "\u2028", "\u2029"))


def _line_ends(data: bytes) -> int:
    """How many lines of `data` end (a last line without an end is not counted): counting line
    feeds only would let a dictionary whose lines end in carriage returns be parsed whole, however long."""
    return sum(data.count(end) for end in _LINE_ENDS) - data.count(b"\r\n")  # \r\n ends one line


def _check_lines(data: bytes, where: str, embedder: dict[str, torch.Tensor], table: str, embedder_where: str) -> None:
    """Refuses, before it is parsed, a dictionary of more lines (each an entry) than the embedder's
    `table` has rows: parsed whole, a 126 MB word.dic took 2.9 GB and 36 s to be found too long."""
    rows = embedder.get(table)
    lines = _line_ends(data)
    if rows is not None and rows.dim() == 2 and lines > rows.shape[0]:
        raise CheckpointError(f"{where}: holds {lines:,} lines or more, more than the {rows.shape[0]:,} rows of "
                              f"{table!r} in {embedder_where}; refused unparsed")


def _dictionaries(source: ModelSource, spec: _TokenEmbedder,
                  embedder: dict[str, torch.Tensor]) -> tuple[CharVocabulary, Vocabulary | None, list[bytes]]:
    raw_chars = _required(source, CHAR_DIC, "the character CNN needs its character dictionary")
    _check_lines(raw_chars, source.where(CHAR_DIC), embedder, "char_emb_layer.embedding.weight",
                 source.where(TOKEN_EMBEDDER))
    try:
        chars = CharVocabulary(parse_dictionary(raw_chars, source.where(CHAR_DIC)))
    except ConfigError as exc:
        raise CheckpointError(f"{source.where(CHAR_DIC)}: {exc}") from exc
    if not spec.word_dim:  # their Embedder reads word.dic only for a word embedding
        return chars, None, [raw_chars]
    raw_words = _required(source, WORD_DIC, f"token_embedder.word_dim={spec.word_dim} needs the word dictionary")
    _check_lines(raw_words, source.where(WORD_DIC), embedder, "word_emb_layer.embedding.weight",
                 source.where(TOKEN_EMBEDDER))
    words = parse_dictionary(raw_words, source.where(WORD_DIC))
    if "<pad>" not in words:
        raise CheckpointError(f"{source.where(WORD_DIC)}: the entry '<pad>' is missing")
    try:
        vocab = Vocabulary(words, specials=FORMANYLANGS_SPECIALS)
    except ConfigError as exc:
        raise CheckpointError(f"{source.where(WORD_DIC)}: {exc}") from exc
    return chars, vocab, [raw_chars, raw_words]


def read_formanylangs(location: str, network: str | None = None) -> Converted:
    """Everything of the model at `location` checked and converted; no model is built yet."""
    # an unset variable, say: '' would be the current folder, and a model found there or below it
    for given, message in ((location, "the model location is an empty string; name its folder, archive or URL"),
                           (network, "the network config is an empty string; name its file or URL, or give none")):
        if given is not None and not given.strip():
            raise CheckpointError(message)
    source = ModelSource(location)
    raw, net_where, net_bytes = network_config(source, network)
    spec = check_network(raw, net_where)
    te_spec, enc_spec = spec.token_embedder, spec.encoder
    # the token embedder first: its tables' rows bound the dictionaries, checked before they are parsed
    embedder_data = _required(source, TOKEN_EMBEDDER, "the model's weights")
    embedder = load_state_dict(embedder_data, source.where(TOKEN_EMBEDDER))
    chars, vocab, dic_bytes = _dictionaries(source, te_spec, embedder)
    files = []
    for name, shapes, counts in (
        (TOKEN_EMBEDDER, lambda: _token_embedder_shapes(te_spec, enc_spec.projection_dim, len(chars), len(vocab or ())),
         [("convolutions.", "token_embedder.filters (one convolution each)", len(te_spec.filters)),
          ("highways._layers.", "token_embedder.n_highway", te_spec.n_highway)]),
        (ENCODER, lambda: _encoder_shapes(enc_spec),
         [("forward_layer_", "encoder.n_layers", enc_spec.n_layers), ("backward_layer_", "encoder.n_layers", enc_spec.n_layers)]),
    ):
        if name == TOKEN_EMBEDDER:
            data, state = embedder_data, embedder
        else:
            data = _required(source, name, "the model's weights")
            state = load_state_dict(data, source.where(name))
        check_shapes(state, shapes, counts, source.where(name), net_where)
        files.append((data, state))
    config = ElmoConfig(
        lstm=LstmConfig(dim=enc_spec.dim, projection_dim=enc_spec.projection_dim, n_layers=enc_spec.n_layers,
                        cell_clip=_clip(enc_spec.cell_clip), proj_clip=_clip(enc_spec.proj_clip)),
        char_cnn=CharCnnConfig(embedding_dim=te_spec.char_dim, max_characters_per_token=te_spec.max_characters_per_token,
                               filters=te_spec.filters, n_highway=te_spec.n_highway, activation=te_spec.activation),
        token_encoder="char_cnn+word" if vocab is not None else "char_cnn",
        word_embedding_dim=te_spec.word_dim or None, vocab_size=len(vocab) if vocab is not None else None,
        name=source_name(source.location), char_dictionary=CharDictionaryConfig(size=len(chars)),
    )
    digest = hashlib.sha256()
    for part in (net_bytes, *dic_bytes, files[0][0], files[1][0]):
        digest.update(hashlib.sha256(part).digest())
    return Converted(config, vocab, chars, _converted(files[0][1], files[1][1], spec), net_where, digest.hexdigest())


def build_model(model_class: type[M], converted: Converted, **model_kwargs: Any) -> M:
    where = f"{converted.config.name} (converted)"
    shapes = {k: tuple(v.shape) for k, v in converted.state.items()}
    check_config_against_shapes(model_class, converted.config, converted.vocab, shapes, where, converted.network_where,
                                converted.chars)
    model = model_class(converted.config, converted.vocab, chars=converted.chars, **model_kwargs)
    load_state(model, converted.state, where)
    model.checksum = converted.checksum
    return model


def load_formanylangs(model_class: type[M], location: str, network: str | None = None, **model_kwargs: Any) -> M:
    """`model_class` with the weights of the ELMoForManyLangs model at `location` (folder or archive)."""
    return build_model(model_class, read_formanylangs(location, network), **model_kwargs)
