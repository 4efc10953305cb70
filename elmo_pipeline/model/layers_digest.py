"""A model's identity as its output layers see it, whatever files it was read from.

`BiLM.checksum` is the sha256 of the files a model was loaded from: the original's
`options.json` + HDF5 and the folder `import-allennlp` made of them differ there, though every
layer they give is the same bits. What reads layers (a learned mix weighs them) needs the
identity of the function, not of its files: the digest here covers what the layers are computed
from, the config's shape of the token encoder and the LSTM, the vocabulary and character
dictionary that turn tokens into ids, and the token encoder's and LSTM's tensors. The model's
name, its file format and its softmax (used by training and perplexity only) do not enter.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elmo_pipeline.model.bilm import BiLM

# config keys that say nothing about the layers: a label, the file format, the LM's output layer
_NOT_LAYERS = ("name", "format", "format_version", "softmax", "weights_sha256")
_LAYER_MODULES = ("token_encoder.", "lstm.")


def layers_sha256(model: BiLM) -> str:
    """sha256 (hex) of everything `model`'s output layers are a function of (see the module)."""
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _NOT_LAYERS}
    ids = {"vocabulary": None if model.vocab is None else list(model.vocab.tokens),
           "characters": None if model.chars is None else list(model.chars.entries)}
    digest.update(json.dumps([config, ids], sort_keys=True, ensure_ascii=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        if not name.startswith(_LAYER_MODULES):
            continue
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(json.dumps([name, str(flat.dtype), list(tensor.shape)]).encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
