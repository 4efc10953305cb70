"""Zero-state extraction: a sentence's vectors do not depend on its batch, neighbours or order."""

import json
import random

import numpy as np
import pytest
import torch

from elmo_pipeline import BiLM, ElmoConfig
from elmo_pipeline.cli.main import main
from elmo_pipeline.model.batch_invariance import GRAIN_SIZE, elementwise_rows
from elmo_pipeline.model.config import CharCnnConfig, LstmConfig
from elmo_pipeline.pipelines.extract import run
from support import parse_extract_args, read_output, ud_texts, vector_column


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


def test_a_model_with_clips_refuses_the_fused_kernel_when_asked_for_it(elmo_fixture_dir, capsys, tmp_path):
    # the drift above is more than 1 on the layers of the released models: asked by name, fused
    # is refused for them, by the library and by every command that loads a model
    d = elmo_fixture_dir
    options, weights = str(d / "options.json"), str(d / "lm_weights.hdf5")
    with pytest.raises(ValueError, match=r"kernel 'fused' .* has no cell or projection clips, and this model clips "
                                         r"\(cell_clip 3.0, proj_clip 3.0\)"):
        BiLM.from_allennlp(options, weights, kernel="fused")
    assert BiLM.from_allennlp(options, weights, kernel="auto").resolved_kernel() == "exact"
    text = tmp_path / "in.txt"
    text.write_text("A sentence .\n")
    assert main(["embed-file", str(text), str(tmp_path / "out.hdf5"), "--options", options, "--weights", weights,
                 "--kernel", "fused"]) == 2
    assert "has no cell or projection clips" in capsys.readouterr().err
    assert not (tmp_path / "out.hdf5").exists()


def test_auto_kernel_is_exact_on_cpu_and_fused_on_cuda_without_clips(reference_model):
    no_clips = BiLM(_no_clip_config())
    assert no_clips.kernel == "auto" and no_clips.resolved_kernel() == "exact"  # this machine: CPU
    assert no_clips.lstm.resolve_kernel("auto", torch.device("cuda")) == "fused"
    assert reference_model.lstm.resolve_kernel("auto", torch.device("cuda")) == "exact"  # clips: never fused
    assert BiLM(_no_clip_config(), kernel="fused").resolved_kernel() == "fused"
    with pytest.raises(ValueError, match="kernel must be one of"):
        BiLM(_no_clip_config(), kernel="cudnn")


def test_a_model_projecting_to_no_fewer_units_than_its_cell_never_runs_fused():
    # torch's LSTM op takes a projection only to fewer units than the cell ("got an incorrect number of RNN
    # parameters" otherwise): such a model (bilm-tf's unprojected cells import as projection_dim == dim) is
    # refused fused by name, and auto runs it exact on CUDA too
    config = ElmoConfig(lstm=LstmConfig(dim=12, projection_dim=12, n_layers=2), char_cnn=_no_clip_config().char_cnn)
    with pytest.raises(ValueError, match=r"kernel 'fused' .* projects only to fewer units than the cell has, and this "
                                         r"model has lstm\.projection_dim 12, lstm\.dim 12"):
        BiLM(config, kernel="fused")
    torch.manual_seed(2)
    model = BiLM(config).eval()
    assert model.lstm.resolve_kernel("auto", torch.device("cuda")) == "exact"
    batch = [["a", "b", "c"], ["hello"]]
    with torch.no_grad():
        tokens, lengths = model.sentence_tokens(batch)
        layers, _ = model.lstm(tokens, lengths, kernel=model.lstm.resolve_kernel("auto", torch.device("cuda")))
        specified, _ = model.lstm.reference_forward(tokens, lengths)
    for got, want in zip(layers, specified):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the reference's own products on 1-3 rows


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_extract_with_default_options_gives_the_same_vectors_at_any_batch_size(tmp_path, precision):
    """The default model and kernel: a corpus extracted in batches of 97 tokens and of 8192 (the
    default). float32 output, because float16 would round most of a drift away. bf16 gives the
    same bits in both (measured, and asserted)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(ud_texts("ud_english_ewt", "en_ewt-ud-dev.conllu", n=80)) + "\n", encoding="utf-8")
    tables = []
    for batch_tokens in ("97", "8192"):
        output = tmp_path / batch_tokens
        summary = run(*parse_extract_args(["--input", str(corpus), "--output", str(output), "--dtype", "float32",
                                           "--batch-tokens", batch_tokens, "--precision", precision]))
        assert summary["tokens"] > 1000
        tables.append(read_output(output))
    small, large = tables
    assert small.column("token_id").to_pylist() == large.column("token_id").to_pylist()
    layers = [c for c in small.column_names if c.startswith("layer_")]
    assert len(layers) == 3
    for name in layers:
        drift = np.abs(vector_column(small, name) - vector_column(large, name)).max()
        assert drift <= (1e-6 if precision == "fp32" else 0.0), f"{name}: {drift:.2e}"


def test_one_torch_thread_gives_a_sentence_the_bits_of_two_threads_in_any_batch():
    # Workers often run torch on one thread (extract gives each worker its share of the
    # cores); the char CNN's one-thread path for a few rows used to differ in the last bit.
    model = BiLM.from_pretrained(cache_size=0).eval()
    target = "The quick brown fox jumps over".split()
    rng = random.Random(5)
    vocab = [f"w{i}x{i * 7}" for i in range(200)]
    neighbours = [[rng.choice(vocab) for _ in range(rng.randint(3, 9))] for _ in range(40)]
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_vectors(model, [target], 0))
            results.append(_vectors(model, neighbours[:20] + [target] + neighbours[20:], 20))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("threads", [3, 5, 8])
def test_more_torch_threads_give_a_sentence_the_same_bits_in_any_batch(threads):
    """Workers on machines with more cores run torch on more threads: the float32 sigmoid and
    tanh were cut between them inside rows, and a sentence in a large batch moved by up to
    1.7e-6 from itself alone (with 3 threads this test failed before the fix). Alone and in the
    batches at the same thread count: across thread counts MKL may split a product's sum (on
    an AMX Xeon the highway's with 8 threads, 2.9e-6), which no row padding can undo."""
    model = BiLM.from_pretrained(cache_size=0).eval()
    rng = random.Random(threads)
    vocab = [f"w{i}x{i * 7}" for i in range(300)]
    batch = [[rng.choice(vocab) for _ in range(rng.randint(3, 40))] for _ in range(90)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone = {i: _vectors(model, [batch[i]], 0) for i in (0, 17, 45, 89)}
        for size in (20, 46, 90):
            for i in (i for i in alone if i < size):
                np.testing.assert_array_equal(_vectors(model, batch[:size], i), alone[i], err_msg=f"{size}, {i}")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7, 8, 16])
def test_elementwise_rows_put_every_cut_between_rows(threads):
    for hidden in (64, 512, 4096):
        for n in range(1, 300):
            rows = elementwise_rows(n, (2 * hidden, hidden), threads)
            assert rows >= n and (threads > 2 or rows == n)
            for width in (2 * hidden, hidden):
                elements = 2 * rows * width
                stretches = 1 if elements <= GRAIN_SIZE else min(threads, -(-elements // GRAIN_SIZE))
                assert -(-elements // stretches) % width == 0, (hidden, n, rows, width)
