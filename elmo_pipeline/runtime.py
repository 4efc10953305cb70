"""Device and precision choices shared by every command that runs the model."""

from __future__ import annotations

import contextlib
import ctypes
from typing import TYPE_CHECKING, ContextManager, NamedTuple

import torch

if TYPE_CHECKING:
    from elmo_pipeline.model.bilm import BiLM

PRECISIONS = ("fp32", "bf16", "fp16")


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent from musl, macOS, Windows
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim); whether any were.

    A batch's tensors and arrays are freed in the middle of a heap whose top is held by longer
    lived allocations (a row group being filled, the next sentences): glibc keeps such pages, so
    without this RSS grows by many batches' worth over a long run (figures in the README,
    "Notes behind the code")."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA on a machine without it is an error.
    A bare `cuda` means this process's GPU under torchrun (`local_rank`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def autocast(device: torch.device, precision: str = "fp32") -> ContextManager:
    """bf16/fp16 autocast on GPU; on CPU only bf16 is offered and fp32 is the default."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    if device.type == "cpu" and precision == "fp16":
        raise ValueError("fp16 autocast is for GPUs; use bf16 or fp32 on CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class PlannedRuntime(NamedTuple):
    """What the workers will embed with, as far as the launching process can know; None where
    only each worker can (a runner elsewhere with `--device auto`)."""

    device: str | None  # a device type: "cpu", "cuda", ...
    kernel: str | None  # "exact" or "fused"


def plan_runtime(model: BiLM, device: str, kernel: str, workers_here: bool) -> PlannedRuntime:
    """The device type and LSTM kernel of `--device`/`--kernel` for `model`: the device is known
    when it is named or when the workers run on this machine; the kernel when it is the same on
    every device the workers could have."""
    if workers_here:
        types = [resolve_device(device).type]
    elif device != "auto":
        types = [torch.device(device).type]
    else:
        types = ["cpu", "cuda"]
    kernels = {model.lstm.resolve_kernel(kernel, torch.device(t)) for t in types}
    return PlannedRuntime(types[0] if len(types) == 1 else None, kernels.pop() if len(kernels) == 1 else None)
