"""Where weights live and how their bytes are read: paths or fsspec URLs, never unpickled."""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from importlib import resources

from elmo_pipeline.filesystems import (SPECIAL_FILE, RemoteReadError, failure_text, local_special_file, open_url,
                                      reads_local, remote_failures_named, resolve_dots, split_http_query, url_to_fs,
                                      without_userinfo)

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
# The most a model's config (config.json, options.json, a network config) may hold: they are about
# 1 KB, and parsed JSON takes some 15 times its bytes (a 139 MB config.json, 15 million cutoffs,
# took 1.9 GB and 17 s to be refused); 1 MiB leaves room for a thousand filters or cutoffs.
MAX_CONFIG_BYTES = 1 << 20


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
        # a server's failure is named (an HTTP 500 was "file not found"), its silence timed out;
        # a chain's file system opens its archive when made, before the file is opened
        with remote_failures_named(url):
            size = _local_size(url, limit, what)
        with open_url(url) as f:
            declared = getattr(f, "size", None)
            if size is None and isinstance(declared, int) and declared > limit:
                # a remote file read for its size only to be refused: 4 GiB fetched into memory
                raise CheckpointError(f"{url}: its {declared:,} bytes are more than the {limit:,} bytes {what} "
                                      "may have; refused unread")
            # a local read asks for what the file holds: read(n) reserves n bytes before reading
            data = f.read(limit + 1 if size is None else size + 1)
    except (CheckpointError, ImportError):  # ours, and fsspec's "install aiohttp" as it is
        raise
    except RemoteReadError as exc:
        raise CheckpointError(str(exc)) from exc.__cause__
    except FileNotFoundError as exc:
        raise CheckpointError(f"{url}: file not found") from exc
    except (IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        raise CheckpointError(f"{url}: cannot be read ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - a remote file system's own errors are no OSError
        # (aiohttp's ClientPayloadError for a transfer cut short was a traceback)
        raise CheckpointError(f"{url}: cannot be read ({failure_text(exc)})") from exc
    check_size(url, len(data), limit, what)
    return data


def check_size(where: str, size: int, limit: int, what: str = "a model file") -> None:
    """Refuses a file of `size` bytes past `limit`, naming it `where` and its kind `what`: the one
    wording of `read_bytes`' refusal, for bytes read otherwise too (an archive's members)."""
    if size > limit:
        raise CheckpointError(f"{where}: larger than the {limit:,} bytes {what} may have; refused")


def _local_size(url: str, limit: int, what: str) -> int | None:
    """The size of the local regular file `url` (also behind a cache or folder view of the local
    file system), refused past `limit` or when it is a special file; None for a folder (opening
    it raises IsADirectoryError, reported by `read_bytes`) and for other file systems' URLs."""
    fs, path = url_to_fs(url)
    if local_special_file(fs, path):
        raise CheckpointError(f"{url}: {SPECIAL_FILE}")
    if not reads_local(fs):
        return None
    info = fs.info(path)
    if info["type"] == "directory":
        return None
    check_size(url, info["size"], limit, what)
    return info["size"]


DEFAULT_MODEL_NAME = "embedded default"  # what outputs record as the location of the default model


def model_shown(location: str | None) -> str:
    """The model location as outputs record it (every Parquet file's metadata, report.json): as
    given, each URL in it without its user part, query and fragment, or DEFAULT_MODEL_NAME for none.
    Those hold what opens a model, not what names it (a password, an access token, a signed URL's
    signature), and every file written would carry it; the model's sha256 tells models apart."""
    if not location:
        return DEFAULT_MODEL_NAME
    # Split only where `load` splits, at the original's OPTIONS.json,WEIGHTS pair: a folder URL's
    # query may hold a comma (?sig=a,b), and a split there kept what followed it. A chained URL's
    # parts are joined by "::".
    return ",".join("::".join(_without_secrets(part) if "://" in part else part for part in piece.split("::"))
                    for piece in allennlp_pair(location) or (location,))


def shown_base_name(location: str) -> str:
    """The last part of `location`'s path: a model is named by its file or folder (import-allennlp,
    import-formanylangs), and an HTTP URL's query (a token) was taken into the name that
    config.json and every later output record. Elsewhere `?` and `#` are characters of the name
    (`split_http_query`): file:///m/zh#2 is zh#2, as the path zh#2 is. Empty for none."""
    last = without_userinfo(location).split("::")[-1]  # a chain's last part: its file or archive
    protocol, sep, rest = last.partition("://")
    path = split_http_query(protocol, rest)[0] if sep else last
    return posixpath.basename(path.rstrip("/\\"))


def allennlp_pair(location: str | None) -> tuple[str, str] | None:
    """(options, weights) when `location` is `OPTIONS.json,WEIGHTS.hdf5`."""
    if location and "," in location and location.split(",")[0].endswith(".json"):
        options, weights = location.split(",", 1)
        return options, weights
    return None


def _without_secrets(url: str) -> str:
    parts = urllib.parse.urlsplit(without_userinfo(url))
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


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
