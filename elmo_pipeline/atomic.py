"""Files that appear whole or not at all: written beside their final name, then renamed."""

from __future__ import annotations

from typing import Callable

import fsspec


def replace_atomically(fs: fsspec.AbstractFileSystem, final: str, write: Callable[[str], None]) -> None:
    """`write(partial)` fills `<final>.partial` on `fs`, which is then renamed to `final`.

    On failure the partial file is removed, nothing appears under `final`, and an OSError
    names the final file."""
    partial = final + ".partial"
    try:
        write(partial)
        fs.mv(partial, final)
    except Exception as exc:
        try:
            if fs.exists(partial):
                fs.rm(partial)
        except Exception:  # noqa: BLE001, S110 - the write's own error is the one to report
            pass
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"cannot write {fs.unstrip_protocol(final)}: {exc}") from exc
        raise


def write_bytes_atomically(fs: fsspec.AbstractFileSystem, final: str, data: bytes) -> None:
    def write(path: str) -> None:
        with fs.open(path, "wb") as f:
            f.write(data)

    replace_atomically(fs, final, write)
