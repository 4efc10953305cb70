"""Zero-state extraction: a sentence's vectors do not depend on its batch, neighbours or order."""

import json
import random

import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.config import CharCnnConfig, LstmConfig


def _sentences(elmo_fixture_dir):
    data = json.loads((elmo_fixture_dir / "sentences.json").read_text())
    return [s.split() for group in data for s in group]


def _vectors(model, batch, index):
    with torch.no_grad():
        out = model.embed(batch)
    return out.layers[:, index, : out.lengths[index]].numpy()


@pytest.mark.parametrize("kernel", ["exact", "fused"])
def test_same_vectors_alone_in_three_or_in_sixty_four(reference_model, elmo_fixture_dir, kernel):
    reference_model.kernel = kernel
    try:
        sents = _sentences(elmo_fixture_dir)
        target = sents[4]
        alone = _vectors(reference_model, [target], 0)
        three = _vectors(reference_model, [sents[1], target, sents[7]], 1)
        rng = random.Random(3)
        neighbours = [rng.choice(sents)[: rng.randint(1, 60)] for _ in range(63)]
        neighbours[5] = sents[1] * 3  # a much longer neighbour
        big = neighbours[:20] + [target] + neighbours[20:]
        sixty_four = _vectors(reference_model, big, 20)
        shuffled = big[::-1]
        reversed_order = _vectors(reference_model, shuffled, len(big) - 1 - 20)
        for other in (three, sixty_four, reversed_order):
            np.testing.assert_allclose(other, alone, atol=1e-6, rtol=0)
    finally:
        reference_model.kernel = "exact"


def _no_clip_config(encoder="char_cnn", vocab_size=None):
    cnn = CharCnnConfig(embedding_dim=8, filters=((1, 8), (2, 8), (3, 16)), n_highway=1)
    lstm = LstmConfig(dim=32, projection_dim=12, n_layers=2)
    return ElmoConfig(lstm=lstm, char_cnn=cnn if encoder != "word" else None, token_encoder=encoder,
                      word_embedding_dim=10 if encoder != "char_cnn" else None, vocab_size=vocab_size)


def test_fused_kernel_equals_exact_kernel_without_clips():
    torch.manual_seed(1)
    model = BiLM(_no_clip_config(), kernel="fused").eval()
    batch = [["a", "b", "c", "d"], ["hello", "world"], ["x"] * 9]
    fused = model.embed(batch).layers.detach()
    model.kernel = "exact"
    exact = model.embed(batch).layers.detach()
    np.testing.assert_allclose(fused, exact, atol=1e-5)


def test_fused_kernel_drifts_when_the_model_has_clips(reference_model, elmo_fixture_dir):
    sents = _sentences(elmo_fixture_dir)[:10]
    with torch.no_grad():
        exact = reference_model.embed(sents).layers
        reference_model.kernel = "fused"
        try:
            fused = reference_model.embed(sents).layers
        finally:
            reference_model.kernel = "exact"
    assert torch.equal(exact[0], fused[0])  # the token layer has no LSTM
    assert (exact[1:] - fused[1:]).abs().max() > 1e-4
