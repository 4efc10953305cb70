"""How far kernel="fused" (nn.LSTM, no clips) drifts from kernel="exact" on a model with clips.

    python -m benchmarks.kernel_drift [--sentences 2000] [--batch-tokens 2048]

Loads the original implementation's small trained biLM (cell clip 3, projection clip 3),
embeds WikiText-2 valid sentences with both kernels (zero state, the same length-sorted
batches) and prints, per output layer, the max and mean absolute difference over real tokens
with its 99.9th percentile and the share of values off by more than 0.01, next to the mean
absolute value of the exact output, for scale. Layer 0 (the char CNN) has no LSTM: it must be 0.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from elmo_pipeline import BiLM

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
            model.kernel = "exact"
            exact = model.embed(batch)
            model.kernel = "fused"
            fused = model.embed(batch)
            for j in range(n_layers):
                diffs[j].append((fused.layers[j] - exact.layers[j])[exact.mask].abs().numpy())
                values[j].append(exact.layers[j][exact.mask].abs().numpy())
    model.kernel = "exact"
    rows = []
    for j in range(n_layers):
        d = np.concatenate(diffs[j]).ravel().astype(np.float64)
        rows.append({"max": d.max(), "mean": d.mean(), "p999": float(np.percentile(d, 99.9)),
                     "over": float((d > 1e-2).mean()), "scale": float(np.concatenate(values[j]).mean())})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=2000, help="first N WikiText-2 valid sentences (0: all)")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    sentences = wikitext_sentences("valid")
    if args.sentences:
        sentences = sentences[: args.sentences]
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
