"""Parity of an imported ELMoForManyLangs model with the vectors the family's own `Embedder` gave.

    python -m benchmarks.formanylangs_parity [--batch-sizes 1,7,64] [--standard-shape]

Imports `../shared/data/formanylangs/fixture_small/model` with `elmo-pipeline import-formanylangs`,
then embeds its 40 sentences through the Python API (`BiLM.from_pretrained(DIR).embed`, in batches
of each size) and through `elmo-pipeline embed-file --all` and `--average` (tab-separated tokens,
each batch size), and prints the largest absolute difference from `expected.hdf5` per layer and
from `expected_average.hdf5`, over every value of every sentence, and the largest difference
between the batch sizes.

`--standard-shape` also writes a random model of the family's standard network
(cnn_50_100_512_4096_sample.json: 2048 filters, 2 highways, cell 4096, projection 512; about
400 MB) and holds its import to the independent float64 reference (formanylangs_family.py) on a
few sentences of the fixture.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import h5py
import numpy as np
import torch

from elmo_pipeline import BiLM
from elmo_pipeline.cli.main import main as cli
from elmo_pipeline.formats.formanylangs import STANDARD_NETWORK_CONFIGS

from .common import shared_data_dir
from .formanylangs_family import reference_layers, write_model


def worst(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    """Largest absolute difference per leading index (layer) for 3-d arrays, else one figure."""
    per = [np.abs(g - w).reshape(g.shape[0] if g.ndim == 3 else 1, -1).max(axis=1) for g, w in zip(got, want)]
    return [float(v) for v in np.max(per, axis=0)]


def api_vectors(model_dir: Path, sentences: list[list[str]], batch_size: int) -> list[np.ndarray]:
    model = BiLM.from_pretrained(str(model_dir)).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(sentences), batch_size):
            result = model.embed(sentences[start : start + batch_size])
            out += [result.layers[:, i, :n].numpy() for i, n in enumerate(result.lengths)]
    return out


def embed_file_vectors(model_dir: Path, lines: Path, mode: str, batch_size: int, n: int, work: Path) -> list[np.ndarray]:
    out = work / f"{mode}-{batch_size}.hdf5"
    code = cli(["embed-file", str(lines), str(out), f"--{mode}", "--tab-separated", "--model", str(model_dir),
                "--batch-size", str(batch_size), "--quiet"])
    assert code == 0, code
    with h5py.File(out) as f:
        return [f[str(i)][...] for i in range(n)]


def fixture_parity(batch_sizes: list[int], work: Path) -> dict:
    fixture = shared_data_dir() / "formanylangs" / "fixture_small"
    sentences = json.loads((fixture / "sentences.json").read_text(encoding="utf-8"))
    with h5py.File(fixture / "expected.hdf5") as f:
        expected = [f[str(i)][...] for i in range(len(sentences))]
    with h5py.File(fixture / "expected_average.hdf5") as f:
        expected_mean = [f[str(i)][...] for i in range(len(sentences))]
    model_dir = work / "imported"
    assert cli(["import-formanylangs", str(fixture / "model"), "--output", str(model_dir)]) == 0
    lines = work / "sentences.tsv"
    lines.write_text("".join("\t".join(s) + "\n" for s in sentences), encoding="utf-8")
    rows, runs = [], {}
    for batch_size in batch_sizes:
        api = api_vectors(model_dir, sentences, batch_size)
        runs[("api", batch_size)] = api
        rows.append(("Python API", batch_size, worst(api, expected), worst([a.mean(axis=0) for a in api], expected_mean)))
        layers = embed_file_vectors(model_dir, lines, "all", batch_size, len(sentences), work)
        mean = embed_file_vectors(model_dir, lines, "average", batch_size, len(sentences), work)
        runs[("embed-file", batch_size)] = layers
        rows.append(("embed-file --all/--average", batch_size, worst(layers, expected), worst(mean, expected_mean)))
    across = max(worst(a, b)[i] for a in runs.values() for b in runs.values() for i in range(3))
    return {"sentences": len(sentences), "tokens": sum(map(len, sentences)), "rows": rows, "across_batches": across}


def standard_shape_parity(work: Path) -> tuple[float, float]:
    fixture = shared_data_dir() / "formanylangs" / "fixture_small"
    sentences = json.loads((fixture / "sentences.json").read_text(encoding="utf-8"))[:6]
    chars = sorted({c for s in sentences for t in s for c in t})
    words = sorted({t for s in sentences for t in s})
    name = "cnn_50_100_512_4096_sample.json"
    folder = write_model(work / "standard", STANDARD_NETWORK_CONFIGS[name], chars, words, seed=1, scale=0.02,
                         config_name="unused.json", config_path=f"../configs/{name}")
    (folder / "unused.json").unlink()  # as released: config_path leads nowhere, the standard config is used
    model = BiLM.from_formanylangs(str(folder)).eval()
    with torch.inference_mode():
        result = model.embed(sentences)
    got = [result.layers[:, i, :n].numpy() for i, n in enumerate(result.lengths)]
    want = [reference_layers(folder, s, STANDARD_NETWORK_CONFIGS[name]) for s in sentences]
    return max(worst(got, want)), max(float(np.abs(w).max()) for w in want)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,7,64")
    parser.add_argument("--standard-shape", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fml-parity-") as tmp:
        result = fixture_parity([int(b) for b in args.batch_sizes.split(",")], Path(tmp))
        print(f"{result['sentences']} sentences, {result['tokens']} tokens; max |ours - expected| over all values")
        print(f"{'path':<28} {'batch':>5} {'layer 0':>10} {'layer 1':>10} {'layer 2':>10} {'average':>10}")
        for path, batch, layers, mean in result["rows"]:
            print(f"{path:<28} {batch:>5} " + " ".join(f"{v:>10.3g}" for v in (*layers, *mean)))
        print(f"largest difference between any two of these runs: {result['across_batches']:.3g}")
        if args.standard_shape:
            difference, largest = standard_shape_parity(Path(tmp))
            print(f"standard network (50_100_512_4096), random weights, 6 sentences: max |ours - reference| "
                  f"{difference:.3g} (largest |value| {largest:.3g})")


if __name__ == "__main__":
    main()
