"""Our format: a folder (or URL) with `config.json`, `model.safetensors`, when the model has a
word encoder or a softmax `vocab.json`, and when its config has `char_dictionary` `chars.json`.

config.json records the sha256 of model.safetensors (`weights_sha256`); a weights file that does
not match it is refused, so a tampered, swapped or half-replaced file fails by name before use.
Nothing here knows the model class: it is handed in, as a `from_pretrained` mixin does.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import posixpath
import secrets
import shutil
import time
from typing import Any, Iterator, NamedTuple, Sequence, TypeVar

import fsspec
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import nn

from elmo_pipeline.filesystems import is_local, local_real_path, resolve_dots
from elmo_pipeline.formats.atomic import (check_no_file_in_the_way, check_output_folder, fsync_dir, fsync_folder,
                                          write_bytes_atomically)
from elmo_pipeline.formats.files import (CHARS_FILE, CHECKPOINT_NAME, CHECKPOINTS_DIR, CONFIG_FILE, MAX_CONFIG_BYTES,
                                         RUN_BEST_DIR, RUN_FILE, RUN_MODEL_DIR, VOCAB_FILE, WEIGHTS_FILE,
                                         CheckpointError, absolute_local, default_model_location, join_url, read_bytes)
from elmo_pipeline.formats.shapes import check_config_against_shapes, load_state
from elmo_pipeline.model.config import WEIGHTS_SHA256_KEY, ElmoConfig, weights_sha256
from elmo_pipeline.strict import ConfigError, check_json_items, dumps_strict, parse_json_strict
from elmo_pipeline.model.vocabulary import CharVocabulary, Vocabulary

M = TypeVar("M", bound=nn.Module)


def save_pretrained(model: nn.Module, directory: str) -> list[str]:
    """Write model.safetensors (and vocab.json), then config.json with the weights' sha256; the
    names written, in order.

    Each file is written under a temporary name and moved into place, so a final name only ever
    holds a whole file; config.json comes last. On a failed write the temporary file is removed
    and an OSError names the file. A `directory` that is, or lies under, an existing file is a
    ValueError naming that file (it was Python's FileExistsError or NotADirectoryError).
    """
    # "" or "file://" (an unset variable, say) wrote into the current folder; "memory://" is a root
    if is_local(fsspec.core.url_to_fs(directory)[0]) and not fsspec.core.split_protocol(directory)[1]:
        raise ValueError(f"save_pretrained: {directory!r} names no folder; give a folder or URL")
    # `x/../m` made a folder x beside m; `memory://x/../m` wrote keys under "x/../m", not at m
    directory = absolute_local(directory)
    check_no_file_in_the_way(directory, "save_pretrained:")
    fs, root = fsspec.core.url_to_fs(directory)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    weights = save_safetensors_bytes(tensors)
    config = {**model.config.to_dict(), WEIGHTS_SHA256_KEY: hashlib.sha256(weights).hexdigest()}
    files = {WEIGHTS_FILE: weights}
    if model.vocab is not None:
        files[VOCAB_FILE] = model.vocab.to_json().encode()
    if getattr(model, "chars", None) is not None:
        files[CHARS_FILE] = model.chars.to_json().encode()
    files[CONFIG_FILE] = dumps_strict(config, CONFIG_FILE, indent=2, sort_keys=True).encode()
    fs.makedirs(root, exist_ok=True)  # once every file's bytes are made: a file that cannot be leaves no folder
    with _folder_locked(directory):
        for name, data in files.items():
            write_bytes_atomically(fs, root.rstrip("/") + "/" + name, data)
    return list(files)


# How long a load waits for a save into its folder to end. Bounded: this process may hold the
# folder itself; past it the load reads anyway, and the weights checksum refuses a mixed folder.
SAVE_WAIT_S = 60.0


@contextlib.contextmanager
def _folder_locked(directory: str, shared: bool = False) -> Iterator[bool]:
    """A flock on the local model folder `directory`: exclusive while a save writes its files,
    shared while a load reads them. Two saves into one folder at once (threads or processes) take
    turns, and a load waits for a save to end: their renames interleaved, leaving one model's
    config.json beside the other's weights (a folder that no longer loads), and a load in the
    middle of a save read the new weights with the old config. Other file systems, and folders
    that cannot be opened or locked, go unlocked. Yields whether the folder was locked."""
    fd = None
    try:
        fs, root = fsspec.core.url_to_fs(directory)
        if directory.strip() and is_local(fs):
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            if shared:
                _lock_shared(fd)
            else:
                fcntl.flock(fd, fcntl.LOCK_EX)
    except (OSError, ValueError, ImportError):  # left for the reads and writes to report
        pass
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # drops the lock


def _lock_shared(fd: int) -> None:
    deadline = time.monotonic() + SAVE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def check_model_destination(directory: str, overwrite: bool = False, reads: Sequence[str] = ()) -> None:
    """Refuses what `publish_pretrained` would refuse, so that a command can say so before its work;
    and a folder that is, or holds, one of the local files or folders the command `reads`, which
    replacing it would delete."""
    check_output_folder(directory)
    fs, root = fsspec.core.url_to_fs(absolute_local(directory))  # as publish_pretrained writes it
    if fs.exists(root) and fs.ls(root):
        if not overwrite:
            raise ValueError(f"{directory} is not empty; give a new folder, or --overwrite to replace a model folder")
        if not fs.exists(root.rstrip("/") + "/" + CONFIG_FILE):
            raise ValueError(f"{directory} holds files but no {CONFIG_FILE}: not a model folder, so not replaced")
        if is_local(fs):
            _check_sources_outside(directory, reads)


def _check_sources_outside(directory: str, reads: Sequence[str]) -> None:
    folder = local_real_path(directory)
    for source in reads:
        path = local_real_path(source)
        if folder is not None and path is not None and (path == folder or path.startswith(folder + os.sep)):
            raise ValueError(f"{directory} holds {source}, which this command reads: replacing the folder would "
                             "delete it; give another --output")


def _new_hidden_folder(parent: str, name: str) -> str:
    """A new folder `.<name>.<random>.partial` in `parent`, made as a plain mkdir makes one (the
    umask's mode: mkdtemp's 0700 would leave the published model unreadable to other users, such
    as the workers of a cluster)."""
    while True:
        path = os.path.join(parent, f".{name}.{secrets.token_hex(8)}.partial")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


@contextlib.contextmanager
def _put_back_if_stopped(root: str) -> Iterator[None]:
    """The files of the local model folder `root`, hard-linked into a hidden folder of it while a
    save replaces them in place, and put back if the save fails or Ctrl-C or SIGTERM ends it: one
    stopped between its new model.safetensors and config.json left a folder of neither model
    (refused by its checksum). SIGKILL leaves the hidden folder, which the next save removes."""
    kept = _new_hidden_folder(root, "earlier-model")
    names = [name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name))]
    for name in names:
        try:
            os.link(os.path.join(root, name), os.path.join(kept, name))
        except OSError:  # a file system without hard links
            shutil.copy2(os.path.join(root, name), os.path.join(kept, name))
    try:
        yield
    except BaseException:
        for name in os.listdir(root):  # the save's files, then the earlier ones back in their place
            if name not in names and os.path.isfile(os.path.join(root, name)):
                os.remove(os.path.join(root, name))
        for name in names:
            os.replace(os.path.join(kept, name), os.path.join(root, name))
        fsync_dir(root)
        raise
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def publish_pretrained(model: nn.Module, directory: str, overwrite: bool = False) -> None:
    """`save_pretrained` into a folder that must be new or empty, or with `overwrite` a model folder
    (one with config.json), which is then replaced whole.

    A new local folder appears whole or not at all: it is written in a hidden folder of its own
    beside it (a name no one else uses, so nothing of the user's there is touched) and renamed.
    An existing folder is written in place, so that a mount point or a folder with its own mode and
    group stays what it is: each file appears whole, config.json last (until it does, the old
    config's weights checksum refuses the new weights), and then whatever else the folder held goes;
    a save that fails or is stopped by Ctrl-C or SIGTERM puts the earlier files back."""
    check_model_destination(directory, overwrite)
    # `new/../m` is `m` (its rename failed while `new` did not exist), `memory://x/../m` too
    fs, root = fsspec.core.url_to_fs(absolute_local(directory))
    root = root.rstrip("/") or root
    local = is_local(fs)
    if local and not fs.exists(root):
        parent = os.path.dirname(os.path.abspath(root))
        staging = None
        try:  # the folders made first fail too where nothing may be written (read-only, /proc)
            os.makedirs(parent, exist_ok=True)
            staging = _new_hidden_folder(parent, os.path.basename(root))
            save_pretrained(model, staging)
            fsync_folder(staging)
            os.rename(staging, root)  # fails, leaving the other, if a folder with files appeared there meanwhile
        except BaseException as exc:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):  # it named the hidden folder, gone now: name the one asked for
                cause = exc
                while isinstance(cause.__cause__, OSError):
                    cause = cause.__cause__
                raise OSError(exc.errno, f"cannot write {directory}: {cause.strerror or cause}") from exc
            raise
        fsync_dir(parent)
        return
    with _put_back_if_stopped(root) if local else contextlib.nullcontext():
        written = set(save_pretrained(model, directory))
    for entry in fs.ls(root, detail=False):
        if entry.rstrip("/").rsplit("/", 1)[-1] not in written:
            fs.rm(entry, recursive=True)


def load_pretrained(model_class: type[M], location: str | None = None, **model_kwargs: Any) -> M:
    """`model_class(config, vocab, **model_kwargs)` from our folder or URL; None: the default model."""
    try:
        read: _ModelFiles | None = _read_model_files(location)
    except CheckpointError as exc:
        read, failure = None, exc
    if read is None or read.checksum_differs:
        # a save into the folder may be between its weights and its config.json: read again
        # once it has ended (the lock of `_folder_locked`); a damaged folder fails again then.
        # Where no save can be waited for (a URL), the first read stands: a model is not fetched twice.
        with _folder_locked(default_model_location() if location is None else location, shared=True) as locked:
            if locked:
                read = _read_model_files(location)
            elif read is None:
                raise failure
    location, config_url, config, vocab, chars, weights = read[:6]
    weights_url = join_url(location, WEIGHTS_FILE)
    if read.checksum_differs:
        raise CheckpointError(f"{weights_url}: sha256 {hashlib.sha256(weights).hexdigest()} does not match "
                              f"{WEIGHTS_SHA256_KEY} {read.expected} in {config_url}: the file was modified, "
                              "truncated or replaced")
    if chars is not None:
        model_kwargs["chars"] = chars
    try:
        state = load_safetensors_bytes(weights)  # as large as the file, whatever the config says
    except (SafetensorError, Exception) as exc:  # safetensors raises several types for bad headers
        raise CheckpointError(f"{weights_url}: not a readable safetensors file ({exc})") from exc
    check_config_against_shapes(model_class, config, vocab, {k: tuple(v.shape) for k, v in state.items()}, weights_url,
                                config_url, chars)
    model = model_class(config, vocab, **model_kwargs)
    load_state(model, state, weights_url)
    model.checksum = read.checksum
    return model


class _ModelFiles(NamedTuple):
    location: str  # the folder or URL, the default model's for None
    config_url: str
    config: ElmoConfig
    vocab: Vocabulary | None
    chars: CharVocabulary | None
    weights: bytes
    expected: str | None  # config.json's weights_sha256
    checksum_differs: bool
    checksum: str  # sha256 of config.json, model.safetensors, vocab.json and chars.json, those it has, in turn


def _read_model_files(location: str | None) -> _ModelFiles:
    """The files of our folder or URL, read and parsed; the weights checked against the config's
    checksum by the caller (`checksum_differs`)."""
    location, config_url, config_bytes, raw, config = _read_config(location)
    try:
        expected = weights_sha256(raw, where=config_url)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    weights_url = join_url(location, WEIGHTS_FILE)
    weights = read_bytes(weights_url)
    _check_tables_fit(config, len(weights), config_url, weights_url)
    vocab = chars = None
    dictionaries = []  # their bytes, for the checksum: a vocab.json swapped for another changes the vectors
    try:
        if config.vocab_size is not None:
            vocab_url = join_url(location, VOCAB_FILE)
            data = read_bytes(vocab_url)
            dictionaries.append(data)
            # its tokens and counts, the three specials and the three keys
            check_json_items(data, 2 * config.vocab_size + 6, vocab_url,
                             f"that vocab_size={config.vocab_size} in {config_url} allows")
            vocab = Vocabulary.from_json(data, vocab_url)
            _check_length(len(vocab), "tokens", vocab_url, "vocab_size", config.vocab_size, config_url)
        if config.char_dictionary is not None:
            chars_url = join_url(location, CHARS_FILE)
            data = read_bytes(chars_url)
            dictionaries.append(data)
            size = config.char_dictionary.size
            check_json_items(data, size + 1, chars_url, f"that char_dictionary.size={size} in {config_url} allows")
            chars = CharVocabulary.from_json(data, chars_url)
            _check_length(len(chars), "entries", chars_url, "char_dictionary.size", config.char_dictionary.size,
                          config_url)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    differs = expected is not None and hashlib.sha256(weights).hexdigest() != expected
    checksum = hashlib.sha256(config_bytes)  # without a vocabulary, sha256(config + weights) as before
    for data in (weights, *dictionaries):
        checksum.update(data)
    return _ModelFiles(location, config_url, config, vocab, chars, weights, expected, differs, checksum.hexdigest())


def _check_tables_fit(config: ElmoConfig, weights_size: int, config_url: str, weights_url: str) -> None:
    """Refuses, before vocab.json or chars.json is read, a vocab_size or char_dictionary.size whose
    table (a row a word, or a character, each of one value or more, two bytes at least) the weights
    file is too small to hold: their items are counted against these sizes before they are parsed
    (`check_json_items`), which a config raising them with the file would defeat."""
    tables = []
    words = config.token_encoder != "char_cnn" or config.softmax.kind in ("full", "sampled")  # a row a word
    if config.vocab_size is not None and words:  # an adaptive softmax's tails may be of no width
        tables.append(("vocab_size", config.vocab_size, "words"))
    if config.char_dictionary is not None:
        tables.append(("char_dictionary.size", config.char_dictionary.size, "characters"))
    for field, rows, what in tables:
        if 2 * rows > weights_size:
            raise CheckpointError(f"{config_url}: {field}={rows} asks for a table of {rows:,} {what}, more than "
                                  f"{weights_url} ({weights_size:,} bytes) can hold; refused before it is read")


def read_config(location: str | None = None) -> ElmoConfig:
    """The config of our folder or URL (None: the default model), without reading its weights."""
    return _read_config(location).config


class _ConfigFile(NamedTuple):
    location: str  # the folder or URL, the default model's for None
    url: str
    data: bytes
    raw: dict
    config: ElmoConfig


def _read_config(location: str | None) -> _ConfigFile:
    if location is None:
        location = default_model_location()
    elif not location.strip():  # an unset variable, say: not a request for the default model
        raise CheckpointError("the model location is an empty string; name a model folder or URL, or give none "
                              "for the default model")
    location = resolve_dots(location)  # saved to `memory://x/../m`, a model is at `memory://m`
    config_url = join_url(location, CONFIG_FILE)
    try:
        config_bytes = read_bytes(config_url, MAX_CONFIG_BYTES, "a model config")
    except CheckpointError as exc:
        if isinstance(exc.__cause__, NotADirectoryError):
            raise CheckpointError(f"{location} is a file, not a model folder: {_KINDS_OF_MODEL}") from exc
        first, _, second = location.rpartition(",")
        if first and second.endswith(".json"):  # the pair in the other order: no folder has that name
            raise CheckpointError(f"{location} is no model folder; the original weights are given as "
                                  f"OPTIONS.json,WEIGHTS.hdf5, the options first: {second},{first}") from exc
        # "DIR/config.json: file not found" said nothing of what to give instead
        problem = _run_folder_problem(location) or _original_files_problem(location)
        if problem is not None:
            raise CheckpointError(problem) from exc
        raise
    try:
        raw = parse_json_strict(config_bytes, config_url)
        if isinstance(raw, dict) and _FORMANYLANGS_KEYS <= raw.keys():
            raise CheckpointError(f"{location} is an ELMoForManyLangs model folder (its config.json names "
                                  f"config_path {raw['config_path']!r}): convert it once with `elmo-pipeline "
                                  "import-formanylangs` (or load it with BiLM.from_formanylangs)")
        return _ConfigFile(location, config_url, config_bytes, raw, ElmoConfig.from_dict(raw, where=config_url))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc


def _run_folder_problem(location: str) -> str | None:
    """What to give instead of `location`, holding no config.json, when it is a pretrain run folder
    or the checkpoints folder of one: the models it holds by name; None for any other folder."""
    try:
        names = _names_in(location)
        steps = sorted(filter(CHECKPOINT_NAME.fullmatch, names))
        if RUN_FILE not in names and CHECKPOINTS_DIR not in names:
            return None if not steps else (f"{location} is the checkpoints folder of a pretrain run, not a model "
                                            f"folder; give one checkpoint, such as {join_url(location, steps[-1])} "
                                            "(the latest)")
        checkpoints = join_url(location, CHECKPOINTS_DIR)
        steps = sorted(filter(CHECKPOINT_NAME.fullmatch, _names_in(checkpoints))) if CHECKPOINTS_DIR in names else []
    except (OSError, ValueError):  # unreadable: the file-not-found error stands
        return None
    models = [f"{join_url(location, folder)} ({what})" for folder, what in
              ((RUN_MODEL_DIR, "its final model"), (RUN_BEST_DIR, "its best on --valid")) if folder in names]
    if steps:
        models.append(f"a checkpoint, such as {join_url(checkpoints, steps[-1])} (the latest)")
    problem = f"{location} is a pretrain run folder, not a model folder"
    if RUN_MODEL_DIR not in names:
        problem += f" (its final model, {join_url(location, RUN_MODEL_DIR)}, is written when the run ends)"
    return f"{problem}; give {', or '.join(models)}" if models else f"{problem}; it holds no model yet"


def _original_files_problem(location: str) -> str | None:
    """What to give instead of `location`, holding no config.json, when it holds the original's
    files, a .json and an .hdf5 (an AllenNLP download): the pair, named when the names tell it;
    None for any other folder."""
    try:
        names = _names_in(location)
    except (OSError, ValueError):  # unreadable: the file-not-found error stands
        return None
    options = sorted(n for n in names if n.endswith(".json"))
    weights = sorted(n for n in names if n.endswith((".hdf5", ".h5")))
    if not options or not weights:
        return None
    options = [n for n in options if n.endswith("options.json")] or options
    weights = [n for n in weights if "weights" in n] or weights
    problem = (f"{location} holds no config.json but the original's files: give them as OPTIONS.json,WEIGHTS.hdf5 "
               "(BiLM.from_allennlp(OPTIONS, WEIGHTS) in Python), or convert them once with `elmo-pipeline "
               "import-allennlp`")
    if len(options) == len(weights) == 1:
        problem += f"; here {join_url(location, options[0])},{join_url(location, weights[0])}"
    return problem


def _names_in(folder: str) -> set[str]:
    """The names of the files and folders in `folder`, a path or URL."""
    fs, path = fsspec.core.url_to_fs(folder)
    return {posixpath.basename(entry.rstrip("/")) for entry in fs.ls(path, detail=False)}


_KINDS_OF_MODEL = ("a model of ours is a folder or URL holding config.json and model.safetensors; the original "
                   "weights are given as OPTIONS.json,WEIGHTS.hdf5 (a comma between the two files)")
# the training settings that an ELMoForManyLangs config.json holds, and a config of ours never does
_FORMANYLANGS_KEYS = frozenset({"config_path", "max_sent_len", "min_count"})


def _check_length(length: int, what: str, where: str, field: str, wanted: int, config_where: str) -> None:
    """A vocabulary or character dictionary as long as the config's `field` (= `wanted`) says."""
    if length != wanted:
        raise CheckpointError(f"{where}: has {length} {what}, but {field}={wanted} in {config_where} needs {wanted}")
