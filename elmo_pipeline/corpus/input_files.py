"""Finding and opening input files on any fsspec filesystem: globs to URLs, compression by
extension (else by the file's first bytes), and the readers fsspec gets wrong (zip archives; zstd,
bz2 and xz streams) written here.

Everything a broken, truncated or vanished file can raise while it is read is in READ_ERRORS,
so that a reader turns it into an ErrorRecord for that file rather than failing the job.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import fnmatch
import io
import lzma
import os
import posixpath
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import fsspec
import fsspec.compression
import pyarrow as pa
import zstandard
from fsspec.caching import BaseCache
from fsspec.spec import AbstractBufferedFile
from fsspec.utils import infer_compression

from elmo_pipeline.filesystems import (SPECIAL_FILE, failure_under_chain, is_local, local_special_file, open_url,
                                       refuse_special_under_chain, remote_failures_named, resolve_dots, url_to_fs)

# bytes read at a time: compressed input (_StreamsReader), newline counts (byte_ranges.range_newlines),
# a file read whole (readers._read_at_most)
READ_CHUNK_BYTES = 8 * 2**20
# compressed bytes given to a decompressor at once. zstd returns all their output in one piece
# (zstandard has no max_length), and a block of one repeated byte turns 4 bytes into 128 KiB:
# this bounds that piece at 64 MiB (a few KiB of ordinary text), where 8 MiB of compressed input
# held the whole text of a highly compressible file in memory at once.
STEP_BYTES = 2 * 2**10
# What a broken, truncated or vanished file raises while it is read and decompressed.
READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error, zstandard.ZstdError, zipfile.BadZipFile,
                pa.ArrowException)


class InputError(ValueError):
    """The input cannot be read at all (bad pattern or options); raised before any work starts."""


def expand_patterns(patterns: Sequence[str]) -> list[str]:
    """The URLs of the files matched by fsspec glob `patterns`, sorted per pattern, without duplicates.

    A pattern that names an existing file is that file, glob characters (`[`, `*`, `?`) and all;
    a symbolic link to a file is a file (a glob's `**` does not descend into linked folders).
    Raises InputError naming the first pattern that matches no file (directories do not count),
    and a file name that is not UTF-8, which Beam cannot carry. Local files are returned as
    normalised absolute paths (`a/../b`, `a//b` and `a/./b` are `b`, `a/b`, `a/b`: one file, one
    set of document ids), others as "protocol://path" (`.` and `..` resolved: `resolve_dots`).
    """
    if isinstance(patterns, (str, os.PathLike)):  # a lone pattern, not a sequence of one-character patterns
        patterns = [patterns]
    if not patterns:  # a job over no input would succeed with nothing written
        raise InputError("no input pattern given")
    urls: dict[str, None] = {}  # ordered set
    for pattern in patterns:
        if not isinstance(pattern, (str, os.PathLike)):  # 5 failed in resolve_dots: "'int' is not iterable"
            raise TypeError(f"an input pattern is a str or a path, got {type(pattern).__name__} ({pattern!r:.80})")
        if os.fspath(pattern) == "":  # an unset variable: '' was the current folder, "give its files, e.g. '/*'"
            raise InputError(f"input pattern {pattern!r} is empty: give a file, a glob or a URL")
        try:
            refuse_special_under_chain(os.fspath(pattern))  # before the chain's file system opens it
            # local paths are normalised below, as globbed; a URL's `..` is a name to fsspec
            with remote_failures_named(os.fspath(pattern)):  # an HTTP 500 was aiohttp's traceback
                fs, path = url_to_fs(resolve_dots(pattern))
                files, hidden = _files_named(fs, path)
                folder = not files and fs.isdir(path)
                special = not files and not folder and local_special_file(fs, path)
        except (ImportError, ValueError, OSError) as e:
            raise InputError(f"cannot list input pattern {pattern!r}: {e}") from e
        if special:  # "matches no files" would send the user looking for a typo
            raise InputError(f"input {pattern!r}: {SPECIAL_FILE}")
        if not files:
            if "::" in pattern and os.path.lexists(pattern):  # read as a chain, the file went unseen
                raise InputError(f"input pattern {pattern!r} names a local file: {CHAIN_IN_NAME}")
            if hidden:  # "matches no files" where `ls` shows them
                raise InputError(f"input pattern {pattern!r} matches only hidden files ({hidden[0]!r}: a name on "
                                 "its path starts with '.', which a wildcard does not match, as in a shell); write "
                                 "the dot in the pattern ('data/.*') to read them")
            if not folder:
                failure = failure_under_chain(os.fspath(pattern))  # a cache's "no file" for a server's error
                if failure is not None:
                    raise InputError(f"cannot list input pattern {pattern!r}: {failure}") from failure
                raise InputError(f"input pattern {pattern!r} matches no files")
            raise InputError(f"input pattern {pattern!r} is a folder; give its files, e.g. "
                             f"{pattern.rstrip('/') + '/*'!r}, or {pattern.rstrip('/') + '/**'!r} for every depth")
        for name in files:
            url = os.path.normpath(name) if is_local(fs) else in_chain(pattern, fs.unstrip_protocol(name))
            if is_local(fs) and "::" in url:
                raise InputError(f"input pattern {pattern!r} matches {url!r}: {CHAIN_IN_NAME}")
            try:
                url.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(f"input pattern {pattern!r} matches {os.fsencode(url)!r}, a file name that is not "
                                 "UTF-8, which Beam cannot carry; rename the file") from None
            urls[url] = None
    return list(urls)


def in_chain(pattern: str, url: str) -> str:
    """`url`, a file that the chained `pattern`'s glob found, put in the place of the pattern's
    path within its chain of file systems: `simplecache::s3://b/*.txt` gives
    `simplecache::s3://b/a.txt`, `zip://*.txt::data.zip` gives `zip://a.txt::data.zip`. The file
    is then read through them; `s3://b/a.txt` bypassed the cache, and `zip://a.txt` named no
    archive. A pattern that is no chain gives `url` as it is."""
    if "::" not in pattern:
        return url
    parts = pattern.split("::")
    parts[_path_part(parts)] = url
    return "::".join(parts)


def _path_part(parts: list[str]) -> int:
    """Which of a chained URL's parts (split at "::") holds the file's path: the first that is
    more than a file system's name (`simplecache`, `filecache://`), a cache taking the path of
    the file system after it, as fsspec reads a chain."""
    for i, part in enumerate(parts):
        _, separator, path = part.partition("://")
        if path if separator else part not in fsspec.available_protocols():
            return i
    return len(parts) - 1


# why a local file whose name holds "::" cannot be read: fsspec's URLs chain file systems there
CHAIN_IN_NAME = ("its name holds '::', which fsspec reads as a chain of file systems (simplecache::s3://...); "
                 "rename the file")


def _files_named(fs: fsspec.AbstractFileSystem, path: str) -> tuple[list[str], list[str]]:
    """(files, hidden): the sorted files that `path` names on `fs`, itself when it is a file, else
    its glob's files but those a wildcard matched only through a hidden name (`hidden_by_wildcard`),
    which are `hidden`."""
    if fs.isfile(path):
        return [path], []
    matches = fs.glob(path, detail=True)
    # fsspec's local glob calls a symbolic link "other", whatever it points to
    found = sorted(name for name, info in matches.items()
                   if info.get("type") == "file" or (info.get("islink") and fs.isfile(name)))
    hidden = [name for name in found if hidden_by_wildcard(path, name)]
    skipped = set(hidden)
    return [name for name in found if name not in skipped], hidden


def hidden_by_wildcard(pattern: str, name: str) -> bool:
    """Whether fsspec's glob `pattern` matched the path `name` only by letting a wildcard (`*`,
    `?`, `[...]`, `**`) match a file or folder name that starts with a dot: `data/*` matched
    `data/.DS_Store`, `data/**` every file under `data/.git/`. A shell and Python's glob skip such
    names unless the pattern's own component starts with a dot (`data/.*`), and so does this."""
    if not name.startswith(".") and "/." not in name:  # nearly every path: matching them all doubled a glob's time
        return False
    parts, names = pattern.split("/"), name.split("/")
    return _components_match(parts, names, hidden=True) and not _components_match(parts, names, hidden=False)


def _components_match(parts: list[str], names: list[str], hidden: bool) -> bool:
    """Whether the path components `names` match the glob components `parts` (fnmatch's rules in
    each, as fsspec's glob; `**` for any number of components), a name starting with a dot only
    where `hidden` or the pattern's component starts with a dot too."""
    if not parts:
        return not names
    part, rest = parts[0], parts[1:]
    if part == "**":
        shown = len(names) if hidden else next((i for i, n in enumerate(names) if n.startswith(".")), len(names))
        return any(_components_match(rest, names[i:], hidden) for i in range(shown + 1))
    if not names or not fnmatch.fnmatchcase(names[0], part):
        return False
    shown = hidden or part.startswith(".") or not names[0].startswith(".")
    return shown and _components_match(rest, names[1:], hidden)


def check_inputs_outside(inputs: Sequence[str], removed: Sequence[str], output: str) -> None:
    """Raises InputError for an input file that is one of the paths `removed` (as the output
    folder's filesystem lists them) or lies inside one: a file of an earlier run in `output`,
    which --overwrite deletes and the run writes anew."""
    doomed = {entry.rstrip("/") for entry in removed}
    for url in inputs:
        path = fsspec.core.url_to_fs(url)[1].rstrip("/")
        while path and path not in doomed and posixpath.dirname(path) != path:
            path = posixpath.dirname(path)
        if path in doomed:
            raise InputError(f"input {url} is output of an earlier run in {output}, which --overwrite deletes and "
                             "the run writes anew; read it from a copy elsewhere")


def compression_of(url: str) -> str | None:
    """The compression implied by the file name (fsspec's inference), e.g. "gzip", "zstd" or None;
    in a chain, the name of the file read, not of the archive it is in (`zip://a.txt::data.zip`)."""
    if "::" in url:
        parts = url.split("::")
        url = parts[_path_part(parts)]
    # also where an older fsspec does not know zstd; any case, as fsspec matches the others
    if url.lower().endswith((".zst", ".zstd")):
        return "zstd"
    return infer_compression(url)


# The first bytes of each compressed format, for files whose name says none (a gzip file named
# `x.txt` was read as text: error records for invalid UTF-8 and junk documents). Those of gzip, xz
# and zstd are not UTF-8; those of bz2 (with its block or end-of-stream marker), zip and lz4 hold
# control characters no text starts with.
_MAGIC = ((b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"),
          (b"\x04\x22\x4d\x18", "lz4"), (b"\x1f\x8b", "gzip"))
_BZ2_MAGIC = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)")  # a block, or the end of an empty stream
_MAGIC_BYTES = 10


def _compression_in(head: bytes) -> str | None:
    """The compression whose magic bytes start `head` (a file's first 10 bytes), e.g. "gzip"; None."""
    if _BZ2_MAGIC.match(head):
        return "bz2"
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def content_compression(url: str) -> str | None:
    """The compression `open_input` reads `url` with: its name's, else the one its first bytes show."""
    return compression_of(url) or magic_compression(url)


def magic_compression(url: str) -> str | None:
    """The compression that the first bytes of the file `url` show, whatever its name says."""
    # the file system inside too: a chain's (zip://a.txt::https://...) opens its archive when made
    with remote_failures_named(url):
        fs, path = url_to_fs(url)
        # blocks of that size: an object store's file fetches a whole block at its first read (5 MiB
        # on S3 or HTTP), which planning a split file would download to look at 10 bytes
        with fs.open(path, "rb", block_size=_MAGIC_BYTES) as f:
            return _compression_in(f.read(_MAGIC_BYTES))


def open_input(url: str, sniff: bool = True, end: int | None = None) -> contextlib.AbstractContextManager[BinaryIO]:
    """The file at `url` opened for binary reading, decompressed according to its extension, or,
    when its name implies none and `sniff`, to its first bytes (`_compression_in`). A format seen
    there that cannot be decompressed here (lz4 without its package) raises OSError naming it.
    `sniff=False` is for a byte range after a file's first, planned once the file's first bytes
    showed no compression: reading them again would cost an object store a request per range.
    `end`: where the caller stops reading but for the line that crosses it (a byte range's end),
    so that an object store's file fetches little past it (`_Fetches`)."""
    if "::" in url and os.path.lexists(url):  # fsspec would open another file, named before the "::"
        raise FileNotFoundError(errno.ENOENT, CHAIN_IN_NAME, url)
    compression = compression_of(url)
    if compression is not None:
        _check_not_empty(url, compression)
    return _open_decompressed(url, compression, sniff, end)


@contextlib.contextmanager
def _open_decompressed(url: str, compression: str | None, sniff: bool, end: int | None) -> Iterator[BinaryIO]:
    with open_url(url) as opened:  # a server's failure, also while the caller reads, names the URL and why
        raw = _read_in_order(opened, end)
        if compression is None and sniff:
            head = raw.read(_MAGIC_BYTES)
            compression = _compression_in(head)
            try:
                raw.seek(0)
            except (ValueError, OSError):  # a stream: fsspec's streamed HTTP file says it can seek, then refuses
                raw = io.BufferedReader(_Prefixed(head, raw))
        if compression is None:
            yield raw
        elif compression in _STREAM_FORMATS:
            yield io.BufferedReader(_StreamsReader(raw, compression), buffer_size=2**20)
        elif compression == "zip":
            with _zip_member(raw) as member:
                yield member
        elif compression in fsspec.compression.compr:  # gzip, and lz4 where its package is installed
            with fsspec.compression.compr[compression](raw, mode="rb") as f:
                yield f
        else:
            raise OSError(f"the file holds {compression}-compressed data (its first bytes say so, its name does not), "
                          "which cannot be decompressed here: decompress it first")


# fsspec's in-memory caches that fetch a block past each read they miss and keep the last fetch
# only. Under fsspec's readline (a block read, then a seek back to the line's end) a 5 MiB
# read-ahead cache fetched 2.5 times a file read whole, and a file's 4 MiB ranges with their
# newline counts 5.4 times the file (114 MB for 21 MB).
_READ_AHEAD_CACHES = ("readahead", "bytes", "adaptive", "background")
# what a read past a range's `end` fetches at least: the rest of the last line, most often short
_PAST_END_BYTES = 64 * 2**10


def _read_in_order(f: BinaryIO, end: int | None) -> BinaryIO:
    """`f` as read here: an object store's file (fsspec's AbstractBufferedFile: S3, GCS, HTTP)
    loses its read-ahead cache and is read through a buffer of its block size (8 MiB at most),
    which, read in order, fetches each byte once and little past `end` (`_Fetches`). A local file
    (a cache's copy included) is returned as it is: the OS buffers it. A cache that keeps what it
    fetched (blockcache's file on disk) stays."""
    if not isinstance(f, AbstractBufferedFile):
        return f
    if getattr(f.cache, "name", None) in _READ_AHEAD_CACHES:
        # fsspec's "none" cache: fetches what is read (fsspec's blockcache sets its own cache so)
        f.cache = BaseCache(f.blocksize, f._fetch_range, f.size)
    return io.BufferedReader(_Fetches(f, end), buffer_size=min(f.blocksize or READ_CHUNK_BYTES, READ_CHUNK_BYTES))


class _Fetches(io.RawIOBase):
    """Reads of the file `f` that ask it for a buffer's worth, but not past `end` while before it,
    and past it no more than has been read past it (64 KiB at least): the rest of a range's last
    line costs a few small fetches, a long one twice its length at most, not a block."""

    def __init__(self, f: BinaryIO, end: int | None) -> None:
        super().__init__()
        self._f, self._end = f, end

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._f.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        self._f.seek(offset, whence)
        return self._f.tell()  # fsspec's streamed HTTP file's seek returns None

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer) -> int:
        size = len(buffer)
        if self._end is not None:
            position = self._f.tell()
            past = position - self._end
            size = min(size, -past if past < 0 else max(_PAST_END_BYTES, past))
        data = self._f.read(size)
        buffer[:len(data)] = data
        return len(data)


class _Prefixed(io.RawIOBase):
    """The bytes `head`, already read from the stream `raw`, then the rest of `raw`."""

    def __init__(self, head: bytes, raw: BinaryIO) -> None:
        super().__init__()
        self._head, self._raw = memoryview(head), raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._head[:len(buffer)] if self._head else self._raw.read(len(buffer))
        self._head = self._head[len(data):]
        buffer[:len(data)] = data
        return len(data)


def _check_not_empty(url: str, compression: str) -> None:
    """A compressed file of no bytes is cut short (compressing nothing still writes a header):
    gzip and zstd readers give no line and no error for it, as if the file held no text."""
    with remote_failures_named(url):  # making the file system reads a chain's archive (magic_compression)
        fs, path = url_to_fs(url)
        size = fs.info(path).get("size")
    if size == 0:
        raise EOFError(f"an empty file is not a valid {compression} file (compressing nothing still writes a "
                       "header): cut short?")


@contextlib.contextmanager
def _zip_member(raw: BinaryIO) -> Iterator[BinaryIO]:
    # fsspec's zip reader opens the archive's first member and ignores the rest (and fails with
    # IndexError on an empty archive): anything but one file is refused, so nothing is dropped.
    with zipfile.ZipFile(raw) as archive:
        names = [info.filename for info in archive.infolist() if not info.is_dir()]
        if len(names) != 1:
            raise zipfile.BadZipFile(f"a zip input must hold exactly one file, this one holds {len(names)}")
        try:
            member = archive.open(names[0])
        except (NotImplementedError, RuntimeError) as e:  # a method zipfile lacks (Deflate64), a password
            raise zipfile.BadZipFile(f"{names[0]} cannot be read: {e}") from e
        with member:
            yield member


# the compressions `_StreamsReader` reads (fsspec's names)
_STREAM_FORMATS = ("zstd", "bz2", "xz", "lzma")


class _StreamsReader(io.RawIOBase):
    """Decompresses a sequence of compressed streams (zstd frames, bz2 or xz streams); raises
    EOFError when the last one is incomplete, and the decompressor's error for bytes after a
    stream that do not start another.

    Not fsspec's readers: its zstandard fallback stops silently after the first frame, returns
    nothing for a truncated file and cannot iterate lines; Python's bz2 and lzma readers stop
    silently at bytes after a stream that do not start another (a damaged second member, a text
    appended)."""

    def __init__(self, raw: BinaryIO, compression: str) -> None:
        super().__init__()
        self._raw, self._name = raw, compression
        # a new decompressor for each stream (each member of `cat a.xz b.xz`); lzma's finds the
        # format, xz or lzma, in each stream's header
        self._new_stream: Callable[[], Any] = {
            "zstd": zstandard.ZstdDecompressor().decompressobj, "bz2": bz2.BZ2Decompressor,
        }.get(compression, lzma.LZMADecompressor)
        # NUL bytes after a stream are padding (xz's stream padding; bzip2 and gzip skip them too);
        # zstd has none
        self._padded = compression != "zstd"
        self._stream = None  # decompressor of the current stream
        self._unused = b""  # compressed bytes of the last step after the end of its stream
        self._pending = memoryview(b"")  # compressed bytes read and not yet decompressed
        self._out = memoryview(b"")  # decompressed bytes not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            step = self._next_step()
            if not step:
                if self._stream is not None and not self._stream.eof:
                    raise EOFError(f"{self._name} file ended before the end of its last "
                                   f"{'frame' if self._name == 'zstd' else 'stream'}")
                return 0
            if self._stream is None or self._stream.eof:
                if self._padded and self._stream is not None:
                    step = bytes(step).lstrip(b"\0")
                    if not step:
                        continue
                self._stream = self._new_stream()
            self._out = memoryview(self._stream.decompress(step))
            if self._stream.eof:
                self._unused = self._stream.unused_data
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _next_step(self) -> bytes | memoryview:
        """The next compressed bytes to decompress, at most STEP_BYTES; empty at the end of the file."""
        if self._unused:
            step, self._unused = self._unused, b""
            return step
        if not self._pending:
            self._pending = memoryview(self._raw.read(READ_CHUNK_BYTES))
        step, self._pending = self._pending[:STEP_BYTES], self._pending[STEP_BYTES:]
        return step
