"""How far kernel="fused" (torch's LSTM, no clips) drifts from kernel="exact" on a model with
clips, and how far each kernel's vectors move with the batch size.

    python -m benchmarks.kernel_drift [--sentences 2000] [--batch-tokens 2048]
    python -m benchmarks.kernel_drift --across-batches 97,8192 [--sentences 2000]

The first loads the original implementation's small trained biLM (cell clip 3, projection clip
3), embeds WikiText-2 valid sentences with both kernels (zero state, the same length-sorted
batches) and prints, per output layer, the max and mean absolute difference over real tokens
with its 99.9th percentile and the share of values off by more than 0.01, next to the mean
absolute value of the exact output, for scale. Layer 0 (the char CNN) has no LSTM: it must be 0.

The second embeds the same sentences with the default model (no clips) in length-sorted
batches of two token budgets, with each kernel and with `auto` as it resolves on this device,
and prints per output layer the largest difference of any value of any sentence between the
two runs: what the README's batch-invariance promise (1e-6) is about.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from elmo_pipeline import BiLM
from elmo_pipeline.model.lstm import EXACT, FUSED, KERNELS

from .common import Sentence, batches_by_tokens, shared_data_dir, wikitext_sentences


def load_reference() -> BiLM:
    d = shared_data_dir() / "allennlp_elmo"
    return BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5")).eval()


def layer_drift(model: BiLM, batches: list[list[Sentence]]) -> list[dict[str, float]]:
    """Per output layer, over every (real token, feature): max, mean and 99.9th percentile of
    |fused - exact|, the share of values off by more than 0.01, and mean |exact| for scale."""
    n_layers = model.config.n_output_layers
    diffs: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
    values: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
    with torch.inference_mode():
        for batch in batches:
            model.kernel = EXACT
            exact = model.embed(batch)
            model.kernel = FUSED
            fused = model.embed(batch)
            for j in range(n_layers):
                diffs[j].append((fused.layers[j] - exact.layers[j])[exact.mask].abs().numpy())
                values[j].append(exact.layers[j][exact.mask].abs().numpy())
    model.kernel = EXACT
    rows = []
    for j in range(n_layers):
        d = np.concatenate(diffs[j]).ravel().astype(np.float64)
        rows.append({"max": d.max(), "mean": d.mean(), "p999": float(np.percentile(d, 99.9)),
                     "over": float((d > 1e-2).mean()), "scale": float(np.concatenate(values[j]).mean())})
    return rows


def batch_drift(model: BiLM, sentences: list[Sentence], budgets: tuple[int, int]) -> list[float]:
    """Per output layer, max |a - b| over every sentence's values, a embedded in batches of
    budgets[0] tokens and b in batches of budgets[1] (the word cache emptied before each run)."""
    runs: list[dict[int, torch.Tensor]] = []
    for budget in budgets:
        model.clear_cache()
        vectors: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            for batch in batches_by_tokens(sentences, budget):
                out = model.embed(batch)
                for row, sentence in enumerate(batch):
                    vectors[id(sentence)] = out.layers[:, row, : out.lengths[row]].clone()
        runs.append(vectors)
    first, second = runs
    return torch.stack([(first[k] - second[k]).abs().amax(dim=(1, 2)) for k in first]).amax(0).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=2000, help="first N WikiText-2 valid sentences (0: all)")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--across-batches", default=None, metavar="A,B",
                        help="instead: the default model's drift between batches of A and of B tokens, per kernel")
    args = parser.parse_args(argv)
    sentences = wikitext_sentences("valid")
    if args.sentences:
        sentences = sentences[: args.sentences]
    if args.across_batches:
        a, b = (int(x) for x in args.across_batches.split(","))
        model = BiLM.from_pretrained().eval()
        print(f"default model, {len(sentences)} WikiText-2 valid sentences, {sum(map(len, sentences))} tokens, "
              f"{torch.get_num_threads()} torch threads; max |batches of {a} - batches of {b}| per output layer:")
        for kernel in KERNELS:
            model.kernel = kernel
            drift = batch_drift(model, sentences, (a, b))
            print(f"  {kernel:5} ({model.resolved_kernel():5} here): " + "  ".join(f"{d:.2e}" for d in drift))
        return
    model = load_reference()
    lstm = model.config.lstm
    tokens = sum(len(s) for s in sentences)
    print(f"reference biLM (cell {lstm.dim}, projection {lstm.projection_dim}, cell_clip {lstm.cell_clip}, "
          f"proj_clip {lstm.proj_clip}); {len(sentences)} WikiText-2 valid sentences, {tokens} tokens")
    rows = layer_drift(model, batches_by_tokens(sentences, args.batch_tokens))
    print("|fused - exact| per output layer, over every (token, feature) value:")
    print(f"{'layer':>5} {'max':>10} {'mean':>10} {'99.9%':>10} {'> 0.01':>8} {'mean |exact|':>13}")
    for j, r in enumerate(rows):
        print(f"{j:5d} {r['max']:10.3e} {r['mean']:10.3e} {r['p999']:10.3e} {100 * r['over']:7.2f}% {r['scale']:13.3e}")


if __name__ == "__main__":
    main()
