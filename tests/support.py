"""Helpers shared by several test modules (pytest puts this folder on sys.path)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from benchmarks.common import DATA_ENV, shared_data_dir
from elmo_pipeline.extract_options import add_extract_args


def data_path(*parts: str) -> Path:
    """A file or folder of the shared data; skips the calling test when it is absent, fails under CI=true."""
    path = shared_data_dir().joinpath(*parts)
    if not path.exists():
        reason = f"shared data {path} is absent (set {DATA_ENV} to its folder)"
        if os.environ.get("CI", "").lower() == "true":
            raise FileNotFoundError(reason)
        pytest.skip(reason)
    return path


def parse_extract_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`extract`'s own options and the rest (Beam's), as the command line splits them."""
    parser = argparse.ArgumentParser()
    add_extract_args(parser)
    return parser.parse_known_args(argv)


class PrivateMemoryFileSystem(MemoryFileSystem):
    """memory:// under another protocol, with its own store: a base for filesystems that
    misbehave on purpose. Subclasses set `protocol` and `store = {}`."""

    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len(cls.protocol) + 3:] if path.startswith(cls.protocol + "://") else path
        return MemoryFileSystem._strip_protocol(path)  # which knows only "memory://"
