"""How far bf16 vectors drift from fp32 vectors, per output layer, for three models.

    python -m benchmarks.precision_drift [--models default,reference,original] [--sentences 0]
        [--original-sentences 2000] [--batch-tokens 4096] [--json PATH]

Every length-sorted batch of WikiText-2 valid sentences is embedded twice from a zero state with
the exact kernel: in fp32, and under bf16 autocast (`runtime.autocast`: matrix products in bf16,
the LSTM cell state and the elementwise step in float32). Per output layer, over real tokens
only: max and mean |bf16 - fp32| over every (token, feature) value and its 99.9th percentile,
the relative RMS sqrt(sum (bf16 - fp32)^2 / sum fp32^2), the smallest cosine similarity between
a token's bf16 and fp32 vectors, and mean |fp32| for scale.

The models: `default`, the embedded default model; `reference`, the original implementation's
small trained biLM (cell 64, projection 16, clips 3) from the shared data; `original`, the
Original shape (4096/512, clips 3) with the random weights bench_bilm times (seed 0). A trained
model's activations are not those of random weights, so the Original's figures only indicate
the size of the drift at that width; the first two are trained models. The small models see
--sentences sentences, the Original --original-sentences (the first N of the split; 0: all).
The word cache is off (bf16 and fp32 alternate, which would empty it at every batch; its
vectors are the same bits either way).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from elmo_pipeline import BiLM, runtime
from elmo_pipeline.model.bilm import Embeddings
from elmo_pipeline.model.lstm import EXACT
from elmo_pipeline.strict import dumps_strict

from .bench_bilm import DEFAULT_MODEL, build_model
from .common import Sentence, batches_by_tokens, wikitext_sentences
from .kernel_drift import Run, kernel_run, layer_drift, load_reference

MODELS = ("default", "reference", "original")
FIGURES = (("max", "max"), ("mean", "mean"), ("p999", "99.9%"), ("rel_rms", "rel RMS"), ("min_cos", "min cos"),
           ("scale", "mean |fp32|"))


def precision_run(precision: str) -> Run:
    """A way to embed a batch: the exact kernel under `precision`'s autocast (none for fp32)."""
    exact = kernel_run(EXACT)

    def run(model: BiLM, batch: list[Sentence]) -> Embeddings:
        with runtime.autocast(model.device, precision):
            return exact(model, batch)
    return run


def precision_drift(model: BiLM, sentences: list[Sentence], batch_tokens: int = 4096,
                    precision: str = "bf16") -> list[dict[str, float]]:
    """Per output layer, the drift of `precision` from fp32 (kernel_drift.layer_drift's figures;
    a = fp32, b = `precision`), over `sentences` in length-sorted batches of `batch_tokens`."""
    runs = (precision_run("fp32"), precision_run(precision))
    return layer_drift(model, batches_by_tokens(sentences, batch_tokens), runs)


def load_model(name: str) -> tuple[BiLM, str]:
    """The model `name` (one of MODELS) on CPU without a word cache, and a line describing it."""
    cpu = torch.device("cpu")
    if name == "reference":
        model = load_reference(cache_size=0)
        what = "reference biLM (trained; cell 64, projection 16, clips 3)"
    else:
        model = build_model(name, cache=False, device=cpu, seed=0)  # bench_bilm's: "default" is the embedded model
        what = ("embedded default model (trained)" if name == DEFAULT_MODEL
                else "Original shape, random weights (seed 0): indicative only")
    lstm = model.config.lstm
    return model, (f"{what}: LSTM {lstm.dim}/{lstm.projection_dim}, clips {lstm.cell_clip}/{lstm.proj_clip}, "
                   f"{model.config.n_output_layers} output layers of {2 * lstm.projection_dim}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--sentences", type=int, default=0,
                        help="first N WikiText-2 valid sentences for the default and reference models (0: all)")
    parser.add_argument("--original-sentences", type=int, default=2000,
                        help="first N sentences for the Original shape (0: all; about 20 min on 2 cores)")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                        help="the precision compared with fp32 (fp32: a check that gives 0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        parser.error(f"--models: expected some of {', '.join(MODELS)}, got {args.models!r}")
    cpu = torch.device("cpu")
    runtime.check_precision(cpu, args.precision)
    every = wikitext_sentences("valid")
    print(f"|{args.precision} - fp32| per output layer over real tokens; exact kernel, zero state, length-sorted "
          f"batches of <= {args.batch_tokens} padded positions; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, native bf16: {runtime.native_bf16(cpu)}")
    report: dict = {"precision": args.precision, "kernel": EXACT, "batch_tokens": args.batch_tokens,
                    "threads": torch.get_num_threads(), "torch": torch.__version__, "models": {}}
    for name in names:
        model, what = load_model(name)
        n = args.original_sentences if name == "original" else args.sentences
        sentences = every[:n] if n else every
        tokens = sum(map(len, sentences))
        print(f"\n{name}: {what}\n  {len(sentences)} of {len(every)} WikiText-2 valid sentences, {tokens} tokens",
              flush=True)
        start = time.perf_counter()
        rows = precision_drift(model, sentences, args.batch_tokens, args.precision)
        seconds = time.perf_counter() - start
        print(f"  {'layer':>5} " + " ".join(f"{label:>11}" for _, label in FIGURES))
        for j, row in enumerate(rows):
            print(f"  {j:5d} " + " ".join(f"{row[key]:11.4e}" if key != "min_cos" else f"{row[key]:11.7f}"
                                          for key, _ in FIGURES))
        print(f"  ({seconds:.0f} s for both precisions)", flush=True)
        report["models"][name] = {"description": what, "sentences": len(sentences), "tokens": tokens,
                                  "seconds": seconds, "layers": rows}
        del model
    if args.json:
        Path(args.json).write_text(dumps_strict(report, args.json, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
