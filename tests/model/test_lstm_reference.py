"""The LSTM kernels held to the reference (elmo_pipeline/model/lstm_reference.py).

Random weights (and non-zero biases), clips off, loose and tight enough to bind, one to nine
rows with ragged lengths, zero and carried initial states, both directions. Largest
differences measured over these cases on CPU float32 (torch 2.x, x86):
- exact inference kernel vs reference: 0, bit for bit, once the reference also sees the rows the stack pads to
  as the stack pads it (on 1-3 rows BLAS takes other paths: 2.4e-7);
- autograd path of the stack (sorted, padded rows) vs reference: values 0 on the padded rows,
  gradients 1.9e-6 (the weight gradients sum the rows in another order); asserted 1e-5;
- fused (torch's LSTM) vs reference without clips: values 4.8e-7 (asserted 1e-5), gradients
  5.7e-6 (asserted 2e-5).
"""

from __future__ import annotations

import pytest
import torch

from elmo_pipeline.model.batch_invariance import pad_rows
from elmo_pipeline.model.config import LstmConfig
from elmo_pipeline.model.lstm import EXACT, FUSED, BiLstmStack, LstmState
from elmo_pipeline.model.lstm_reference import lstm_step

CLIPS = {"none": (None, None), "loose": (3.0, 3.0), "tight": (0.3, 0.1)}
LENGTHS = {"one": [5], "three": [3, 7, 1], "seven": [9, 2, 9, 4, 1, 6, 3], "nine": [17] * 4 + [5, 11, 2, 8, 13]}


def _stack(clips: str, hidden: int = 32, proj: int = 12, seed: int = 0) -> BiLstmStack:
    torch.manual_seed(seed)
    cell_clip, proj_clip = CLIPS[clips]
    stack = BiLstmStack(LstmConfig(dim=hidden, projection_dim=proj, n_layers=2, cell_clip=cell_clip,
                                   proj_clip=proj_clip)).eval()
    with torch.no_grad():
        for layer in stack.layers:
            layer.bias.normal_(0, 0.5)
    return stack


def _inputs(stack: BiLstmStack, lengths: list[int], carried: bool) -> tuple[torch.Tensor, torch.Tensor, LstmState | None]:
    gen = torch.Generator().manual_seed(len(lengths))
    b, t, p, h = len(lengths), max(lengths), stack.cfg.projection_dim, stack.cfg.dim
    lens = torch.tensor(lengths)
    tokens = torch.randn(b, t, p, generator=gen) * (torch.arange(t) < lens.unsqueeze(1)).unsqueeze(-1)
    state = None
    if carried:
        state = LstmState(torch.randn(2, 2, b, p, generator=gen) * 0.3, torch.randn(2, 2, b, h, generator=gen))
    return tokens, lens, state


def _padded_reference(stack: BiLstmStack, tokens: torch.Tensor, lengths: torch.Tensor,
                      state: LstmState | None) -> tuple[list[torch.Tensor], LstmState]:
    """The reference on the batch padded as the stack pads it (>= 16 rows, a multiple of 4), sliced back."""
    b = tokens.shape[0]
    if state is not None:
        state = LstmState(*(pad_rows(s.transpose(0, 2)).transpose(0, 2) for s in state))
    outs, final = stack.reference_forward(pad_rows(tokens), pad_rows(lengths, 1), state)
    return [o[:, :b] for o in outs], LstmState(final.h[:, :, :b], final.c[:, :, :b])


def _flat(outs: list[torch.Tensor], state: LstmState) -> list[torch.Tensor]:
    return [*outs, state.h, state.c]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("carried", [False, True], ids=["zero_state", "carried_state"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("clips", CLIPS)
def test_exact_inference_kernel_equals_the_reference_bit_for_bit(clips, lengths, carried):
    stack = _stack(clips)
    tokens, lens, state = _inputs(stack, lengths, carried)
    with torch.no_grad():
        got = _flat(*stack(tokens, lens, state, kernel=EXACT))
        want = _flat(*_padded_reference(stack, tokens, lens, state))
        unpadded = _flat(*stack.reference_forward(tokens, lens, state))
    for g, w in zip(got, want):
        assert torch.equal(g, w), float((g - w).abs().max())
    assert _max_diff(got, unpadded) <= 1e-6  # the reference's own products on 1-3 rows
    top = got[1]  # (2, B, T, P), both directions
    valid = torch.arange(tokens.shape[1]) < lens.unsqueeze(1)
    assert bool((top[:, ~valid] == 0).all())  # zero at padding
    assert float((top[:, valid] != 0).float().mean()) > 0.9  # (a clip plus the residual can give 0)
    if clips == "tight":  # the clips bind, so a kernel without them would differ
        assert float(got[0].abs().max()) == pytest.approx(CLIPS["tight"][1])


def _grads(stack: BiLstmStack, run, tokens: torch.Tensor, lengths: torch.Tensor, state: LstmState | None
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Values and gradients of a fixed random projection of every output and final state."""
    stack.zero_grad()
    tokens = tokens.clone().requires_grad_(True)
    if state is not None:
        state = LstmState(*(s.clone().requires_grad_(True) for s in state))
    values = _flat(*run(tokens, lengths, state))
    gen = torch.Generator().manual_seed(7)
    loss = sum((v * torch.randn(v.shape, generator=gen)).sum() for v in values)
    loss.backward()
    leaves = [tokens, *(state or ()), *stack.parameters()]
    return [v.detach() for v in values], [leaf.grad.clone() for leaf in leaves]


@pytest.mark.parametrize("carried", [False, True], ids=["zero_state", "carried_state"])
@pytest.mark.parametrize("lengths", [LENGTHS["seven"], LENGTHS["nine"]], ids=["seven", "nine"])
@pytest.mark.parametrize("clips", CLIPS)
def test_autograd_path_of_the_stack_matches_the_reference_values_and_gradients(clips, lengths, carried):
    stack = _stack(clips)
    tokens, lens, state = _inputs(stack, lengths, carried)
    values, grads = _grads(stack, lambda x, n, s: stack(x, n, s, kernel=EXACT), tokens, lens, state)
    ref_values, ref_grads = _grads(stack, stack.reference_forward, tokens, lens, state)
    for v, r in zip(values, ref_values):
        assert torch.equal(v, r)
    assert _max_diff(grads, ref_grads) <= 1e-5
    assert all(g.abs().max() > 0 for g in grads)


@pytest.mark.parametrize("carried", [False, True], ids=["zero_state", "carried_state"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_fused_kernel_matches_the_reference_without_clips(lengths, carried):
    stack = _stack("none")
    tokens, lens, state = _inputs(stack, lengths, carried)
    values, grads = _grads(stack, lambda x, n, s: stack(x, n, s, kernel=FUSED), tokens, lens, state)
    ref_values, ref_grads = _grads(stack, stack.reference_forward, tokens, lens, state)
    assert _max_diff(values, ref_values) <= 1e-5
    assert _max_diff(grads, ref_grads) <= 2e-5
    with torch.no_grad():
        assert _max_diff(_flat(*stack(tokens, lens, state, kernel=FUSED)), ref_values) <= 1e-5


def test_fused_kernel_is_not_the_reference_when_clips_bind():
    stack = _stack("tight")
    tokens, lens, state = _inputs(stack, LENGTHS["seven"], True)
    with torch.no_grad():
        assert _max_diff(_flat(*stack(tokens, lens, state, kernel=FUSED)),
                         _flat(*stack.reference_forward(tokens, lens, state))) > 1e-2


def test_each_direction_reads_only_its_own_side_of_a_token():
    """Changing token j moves forward outputs at j and after only, backward outputs at j and
    before only, and nothing in another sentence of the batch."""
    stack = _stack("loose")
    tokens, lens, _ = _inputs(stack, LENGTHS["seven"], False)
    row, j = 2, 4  # a sentence of 9 tokens
    changed = tokens.clone()
    changed[row, j] += 1.0
    with torch.no_grad():
        before, _ = stack.reference_forward(tokens, lens)
        after, _ = stack.reference_forward(changed, lens)
    for b, a in zip(before, after):
        moved = (a - b).abs().amax(-1) > 0  # (2, B, T)
        assert moved[0, row].tolist() == [step >= j for step in range(9)]
        assert moved[1, row].tolist() == [step <= j for step in range(9)]
        assert not moved[:, [r for r in range(len(lens)) if r != row]].any()


def test_one_step_follows_the_gate_equations():
    """lstm_step against the equations written out with scalars for one cell of one row."""
    stack = _stack("tight", hidden=3, proj=2)
    layer = stack.layers[0]
    gen = torch.Generator().manual_seed(3)
    x_gates, h, c = torch.randn(2, 1, 12, generator=gen), torch.randn(2, 1, 2, generator=gen), torch.randn(2, 1, 3, generator=gen)
    layer.requires_grad_(False)
    h_new, c_new = lstm_step(x_gates, h, c, layer, *CLIPS["tight"])
    d = 1  # the backward direction
    gates = x_gates[d, 0] + layer.recurrent_weight[d] @ h[d, 0]
    sig, tanh = torch.sigmoid, torch.tanh
    cell = [max(-0.3, min(0.3, float(sig(gates[3 + k]) * c[d, 0, k] + sig(gates[k]) * tanh(gates[6 + k]))))
            for k in range(3)]
    hidden = torch.tensor([float(sig(gates[9 + k]) * tanh(torch.tensor(cell[k]))) for k in range(3)])
    out = (layer.projection[d] @ hidden).clamp(-0.1, 0.1)
    torch.testing.assert_close(c_new[d, 0], torch.tensor(cell), rtol=0, atol=1e-6)
    torch.testing.assert_close(h_new[d, 0], out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernel", [EXACT, FUSED])
def test_the_layers_returned_hold_the_callers_rows_only(kernel):
    # the stack pads a batch to MIN_ROWS rows; its results were views of the padded tensors, so one
    # long sentence held 16 rows of every layer (the default model: 110 KB a token, 63 now)
    stack = _stack("none")
    tokens, lengths, _ = _inputs(stack, [40], carried=False)
    with torch.inference_mode():
        outs, _ = stack(tokens, lengths, kernel=kernel)
        expected, _ = _padded_reference(stack, tokens, lengths, None)
    for out, ref in zip(outs, expected):
        assert out.shape == (2, 1, 40, 12)
        assert out.untyped_storage().nbytes() == 2 * 40 * 12 * out.element_size()
        assert torch.equal(out, ref) if kernel == EXACT else torch.allclose(out, ref, atol=1e-5)
