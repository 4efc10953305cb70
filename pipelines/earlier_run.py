"""An earlier run's output set aside while `--overwrite` replaces it, until the job succeeds.

Deleting the earlier run before the job started lost it whenever the job then failed (a runner
that cannot start, a wrong job endpoint, a Ctrl-C): it waits in a hidden folder inside the
output folder instead, and comes back if the job fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from typing import Callable, Iterator, Sequence

import fsspec

from elmo_pipeline.filesystems import is_local
from elmo_pipeline.pipelines.signals import Ending

ASIDE_PREFIX = ".earlier-run-"  # the hidden folder an earlier run waits in while the next one runs


@contextlib.contextmanager
def set_aside(output: str, entries: Sequence[str], writes: Callable[[str], bool] | None = None,
              ending: "Ending | None" = None) -> Iterator[Callable[[], None]]:
    """The local `entries` of the folder `output` moved into a hidden folder in it while the block
    runs, put back if it fails (a runner that cannot start, a wrong job endpoint) and removed once
    it succeeded; gives the function that puts them back, which first removes the entries that
    appeared meanwhile and that `writes` names (what the failed job wrote). It is given to
    `ending` before anything moves, may be called from two threads at once (the second waits),
    and does nothing once the block succeeded. Where a rename is a copy (object stores) the
    entries are deleted at once instead, and nothing is put back."""
    fs, root = fsspec.core.url_to_fs(output)
    if not is_local(fs):
        for entry in entries:
            fs.rm(entry, recursive=True)
        yield lambda: None
        return
    aside = tempfile.mkdtemp(prefix=ASIDE_PREFIX, dir=root) if entries else None
    moved: list[tuple[str, str]] = []
    present = set(os.listdir(root)) if os.path.isdir(root) else set()
    lock, settled = threading.Lock(), []

    def put_back() -> None:
        with lock:
            if settled:  # put back already, or the job succeeded
                return
            settled.append(True)
            if writes is not None and os.path.isdir(root):
                for name in set(os.listdir(root)) - present - {os.path.basename(aside or "")}:
                    if writes(name):
                        _remove(os.path.join(root, name))
            for where, entry in moved:
                if not os.path.lexists(where):  # a signal came between the note and the move
                    continue
                if os.path.lexists(entry):  # the failed job's, under the same name
                    _remove(entry)
                os.rename(where, entry)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)

    if ending is not None:
        ending.put_back = put_back
    try:
        for entry in entries:
            moved.append((os.path.join(aside, os.path.basename(entry.rstrip("/"))), entry))  # noted, then moved
            os.rename(entry, moved[-1][0])
        yield put_back
    except BaseException:
        put_back()
        raise
    with lock:
        settled.append(True)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
