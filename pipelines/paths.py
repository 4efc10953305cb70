"""The paths a job's workers use, settled before the job: local ones made absolute (the workers
may run in another folder) and the output folder checked writable (else Beam fails only once
the job started).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
from typing import Iterator

import fsspec
from apache_beam.io.filesystems import FileSystems

from elmo_pipeline.corpus.records import has_lone_surrogate
from elmo_pipeline.corpus.tokenization import absolute_spacy_model
from elmo_pipeline.filesystems import is_local
from elmo_pipeline.formats.atomic import check_output_folder, missing_folders, nearest_existing, remove_empty_folders
from elmo_pipeline.formats.files import absolute_local
from elmo_pipeline.formats.pretrained import absolute_model_location
from elmo_pipeline.pipelines.signals import undone_if_ended


def make_paths_absolute(args: argparse.Namespace) -> None:
    """The local paths a job's workers read or write (`output`, `model`, `spacy_model`, where
    `args` has them) made absolute, as the inputs are: a portable runner's or a cluster's workers
    run in a folder of their own, where `out/` wrote the shards beside them while the launcher
    reported success."""
    if getattr(args, "output", None):
        args.output = absolute_local(args.output)
    if getattr(args, "model", None):
        args.model = absolute_model_location(args.model)
    if getattr(args, "spacy_model", None):
        args.spacy_model = absolute_spacy_model(args.spacy_model)


# Beam's file sinks match `<output>/<prefix>-*-of-N` as a pattern to delete what an earlier write
# left and to find their own files: in a folder named `o*x` they deleted the shards of `old-x`.
_PATTERN_CHARACTERS = "*?[]{}"


def check_beam_writable(output: str) -> None:
    """Raises ValueError for a folder Beam's file sinks cannot write (memory://, say) or would read
    as a pattern: found now, not after the job ran. Local paths, gs://, s3:// and hdfs:// pass."""
    if has_lone_surrogate(output):  # Beam sends the sinks' paths as UTF-8: the started job failed on it
        raise ValueError(f"--output {output!r}: the name is not UTF-8 (bytes the shell passed as they were), "
                         "which Beam's file sinks cannot encode; choose a UTF-8 name")
    pattern = sorted(set(_PATTERN_CHARACTERS) & set(output))
    if pattern:
        raise ValueError(f"--output {output}: holds {' '.join(pattern)}, which Beam's file sinks read as a "
                         "pattern when they clear and rename their shards (matching, and deleting, other "
                         "folders' files); choose a folder name without them")
    try:
        FileSystems.get_filesystem(output)
    except ValueError as exc:
        raise ValueError(f"--output {output}: Beam's file sinks cannot write there ({exc})") from exc
    try:
        fs, path = fsspec.core.url_to_fs(output)
    except (ValueError, ImportError) as exc:  # azfs:// is Beam's name, unknown to fsspec (adlfs: az://)
        raise ValueError(f"--output {output}: the command also checks and clears the output folder "
                         f"through fsspec, which cannot open it ({exc})") from exc
    if is_local(fs):
        _check_local_writable(fs, output, os.path.abspath(path))


@contextlib.contextmanager
def output_claimed(output: str) -> Iterator[None]:
    """This process's claim on a local output folder, from before its earlier run is looked at
    until the job's last file is written: a second extract, prepare or probe on the folder is
    refused (two runs at once each cleared or replaced the other's shards, and one could exit 0
    with its output gone). A flock on the folder itself, which the kernel drops when the process
    ends, however it ends; a folder made for the claim and left empty is removed. A URL's folder,
    or a file system without locks, is not claimed."""
    check_beam_writable(output)
    check_output_folder(output)  # before a folder is made for the claim
    fs, path = fsspec.core.url_to_fs(output)
    if not is_local(fs):
        yield
        return
    path = os.path.abspath(path)
    made = missing_folders(path)  # the folders made for the claim: `a/b/out` makes a and b too
    os.makedirs(path, exist_ok=True)

    def remove_if_made() -> None:
        remove_empty_folders(made)

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"--output {output} is being written by another run (extract, prepare or probe) "
                             "now; wait for it to end, or give another --output") from None
        except OSError:
            pass  # no locks there (some network file systems): unclaimed, as before
        with undone_if_ended(remove_if_made):  # Ctrl-C or SIGTERM left the empty folder behind
            yield
    finally:
        os.close(fd)
        remove_if_made()


def _check_local_writable(fs: fsspec.AbstractFileSystem, output: str, path: str) -> None:
    """A local folder, or the nearest existing folder above it, that this process cannot write (a
    read-only mount stops root too) fails here, not as Beam's traceback once the job started."""
    existing = nearest_existing(fs, path)
    if existing is not None and os.path.isdir(existing) and not os.access(existing, os.W_OK | os.X_OK):
        where = "it is" if existing == path else f"{existing}, where it would be made, is"
        raise ValueError(f"--output {output} cannot be written: {where} not writable by this process")
