"""Where weights live and how their bytes are read: paths or fsspec URLs, never unpickled."""

from __future__ import annotations

import os
import posixpath
from importlib import resources

import fsspec

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


def join_url(base: str, name: str) -> str:
    if "://" in base:
        return posixpath.join(base.rstrip("/"), name)
    return os.path.join(base, name)
