"""Files and folders that appear whole or not at all: written beside their final name, then renamed."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import shutil
import stat
import threading
from typing import Callable, Iterator, Sequence

import fsspec

from elmo_pipeline.filesystems import (innermost_frame, is_local, local_special_file, partial_name,
                                       refuse_special_under_chain, shown, written_for)


# Taken for good by a local run that a signal ends (pipelines/signals.py) before it puts the earlier
# run back: the job's threads in this process go on until it dies, and a shard renamed into place
# (or a partial file begun) then stayed beside the earlier run. They now wait here: at every local
# rename, and for the whole of a local write of bytes held in memory (a prepared shard), which is
# short, so that no partial file appears after the earlier run's folder was swept.
LOCAL_RENAMES = threading.RLock()


def replace_atomically(fs: fsspec.AbstractFileSystem, final: str, write: Callable[[str], None]) -> None:
    """`write(partial)` fills `partial_name(final)` on `fs`, which is then renamed to `final`.

    On failure the partial file is removed, nothing appears under `final` (an earlier file there
    stays as it was), and an OSError names the final file. Not fsspec's `fs.transaction`: where
    its temporaries go, and whether a failed one is removed, differs per backend. A local rename
    is `os.replace`: fsspec's local `mv` copies onto the final name in place when the rename fails
    (a full disk, a folder made read-only). A local symbolic link is written through, as a
    shell's `>` would: its target is replaced and the link kept; a local file replaced keeps its
    permission bits and group (`_keep_mode`).

    A local partial file is locked (flock) by this process from its creation to its rename, which
    tells a live write's from one that SIGKILL left (`remove_abandoned_partials`). A writer that
    opens the partial file itself with a lock of its own (HDF5's) must not take it."""
    if fs.isdir(final):  # the rename would move the file into it, under the partial name, and succeed
        raise IsADirectoryError(errno.EISDIR, f"cannot write {shown(fs, final)}: it is an existing folder")
    _refuse_special(fs, final)
    if is_local(fs) and os.path.islink(final):
        final = os.path.realpath(final)
    partial = partial_name(final)
    try:
        if is_local(fs):
            with _held_partial(fs._strip_protocol(partial)) as held:
                write(held)
                _keep_mode(fs._strip_protocol(final), held)
                with LOCAL_RENAMES:
                    os.replace(held, fs._strip_protocol(final))
        else:
            write(partial)
            fs.mv(partial, final)
    except BaseException as exc:  # Ctrl-C and SIGTERM (commands.Terminated) too
        try:
            if fs.exists(partial):
                fs.rm(partial)
        except Exception:  # noqa: BLE001, S110 - the write's own error is the one to report
            pass
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"cannot write {shown(fs, final)}: {exc}") from exc
        if isinstance(exc, NotImplementedError) and _raised_by_file_system(fs, exc):
            # fsspec's HTTP file system (empty message: "error: " alone)
            raise OSError(errno.EROFS, f"cannot write {shown(fs, final)}: its file system does not write "
                                       "files") from exc
        raise


def _raised_by_file_system(fs: fsspec.AbstractFileSystem, exc: BaseException) -> bool:
    """Whether `exc` was raised in the code of `fs`'s own classes (its refusal to write), not in the
    write it ran: embed-file runs the whole model there, and torch raises NotImplementedError for
    an op a backend lacks."""
    modules = {cls.__module__ for cls in type(fs).__mro__} - {"builtins"}
    frame = innermost_frame(exc)
    return frame is not None and frame.f_globals.get("__name__") in modules


@contextlib.contextmanager
def _held_partial(partial: str) -> Iterator[str]:
    """A new local partial file (`partial`, or another name of `partial_name`'s where a cleaner took
    that one before it was locked), locked by this process until the block ends (where the file
    system takes locks). The lock goes with the process however it ends: a file no process holds is
    a killed write's."""
    while True:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                # a file system without locks (NFS without its lock daemon, Lustre without -o flock):
                # written unlocked, as before locks; a cleaner cannot lock it there to remove it either
                break
            if _same_file(partial, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed between its creation and the lock: as if never made
        partial = partial_name(written_for(partial))
    try:
        yield partial
    except BaseException:
        with contextlib.suppress(OSError):
            if _same_file(partial, fd):
                os.unlink(partial)
        raise
    finally:
        os.close(fd)  # after the rename: a cleaner meanwhile finds the lock held, or the name gone


def remove_abandoned_partials(final: str) -> None:
    """Removes the partial files (`partial_name`'s) of the local file `final` that no process holds
    locked: `replace_atomically` holds its own from creation to rename, and the lock dies with the
    process, so these are what writes killed by SIGKILL (or a machine lost) left. A file that cannot
    be opened or locked here (another user's, or a file system without locks) is left as it is.
    It lists the folder: for a command's one output, not each of many files written into one folder
    (a prepared corpus's shards)."""
    folder, name = os.path.split(final)
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return
    for entry in entries:
        if entry == name or written_for(entry) != name:
            continue
        path = os.path.join(folder, entry)
        try:  # not through a link, and a FIFO so named does not block the open
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a write in progress
                if _same_file(path, fd):  # not renamed to `final` by its writer, which has ended, since
                    os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _same_file(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _keep_mode(final: str, partial: str) -> None:
    """Gives `partial` the permission bits and group of the local file `final` it replaces, as a write
    into that file keeps them: a private (0600) file came back with the umask's 0644, readable by
    all. A group this process may not give is left as it is."""
    try:
        kept = os.stat(final)
    except FileNotFoundError:  # a new file: the umask's mode, as for any file made
        return
    os.chmod(partial, stat.S_IMODE(kept.st_mode))
    try:
        os.chown(partial, -1, kept.st_gid)
    except PermissionError:  # a group this user is not in
        pass


def write_bytes_atomically(fs: fsspec.AbstractFileSystem, final: str, data: bytes) -> None:
    def write(path: str) -> None:
        with fs.open(path, "wb") as f:
            f.write(data)

    with LOCAL_RENAMES if is_local(fs) else contextlib.nullcontext():
        replace_atomically(fs, final, write)


def write_url_atomically(url: str, data: bytes) -> None:
    """`write_bytes_atomically` to the file `url`, creating the folders above it."""
    fs, path = fsspec.core.url_to_fs(url)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    write_bytes_atomically(fs, path, data)


# -- local folders ------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    """Makes the renames and new names inside the local folder `path` durable (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_folder(path: str) -> None:
    """Flushes every file of the flat local folder `path`, then the folder itself."""
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(path)


def replace_folder(final: str, write: Callable[[str], None]) -> None:
    """`write(staging)` fills the local folder `<final>.tmp`, which then replaces the folder `final`.

    No rename replaces a folder that holds files, so the old folder is first renamed to
    `<final>.old`: a process killed between the two renames leaves no `final` but a complete
    `<final>.tmp` beside `<final>.old`. `recover_folder` (called here first, and by whoever reads
    `final` after a possible kill) completes that swap; after it, `final` is either the old
    folder or the new one, whole. A `<final>.tmp` without `<final>.old` may be partial and is
    discarded: the caller must not record that the new folder exists before this returns."""
    recover_folder(final)
    staging = final + ".tmp"
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # partial: no later call would use it
        raise
    publish_folder(staging, final, aside=final + ".old")


def publish_folder(staging: str, final: str, aside: str) -> None:
    """Flushes the complete local folder `staging` and renames it to `final`, durably.

    A folder already at `final` is first renamed to `aside` and removed after the swap (see
    `replace_folder`): removed in place, a kill would leave it there without some of its files."""
    fsync_folder(staging)
    if os.path.exists(final):
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(aside, ignore_errors=True)


def recover_folder(final: str) -> None:
    """Completes or undoes a `replace_folder` of `final` that a killed process left half done."""
    staging, old = final + ".tmp", final + ".old"
    if os.path.isdir(old):
        if not os.path.exists(final):  # killed between the renames; staging was complete before the first
            os.rename(staging if os.path.isdir(staging) else old, final)
            fsync_dir(os.path.dirname(os.path.abspath(final)))
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


def check_output_folder(url: str) -> None:
    """Refuses an output folder that cannot be created because it, or a folder above it, is an
    existing file: caught here, before any work, rather than by the first write. An empty one
    (an unset variable, say) is refused: it meant the current folder, which `extract` wrote into."""
    if not fsspec.core.split_protocol(url)[1]:
        raise ValueError(f"--output {url!r} names no folder; give a folder or URL")
    check_no_file_in_the_way(url, "--output")


def check_no_file_in_the_way(url: str, what: str) -> None:
    """Refuses a folder `url` that is, or lies under, an existing file (whose first write failed
    with Python's FileExistsError or NotADirectoryError); `what` names it: an option, a function."""
    fs, start = fsspec.core.url_to_fs(url)
    start = start.rstrip("/") or start
    blocker = _file_at_or_above(fs, start)
    if blocker is None:
        return
    if blocker == start:
        raise ValueError(f"{what} {url} is an existing file; it must name a folder (new or existing)")
    raise ValueError(f"{what} {url} cannot be created as a folder: {shown(fs, blocker)} is an existing file")


def check_output_file(url: str, reads: Sequence[tuple[str, str]] = ()) -> None:
    """Refuses an output file that is an existing folder (a rename would move the file into it),
    a device, FIFO or socket, or that lies under an existing file, before any work; a name ending
    in "/" is a folder's (the file was written under the name without it). `reads` are (what,
    url) of the files the command reads, its input and its model's: the output may be none of them,
    by any name, since writing it would replace the file (the model's weights, say) with the output."""
    for what, source in reads:
        if same_file(url, source):
            raise ValueError(f"output {url} is {what}, which this command reads: it would be replaced by the "
                             "output; give another name")
    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        raise ValueError(f"output {url} is an existing folder; it must name a file")
    if url.endswith(("/", os.sep)):
        raise ValueError(f"output {url} ends in {url[-1]!r}, as a folder's name does; it must name a file")
    _refuse_special(fs, path)
    blocker = _file_at_or_above(fs, fs._parent(path.rstrip("/")))
    if blocker is not None:
        raise ValueError(f"output {url} cannot be created: {shown(fs, blocker)} is an existing file, not a folder")


def same_file(a: str, b: str) -> bool:
    """Whether two URLs name one file: by the file itself where both are local and exist (a link or
    a hard link to it too), else by protocol and path. A chain over a device or FIFO is refused: making
    its file system would open it."""
    refuse_special_under_chain(a)
    refuse_special_under_chain(b)
    try:
        fs_a, path_a = fsspec.core.url_to_fs(a)
        fs_b, path_b = fsspec.core.url_to_fs(b)
    except FileNotFoundError:  # a chain's archive that is not there: no file, and its reader names it
        return False
    if is_local(fs_a) and is_local(fs_b):
        return os.path.exists(path_a) and os.path.exists(path_b) and os.path.samefile(path_a, path_b)
    return fs_a.protocol == fs_b.protocol and path_a.rstrip("/") == path_b.rstrip("/")


def _refuse_special(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """A device, FIFO or socket (/dev/null, say) is not replaced by the file written in its place."""
    if local_special_file(fs, path):
        raise ValueError(f"output {shown(fs, path)} is not a regular file (a device, FIFO or socket); a file written "
                         "there would replace it, so it is refused")


def missing_folders(path: str) -> list[str]:
    """The local folders at and above `path` that do not exist, deepest first: those that
    `os.makedirs(path)` makes, which a failed write should leave as it found them."""
    made = []
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    return made


def remove_empty_folders(folders: Sequence[str]) -> None:
    """Removes `folders` (deepest first, as `missing_folders` lists them) while they are empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # not empty: what was written, and the folders above it
            return


def nearest_existing(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """`path`, or the nearest path above it, that exists; None when none does."""
    while not fs.exists(path):
        parent = fs._parent(path)
        if not parent or parent == path:
            return None
        path = parent
    return path


def _file_at_or_above(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The nearest existing path at or above `path` when it is a file, in which nothing can be created."""
    existing = nearest_existing(fs, path)
    return None if existing is None or fs.isdir(existing) else existing
