"""Training checkpoints: written whole or not at all, the last K kept, nothing pickled.

    RUN/checkpoints/step-000001200/
        config.json, model.safetensors, vocab.json   the model (`BiLM.save_pretrained` format)
        optimizer.safetensors                         optimizer state tensors
        optimizer.json                                optimizer hyper-parameters and scalars
        rng-rank00000.safetensors ...                 each process's random state
        trainer_state.json                            step, data position, metrics, best score

A checkpoint is assembled in `.tmp-step-...` and renamed into place (a rename is atomic on a
local file system), and one removed (pruned, or replaced by the same step) is first renamed to
`.tmp-old-step-...`, so a run killed at any moment leaves only complete checkpoints beside
temporary folders, which the next run removes. Checkpoints live on a local (or
locally mounted) file system.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from typing import Any, Iterator, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elmo_pipeline.filesystems import location_key
from elmo_pipeline.formats.atomic import publish_folder
from elmo_pipeline.formats.files import CHECKPOINT_NAME, CHECKPOINTS_DIR, CheckpointError
from elmo_pipeline.formats.native import check_model_destination, publish_pretrained
from elmo_pipeline.strict import dumps_strict, parse_json_strict
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.config import fields_differing
from elmo_pipeline.runtime_choices import EXPORT_DTYPES


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = CHECKPOINT_NAME.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, "trainer_state.json")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(run_dir: str) -> str | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps_strict(value, path, indent=2, sort_keys=True))  # made durable by publish_folder


LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_lock(run_dir: str) -> Iterator[None]:
    """This process's claim on a run folder. A second `pretrain` writing the same folder would
    remove the first one's temporary checkpoint and interleave their files; it is refused
    instead. The kernel drops a flock when its process ends, however it ends, so no stale lock
    outlives a crash."""
    with open(os.path.join(run_dir, LOCK_FILE), "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(f"{run_dir} is in use by another pretrain ({holder}); wait for it to end, or give "
                             "another --output") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- random state ---------------------------------------------------------------------------
def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{i}"] = s
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = [state[k] for k in sorted(k for k in state if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# -- optimizer ------------------------------------------------------------------------------
def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in sd["state"].items():
        for name, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{index}/{name}"] = value.detach().cpu().contiguous().reshape(value.shape)
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    # safetensors keeps 0-d tensors, but store shapes too so a reader never has to guess.
    return tensors, {"param_groups": groups, "scalars": scalars, "shapes": shapes}


def optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         meta: dict[str, Any], device: torch.device) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split("/", 1)
        value = value.reshape(meta["shapes"][key])
        # Adam's `step` counter stays on the CPU unless capturable; everything else follows the params.
        state.setdefault(int(index), {})[name] = value if name == "step" else value.to(device)
    for index, entries in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entries)
    # the state is the checkpoint's; the hyper-parameters are this command's, since torch would put
    # back the saved ones (a --weight-decay changed at resume, noted as taken, changed nothing)
    if len(meta["param_groups"]) != len(optimizer.param_groups):  # zip would drop the extra ones
        raise CheckpointError(f"optimizer.json: {len(meta['param_groups'])} parameter groups, where the optimizer "
                              f"has {len(optimizer.param_groups)}")
    groups = [{**{k: v for k, v in now.items() if k != "params"}, "params": saved["params"]}
              for saved, now in zip(meta["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- whole checkpoints ----------------------------------------------------------------------
def temporary_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CHECKPOINTS_DIR, ".tmp-" + checkpoint_name(step))


def begin_checkpoint(run_dir: str, step: int) -> str:
    """Main process: a fresh temporary folder for the checkpoint of `step`."""
    tmp = temporary_dir(run_dir, step)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def _save_tensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, whose failure to write (a full disk) is a SafetensorError naming
    no file: an OSError naming it, as every other write's."""
    try:
        save_file(tensors, path)
    except SafetensorError as exc:
        raise OSError(f"cannot write {path}: {exc}") from exc


def write_rng(tmp: str, rank: int) -> None:
    _save_tensors(rng_state(), os.path.join(tmp, f"rng-rank{rank:05d}.safetensors"))


def finish_checkpoint(run_dir: str, step: int, tmp: str, model: BiLM, optimizer: torch.optim.Optimizer,
                      trainer_state: dict[str, Any], keep: int) -> str:
    """Main process: model, optimizer and state into `tmp`, then the rename, then pruning. A
    checkpoint that cannot be written whole (a full disk) takes its temporary folder away."""
    try:
        model.save_pretrained(tmp)
        tensors, meta = optimizer_to_files(optimizer)
        _save_tensors(tensors, os.path.join(tmp, "optimizer.safetensors"))
        _write_json(os.path.join(tmp, "optimizer.json"), meta)
        _write_json(os.path.join(tmp, "trainer_state.json"), trainer_state)  # last: marks completeness
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = os.path.join(run_dir, CHECKPOINTS_DIR, checkpoint_name(step))
    # the same step written again (the final checkpoint of a run whose last step had one) replaces
    # the earlier one by way of a temporary name: removed in place, a kill left it listed without
    # some of its files, and the same command refused to resume from it
    publish_folder(tmp, final, aside=_aside(final))
    prune(run_dir, keep)
    return final


def _aside(path: str) -> str:
    """A name for a checkpoint folder being removed: no checkpoint's, and `remove_temporaries`'."""
    return os.path.join(os.path.dirname(path), ".tmp-old-" + os.path.basename(path))


def prune(run_dir: str, keep: int) -> None:
    found = list_checkpoints(run_dir)
    for _, path in found[: max(0, len(found) - max(1, keep))]:
        with contextlib.suppress(OSError):  # as rmtree's own errors: a folder left is pruned next time
            os.rename(path, _aside(path))
            shutil.rmtree(_aside(path), ignore_errors=True)


def remove_temporaries(run_dir: str) -> None:
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_json(path: str) -> Any:
    """A local JSON file, parsed strictly (errors name it)."""
    with open(path, "rb") as f:
        return parse_json_strict(f.read(), path)


@contextlib.contextmanager
def reading_checkpoint(path: str) -> Iterator[None]:
    """A checkpoint that cannot be read, whatever the reason, as one error naming it and how to
    go on. The run does not fall back to an earlier checkpoint by itself: a damaged file says
    something about the disk that its owner should see."""
    try:
        yield
    except (CheckpointError, SafetensorError, OSError, KeyError, TypeError, ValueError) as exc:
        run_dir = os.path.dirname(os.path.dirname(path))
        earlier = [p for _, p in list_checkpoints(run_dir) if p != path]
        then = (f"delete that folder and run the same command to resume from {earlier[-1]}" if earlier else
                "delete that folder and run the same command to start the run again")
        detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, (KeyError, SafetensorError)) else str(exc)
        raise CheckpointError(f"checkpoint {path} cannot be read ({detail}); {then}") from exc


def load_trainer_state(path: str) -> dict[str, Any]:
    state = read_json(os.path.join(path, "trainer_state.json"))
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}/trainer_state.json: expected a JSON object")
    # The name orders the checkpoints and prune keeps the highest: a copy or link of another step
    # under a higher name was resumed, then kept while the checkpoints written after it were pruned.
    named = CHECKPOINT_NAME.fullmatch(os.path.basename(path))
    if named and state.get("step") != int(named.group(1)):
        raise CheckpointError(f"{path}/trainer_state.json: holds step {state.get('step')!r}, not the step "
                              f"{int(named.group(1))} its folder's name says (a copy or link of another checkpoint?)")
    return state


def load_checkpoint_model(path: str, **kwargs: Any) -> BiLM:
    return BiLM.from_pretrained(path, **kwargs)


def _load_tensors(file: str) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file; one that cannot be read is named (safetensors' own error is not)."""
    try:
        return load_file(file)
    except SafetensorError as exc:
        raise CheckpointError(f"{os.path.basename(file)}: SafetensorError: {exc}") from exc


def restore_optimizer(path: str, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    tensors = _load_tensors(os.path.join(path, "optimizer.safetensors"))
    meta = read_json(os.path.join(path, "optimizer.json"))
    optimizer_from_files(optimizer, tensors, meta, device)


def restore_rng(path: str, rank: int) -> None:
    file = os.path.join(path, f"rng-rank{rank:05d}.safetensors")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{path}: no random state for rank {rank} (was the run started with a different "
                                "number of processes?)")
    set_rng_state(_load_tensors(file))


def export_model(sources: str | Sequence[str], destination: str, dtype: str = "float32",
                 overwrite: bool = False) -> BiLM:
    """Write a trained model (a checkpoint, `best/` or `model/`, or any model `BiLM.load` reads,
    the original `OPTIONS.json,WEIGHTS.hdf5` too) as a plain model folder,
    optionally with float16 or bfloat16 weights (loading upcasts them to the model's float32). The folder
    must be new or empty, or with `overwrite` a model folder, replaced whole: files of another
    model left beside the new ones (a vocab.json the new model has no use for) would be read
    with it.

    Given several sources (checkpoints of one run, or runs continued from one model), the
    weights written are their element-wise mean; the sources must share the configuration
    and the vocabulary, which a mean of unrelated models would silently break."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise ValueError("export needs at least one source model")
    named = {}
    for source in sources:  # `A` and `./A/` too: it would weigh double in the mean, which "averaged" would not show
        named.setdefault(tuple(location_key(part) for part in source.split(",")), []).append(source)
    twice = [" and ".join(spellings) for spellings in named.values() if len(spellings) > 1]
    if twice:
        raise ValueError(f"export sources given more than once: {'; '.join(twice)}")
    # before the sources are read and averaged; an OPTIONS.json,WEIGHTS.hdf5 source is its two files
    check_model_destination(destination, overwrite, reads=[part for source in sources for part in source.split(",")])
    model = BiLM.load(sources[0])
    if len(sources) > 1:
        _average_into(model, sources)
    model.to(getattr(torch, dtype))
    _check_representable(model, dtype, sources[0])
    publish_pretrained(model, destination, overwrite=overwrite)
    return model


def _check_representable(model: BiLM, dtype: str, source: str) -> None:
    """Refuses weights that the narrower type turned into infinities (float16 stops at 65504):
    the folder would be written, and then refused by every load."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: tensor {name!r} has values beyond {dtype}'s range (largest finite "
                             f"{torch.finfo(getattr(torch, dtype)).max:.6g}); export it as float32 or bfloat16")


def _vocab_tokens(model: BiLM) -> list[str] | None:
    return model.vocab.tokens if model.vocab is not None else None


def _average_into(model: BiLM, sources: Sequence[str]) -> None:
    # Sums in float64 so that the mean does not depend on the order of the sources beyond
    # the last bit of a float32.
    words = _vocab_tokens(model)
    totals = {k: v.detach().to(torch.float64).clone() for k, v in model.state_dict().items()
              if v.is_floating_point()}
    for source in sources[1:]:
        other = BiLM.load(source)
        # the name is a label (the same model imported twice may carry two): it takes the first's
        differ = fields_differing(other.config.to_dict(), model.config.to_dict(), ignore=("name",))
        if differ:
            raise ValueError(f"{source}: its configuration differs from {sources[0]}'s ({', '.join(differ)}); "
                             "only models of one architecture and vocabulary size can be averaged")
        if _vocab_tokens(other) != words:
            raise ValueError(f"{source}: its vocabulary differs from {sources[0]}'s; word rows would be mixed "
                             "across different words")
        if other.chars != model.chars:
            raise ValueError(f"{source}: its character dictionary differs from {sources[0]}'s; character rows "
                             "would be mixed across different characters")
        for name, tensor in other.state_dict().items():
            if name in totals:
                totals[name] += tensor.detach().to(torch.float64)
    with torch.no_grad():
        state = model.state_dict()
        for name, total in totals.items():
            state[name].copy_((total / len(sources)).to(state[name].dtype))
