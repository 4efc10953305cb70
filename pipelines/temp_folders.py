"""The sinks' temporary folders (beam-temp-*), where Beam's file sinks write each shard until
finalize: a job that fails or is interrupted leaves them, partial shards in its output folder,
so the run takes away the ones that appeared while it ran (and only those: an earlier one may
not be this run's).
"""

from __future__ import annotations

import os
import shutil

import fsspec

from elmo_pipeline.filesystems import is_local
from elmo_pipeline.transforms.write import TEMP_FOLDER


def _temp_folders(root: str) -> set[str]:
    """The sinks' temporary folders (where they write each shard until finalize) at any depth under
    the local folder `root`."""
    return {os.path.join(folder, name) for folder, names, _ in os.walk(root) for name in names
            if TEMP_FOLDER.fullmatch(name)}


class TempFolders:
    """The sinks' temporary folders that appear under a local `output` while it is entered: taken
    away if the block fails (`remove_new` on an interrupt)."""

    def __init__(self, output: str) -> None:
        self.output = output
        fs, self.root = fsspec.core.url_to_fs(output)
        self.local = is_local(fs)
        self.before: set[str] = set()

    def __enter__(self) -> "TempFolders":
        self.before = _temp_folders(self.root) if self.local else set()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.remove_new()

    def remove_new(self) -> str:
        """Removes them; says what is left, for the one line a command ends with."""
        if not self.local:
            return f"its temporary folders (beam-temp-*) under {self.output} may remain"
        for folder in sorted(_temp_folders(self.root) - self.before):
            shutil.rmtree(folder, ignore_errors=True)
        left = sorted(_temp_folders(self.root) - self.before)  # a thread still writing made one again
        return f"{self.output} holds no temporary folder of it" if not left else f"left {', '.join(left)}"
