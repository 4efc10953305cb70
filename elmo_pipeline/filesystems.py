"""Which file system a path or URL lives on, for every part (fsspec only, no part of ours).

Atomic renames, `os` calls and programs run in a folder (Feast) need this machine's file
system; a URL of another one (`gs://`, `memory://`) is either handled by fsspec or refused by
name, never taken as a relative local path.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
import types
from collections.abc import Iterator
from typing import IO

import fsspec


# Every HTTP read (a model's files, an input, a labelled file): a server that sends no byte for
# HTTP_READ_TIMEOUT_S (or takes HTTP_CONNECT_TIMEOUT_S to accept) fails the read, and one that
# keeps sending is waited for however long the file takes. aiohttp's own session limit was 300 s
# for each request whole: a silent server held a read for 10 minutes (fsspec asks for the size by
# HEAD, then by GET) before it was "file not found", and a file taking over 5 minutes to download
# could not be read at all.
HTTP_CONNECT_TIMEOUT_S, HTTP_READ_TIMEOUT_S = 30.0, 60.0


def http_options(url: str | os.PathLike) -> dict:
    """fsspec's options for the HTTP parts of `url` (also in a chain, `simplecache::https://...`):
    the timeouts above; none without aiohttp, whose absence fsspec names when it opens the file.
    A pathlib.Path is a local path, as fsspec takes it (ReadDocuments(Path) failed here on .split)."""
    protocols = {fsspec.core.split_protocol(part)[0] for part in os.fspath(url).split("::")} & {"http", "https"}
    if not protocols:
        return {}
    try:
        import aiohttp
    except ImportError:
        return {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_CONNECT_TIMEOUT_S, sock_read=HTTP_READ_TIMEOUT_S)
    return {protocol: {"client_kwargs": {"timeout": timeout}} for protocol in protocols}


def url_to_fs(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec's file system and path for `url`, made with `http_options`: what a file is read by."""
    return fsspec.core.url_to_fs(url, **http_options(url))


@contextlib.contextmanager
def open_url(url: str | os.PathLike, mode: str = "rb") -> Iterator[IO]:
    """`url` opened by fsspec with `http_options`; a remote failure while it is open or read (in
    the caller's block too) is a RemoteReadError (`remote_failures_named`)."""
    with remote_failures_named(url), fsspec.open(url, mode, **http_options(url)) as f:
        yield f


class RemoteReadError(OSError):
    """A file a server did not give for a reason other than its absence (an HTTP 500 or 403, a
    body cut short, a server silent too long), naming the URL and why. An OSError, as a local
    file's failures are, so that every reader reports it where it reports those."""


@contextlib.contextmanager
def remote_failures_named(url: str | os.PathLike) -> Iterator[None]:
    """Turns a failure of the HTTP client inside the block into a RemoteReadError naming `url`
    and why. fsspec raises FileNotFoundError for any failed request for a file's size, the
    failure as its cause (a server's error sent the user looking for a typo), and lets aiohttp's
    own errors through (ClientPayloadError, no OSError, was a traceback); a 404 or 410 stays
    FileNotFoundError. Under a chain, where fsspec's cache says "not found" without a cause, the
    chain's last part is asked why (`failure_under_chain`). A cache of the chain drops what it
    kept of the file then (`_drop_cached_copy`)."""
    try:
        with _client_failures_named(url):
            yield
    except RemoteReadError:
        _drop_cached_copy(url)
        raise


@contextlib.contextmanager
def _client_failures_named(url: str | os.PathLike) -> Iterator[None]:
    """`remote_failures_named`'s translation, without the cache's clean-up."""
    try:
        yield
    except RemoteReadError:
        raise
    except FileNotFoundError as exc:
        cause = _failure_behind(exc)
        if cause is not None:
            raise _read_failure(url, cause)
        failure = failure_under_chain(url)
        if failure is None:
            raise
        raise failure from failure.__cause__
    except Exception as exc:  # noqa: BLE001 - aiohttp's errors are no OSError; any other goes on
        cause = exc if _from_http_client(exc) else _failure_copied_by_cache(exc)
        if cause is None:
            raise
        raise _read_failure(url, cause)


def _failure_copied_by_cache(exc: Exception) -> BaseException | None:
    """The HTTP client's failure that fsspec's block cache (`blockcache::https://...`) took for a
    block's bytes: it copies what its fetcher returns, a failure too, into its file, which raises
    "TypeError: a bytes-like object is required, not 'ClientPayloadError'" (the failure itself is
    that frame's value). None for any other error, our own TypeErrors among them."""
    if not isinstance(exc, TypeError):
        return None
    frame = innermost_frame(exc)
    if frame is None or frame.f_globals.get("__name__") != "fsspec.caching":
        return None
    return next((v for v in frame.f_locals.values() if isinstance(v, BaseException) and _from_http_client(v)), None)


def innermost_frame(exc: BaseException) -> types.FrameType | None:
    """The frame in which `exc` was raised, None for one never raised."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def _drop_cached_copy(url: str | os.PathLike) -> None:
    """Removes what the cache at the head of the chained `url` kept of its file after a failed read:
    fsspec keeps a download cut short (simplecache::, filecache::) and a block cache's blocks it
    failed to fetch (blockcache::, zeros), and served them to the next read in this process (Beam
    retries a failed bundle in the same worker) as the whole file, without an error. Only that
    file's copy goes; a copy in a read-only storage (not the last) is left."""
    url = os.fspath(url)
    if "::" not in url:
        return
    from fsspec.implementations.cached import CachingFileSystem, SimpleCacheFileSystem

    head = url.split("::")[0].split("://")[0]  # "simplecache", or "zip" of "zip://a.txt"
    # made only for a cache: another head (zip://) would open its remote archive again
    if head not in fsspec.available_protocols() or not issubclass(fsspec.get_filesystem_class(head),
                                                                   CachingFileSystem):
        return
    # the read's own failure is the one to report, whatever the clean-up meets (it uses fsspec's
    # private _check_file for simplecache, which a later fsspec may change)
    with contextlib.suppress(Exception):
        fs, path = url_to_fs(url)
        if isinstance(fs, SimpleCacheFileSystem):  # keeps no record of its files: the copy is its hash's name
            copy = fs._check_file(path)
            if copy and os.path.dirname(copy) == fs.storage[-1]:
                os.remove(copy)
        else:
            fs.pop_from_cache(path)


def failure_under_chain(url: str | os.PathLike) -> RemoteReadError | None:
    """Why the last part of the chained `url` (the remote file under a cache, `simplecache::https://
    ...`; the archive of `zip://a.txt::https://...`) cannot be read, when it is there for all we
    know: a RemoteReadError naming `url` and why (the server's failure as its cause), else None (no
    chain, a last part that reads, or is not there). fsspec's caches ask whether the file exists,
    which takes any failure for no, and say "file not found" (an HTTP 500 sent the user looking
    for a typo): asked for its details, the last part's file system names the failure."""
    url = os.fspath(url)
    if "::" not in url:
        return None
    fs, path = url_to_fs(url.split("::")[-1])
    try:
        fs.info(path)
        return None
    except FileNotFoundError as exc:
        cause = _failure_behind(exc)
    except Exception as exc:  # noqa: BLE001 - only the HTTP client's are taken, as above
        cause = exc if _from_http_client(exc) else None
    if cause is None:
        return None
    return _read_failure(url, cause)


def _read_failure(url: str | os.PathLike, cause: BaseException) -> RemoteReadError:
    """The RemoteReadError naming `url` and why the HTTP client's `cause` failed, `cause` its cause."""
    failure = RemoteReadError(f"{url}: cannot be read ({_http_failure(cause)})")
    failure.__cause__ = cause
    return failure


def _failure_behind(exc: FileNotFoundError) -> BaseException | None:
    """The HTTP client's failure behind fsspec's "not found" for a file that is there for all we
    know (its cause: an HTTP 500, a timeout); None for one not there (a 404 or 410, or another
    cause: a zip archive's KeyError for a member it lacks)."""
    cause = exc.__cause__
    if cause is None or not _from_http_client(cause) or getattr(cause, "status", None) in (404, 410):
        return None
    return cause


def _from_http_client(exc: BaseException) -> bool:
    """Whether `exc` is aiohttp's (only once aiohttp is loaded can it be) or a timeout."""
    aiohttp = sys.modules.get("aiohttp")
    return isinstance(exc, TimeoutError) or (aiohttp is not None and isinstance(exc, aiohttp.ClientError))


def _http_failure(exc: BaseException) -> str:
    """Why a request failed: the HTTP status of an error response, else `failure_text`."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return f"HTTP {status} {getattr(exc, 'message', '')}".rstrip()
    return failure_text(exc)


def without_userinfo(url: str) -> str:
    """`url` without the user part (`user:password@`) of each URL in it (a chain's parts are joined
    by "::"): what an output records of an input (doc ids, error records), where a password was
    copied into every row. The query stays: it may be all that tells two inputs apart. Only the
    user part goes: the rest is kept byte for byte, as ids are joined on."""
    if "@" not in url:  # nearly every input: no parse for each of its lines
        return url
    return "::".join(_drop_userinfo(part) for part in url.split("::"))


# The protocols whose URLs carry a user (and password) before the host. Elsewhere what precedes an
# "@" there is a path or a name: a zip or tar member's (zip://a@b.txt::f.zip was read as zip://b.txt,
# and the ids of members a@b.txt and c@b.txt merged), memory://'s, abfs://CONTAINER@ACCOUNT,
# oci://BUCKET@NAMESPACE, github://ORG:REPO@SHA.
_USER_PROTOCOLS = frozenset({"http", "https", "ftp", "sftp", "ssh", "smb", "webhdfs", "hdfs", "arrow_hdfs"})
# HDFS connects as the URL's user (fsspec's webhdfs, Arrow's hdfs): without a password it is an
# identity, no secret, and dropping it made Feast read hdfs://alice@nn/... as the process's user
_IDENTITY_PROTOCOLS = frozenset({"webhdfs", "hdfs", "arrow_hdfs"})


def _drop_userinfo(url: str) -> str:
    protocol, sep, rest = url.partition("://")
    if not sep or protocol.lower() not in _USER_PROTOCOLS:
        return url
    # the host part ends at the first "/", "?" or "#": an "@" after it (a/b@c.txt, ?mail=a@b) is no user's
    host_end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    user, at, host = rest[:host_end].rpartition("@")
    if not at or (protocol.lower() in _IDENTITY_PROTOCOLS and ":" not in user):
        return url
    return f"{protocol}://{host}{rest[host_end:]}"


def failure_text(exc: BaseException) -> str:
    """An exception as the reason a read failed: its type, and its message where it has one. A C
    module's bare `error` is named with its module: a damaged .gz said "error: Error -3 while ..."."""
    name = type(exc).__name__
    if name == "error":
        name = f"{type(exc).__module__}.error"
    return f"{name}: {exc}" if str(exc) else name


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is this machine's file system, where a rename is atomic and cheap."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "file" in protocols or "local" in protocols


def reads_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` reads this machine's files, itself or through the file systems it wraps (a
    cache such as `simplecache::file://`, a folder view such as `dir::`): a device or FIFO can
    then lie behind one of its paths."""
    while fs is not None:
        if is_local(fs):
            return True
        fs = getattr(fs, "fs", None)
    return False


SPECIAL_FILE = "not a regular file (a device, FIFO or socket); refused unread"


def local_special_file(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether `path` of `fs` is one of this machine's devices, FIFOs or sockets (also behind a
    symbolic link, a cache or a folder view): endless, like /dev/zero, or blocking to read."""
    if not reads_local(fs):
        return False
    try:
        kind = fs.info(path)["type"]  # through symbolic links: what a read would open
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a path under a file
        return False
    return kind not in ("file", "directory")


def refuse_special_under_chain(url: str) -> None:
    """Refuses a chained URL whose file systems read from a local device, FIFO or socket (its last
    part: the archive of `zip://a.txt::/dev/zero`), a ValueError naming it. That file is opened as
    soon as the chain's file system is made, before `local_special_file` can look at the member: a
    FIFO there blocked for ever, and /dev/zero as a zip was read until memory ran out."""
    if "::" not in url:
        return
    fs, path = fsspec.core.url_to_fs(url.split("::")[-1])
    if local_special_file(fs, path):
        raise ValueError(f"{url} reads {shown(fs, path)}, which is {SPECIAL_FILE}")


def shown(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """`path` of `fs` as a user writes it: a local path bare, any other with its protocol."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def local_folder(url: str, option: str, why: str) -> str:
    """The local path that `url` (a path or a `file://` URL) names; a URL of another file
    system is refused, naming `option` and `why` it must be local."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        if not path:  # '' or file:// alone: os.makedirs failed later with "[Errno 2] ... ''", naming no option
            raise ValueError(f"{option} {url!r} names no folder; give a local path")
        return path
    raise ValueError(f"{option} {url}: {why}, not a {protocol}:// URL; give a local path")


def local_real_path(url: str) -> str | None:
    """The real path on this machine behind `url` (a plain path, `file://`, or the local end of a
    chain such as `simplecache::file://...`), or None when it lives elsewhere."""
    fs, path = fsspec.core.url_to_fs(url.split("::")[-1])
    return os.path.realpath(path) if is_local(fs) else None


def location_key(url: str) -> str:
    """What `url` names, whatever its spelling: a local path as its real path (`local_real_path`),
    so `m`, `m/`, `./m` and a link to it are one; another file system's as its protocol and path
    without a trailing slash."""
    local = local_real_path(url)
    if local is not None:
        return local
    fs, path = fsspec.core.url_to_fs(url.split("::")[-1])
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{fs._strip_protocol(path).rstrip('/')}"


def resolve_dots(url: str) -> str:
    """`url` with the `.` and `..` components of its path resolved, as this machine resolves a
    local path's: `memory://a/../b` is `memory://b`. fsspec and object stores take them as parts of
    a name, so a model saved to `gs://b/runs/../m` was written under a key `runs/../m`, not at
    `gs://b/m`, where loading it said "file not found". Empty components (`a//b`: another key on
    S3) stay. A local path, a chained URL (`simplecache::...`) or one without such components is
    returned as it is; a `..` above the file system's root, or above an object store's bucket, is
    a ValueError naming the URL. An HTTP URL's query and fragment are not its path: `?file=a/../b`
    stays as it is."""
    protocol, path = fsspec.core.split_protocol(url)
    path, query = split_http_query(protocol, path)
    parts = path.split("/")
    if protocol is None or "::" in url or not {".", ".."} & set(parts):
        return url
    # an object store's bucket (an HTTP host) is no folder to leave: `gs://b/../c` named bucket c
    top = 0 if protocol in ("memory", "file", "local") or path.startswith("/") else 1
    kept: list[str] = []
    for part in parts:
        if part == "..":
            if len(kept) <= top or kept == [""]:
                above = f"{protocol}://{kept[0]}" if top else f"the root of {protocol}://"
                raise ValueError(f"{url}: its '..' goes above {above}")
            kept.pop()
        elif part != ".":
            kept.append(part)
    return f"{protocol}://{'/'.join(kept)}{query}"


def split_http_query(protocol: str | None, path: str) -> tuple[str, str]:
    """(path, query and fragment) of an HTTP URL's `path` after its `protocol://`; elsewhere `?`
    and `#` are characters of a key's name, and the query is empty."""
    if protocol not in ("http", "https"):
        return path, ""
    end = min((i for i in (path.find("?"), path.find("#")) if i >= 0), default=len(path))
    return path[:end], path[end:]


def partial_name(final: str) -> str:
    """`<final>.<random>.partial`: a name of this write's own, so that two runs writing one file at
    once never write into the same temporary file (the last rename wins, whole)."""
    return f"{final}.{secrets.token_hex(4)}.partial"


PARTIAL_SUFFIX = re.compile(r"\.[0-9a-f]{8}\.partial")  # what partial_name adds


def written_for(name: str) -> str:
    """The name a partial file (`partial_name`'s) was being written for; any other name as it is."""
    final, dot, suffix = name.rpartition(".")
    final, dot, token = final.rpartition(".")
    return final if dot and PARTIAL_SUFFIX.fullmatch(f".{token}.{suffix}") else name
