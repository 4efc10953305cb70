"""Reading and writing model weights. Nothing here unpickles.

- The original format: `options.json` + an HDF5 file of TF-layout matrices (`[in, out]`,
  gate blocks i, j, f, o). HDF5 external links, external storage and virtual datasets are
  refused, so a weight file can only ever read its own bytes.
- Ours: a directory (or URL) with `config.json`, `model.safetensors` and, when the model has
  a word encoder or a softmax, `vocab.json`. config.json records the sha256 of
  model.safetensors (`weights_sha256`); a weights file that does not match it is refused, so a
  tampered, swapped or half-replaced file fails by name before it is used.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
from importlib import resources
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import fsspec
import h5py
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from elmo_pipeline.formats.atomic import write_bytes_atomically
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.config import (
    WEIGHTS_SHA256_KEY,
    ConfigError,
    ElmoConfig,
    dumps_strict,
    parse_json_strict,
    weights_sha256,
)
from elmo_pipeline.model.vocabulary import Vocabulary

CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "model.safetensors", "vocab.json"


class CheckpointError(ValueError):
    """A weight file that is missing, corrupt, or does not match its config; names the file and tensor."""


def read_bytes(url: str) -> bytes:
    try:
        with fsspec.open(url, "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{url}: file not found") from exc


def default_model_location() -> str:
    return str(resources.files("elmo_pipeline") / "default_model")


def _join(base: str, name: str) -> str:
    if "://" in base:
        return posixpath.join(base.rstrip("/"), name)
    return os.path.join(base, name)


# -- configuration against tensors ------------------------------------------------------------
# A config is checked against the shapes its weight file holds before the model is allocated:
# a config.json or options.json that says lstm.dim 4000000 beside unchanged tensors would
# otherwise allocate tens of GB before the first tensor is compared.
class Dim(NamedTuple):
    """One axis of a tensor the config asks for: its size and the config field that sets it
    (with its value, "lstm.dim=4096"; empty for a fixed size)."""

    size: int
    field: str = ""


def _shape_error(where: str, name: str, actual: tuple[int, ...], dims: Sequence[Dim], config_where: str) -> CheckpointError:
    needed = tuple(d.size for d in dims)
    wrong = [d for d, a in zip(dims, actual) if d.size != a] if len(actual) == len(dims) else list(dims)
    fields = list(dict.fromkeys(d.field for d in wrong if d.field)) or list(dict.fromkeys(d.field for d in dims if d.field))
    who = f"{' and '.join(fields)} in {config_where}" if fields else config_where
    return CheckpointError(f"{where}: tensor {name!r} has shape {actual}, but {who} needs {needed}")


def _native_dims(name: str, shape: tuple[int, ...], config: ElmoConfig) -> tuple[Dim, ...]:
    """The model's tensor `name` of `shape`, each axis with the config field that sets it."""
    lstm, cnn = config.lstm, config.char_cnn
    p, h = f"lstm.projection_dim={lstm.projection_dim}", f"lstm.dim={lstm.dim}"
    v, w = f"vocab_size={config.vocab_size}", f"word_embedding_dim={config.word_embedding_dim}"
    n_filters = "" if cnn is None else f"char_cnn.filters (counts summing to {cnn.n_filters})"
    parts = name.split(".")
    fields: tuple[str, ...] = ()
    if parts[0] == "lstm":  # lstm.layers.I.input_weight (2, 4H, P), recurrent_weight, bias (2, 4H), projection (2, P, H)
        fields = {"input_weight": ("", h, p), "recurrent_weight": ("", h, p), "bias": ("", h),
                  "projection": ("", p, h)}.get(parts[-1], ())
    elif parts[:2] == ["token_encoder", "char_cnn"] and cnn is not None:
        embedding = f"char_cnn.embedding.dim={cnn.embedding_dim}"
        if parts[2] == "char_embedding":
            fields = ("", embedding)
        elif parts[2] == "convs":
            k = int(parts[3])
            filters = f"char_cnn.filters[{k}]={list(cnn.filters[k]) if k < len(cnn.filters) else None}"
            fields = (filters, embedding, filters) if parts[-1] == "weight" else (filters,)
        elif parts[2] == "highways":
            fields = (n_filters, n_filters)
    elif parts[:2] == ["token_encoder", "word_embedding"]:
        fields = (v, w)
    elif parts[:2] == ["token_encoder", "projection"]:
        inputs = " + ".join(f for f, used in ((n_filters, cnn is not None), (w, config.word_embedding_dim)) if used)
        fields = (p, inputs)
    elif parts[0] == "softmax":
        if parts[1] == "adaptive":
            fields = (f"softmax.cutoffs={list(config.softmax.cutoffs)}, softmax.div_value={config.softmax.div_value}, "
                      f"{v} and {p}",) * len(shape)
        else:
            fields = (v, p)
    return tuple(Dim(size, fields[i] if i < len(fields) else "") for i, size in enumerate(shape))


def _present_count(names: Iterable[str], prefix: str) -> int:
    """How many consecutive blocks `prefix`0., `prefix`1., ... `names` holds."""
    indices = {int(n[len(prefix):].split(".", 1)[0]) for n in names
               if n.startswith(prefix) and n[len(prefix):].split(".", 1)[0].isdigit()}
    count = 0
    while count in indices:
        count += 1
    return count


def check_config_against_shapes(
    config: ElmoConfig, vocab: Vocabulary | None, shapes: Mapping[str, tuple[int, ...]], where: str, config_where: str,
) -> None:
    """Refuse, naming the config field and the tensor, a config whose model does not have
    exactly the tensors `shapes` (name -> shape) describes; nothing of the model's size is
    allocated (the model is built on the meta device)."""
    names = list(shapes)
    counted = [("lstm.layers.", "lstm.n_layers", config.lstm.n_layers)]
    if config.char_cnn is not None:
        counted += [("token_encoder.char_cnn.highways.", "char_cnn.n_highway", config.char_cnn.n_highway),
                    ("token_encoder.char_cnn.convs.", "char_cnn.filters (one convolution each)",
                     len(config.char_cnn.filters))]
    for prefix, field, wanted in counted:  # first: a count of a million would build a million modules
        present = _present_count(names, prefix)
        if wanted != present:
            raise CheckpointError(f"{where}: holds {present} of the numbered tensor groups '{prefix}N.*', "
                                  f"but {field}={wanted} in {config_where} needs {wanted}")
    with torch.device("meta"):
        expected = {k: tuple(t.shape) for k, t in BiLM(config, vocab, cache_size=0).state_dict().items()}
    for name, shape in expected.items():  # the model's order: the first problem named is the first in the model
        if name not in shapes:
            raise CheckpointError(f"{where}: tensor {name!r} is missing ({len(set(expected) - set(shapes))} missing "
                                  f"in all); {config_where} asks for it")
        if tuple(shapes[name]) != shape:
            raise _shape_error(where, name, tuple(shapes[name]), _native_dims(name, shape, config), config_where)
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
                              f"{config_where} does not ask for it")


# -- the original format --------------------------------------------------------------------
def _hdf5_dataset(f: h5py.File, name: str, dims: Sequence[Dim], where: str, config_where: str,
                  exists_because: str = "") -> np.ndarray:
    """The dataset `name`, checked to have the shape `dims` before a byte of it is read."""
    parts = name.split("/")
    for depth in range(1, len(parts) + 1):  # every group on the way too: a link there leads elsewhere as well
        path = "/".join(parts[:depth])
        link = f.get(path, getlink=True)
        if link is None:
            why = f"; {exists_because} in {config_where} asks for it" if exists_because else ""
            raise CheckpointError(f"{where}: tensor {name!r} is missing{why}")
        if not isinstance(link, h5py.HardLink):
            what = f"tensor {name!r}" if path == name else f"group {path!r} of tensor {name!r}"
            raise CheckpointError(f"{where}: {what} is a {type(link).__name__}; only plain datasets are read")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise CheckpointError(f"{where}: {name!r} is not a dataset")
    if ds.is_virtual or ds.external:
        raise CheckpointError(f"{where}: tensor {name!r} points outside the file (virtual or external); refused")
    if tuple(ds.shape) != tuple(d.size for d in dims):
        raise _shape_error(where, name, tuple(ds.shape), dims, config_where)
    if ds.dtype.kind != "f":
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {ds.dtype}, expected floating point")
    value = np.asarray(ds[...], dtype=np.float32)
    if not np.isfinite(value).all():
        raise CheckpointError(f"{where}: tensor {name!r} holds NaN or infinite values")
    return value


def _tf_gates_to_torch(w: np.ndarray, hidden: int) -> np.ndarray:
    """Reorder gate blocks along axis 0 from TF's (i, j, f, o) to torch's (i, f, g=j, o)."""
    i, j, f, o = (w[k * hidden : (k + 1) * hidden] for k in range(4))
    return np.concatenate([i, f, j, o])


def load_allennlp(options: str, weights: str, **model_kwargs: Any) -> BiLM:
    raw = parse_json_strict(read_bytes(options), options)
    config = ElmoConfig.from_options(raw, name=posixpath.basename(weights.rstrip("/")) or "elmo")
    cnn, lstm = config.char_cnn, config.lstm
    assert cnn is not None
    state: dict[str, torch.Tensor] = {}
    try:
        h5 = h5py.File(io.BytesIO(read_bytes(weights)), "r")
    except OSError as exc:
        raise CheckpointError(f"{weights}: not a readable HDF5 file ({exc})") from exc
    # Every dataset's shape is checked against the config before it is read, and the model is
    # built only once all of them matched.
    emb = Dim(cnn.embedding_dim, f"char_cnn.embedding.dim={cnn.embedding_dim}")
    nf = Dim(cnn.n_filters, f"char_cnn.filters (counts summing to {cnn.n_filters})")
    p = Dim(lstm.projection_dim, f"lstm.projection_dim={lstm.projection_dim}")
    h = Dim(lstm.dim, f"lstm.dim={lstm.dim}")
    with h5:
        def get(name: str, *dims: Dim, exists_because: str = "") -> np.ndarray:
            return _hdf5_dataset(h5, name, dims, weights, options, exists_because)

        link = h5.get("char_embed", getlink=True)
        rows = h5["char_embed"].shape[0] if isinstance(link, h5py.HardLink) else 261
        table = get("char_embed", Dim(rows if rows in (261, 262) else 261), emb)
        if table.shape[0] == 261:  # the original has no padding row: prepend the zero row
            table = np.concatenate([np.zeros((1, cnn.embedding_dim), np.float32), table])
        state["token_encoder.char_cnn.char_embedding.weight"] = torch.from_numpy(table)
        for k, (width, n) in enumerate(cnn.filters):
            filters = f"char_cnn.filters[{k}]={[width, n]}"
            w = get(f"CNN/W_cnn_{k}", Dim(1), Dim(width, filters), emb, Dim(n, filters), exists_because=filters)[0]
            state[f"token_encoder.char_cnn.convs.{k}.weight"] = torch.from_numpy(w.transpose(2, 1, 0).copy())
            state[f"token_encoder.char_cnn.convs.{k}.bias"] = torch.from_numpy(get(f"CNN/b_cnn_{k}", Dim(n, filters)))
        for k in range(cnn.n_highway):
            for part in ("carry", "transform"):
                w = get(f"CNN_high_{k}/W_{part}", nf, nf, exists_because=f"char_cnn.n_highway={cnn.n_highway}")
                state[f"token_encoder.char_cnn.highways.{k}.{part}.weight"] = torch.from_numpy(w.T.copy())
                state[f"token_encoder.char_cnn.highways.{k}.{part}.bias"] = torch.from_numpy(get(f"CNN_high_{k}/b_{part}", nf))
        state["token_encoder.projection.weight"] = torch.from_numpy(get("CNN_proj/W_proj", nf, p).T.copy())
        state["token_encoder.projection.bias"] = torch.from_numpy(get("CNN_proj/b_proj", p))
        four_h = Dim(4 * lstm.dim, h.field)
        for layer in range(lstm.n_layers):
            parts: dict[str, list[np.ndarray]] = {"input_weight": [], "recurrent_weight": [], "bias": [], "projection": []}
            for direction in (0, 1):
                base = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
                w = get(f"{base}/W_0", Dim(2 * p.size, p.field), four_h, exists_because=f"lstm.n_layers={lstm.n_layers}")
                w = _tf_gates_to_torch(w.T, lstm.dim)  # (4H, in + P)
                parts["input_weight"].append(w[:, : p.size])
                parts["recurrent_weight"].append(w[:, p.size :])
                parts["bias"].append(_tf_gates_to_torch(get(f"{base}/B", four_h), lstm.dim))
                parts["projection"].append(get(f"{base}/W_P_0", h, p).T)
            for key, values in parts.items():
                state[f"lstm.layers.{layer}.{key}"] = torch.from_numpy(np.stack(values).copy())
    model = BiLM(config, **model_kwargs)
    _load_state(model, state, weights)
    model.checksum = hashlib.sha256(read_bytes(options) + read_bytes(weights)).hexdigest()
    return model


def _load_state(model: BiLM, state: dict[str, torch.Tensor], where: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all)")
    for name in expected:  # the model's own order, so the first problem named is the first in the model
        value = state[name]
        if tuple(value.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(value.shape)}, the config needs {tuple(expected[name].shape)}")
        if not value.is_floating_point():
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {value.dtype}, expected floating point")
        if not torch.isfinite(value).all():
            raise CheckpointError(f"{where}: tensor {name!r} holds NaN or infinite values")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


# -- our format -----------------------------------------------------------------------------
def save_pretrained(model: BiLM, directory: str) -> None:
    """Write model.safetensors (and vocab.json), then config.json with the weights' sha256.

    Each file is written under a temporary name and moved into place, so a final name only ever
    holds a whole file; config.json comes last. On a failed write the temporary file is removed
    and an OSError names the file.
    """
    fs, root = fsspec.core.url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    weights = save_safetensors_bytes(tensors)
    config = {**model.config.to_dict(), WEIGHTS_SHA256_KEY: hashlib.sha256(weights).hexdigest()}
    files = {WEIGHTS_FILE: weights}
    if model.vocab is not None:
        files[VOCAB_FILE] = model.vocab.to_json().encode()
    files[CONFIG_FILE] = dumps_strict(config, CONFIG_FILE, indent=2, sort_keys=True).encode()
    for name, data in files.items():
        write_bytes_atomically(fs, root.rstrip("/") + "/" + name, data)


def load_pretrained(location: str | None = None, **model_kwargs: Any) -> BiLM:
    location = location or default_model_location()
    config_url, weights_url = _join(location, CONFIG_FILE), _join(location, WEIGHTS_FILE)
    config_bytes = read_bytes(config_url)
    try:
        raw = parse_json_strict(config_bytes, config_url)
        config = ElmoConfig.from_dict(raw)
        expected = weights_sha256(raw)
    except ConfigError as exc:
        message = str(exc)
        raise CheckpointError(message if message.startswith(config_url) else f"{config_url}: {message}") from exc
    vocab = None
    needs_vocab = config.vocab_size is not None
    if needs_vocab:
        vocab_url = _join(location, VOCAB_FILE)
        try:
            vocab = Vocabulary.from_json(read_bytes(vocab_url), vocab_url)
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from exc
    weights = read_bytes(weights_url)
    if expected is not None and hashlib.sha256(weights).hexdigest() != expected:
        raise CheckpointError(f"{weights_url}: sha256 {hashlib.sha256(weights).hexdigest()} does not match "
                              f"{WEIGHTS_SHA256_KEY} {expected} in {config_url}: the file was modified, "
                              "truncated or replaced")
    try:
        state = load_safetensors_bytes(weights)  # as large as the file, whatever the config says
    except (SafetensorError, Exception) as exc:  # safetensors raises several types for bad headers
        raise CheckpointError(f"{weights_url}: not a readable safetensors file ({exc})") from exc
    check_config_against_shapes(config, vocab, {k: tuple(v.shape) for k, v in state.items()}, weights_url, config_url)
    model = BiLM(config, vocab, **model_kwargs)
    _load_state(model, state, weights_url)
    model.checksum = hashlib.sha256(config_bytes + weights).hexdigest()
    return model


def load_model(location: str | None = None, **model_kwargs: Any) -> BiLM:
    """A native directory/URL, or `OPTIONS.json,WEIGHTS.hdf5` for the original format."""
    if location and "," in location and location.split(",")[0].endswith(".json"):
        options, weights = location.split(",", 1)
        return load_allennlp(options, weights, **model_kwargs)
    return load_pretrained(location, **model_kwargs)
