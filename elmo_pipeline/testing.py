"""Where tests and benchmarks find the shared public data, and what they do when it is absent."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "ELMO_PIPELINE_DATA"


def shared_data_dir() -> Path:
    """`$ELMO_PIPELINE_DATA`, else `../shared/data` beside the project checkout."""
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def data_path(*parts: str) -> Path:
    """A file or folder of the shared data; skips the calling test when it is absent, fails under CI=true."""
    path = shared_data_dir().joinpath(*parts)
    if not path.exists():
        reason = f"shared data {path} is absent (set {DATA_ENV} to its folder)"
        if os.environ.get("CI", "").lower() == "true":
            raise FileNotFoundError(reason)
        import pytest

        pytest.skip(reason)
    return path
