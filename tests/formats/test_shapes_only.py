"""`shapes_only`: a model built on the meta device for its shapes, without torch's meta kernels
for the random fills (whose first call imported some 830 modules of torch at every model load)."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from elmo_pipeline import BiLM
from elmo_pipeline.formats.shapes import shapes_only
from support import MODEL_KINDS, small_model_config

# the default model loaded in a new process (its config is checked against its tensors on the meta
# device first, as at every load): what the meta kernels of a fill brought in is listed
_LOAD_IN_A_NEW_PROCESS = """
import sys
from elmo_pipeline import BiLM
before = set(sys.modules)
BiLM.load(None)
print(sorted(m for m in set(sys.modules) - before if m in ("torch._meta_registrations", "torch._decomp", "torch._dynamo")))
"""


def test_a_model_loads_without_torchs_meta_kernels():
    out = subprocess.run([sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"  # the old check imported torch._dynamo: some 820 modules, 1 to 2 s of CPU


@pytest.mark.parametrize("encoder, softmax", MODEL_KINDS)
def test_the_shapes_are_those_of_the_meta_device(encoder, softmax):
    config, words = small_model_config(encoder, softmax)
    with torch.device("meta"):
        want = {k: (tuple(v.shape), v.dtype) for k, v in BiLM(config, words, cache_size=0).state_dict().items()}
    with shapes_only():
        got = BiLM(config, words, cache_size=0).state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == want
    assert all(v.is_meta for v in got.values())


def test_only_fills_of_meta_tensors_are_skipped():
    with shapes_only():
        on_cpu = torch.zeros(3, device="cpu")
        nn.init.constant_(on_cpu, 2.5)  # a tensor with values is filled as before
        embedding = nn.Embedding(4, 2)
    assert on_cpu.tolist() == [2.5, 2.5, 2.5] and embedding.weight.is_meta
    torch.manual_seed(0)
    after = nn.Embedding(4, 2).weight  # outside, a new layer is filled at random as before
    torch.manual_seed(0)
    assert torch.equal(after, torch.randn(4, 2)) and not after.is_meta
