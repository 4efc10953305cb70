"""Import of the original format: `options.json` + an HDF5 file of TF-layout matrices.

TF stores `[in, out]` matrices with gate blocks in the order i, j, f, o; torch wants `[out, in]`
with i, f, g, o. HDF5 external links, external storage and virtual datasets are refused, so a
weight file can only ever read its own bytes.
"""

from __future__ import annotations

import hashlib
import io
import math
from typing import Any, Callable, Iterator, NamedTuple, Sequence, TypeVar

import h5py
import numpy as np
import torch
from torch import nn

from elmo_pipeline.formats.files import MAX_CONFIG_BYTES, MAX_FILE_BYTES, CheckpointError, read_bytes, shown_base_name
from elmo_pipeline.formats.shapes import Dim, load_state, shape_error
from elmo_pipeline.model.config import ElmoConfig
from elmo_pipeline.strict import parse_json_strict

M = TypeVar("M", bound=nn.Module)
_SOFTMAX_GROUP = "softmax"  # the training output layer: never read (see _check_nothing_else)


def _hdf5_dataset(f: h5py.File, name: str, dims: Sequence[Dim], where: str, config_where: str,
                  exists_because: str = "") -> h5py.Dataset:
    """The dataset `name`, checked to have the shape `dims`; nothing of it is read yet."""
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
    if ds.shape is None:  # h5py.Empty: its shape None failed as a TypeError of our own code
        raise CheckpointError(f"{where}: tensor {name!r} is an empty dataset (a null dataspace), which holds no values")
    if ds.is_virtual or ds.external:
        raise CheckpointError(f"{where}: tensor {name!r} points outside the file (virtual or external); refused")
    if tuple(ds.shape) != tuple(d.size for d in dims):
        raise shape_error(where, name, tuple(ds.shape), dims, config_where)
    if ds.dtype.kind != "f":
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {ds.dtype}, expected floating point")
    return ds


def _check_written(found: dict[str, h5py.Dataset], where: str) -> None:
    """Refuses a dataset whose values the file does not store, all or some (never written): they read
    as the fill value, a model of zeros where its weights should be."""
    for name, ds in found.items():
        unwritten = _unwritten(ds)
        if unwritten:
            raise CheckpointError(f"{where}: tensor {name!r} was never written ({unwritten} would read as the fill "
                                  f"value {ds.fillvalue})")


def _unwritten(ds: h5py.Dataset) -> str:
    """Which of the dataset's values the file does not store, never written ("" when it stores them
    all): all of them where it has no storage, or those of the chunks its shape needs and it lacks."""
    if not ds.size:
        return ""
    if ds.chunks is None:
        return "the file stores none of its values, which" if ds.id.get_storage_size() == 0 else ""
    needed = math.prod(-(-size // chunk) for size, chunk in zip(ds.shape, ds.chunks))
    stored = ds.id.get_num_chunks()
    return f"the file stores {stored:,} of its {needed:,} chunks; the others" if stored < needed else ""


def _read(ds: h5py.Dataset, name: str, where: str) -> np.ndarray:
    try:
        stored = ds[...]
    except OSError as exc:  # a damaged compressed chunk, say
        raise CheckpointError(f"{where}: tensor {name!r} cannot be read ({exc})") from exc
    if not np.isfinite(stored).all():
        raise CheckpointError(f"{where}: tensor {name!r} holds NaN or infinite values")
    if stored.size and np.abs(stored).max() > np.finfo(np.float32).max:  # finite in float64 only
        raise CheckpointError(f"{where}: tensor {name!r} holds values beyond float32's range, which would be "
                              "infinite in the model")
    return np.asarray(stored, dtype=np.float32)


def _char_rows(f: h5py.File) -> int:
    """Rows of `char_embed`: the original's 261, or 262 with our padding row first (anything else is
    then reported against 261)."""
    if isinstance(f.get("char_embed", getlink=True), h5py.HardLink):  # no other link is followed
        table = f["char_embed"]
        if isinstance(table, h5py.Dataset) and (table.shape or ())[:1] == (262,):  # None: refused when read
            return 262
    return 261


class _Layout(NamedTuple):
    """What the options leave to the file: whether it holds the char CNN's projection (`CNN_proj`)
    and the LSTM cells' (`W_P_0`), and whether its one LSTM layer is named without a stack."""

    token: bool
    cell: bool
    unstacked: bool


def _holds(f: h5py.File, name: str) -> bool:
    """Whether `name` is in the file, asked of each group on the way without following a link (a
    link found is "held": reading it is then refused by `_hdf5_dataset`, naming it)."""
    parts = name.split("/")
    for depth in range(1, len(parts) + 1):
        link = f.get("/".join(parts[:depth]), getlink=True)
        if link is None:
            return False
        if not isinstance(link, h5py.HardLink):
            return True
    return True


def _layout(f: h5py.File, config: ElmoConfig) -> _Layout:
    """bilm-tf builds the char CNN's projection only when the filters' count differs from
    lstm.projection_dim, and projected LSTM cells only when projection_dim is below lstm.dim: its
    files then lack `CNN_proj` or every `W_P_0`. Where the sizes are equal a file may still hold
    them (the AllenNLP port always reads both), and then they are read. bilm-tf trains one layer
    without a MultiRNNCell, so its dump names that cell `RNN_0/RNN/LSTMCell` (which neither bilm-tf's
    inference nor the AllenNLP port finds); such a file is read under those names."""
    cnn, lstm = config.char_cnn, config.lstm
    assert cnn is not None
    unstacked = lstm.n_layers == 1 and _holds(f, _cell(0, 0, True)) and not _holds(f, "RNN_0/RNN/MultiRNNCell")
    return _Layout(token=cnn.n_filters != lstm.projection_dim or _holds(f, "CNN_proj"),
                   cell=lstm.dim != lstm.projection_dim or _holds(f, f"{_cell(0, 0, unstacked)}/W_P_0"),
                   unstacked=unstacked)


def _cell(direction: int, layer: int, unstacked: bool) -> str:
    return f"RNN_{direction}/RNN/LSTMCell" if unstacked else f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def _wanted(config: ElmoConfig, char_rows: int, layout: _Layout) -> Iterator[tuple[str, tuple[Dim, ...], str]]:
    """Every dataset the options ask for: (name, its dims, the field that asks for it), lazily, so
    that a count of a million stops at the first missing dataset."""
    cnn, lstm = config.char_cnn, config.lstm
    assert cnn is not None
    emb = Dim(cnn.embedding_dim, f"char_cnn.embedding.dim={cnn.embedding_dim}")
    nf = Dim(cnn.n_filters, f"char_cnn.filters (counts summing to {cnn.n_filters})")
    p = Dim(lstm.projection_dim, f"lstm.projection_dim={lstm.projection_dim}")
    h = Dim(lstm.dim, f"lstm.dim={lstm.dim}")
    yield "char_embed", (Dim(char_rows), emb), ""
    for k, (width, n) in enumerate(cnn.filters):
        filters = f"char_cnn.filters[{k}]={[width, n]}"
        yield f"CNN/W_cnn_{k}", (Dim(1), Dim(width, filters), emb, Dim(n, filters)), filters
        yield f"CNN/b_cnn_{k}", (Dim(n, filters),), filters
    for k in range(cnn.n_highway):
        for part in ("carry", "transform"):
            yield f"CNN_high_{k}/W_{part}", (nf, nf), f"char_cnn.n_highway={cnn.n_highway}"
            yield f"CNN_high_{k}/b_{part}", (nf,), f"char_cnn.n_highway={cnn.n_highway}"
    # a projection is asked for by sizes that differ (see _layout); one the file holds anyway, by nothing
    token_projection = (f"lstm.projection_dim={lstm.projection_dim} (the filters' count is {cnn.n_filters})"
                        if cnn.n_filters != lstm.projection_dim else "")
    if layout.token:
        yield "CNN_proj/W_proj", (nf, p), token_projection
        yield "CNN_proj/b_proj", (p,), token_projection
    four_h = Dim(4 * lstm.dim, h.field)
    layers = f"lstm.n_layers={lstm.n_layers}"
    cell_projection = (f"lstm.projection_dim={lstm.projection_dim} (lstm.dim is {lstm.dim})"
                       if lstm.dim != lstm.projection_dim else layers)
    for layer in range(lstm.n_layers):
        for direction in (0, 1):
            base = _cell(direction, layer, layout.unstacked)
            yield f"{base}/W_0", (Dim(2 * p.size, p.field), four_h), layers
            yield f"{base}/B", (four_h,), layers
            if layout.cell:
                yield f"{base}/W_P_0", (h, p), cell_projection


def _check_nothing_else(f: h5py.File, found: dict[str, h5py.Dataset], where: str, config_where: str) -> None:
    """Refuses a dataset, group or link the options do not ask for, as the other formats refuse an
    unexpected tensor: options.json with fewer layers or highways than the file holds is a mismatch.
    The `softmax` group is let through unread: it is the training output layer (bilm-tf's `softmax/W`
    and `softmax/b`), which weight dumps made with it keep, and no option describes it; a link in it
    is refused as anywhere else."""
    wanted = set(found)
    for name in found:
        parts = name.split("/")
        wanted.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
    unexpected: list[str] = []

    def note(name: str, link: h5py.HardLink | h5py.SoftLink | h5py.ExternalLink) -> None:
        softmax = name.split("/")[0] == _SOFTMAX_GROUP and isinstance(link, h5py.HardLink)
        if name not in wanted and not softmax:  # links themselves: none is followed
            unexpected.append(name)

    f.visititems_links(note)
    if unexpected:
        raise CheckpointError(f"{where}: unexpected entry {sorted(unexpected)[0]!r} ({len(unexpected)} in all); "
                              f"{config_where} does not ask for it")


def _check_declared_size(found: dict[str, h5py.Dataset], where: str) -> None:
    """Refuses, before a byte is read, datasets that declare more than MAX_FILE_BYTES: a compressed
    or never-written dataset costs next to nothing on disk, whatever its shape."""
    declared = sum(ds.size * ds.dtype.itemsize for ds in found.values())
    if declared > MAX_FILE_BYTES:
        raise CheckpointError(f"{where}: its datasets declare {declared:,} bytes, more than the {MAX_FILE_BYTES:,} "
                              "a weight file may hold; refused before reading")


def _tf_gates_to_torch(w: np.ndarray, hidden: int) -> np.ndarray:
    """Reorder gate blocks along axis 0 from TF's (i, j, f, o) to torch's (i, f, g=j, o)."""
    i, j, f, o = (w[k * hidden : (k + 1) * hidden] for k in range(4))
    return np.concatenate([i, f, j, o])


def _converted(get: Callable[[str], np.ndarray], config: ElmoConfig, layout: _Layout) -> dict[str, torch.Tensor]:
    """The datasets (read by `get`) under our names and layouts; a projection the file does not hold
    is the identity (its sizes are then equal), which our model computes exactly."""
    cnn, lstm = config.char_cnn, config.lstm
    assert cnn is not None
    state: dict[str, torch.Tensor] = {}
    table = get("char_embed")
    if table.shape[0] == 261:  # the original has no padding row: prepend the zero row
        table = np.concatenate([np.zeros((1, cnn.embedding_dim), np.float32), table])
    state["token_encoder.char_cnn.char_embedding.weight"] = torch.from_numpy(table)
    for k in range(len(cnn.filters)):
        conv = f"token_encoder.char_cnn.convs.{k}"
        state[f"{conv}.weight"] = torch.from_numpy(get(f"CNN/W_cnn_{k}")[0].transpose(2, 1, 0).copy())
        state[f"{conv}.bias"] = torch.from_numpy(get(f"CNN/b_cnn_{k}"))
    for k in range(cnn.n_highway):
        for part in ("carry", "transform"):
            ours = f"token_encoder.char_cnn.highways.{k}.{part}"
            state[f"{ours}.weight"] = torch.from_numpy(get(f"CNN_high_{k}/W_{part}").T.copy())
            state[f"{ours}.bias"] = torch.from_numpy(get(f"CNN_high_{k}/b_{part}"))
    p = lstm.projection_dim
    if layout.token:
        state["token_encoder.projection.weight"] = torch.from_numpy(get("CNN_proj/W_proj").T.copy())
        state["token_encoder.projection.bias"] = torch.from_numpy(get("CNN_proj/b_proj"))
    else:
        state["token_encoder.projection.weight"] = torch.eye(p)
        state["token_encoder.projection.bias"] = torch.zeros(p)
    for layer in range(lstm.n_layers):
        parts: dict[str, list[np.ndarray]] = {"input_weight": [], "recurrent_weight": [], "bias": [], "projection": []}
        for direction in (0, 1):
            base = _cell(direction, layer, layout.unstacked)
            w = _tf_gates_to_torch(get(f"{base}/W_0").T, lstm.dim)  # (4H, in + P)
            parts["input_weight"].append(w[:, :p])
            parts["recurrent_weight"].append(w[:, p:])
            parts["bias"].append(_tf_gates_to_torch(get(f"{base}/B"), lstm.dim))
            parts["projection"].append(get(f"{base}/W_P_0").T if layout.cell else np.eye(p, dtype=np.float32))
        for key, values in parts.items():
            state[f"lstm.layers.{layer}.{key}"] = torch.from_numpy(np.stack(values).copy())
    return state


def read_options(options: str, weights: str) -> ElmoConfig:
    """The config of the original `options.json` (for a model named after `weights`), without
    reading the weights."""
    _check_named(options, weights)
    return _config(read_bytes(options, MAX_CONFIG_BYTES, "a model config"), options, weights)


def _check_named(options: str, weights: str) -> None:
    """An empty path (an unset variable, say) is the current folder to fsspec: refused by name."""
    for given, what in ((options, "options"), (weights, "weights")):
        if not given.strip():
            raise CheckpointError(f"the {what} file is an empty string; name the original {what} file (path or URL)")


def _config(options_bytes: bytes, options: str, weights: str) -> ElmoConfig:
    raw = parse_json_strict(options_bytes, options)
    return ElmoConfig.from_options(raw, name=shown_base_name(weights) or "elmo", where=options)


def load_allennlp(model_class: type[M], options: str, weights: str, **model_kwargs: Any) -> M:
    """`model_class(config, **model_kwargs)` with the weights of the original `options.json` +
    HDF5 pair. Every dataset is checked against the options (shape, kind, nothing else in the file,
    the declared size) before any is read, and the model is built after all of them are."""
    _check_named(options, weights)
    options_bytes = read_bytes(options, MAX_CONFIG_BYTES, "a model config")
    config = _config(options_bytes, options, weights)
    weights_bytes = read_bytes(weights)
    try:
        h5 = h5py.File(io.BytesIO(weights_bytes), "r")
    except OSError as exc:
        raise CheckpointError(f"{weights}: not a readable HDF5 file ({exc})") from exc
    with h5:
        layout = _layout(h5, config)
        if not layout.cell:  # bilm-tf's cell without a projection has nothing to clip: proj_clip is unused
            config = config.model_copy(update={"lstm": config.lstm.model_copy(update={"proj_clip": None})})
        found = {name: _hdf5_dataset(h5, name, dims, weights, options, because)
                 for name, dims, because in _wanted(config, _char_rows(h5), layout)}
        _check_nothing_else(h5, found, weights, options)
        _check_declared_size(found, weights)
        _check_written(found, weights)
        state = _converted(lambda name: _read(found[name], name, weights), config, layout)
    model = model_class(config, **model_kwargs)
    load_state(model, state, weights)
    model.checksum = hashlib.sha256(options_bytes + weights_bytes).hexdigest()
    return model
