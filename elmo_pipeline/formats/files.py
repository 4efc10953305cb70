"""Where weights live and how their bytes are read: paths or fsspec URLs, never unpickled."""

from __future__ import annotations

import os
import posixpath
from importlib import resources

import fsspec

CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "model.safetensors", "vocab.json"
CHARS_FILE = "chars.json"  # the character dictionary of a model with `char_dictionary` in its config


class CheckpointError(ValueError):
    """A weight file that is missing, corrupt, or does not match its config; names the file and tensor."""


def read_bytes(url: str, limit: int | None = None) -> bytes:
    """The bytes of `url`; with `limit`, a file larger than `limit` bytes is refused after reading
    at most one byte past it (whatever size the filesystem reports)."""
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{url}: file not found") from exc
    if limit is not None and len(data) > limit:
        raise CheckpointError(f"{url}: larger than the {limit:,} bytes a model file may have; refused")
    return data


def default_model_location() -> str:
    return str(resources.files("elmo_pipeline") / "default_model")


def join_url(base: str, name: str) -> str:
    if "://" in base:
        return posixpath.join(base.rstrip("/"), name)
    return os.path.join(base, name)
