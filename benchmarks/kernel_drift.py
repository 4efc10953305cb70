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
from typing import Callable

import numpy as np
import torch

from elmo_pipeline import BiLM
from elmo_pipeline.model.bilm import DEFAULT_CACHE_SIZE, Embeddings
from elmo_pipeline.model.lstm import EXACT, FUSED, KERNELS

from .common import Sentence, batches_by_tokens, shared_data_dir, wikitext_sentences


def load_reference(cache_size: int = DEFAULT_CACHE_SIZE) -> BiLM:
    d = shared_data_dir() / "allennlp_elmo"
    return BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5"), cache_size=cache_size).eval()


Run = Callable[[BiLM, list[Sentence]], Embeddings]


def kernel_run(kernel: str) -> Run:
    """A way to embed a batch: with the LSTM kernel `kernel` (set on the model; put back after)."""
    def run(model: BiLM, batch: list[Sentence]) -> Embeddings:
        before, model.kernel = model.kernel, kernel
        try:
            return model.embed(batch)
        finally:
            model.kernel = before
    return run


def layer_drift(model: BiLM, batches: list[list[Sentence]],
                runs: tuple[Run, Run] | None = None) -> list[dict[str, float]]:
    """Per output layer, how far run b's vectors are from run a's (by default a: the exact
    kernel, b: the fused one), each batch embedded both ways, over its real tokens: max, mean and
    99.9th percentile of |b - a| over every (token, feature) value, the share of values off by
    more than 0.01, the relative RMS sqrt(sum (b - a)^2 / sum a^2), the smallest cosine between a
    token's a and b vectors (`min_cos`; tokens with a zero vector left out), and mean |a| for
    scale. Sums in float64."""
    run_a, run_b = runs or (kernel_run(EXACT), kernel_run(FUSED))
    n_layers = model.config.n_output_layers
    diffs: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
    sums = np.zeros((n_layers, 3))  # per layer: sum |a|, sum (b - a)^2, sum a^2 (float64)
    min_cos = np.full(n_layers, np.inf)
    with torch.inference_mode():
        for batch in batches:
            a_out = run_a(model, batch)
            b_out = run_b(model, batch)
            mask = a_out.mask
            for j in range(n_layers):
                a = a_out.layers[j][mask].double()  # (tokens, features)
                b = b_out.layers[j][mask].double()
                d = b - a
                diffs[j].append(d.abs().float().cpu().numpy())
                sums[j] += [a.abs().sum().item(), d.square().sum().item(), a.square().sum().item()]
                na, nb = a.norm(dim=1, keepdim=True), b.norm(dim=1, keepdim=True)
                both = ((na > 0) & (nb > 0)).squeeze(1)
                if both.any():  # 1 - |a/|a| - b/|b||^2 / 2: accurate near 1, and exactly 1 when b == a
                    cos = 1 - (a[both] / na[both] - b[both] / nb[both]).square().sum(1) / 2
                    min_cos[j] = min(min_cos[j], cos.min().item())
    rows = []
    for j in range(n_layers):
        d = np.concatenate(diffs[j]).ravel().astype(np.float64)
        rows.append({"max": float(d.max()), "mean": float(d.mean()), "p999": float(np.percentile(d, 99.9)),
                     "over": float((d > 1e-2).mean()), "rel_rms": float(np.sqrt(sums[j, 1] / sums[j, 2])),
                     "min_cos": float(min_cos[j]), "scale": float(sums[j, 0] / d.size)})
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
