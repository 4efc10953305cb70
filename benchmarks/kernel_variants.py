"""The LSTM kernels a benchmark can name, the static-shape ones included before the model
dispatches to them.

`exact` and `fused` are the model's own kernels (BiLM.kernel). The static-shape layer of
`model/lstm_static.py` is not dispatched to by `BiLstmStack` yet, so `use_kernel` swaps it in
for `lstm._exact_layer` (which has the same contract) for the length of a `with` block:
- `static`: `static_exact_layer`, eagerly (padded buckets, masked rows, no host reads);
- `graphed`: a `GraphedLayer`, one CUDA graph per bucket (eager off CUDA);
- `graphed-compiled`: the same with the step compiled by torch.compile.
The swap is process-wide: use it in a benchmark, never around a model other threads are using.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator

import torch

from elmo_pipeline.model import lstm
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.lstm import EXACT, FUSED
from elmo_pipeline.model.lstm_static import GraphedLayer, compiled_step, static_exact_layer

STATIC, GRAPHED, GRAPHED_COMPILED = "static", "graphed", "graphed-compiled"
VARIANTS = (EXACT, FUSED, STATIC, GRAPHED, GRAPHED_COMPILED)
_CONTRACT = ["x", "lengths", "batch_sizes", "layer", "h", "c", "cell_clip", "proj_clip"]


def static_layer(variant: str, max_graphs: int = 64) -> Callable:
    """A fresh layer function for a static variant (a graphed one starts with no graph)."""
    if variant == STATIC:
        return static_exact_layer
    if variant == GRAPHED:
        return GraphedLayer(max_graphs)
    if variant == GRAPHED_COMPILED:
        return GraphedLayer(max_graphs, step=compiled_step())
    raise ValueError(f"not a static variant: {variant!r}")


def hook_problem() -> str | None:
    """Why `lstm._exact_layer` cannot be swapped here (None when it can): the swap relies on
    its name and arguments, which a rewrite of lstm.py may change."""
    target = getattr(lstm, "_exact_layer", None)
    if target is None:
        return "elmo_pipeline.model.lstm has no _exact_layer any more: update benchmarks/kernel_variants.py"
    names = list(inspect.signature(target).parameters)[: len(_CONTRACT)]
    if names != _CONTRACT:
        return f"lstm._exact_layer's arguments are now {names}, not {_CONTRACT}: update benchmarks/kernel_variants.py"
    return None


@contextlib.contextmanager
def swap_exact_layer(fn: Callable) -> Iterator[Callable]:
    """Within the block, every model's exact kernel is `fn` (process-wide)."""
    problem = hook_problem()
    if problem:
        raise RuntimeError(problem)
    original = lstm._exact_layer
    lstm._exact_layer = fn
    try:
        yield fn
    finally:
        lstm._exact_layer = original


@contextlib.contextmanager
def use_kernel(model: BiLM, variant: str, layer_fn: Callable | None = None) -> Iterator[Callable | None]:
    """Within the block, `model` computes with `variant`; yields the static layer function in use
    (None for the model's own kernels). `layer_fn` reuses one (a GraphedLayer keeps its graphs)."""
    if variant not in VARIANTS:
        raise ValueError(f"kernel variant must be one of {VARIANTS}, got {variant!r}")
    before = model.kernel
    model.kernel = variant if variant in (EXACT, FUSED) else EXACT
    try:
        if variant in (EXACT, FUSED):
            yield None
        else:
            with swap_exact_layer(layer_fn or static_layer(variant)) as fn:
                yield fn
    finally:
        model.kernel = before


def graph_counts(fn: Callable | None) -> dict[str, int]:
    """Captures, replays and memory of a GraphedLayer (empty for anything else)."""
    if isinstance(fn, GraphedLayer):
        return {"graphs_captured": fn.captures, "graph_replays": fn.replays, "graphs_gib": fn.graph_bytes / 2**30,
                "gates_buffer_gib": fn.buffer_bytes / 2**30}
    return {}


def cuda_only(variant: str) -> bool:
    return variant in (GRAPHED, GRAPHED_COMPILED)


def is_available(variant: str, device: torch.device) -> str | None:
    """Why `variant` cannot run meaningfully on `device` (None when it can)."""
    if variant in (EXACT, FUSED):
        return None
    problem = hook_problem()
    if problem:
        return problem
    if cuda_only(variant) and device.type != "cuda":
        return f"{variant} captures CUDA graphs; on {device.type} it is the static kernel run eagerly"
    return None
