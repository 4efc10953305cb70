"""Import of the original format: `options.json` + an HDF5 file of TF-layout matrices.

TF stores `[in, out]` matrices with gate blocks in the order i, j, f, o; torch wants `[out, in]`
with i, f, g, o. HDF5 external links, external storage and virtual datasets are refused, so a
weight file can only ever read its own bytes.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
from typing import Any, Sequence, TypeVar

import h5py
import numpy as np
import torch
from torch import nn

from elmo_pipeline.formats.files import CheckpointError, read_bytes
from elmo_pipeline.formats.shapes import Dim, load_state, shape_error
from elmo_pipeline.model.config import ElmoConfig
from elmo_pipeline.strict import parse_json_strict

M = TypeVar("M", bound=nn.Module)


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
        raise shape_error(where, name, tuple(ds.shape), dims, config_where)
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


def load_allennlp(model_class: type[M], options: str, weights: str, **model_kwargs: Any) -> M:
    """`model_class(config, **model_kwargs)` with the weights of the original `options.json` +
    HDF5 pair; every dataset is shape-checked before it is read, the model built after."""
    raw = parse_json_strict(read_bytes(options), options)
    config = ElmoConfig.from_options(raw, name=posixpath.basename(weights.rstrip("/")) or "elmo", where=options)
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
    model = model_class(config, **model_kwargs)
    load_state(model, state, weights)
    model.checksum = hashlib.sha256(read_bytes(options) + read_bytes(weights)).hexdigest()
    return model
