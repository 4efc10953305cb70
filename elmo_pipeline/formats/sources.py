"""A model given as a folder or as an archive of one (.zip, .tar.bz2, .tar.xz, .tar.gz, .tar), local
or at any fsspec URL, read file by file by relative name.

An archive is read from its bytes in memory and never extracted: every member is checked first,
and one absolute name, `..` component, link (symbolic or hard) or special file refuses the whole
archive, as does a member count or a size past the limits below, counted on the bytes actually
read rather than on what the headers declare. The sizes the headers declare are held to them as
well, before anything is inflated (zipfile and tarfile read no more of a member than its header
declares; a tar's headers are read one by one: reaching the next header inflates the data before it).
A compressed tar is read to the end of its stream, where gzip and xz check what they inflated.
"""

from __future__ import annotations

import io
import lzma
import posixpath
import stat
import struct
import tarfile
import zipfile
import zlib

from elmo_pipeline.filesystems import url_to_fs
from elmo_pipeline.formats.files import (MAX_FILE_BYTES, CheckpointError, check_size, join_url, read_bytes,
                                         shown_base_name)

# Released ELMoForManyLangs models are 0.3 to 1 GB in all; the limits leave room and stop a
# decompression bomb long before it fills memory. MAX_FILE_BYTES (imported above, and read from
# this module's namespace): one file, and an archive's own compressed bytes.
MAX_TOTAL_BYTES = 8 << 30  # everything read out of one archive
MAX_MEMBERS = 10_000
ARCHIVE_SUFFIXES = (".zip", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar")


def is_archive(location: str) -> bool:
    return location.lower().endswith(ARCHIVE_SUFFIXES)


def source_name(location: str) -> str:
    """The model's name: the folder's or the archive's, without the archive suffix."""
    base = shown_base_name(location) or "model"
    for suffix in ARCHIVE_SUFFIXES:
        if base.lower().endswith(suffix):
            return base[: -len(suffix)] or "model"
    return base


class ModelSource:
    """Files of a model folder by name relative to the folder (the one holding `anchor`)."""

    def __init__(self, location: str, anchor: str = "config.json") -> None:
        self.location = location
        self.files: dict[str, bytes] | None = None  # an archive's regular files, by normalised name
        self.root = ""
        if is_archive(location) or _is_file(location):  # an archive saved without its suffix too
            self.files = read_archive(location)
            self.root = _root_of(self.files, anchor, location)
        else:
            self.location = model_folder(location, anchor)

    def where(self, name: str) -> str:
        """`name` as messages show it: a path or URL, or `ARCHIVE!member`."""
        if self.files is None:
            return self._url(name)
        return f"{self.location}!{posixpath.join(self.root, name)}"

    def _url(self, name: str) -> str:
        """The folder's file `name`; its `..` resolved in a URL, as the local file system resolves
        it in a path: an object store (or memory://) has keys, not folders, and would look up
        `model/../configs/net.json` as a key of its own."""
        url = join_url(self.location, name)
        if "://" not in url or ".." not in name.split("/"):
            return url
        head, sep, path = url.rpartition("://")
        return f"{head}{sep}{posixpath.normpath(path)}"

    def read(self, name: str, limit: int | None = None, what: str = "a model file") -> bytes | None:
        """The bytes of the file `name` (relative; `..` allowed where it stays inside an archive),
        or None when there is no such file. A file larger than `limit` (MAX_FILE_BYTES by default)
        is refused as `read_bytes` refuses it: a folder's unread, an archive's member (in memory
        already) before it is parsed."""
        limit = MAX_FILE_BYTES if limit is None else limit
        if self.files is not None:
            if posixpath.isabs(name):
                return None
            path = posixpath.normpath(posixpath.join(self.root, name))
            data = None if path.startswith("../") else self.files.get(path)
            if data is not None:
                check_size(self.where(name), len(data), limit, what)
            return data
        try:
            return read_bytes(self._url(name), limit, what)
        except CheckpointError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise


def _is_file(location: str) -> bool:
    fs, path = url_to_fs(location)
    try:
        return bool(fs.isfile(path))
    except OSError:
        return False  # left for the reads to report


def model_folder(location: str, anchor: str = "config.json") -> str:
    """The folder `location`, or the one folder in it that holds `anchor` where it holds none
    itself: the folder an archive was unpacked into, whose model may lie one folder down as it may
    in the archive. Anything unreadable, or empty (not the current folder), is left for the reads
    to report."""
    if not location.strip():
        return location
    fs, path = url_to_fs(location)
    path = path.rstrip("/") or path
    try:
        if not fs.isdir(path) or fs.isfile(f"{path}/{anchor}"):
            return location
        entries = fs.ls(path, detail=True)
        folders = sorted(posixpath.basename(entry["name"].rstrip("/")) for entry in entries
                         if entry["type"] == "directory" and fs.isfile(f"{entry['name'].rstrip('/')}/{anchor}"))
    except OSError:
        return location
    if len(folders) > 1:
        raise CheckpointError(f"{location}: holds no {anchor} but several model folders "
                              f"({', '.join(map(repr, folders))}); give one")
    return join_url(location, folders[0]) if folders else location


def read_archive(location: str) -> dict[str, bytes]:
    """Every regular file of the archive at `location`, by normalised member name."""
    data = read_bytes(location, MAX_FILE_BYTES)
    try:
        # by its suffix, or by its first bytes where a zip has none (or another): a zip's local
        # header or, for an empty one, its end record
        if location.lower().endswith(".zip") or data[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
            return _read_zip(data, location)
        return _read_tar(data, location)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, RuntimeError, ValueError, zlib.error,
            lzma.LZMAError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        why = str(exc).splitlines()[0].rstrip(":") if str(exc) else ""  # tarfile's lists a line per method tried
        raise CheckpointError(f"{location}: not a readable archive (.zip, .tar, .tar.gz, .tar.bz2 or .tar.xz): "
                              f"{type(exc).__name__}{': ' + why if why else ''}") from exc


def _safe_name(name: str, location: str) -> str:
    """The member name normalised, `\\` taken as the separator that zips made on Windows write
    (PowerShell's Compress-Archive, say); absolute names, drive letters and `..` refused."""
    path = name.replace("\\", "/")
    if not path or path.startswith("/") or (len(path) > 1 and path[1] == ":") or "\0" in path:
        raise CheckpointError(f"{location}: member {name!r} has an absolute or unsafe name; archive refused")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise CheckpointError(f"{location}: member {name!r} points outside the archive (..); archive refused")
    return "/".join(parts)


class _Members:
    """The files read out of one archive so far (name -> bytes), against the limits; a name may
    come once."""

    def __init__(self, location: str) -> None:
        self.location, self.total = location, 0
        self.files: dict[str, bytes] = {}

    def add(self, name: str, f: io.BufferedIOBase | None) -> None:
        assert f is not None
        if name in self.files:
            raise CheckpointError(f"{self.location}: member {name!r} appears twice; archive refused")
        with f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise CheckpointError(f"{self.location}: member {name!r} holds more than {MAX_FILE_BYTES:,} bytes; refused")
        self.count(len(data))
        self.files[name] = data

    def count(self, size: int) -> None:
        """`size` more bytes read out of the archive, refused past MAX_TOTAL_BYTES in all."""
        self.total += size
        if self.total > MAX_TOTAL_BYTES:
            raise CheckpointError(f"{self.location}: its files hold more than {MAX_TOTAL_BYTES:,} bytes; refused")


def _check_declared(name: str, size: int, total: int, location: str) -> None:
    """The member `name`'s size as its header declares it, and `total` the members' so far."""
    if size > MAX_FILE_BYTES:
        raise CheckpointError(f"{location}: member {name!r} holds more than {MAX_FILE_BYTES:,} bytes; refused")
    if total > MAX_TOTAL_BYTES:
        raise CheckpointError(f"{location}: its files hold more than {MAX_TOTAL_BYTES:,} bytes; refused")


def _check_count(count: int, location: str) -> None:
    if count > MAX_MEMBERS:
        raise CheckpointError(f"{location}: more than {MAX_MEMBERS:,} members; refused")


# The zip records walked before zipfile builds an object per member (APPNOTE 4.3.12-4.3.16).
_END = struct.Struct("<4s4H2LH")  # signature, disks, entries, central directory size and offset, comment length
_END64_LOCATOR_SIZE = 20
_END64 = struct.Struct("<4sQ2H2L4Q")  # ... entries, central directory size (index 8) and offset
_CENTRAL_HEADER_SIZE = 46  # name, extra and comment lengths at bytes 28, 30, 32


def _count_zip_members(data: bytes, location: str) -> None:
    """Count the central directory's entries as zipfile would find them, stopping past the limit.

    zipfile walks the whole directory (its size, not its declared count) into objects before
    anything can be checked: a directory of millions of 46-byte entries costs gigabytes.
    Whatever this walk cannot make sense of is left for zipfile to refuse."""
    # where zipfile finds the end record: the last 22 bytes when there is no comment, else the
    # last signature within the longest comment's reach
    end = len(data) - _END.size
    if end < 0 or data[end:end + 4] != b"PK\x05\x06" or data[-2:] != b"\0\0":
        end = data.rfind(b"PK\x05\x06", max(0, len(data) - _END.size - 0xFFFF))
        if end < 0 or end + _END.size > len(data):
            return
    size = _END.unpack_from(data, end)[5]
    top = end  # the directory ends where the end records begin
    end64 = end - _END64_LOCATOR_SIZE - _END64.size
    if end64 >= 0 and data[end - _END64_LOCATOR_SIZE:end - _END64_LOCATOR_SIZE + 4] == b"PK\x06\x07" \
            and data[end64:end64 + 4] == b"PK\x06\x06":
        size, top = _END64.unpack_from(data, end64)[8], end64
    position, count = top - size, 0
    while 0 <= position <= top - _CENTRAL_HEADER_SIZE and data[position:position + 4] == b"PK\x01\x02":
        count += 1
        _check_count(count, location)
        position += _CENTRAL_HEADER_SIZE + sum(struct.unpack_from("<3H", data, position + 28))


def _read_zip(data: bytes, location: str) -> dict[str, bytes]:
    read = _Members(location)
    _count_zip_members(data, location)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
        _check_count(len(infos), location)
        declared = 0
        for info in infos:
            name = _safe_name(info.filename, location)
            declared += info.file_size
            _check_declared(name, info.file_size, declared, location)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise CheckpointError(f"{location}: member {info.filename!r} is a symbolic link; archive refused")
            # zipfile.writestr and some tools store permission bits without a file type: a plain file
            if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(f"{location}: member {info.filename!r} is not a regular file; archive refused")
        for info in infos:
            if not info.is_dir():
                read.add(_safe_name(info.filename, location), archive.open(info))
    return read.files


def _read_tar(data: bytes, location: str) -> dict[str, bytes]:
    read = _Members(location)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        members, declared = [], 0
        # header by header, stopping at the limits (getmembers() would first read them all)
        for member in archive:
            members.append(member)
            _check_count(len(members), location)
            name = _safe_name(member.name, location)
            if member.issym() or member.islnk():
                raise CheckpointError(f"{location}: member {member.name!r} is a link; archive refused")
            if not (member.isfile() or member.isdir()):
                raise CheckpointError(f"{location}: member {member.name!r} is not a regular file; archive refused")
            declared += member.size
            _check_declared(name, member.size, declared, location)
        for member in members:
            if member.isfile():
                read.add(_safe_name(member.name, location), archive.extractfile(member))
        _read_to_the_end(archive, read)
    return read.files


def _read_to_the_end(archive: tarfile.TarFile, read: _Members) -> None:
    """Inflates what follows the last member, to the end of the stream: gzip's CRC-32 and xz's
    check are verified only there, and tarfile stops at the end-of-archive blocks before it, so a
    .tar.gz with a flipped bit would load its wrong bytes. What is inflated counts as read."""
    assert archive.fileobj is not None
    while chunk := archive.fileobj.read(1 << 20):
        read.count(len(chunk))


def _root_of(files: dict[str, bytes], anchor: str, location: str) -> str:
    """The folder inside the archive that holds `anchor`: the archive's top or one folder in it."""
    folders = sorted(posixpath.dirname(name) for name in files if posixpath.basename(name) == anchor)
    if not folders:
        raise CheckpointError(f"{location}: the archive holds no {anchor}")
    if len(folders) > 1:
        raise CheckpointError(f"{location}: the archive holds several model folders ({', '.join(repr(f) for f in folders)}); "
                              "give an archive of one model")
    return folders[0]
