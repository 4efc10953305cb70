"""The static-shape exact layer (elmo_pipeline/model/lstm_static.py) held to the reference.

Random weights with non-zero biases, clips off, loose and tight enough to bind, one to nine
rows with ragged lengths (random inputs in the padding too, which must not leak), zero and
carried initial states, both directions. Largest differences measured on CPU float32 (torch
2.13, x86, 2 threads) over these 24 cases: against `lstm_reference.lstm_layer` 2.4e-7 (0, bit
for bit, against the reference run on the rows padded to >= 4 as the stack pads them: fewer
rows take other BLAS paths); through the stack in place of the exact kernel 0; with the step
compiled by torch.compile (inductor, C++ on CPU) 2.4e-7. Asserted: 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from elmo_pipeline.model import lstm
from elmo_pipeline.model.config import LstmConfig
from elmo_pipeline.model.lstm import EXACT, BiLstmStack, LstmState
from elmo_pipeline.model.lstm_reference import BiLstmLayer, lstm_layer
from elmo_pipeline.model.lstm_static import (GraphedLayer, bucket, bucket_shape, compiled_step, static_exact_layer,
                                             step_mask)

CLIPS = {"none": (None, None), "loose": (3.0, 3.0), "tight": (0.3, 0.1)}
LENGTHS = {"one": [5], "three": [3, 7, 1], "seven": [9, 2, 9, 4, 1, 6, 3], "nine": [17] * 4 + [5, 11, 2, 8, 13]}
TOLERANCE = 1e-6


def _layer(hidden: int = 32, proj: int = 12, inputs: int = 12, seed: int = 0) -> BiLstmLayer:
    torch.manual_seed(seed)
    layer = BiLstmLayer(inputs, hidden, proj).eval()
    with torch.no_grad():
        layer.bias.normal_(0, 0.5)
    return layer


def _inputs(layer: BiLstmLayer, lengths: list[int], carried: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed + len(lengths))
    b, t = len(lengths), max(lengths)
    x = torch.randn(2, b, t, layer.input_weight.shape[2], generator=gen)  # padding too: must not leak
    h = c = None
    if carried:
        h = torch.randn(2, b, layer.proj, generator=gen) * 0.3
        c = torch.randn(2, b, layer.hidden, generator=gen)
    else:
        h, c = torch.zeros(2, b, layer.proj), torch.zeros(2, b, layer.hidden)
    return x, torch.tensor(lengths), h, c


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("n, multiple, expected", [
    (1, 1, 4), (4, 1, 4), (5, 1, 5), (8, 1, 8), (9, 1, 10), (15, 1, 16), (17, 1, 20), (100, 1, 112),
    (1, 4, 4), (5, 4, 8), (9, 4, 12), (13, 4, 16), (17, 4, 20), (33, 4, 40), (1000, 4, 1024),
])
def test_buckets(n, multiple, expected):
    assert bucket(n, multiple) == expected


def test_buckets_waste_at_most_a_quarter_and_rows_stay_multiples_of_four():
    for n in range(4, 3000):
        assert n <= bucket(n) <= 1.25 * n
        rows, steps = bucket_shape(n, n)
        assert rows % 4 == 0 and n <= rows <= max(1.25 * n, n + 3) and steps == bucket(n)
    assert len({bucket(n) for n in range(1, 257)}) == 25  # few shapes: few graphs


@pytest.mark.parametrize("carried", [False, True], ids=["zero_state", "carried_state"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("clips", CLIPS)
def test_static_layer_equals_the_reference(clips, lengths, carried):
    layer = _layer()
    x, lens, h, c = _inputs(layer, lengths, carried)
    with torch.no_grad():
        got = static_exact_layer(x, lens, None, layer, h, c, *CLIPS[clips])
        want = lstm_layer(x, lens, layer, h, c, *CLIPS[clips])
    assert [g.shape for g in got] == [w.shape for w in want]
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert _max_diff(got, want) <= TOLERANCE
    valid = torch.arange(x.shape[2]) < lens.unsqueeze(1)
    assert bool((got[0][:, ~valid] == 0).all())  # zero at padding
    if clips == "tight":  # the clips bind: a kernel without them would differ
        assert float(got[0].abs().max()) == pytest.approx(CLIPS["tight"][1])


@pytest.mark.parametrize("clips", CLIPS)
def test_static_layer_in_the_stack_equals_the_exact_kernel(clips, monkeypatch):
    """Through BiLstmStack.forward in place of `lstm._exact_layer` (sorted rows, batch_sizes,
    the residual, the carry): the dispatch the README describes for CUDA."""
    torch.manual_seed(0)
    stack = BiLstmStack(LstmConfig(dim=32, projection_dim=12, n_layers=2, cell_clip=CLIPS[clips][0],
                                   proj_clip=CLIPS[clips][1])).eval()
    lengths = torch.tensor(LENGTHS["seven"])
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randn(7, 9, 12, generator=gen) * (torch.arange(9) < lengths.unsqueeze(1)).unsqueeze(-1)
    state = LstmState(torch.randn(2, 2, 7, 12, generator=gen) * 0.3, torch.randn(2, 2, 7, 32, generator=gen))
    with torch.no_grad():
        want = stack(tokens, lengths, state, kernel=EXACT)
        monkeypatch.setattr(lstm, "_exact_layer", static_exact_layer)
        got = stack(tokens, lengths, state, kernel=EXACT)
    assert _max_diff([*got[0], *got[1]], [*want[0], *want[1]]) <= TOLERANCE


def test_static_layer_under_bf16_autocast_gives_the_exact_kernels_dtypes_and_a_bf16_sized_drift():
    layer = _layer(hidden=64, proj=16, inputs=16)
    x, lens, h, c = _inputs(layer, LENGTHS["nine"], True)
    order = torch.argsort(lens, descending=True, stable=True)
    x, lens, h, c = x[:, order], lens[order], h[:, order], c[:, order]
    batch_sizes = [int((lens > s).sum()) for s in range(x.shape[2])]
    with torch.no_grad():
        fp32 = lstm_layer(x, lens, layer, h, c, 3.0, 3.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = static_exact_layer(x, lens, batch_sizes, layer, h, c, 3.0, 3.0)
            exact = lstm._exact_layer(x, lens, batch_sizes, layer, h, c, 3.0, 3.0)
    assert [g.dtype for g in got] == [e.dtype for e in exact] == [torch.bfloat16, torch.bfloat16, torch.float32]
    # products in bf16, the cell state in float32: measured 1.5e-2 from float32 (the exact
    # kernel 1.0e-2; on CPU it computes the cell's elementwise part in float32)
    assert _max_diff([g.float() for g in got], fp32) <= 3e-2


def test_graphed_layer_runs_the_static_layer_off_cuda():
    layer = _layer()
    x, lens, h, c = _inputs(layer, LENGTHS["seven"], True)
    runner = GraphedLayer()
    with torch.no_grad():
        assert _max_diff(runner(x, lens, None, layer, h, c, 0.3, 0.1),
                         static_exact_layer(x, lens, None, layer, h, c, 0.3, 0.1)) == 0
    assert runner.captures == 0


def test_the_graphed_loop_with_its_shared_gate_buffer_computes_the_static_layer():
    """What GraphedLayer captures, run eagerly on CPU: the padded batch, the mask, the input gates
    written into a shared (here poisoned) buffer larger than needed."""
    layer = _layer()
    x, lens, h, c = _inputs(layer, LENGTHS["seven"], True)
    rows, steps = bucket_shape(7, 9)
    xp = torch.zeros(2, rows, steps, x.shape[3])
    xp[:, :7, :9] = x
    hp, cp = torch.zeros(2, rows, layer.proj), torch.zeros(2, rows, layer.hidden)
    hp[:, :7], cp[:, :7] = h, c
    buffer = torch.full((2 * rows * steps * 4 * layer.hidden + 100,), float("nan"))
    with torch.no_grad():
        out, hn, cn = GraphedLayer()._loop(layer, torch.float32, xp, step_mask(lens, rows, steps, xp.device), hp, cp,
                                           0.3, 0.1, buffer)
        want = static_exact_layer(x, lens, None, layer, h, c, 0.3, 0.1)
    assert _max_diff([out[:, :7, :9], hn[:, :7], cn[:, :7]], want) == 0
    assert not torch.isnan(buffer[: 2 * rows * steps * 4 * layer.hidden]).any()


def test_static_layer_gradients_match_the_reference():
    layer = _layer()
    x, lens, h, c = _inputs(layer, LENGTHS["seven"], True)
    grads = []
    for fn in (static_exact_layer, None):
        layer.zero_grad()
        xr = x.clone().requires_grad_(True)
        if fn is None:
            outs = lstm_layer(xr, lens, layer, h, c, 3.0, 3.0)
        else:
            outs = fn(xr, lens, None, layer, h, c, 3.0, 3.0)
        gen = torch.Generator().manual_seed(7)
        sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
        grads.append([xr.grad, *(p.grad for p in layer.parameters())])
    assert _max_diff(*grads) <= 1e-5


def _compiled_or_skip():
    step = compiled_step()
    layer = _layer(hidden=8, proj=4, inputs=4)
    x, lens, h, c = _inputs(layer, [2, 1], False)
    try:
        with torch.no_grad():
            static_exact_layer(x, lens, None, layer, h, c, 3.0, 3.0, step)
    except Exception as exc:  # torch.compile needs a working C++ toolchain on CPU
        pytest.skip(f"torch.compile does not work here: {type(exc).__name__}: {str(exc)[:300]}")
    return step


@pytest.mark.parametrize("carried", [False, True], ids=["zero_state", "carried_state"])
def test_compiled_step_equals_the_reference(carried):
    step = _compiled_or_skip()
    layer = _layer()
    for lengths in (LENGTHS["three"], LENGTHS["seven"]):  # rows bucketed to 4 and 8
        x, lens, h, c = _inputs(layer, lengths, carried)
        with torch.no_grad():
            got = static_exact_layer(x, lens, None, layer, h, c, *CLIPS["tight"], step=step)
            want = lstm_layer(x, lens, layer, h, c, *CLIPS["tight"])
        assert _max_diff(got, want) <= TOLERANCE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graphed_layer_replays_what_the_eager_loop_computes(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    layer = _layer(hidden=64, proj=16, inputs=16).cuda()
    runner = GraphedLayer()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16")
    for lengths in (LENGTHS["nine"], LENGTHS["seven"], LENGTHS["nine"]):
        x, lens, h, c = _inputs(layer, lengths, True)
        x, h, c = x.cuda(), h.cuda(), c.cuda()
        with torch.no_grad(), autocast:
            got = runner(x, lens, None, layer, h, c, 3.0, 3.0)
            want = static_exact_layer(x, lens, None, layer, h, c, 3.0, 3.0)
        assert _max_diff([g.float() for g in got], [w.float() for w in want]) <= (1e-6 if dtype == "fp32" else 1e-2)
    assert runner.captures == 2 and runner.replays == 3
