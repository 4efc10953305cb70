"""Where weights live and how their bytes are read: paths or fsspec URLs, never unpickled."""

from __future__ import annotations

import os
import re
from importlib import resources

import fsspec

from elmo_pipeline.filesystems import (SPECIAL_FILE, local_special_file, reads_local, resolve_dots,
                                      split_http_query)

CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "model.safetensors", "vocab.json"
CHARS_FILE = "chars.json"  # the character dictionary of a model with `char_dictionary` in its config
# A pretrain run folder holds run.json, its final model in model/, the best in best/ and its
# checkpoints (model folders too) in checkpoints/step-NNNNNNNNN/; named here so that a load given
# the run folder itself can say which of them to give.
RUN_FILE, RUN_MODEL_DIR, RUN_BEST_DIR, CHECKPOINTS_DIR = "run.json", "model", "best", "checkpoints"
CHECKPOINT_NAME = re.compile(r"step-(\d{9})")
# The most one model file may hold, and what the tensors of an HDF5 file or a .pkl may declare
# once inflated. The original model is 374 MB of float32 and released ELMoForManyLangs files are
# 0.3 to 1 GB: this leaves room, and stops a file that would fill memory (/dev/zero, a bomb).
MAX_FILE_BYTES = 4 << 30


# A model file over HTTP: a server that sends no byte for HTTP_READ_TIMEOUT_S (or takes
# HTTP_CONNECT_TIMEOUT_S to accept) fails the read, and one that keeps sending is waited for
# however long the file takes. aiohttp's own session limit was 300 s for each request whole: a
# silent server held a load for 10 minutes (fsspec asks for the size by HEAD, then by GET) before
# it was "file not found", and a model that takes over 5 minutes to download could not be loaded.
HTTP_CONNECT_TIMEOUT_S, HTTP_READ_TIMEOUT_S = 30.0, 60.0


class CheckpointError(ValueError):
    """A weight file that is missing, corrupt, or does not match its config; names the file and tensor."""


def read_bytes(url: str, limit: int = MAX_FILE_BYTES, what: str = "a model file") -> bytes:
    """The bytes of `url`; a file larger than `limit` bytes is refused after reading at most one
    byte past it (whatever size the filesystem reports), before reading where its size is known
    (a local file, a server's Content-Length), and a local special file (a device, a FIFO: endless
    or blocking) unread. `what` names the file's kind in the refusal. A CheckpointError whose
    cause is a FileNotFoundError says the file is not there; any other failure to read it (an
    HTTP 500, a transfer cut short) is one naming `url` and why."""
    try:
        size = _local_size(url, limit, what)
        with fsspec.open(url, "rb", **_http_options(url)) as f:
            declared = getattr(f, "size", None)
            if size is None and isinstance(declared, int) and declared > limit:
                # a remote file read for its size only to be refused: 4 GiB fetched into memory
                raise CheckpointError(f"{url}: its {declared:,} bytes are more than the {limit:,} bytes {what} "
                                      "may have; refused unread")
            # a local read asks for what the file holds: read(n) reserves n bytes before reading
            data = f.read(limit + 1 if size is None else size + 1)
    except (CheckpointError, ImportError):  # ours, and fsspec's "install aiohttp" as it is
        raise
    except FileNotFoundError as exc:
        failure = _not_found_failure(exc)
        if failure is not None:
            raise CheckpointError(f"{url}: cannot be read ({failure})") from exc.__cause__
        raise CheckpointError(f"{url}: file not found") from exc
    except (IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        raise CheckpointError(f"{url}: cannot be read ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - a remote file system's own errors are no OSError
        # (aiohttp's ClientPayloadError for a transfer cut short was a traceback)
        raise CheckpointError(f"{url}: cannot be read ({_failure(exc)})") from exc
    if len(data) > limit:
        raise CheckpointError(f"{url}: larger than the {limit:,} bytes {what} may have; refused")
    return data


def _http_options(url: str) -> dict:
    """fsspec's options for the HTTP parts of `url` (also in a chain, `simplecache::https://...`):
    the timeouts above; none without aiohttp, whose absence fsspec names when it opens the file."""
    protocols = {fsspec.core.split_protocol(part)[0] for part in url.split("::")} & {"http", "https"}
    if not protocols:
        return {}
    try:
        import aiohttp
    except ImportError:
        return {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_CONNECT_TIMEOUT_S, sock_read=HTTP_READ_TIMEOUT_S)
    return {protocol: {"client_kwargs": {"timeout": timeout}} for protocol in protocols}


def _not_found_failure(exc: FileNotFoundError) -> str | None:
    """Why a remote file said not found could not be read, when it is there for all we know; None
    when it is not. fsspec's HTTP file system raises FileNotFoundError for any failed request for
    a file's size (an HTTP 500 or 403, a refused connection, a timeout), with the failure as its
    cause: reported as "file not found", a server's error sent the user looking for a typo."""
    cause = exc.__cause__
    if cause is None or isinstance(cause, FileNotFoundError):
        return None
    status = getattr(cause, "status", None)  # aiohttp's ClientResponseError, without importing aiohttp
    if isinstance(status, int):
        return None if status in (404, 410) else f"HTTP {status} {getattr(cause, 'message', '')}".rstrip()
    return _failure(cause)


def _failure(exc: BaseException) -> str:
    """An exception as the reason a read failed: its type, and its message where it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _local_size(url: str, limit: int, what: str) -> int | None:
    """The size of the local regular file `url` (also behind a cache or folder view of the local
    file system), refused past `limit` or when it is a special file; None for a folder (opening
    it raises IsADirectoryError, reported by `read_bytes`) and for other file systems' URLs."""
    fs, path = fsspec.core.url_to_fs(url)
    if local_special_file(fs, path):
        raise CheckpointError(f"{url}: {SPECIAL_FILE}")
    if not reads_local(fs):
        return None
    info = fs.info(path)
    if info["type"] == "directory":
        return None
    if info["size"] > limit:
        raise CheckpointError(f"{url}: larger than the {limit:,} bytes {what} may have; refused")
    return info["size"]


DEFAULT_MODEL_NAME = "embedded default"  # what outputs record as the location of the default model


def model_shown(location: str | None) -> str:
    """The model location as outputs record it: as given, or DEFAULT_MODEL_NAME for none."""
    return location or DEFAULT_MODEL_NAME


def default_model_location() -> str:
    return str(resources.files("elmo_pipeline") / "default_model")


def absolute_local(location: str) -> str:
    """A local path made absolute (and `a/../b` `b`), a URL with its `.` and `..` resolved
    (`resolve_dots`): a cluster's or a portable runner's workers run in a folder of their own,
    where a relative path names another file, or none."""
    if not location:
        return location
    return resolve_dots(location) if "://" in location else os.path.abspath(location)


def join_url(base: str, name: str) -> str:
    """`name` inside the folder `base` (a path or URL), with one separator between them."""
    if "://" in base:
        # slashes stripped after the scheme only: "memory://" + name is not "memory:/" + name (a
        # local relative path to fsspec), and "file:///" keeps the root's
        head, sep, tail = base.partition("://")
        # an HTTP folder's query (`?token=...`) goes to each of its files: it was taken as path,
        # `https://host/m?token=t/config.json`
        tail, query = split_http_query(head, tail)
        tail = tail.rstrip("/") or tail[:1]
        return f"{head}{sep}{tail}{'' if not tail or tail.endswith('/') else '/'}{name}{query}"
    return os.path.join(base.rstrip("/") or base, name)
