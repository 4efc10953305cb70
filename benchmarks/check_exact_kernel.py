"""Numerical checks for speed work on the biLM: run after touching lstm.py, bilm.py or word_cache.py.

    python -m benchmarks.check_exact_kernel

1. The in-place inference kernel equals the reference (lstm_reference.lstm_layer) bit for bit
   (outputs and final states), on random configs, ragged lengths and random initial states.
2. The original's fixture: token embeddings and the carried-state top layer within 1e-5.
3. fused == exact within 1e-5 on a config without clips.
4. encode_words in chunks equals one encoder call.
5. Batch invariance: a sentence's vectors are the same bits alone and inside a larger batch.
Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import h5py
import numpy as np
import torch

from elmo_pipeline import BiLM, CarriedState
from elmo_pipeline.model.batch_invariance import pad_rows
from elmo_pipeline.model.config import CharCnnConfig, ElmoConfig, LstmConfig
from elmo_pipeline.model.lstm import EXACT, FUSED, BiLstmLayer, _exact_layer
from elmo_pipeline.model.lstm_reference import lstm_layer

from .common import shared_data_dir

FAILURES: list[str] = []


def report(name: str, value: float, limit: float) -> None:
    ok = value <= limit
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3g} (limit {limit:g})")
    if not ok:
        FAILURES.append(name)


def check_kernels_bitwise() -> None:
    cases = [  # (input dim, hidden, projection, clips, rows, max length)
        (16, 64, 16, 3.0, 3, 9), (12, 32, 12, None, 13, 17), (128, 1024, 128, 3.0, 37, 30),
        (64, 256, 64, 0.5, 64, 12), (512, 4096, 512, 3.0, 9, 6),
    ]
    gen = torch.Generator().manual_seed(0)
    for i, hidden, proj, clip, rows, max_len in cases:
        torch.manual_seed(len(FAILURES) + hidden)
        layer = BiLstmLayer(i, hidden, proj).requires_grad_(False)
        layer.bias.normal_(0, 0.5, generator=gen)
        b = len(pad_rows(torch.zeros(rows)))  # the stack pads rows to >= 16, a multiple of 4
        lengths = sorted((int(v) for v in torch.randint(1, max_len + 1, (b,), generator=gen)), reverse=True)
        batch_sizes = [sum(1 for n in lengths if n > s) for s in range(max_len)]
        x = torch.randn(2, b, max_len, i, generator=gen)
        for row, n in enumerate(lengths):
            x[:, row, n:] = 0
        h = torch.randn(2, b, proj, generator=gen) * 0.3
        c = torch.randn(2, b, hidden, generator=gen)
        with torch.no_grad():
            ref = lstm_layer(x, torch.tensor(lengths), layer, h, c, clip, clip)
            new = _exact_layer(x, torch.tensor(lengths), batch_sizes, layer, h, c, clip, clip)
        worst = max(float((a - b_).abs().max()) for a, b_ in zip(ref, new))
        same = all(torch.equal(a, b_) for a, b_ in zip(ref, new))
        report(f"inference kernel == reference, H={hidden} P={proj} clip={clip} rows={b}"
               f"{' (bitwise)' if same else ''}", worst, 0.0)


def check_encoder_chunks() -> None:
    """encode_words splits long word lists into chunks; the bits must not depend on it."""
    from elmo_pipeline.model.bilm import _ENCODE_CHUNK_CPU
    from elmo_pipeline.model.characters import tokens_char_ids

    from .common import shape_config, wikitext_sentences

    torch.manual_seed(0)
    model = BiLM(shape_config("small"), cache_size=0).eval()
    words = list(dict.fromkeys(w for s in wikitext_sentences("valid")[:200] for w in s))[: 3 * _ENCODE_CHUNK_CPU + 5]
    with torch.no_grad():
        chunked = model.encode_words(words)
        whole = model.token_encoder(torch.from_numpy(tokens_char_ids(words)), None)
    report(f"encode_words in chunks vs one call ({len(words)} words)"
           + (" (bitwise)" if torch.equal(chunked, whole) else ""), float((chunked - whole).abs().max()), 1e-6)


def reference_model() -> BiLM:
    d = shared_data_dir() / "allennlp_elmo"
    return BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5")).eval()


def check_fixture(model: BiLM) -> None:
    d = shared_data_dir() / "allennlp_elmo"
    words = [line.rstrip("\n") for line in open(d / "vocab_test.txt", encoding="utf-8")]
    with torch.no_grad():
        reps = model.encode_words(words).numpy()
    with h5py.File(d / "elmo_token_embeddings.hdf5") as f:
        report("token embeddings vs fixture", float(np.abs(reps - f["embedding"][...]).max()), 1e-5)
    sentences = json.loads((d / "sentences.json").read_text())
    carried = CarriedState(model)
    worst = 0.0
    with torch.no_grad(), h5py.File(d / "lm_embeddings_0.hdf5") as expected:
        for i in range(10):
            out = carried.embed([sentences[j][i].split() for j in range(3)])
            top = out.layers[-1, 0, : out.lengths[0]].numpy()
            ref = np.concatenate([expected[str(i)][0], expected[str(i)][1]], -1)
            worst = max(worst, float(np.abs(top - ref).max()))
    report("carried-state top layer vs fixture", worst, 1e-5)


def check_fused_equals_exact() -> None:
    torch.manual_seed(1)
    cnn = CharCnnConfig(embedding_dim=8, filters=((1, 8), (2, 8), (3, 16)), n_highway=1)
    model = BiLM(ElmoConfig(lstm=LstmConfig(dim=32, projection_dim=12, n_layers=2), char_cnn=cnn)).eval()
    batch = [["a", "b", "c", "d"], ["hello", "world"], ["x"] * 9, ["one"]]
    with torch.no_grad():
        model.kernel = FUSED
        fused = model.embed(batch).layers
        model.kernel = EXACT
        exact = model.embed(batch).layers
    report("fused vs exact without clips", float((fused - exact).abs().max()), 1e-5)


def check_batch_invariance(model: BiLM) -> None:
    d = shared_data_dir() / "allennlp_elmo"
    sents = [s.split() for group in json.loads((d / "sentences.json").read_text()) for s in group]
    rng = random.Random(3)
    target = sents[4]
    others = [rng.choice(sents)[: rng.randint(1, 60)] for _ in range(63)]
    with torch.no_grad():
        alone = model.embed([target])
        big = model.embed(others[:20] + [target] + others[20:])
    a = alone.layers[:, 0, : alone.lengths[0]]
    b = big.layers[:, 20, : big.lengths[20]]
    report("alone vs in a batch of 64" + (" (bitwise)" if torch.equal(a, b) else ""),
           float((a - b).abs().max()), 1e-6)


def main() -> int:
    # it takes no option: --help shows what it checks, and any argument is an error naming it, not ignored
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    check_kernels_bitwise()
    check_encoder_chunks()
    model = reference_model()
    check_fixture(model)
    check_fused_equals_exact()
    check_batch_invariance(model)
    print("all checks passed" if not FAILURES else f"{len(FAILURES)} check(s) failed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
