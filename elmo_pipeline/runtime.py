"""Device and precision choices shared by every command that runs the model."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import warnings
from typing import TYPE_CHECKING, ContextManager, NamedTuple

import torch

from elmo_pipeline.runtime_choices import PRECISIONS

if TYPE_CHECKING:
    from elmo_pipeline.model.bilm import BiLM



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
    without this RSS grows by many batches' worth over a long run (figures in
    docs/design-measurements.md)."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class HeapTrimmer:
    """`release_free_heap` at most once per `interval_s` seconds: a trim walks the whole heap
    (about 8 ms after a batch of the default model), and the pages freed between two trims are
    mostly taken again by the next batches anyway. Safe to share between threads."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # pickled with a Beam DoFn: a lock does not pickle
        return {"interval_s": self.interval_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["interval_s"])

    def __call__(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                return False
            self._next = now + self.interval_s
        return release_free_heap()


DEVICE_TYPES = ("cpu", "cuda")  # what the kernels are written and tested for


def parse_device(name: str) -> torch.device:
    """`name` as a torch device of a type in DEVICE_TYPES; anything else refused by name (`meta`
    holds no values; `mps` or `xpu` would fail in a worker after the input was read)."""
    # None (as if for the default) raised torch's TypeError, listing its signatures, naming no option
    if isinstance(name, bool) or not isinstance(name, (str, int, torch.device)):
        raise TypeError(f"device must be a str (auto, cpu, cuda, cuda:N), a torch.device or a CUDA index, got {name!r}")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r} is not a torch device (auto, cpu, cuda, cuda:N): "
                         f"{str(exc).splitlines()[0]}") from None
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"device {name!r}: elmo-pipeline runs on {' or '.join(DEVICE_TYPES)} (auto picks one), "
                         f"not {device.type}")
    return device


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA on a machine without it is an error.
    A bare `cuda` means this process's GPU under torchrun (`local_rank`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices in hardware: on CPU, AVX512-BF16 or AMX (without
    them oneDNN emulates bf16 and it can run slower than fp32); on CUDA, what torch reports. A
    CUDA device this machine does not have (a job launched here for GPU workers) is not judged."""
    if device.type == "cuda":
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True  # nothing to check against: the backend decides
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


class SlowPrecisionWarning(RuntimeWarning):
    """The precision asked for has no hardware support here: results are right but may be slow."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def check_precision_runs(device: torch.device | None, precision: str) -> None:
    """A ValueError for a precision that is no name of ours, or that `device` (None: not chosen
    yet) cannot run."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if device is not None and device.type == "cpu" and precision == "fp16":
        raise ValueError("fp16 autocast is for GPUs; use bf16 or fp32 on CPU")


def check_precision(device: torch.device, precision: str = "fp32") -> str:
    """`precision` if it can run on `device`, else a ValueError; bf16 on a device without native
    bf16 matrix instructions runs, with one SlowPrecisionWarning per device type and process."""
    check_precision_runs(device, precision)
    if precision == "bf16" and not native_bf16(device):
        with _warned_lock:
            first = device.type not in _warned
            _warned.add(device.type)
        if first:
            what = "AVX512-BF16 or AMX" if device.type == "cpu" else "native bf16"
            warnings.warn(f"--precision bf16: this {device.type} has no {what} instructions, so bf16 matrix "
                          "products are emulated and may run slower than fp32 (the results are the same)",
                          SlowPrecisionWarning, stacklevel=2)
    return precision


def autocast(device: torch.device, precision: str = "fp32") -> ContextManager:
    """bf16 autocast on CPU or GPU, fp16 on GPU only; fp32 (the default) is no autocast at all.
    Products then run in 16 bits while the LSTM cell state and the elementwise work stay float32
    (see model/lstm.py)."""
    if check_precision(device, precision) == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def product_dtype(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a matrix product of `x` with a weight of `weight_dtype` here: autocast's on
    x's device when it is on, else the weight's. In-place and out= products bypass autocast, so
    kernels that use them cast explicitly to this."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight_dtype


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
        types = [parse_device(device).type]
    else:
        types = ["cpu", "cuda"]
    kernels = {model.lstm.resolve_kernel(kernel, torch.device(t)) for t in types}
    return PlannedRuntime(types[0] if len(types) == 1 else None, kernels.pop() if len(kernels) == 1 else None)
