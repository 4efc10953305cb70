"""`elmo-pipeline embed-file`: a drop-in for the removed `allennlp elmo` command.

Input: one whitespace-tokenized sentence per line (or, with `tab_separated`, tokens separated by
tabs, as ELMoForManyLangs' own command reads them, so that a token may hold a space). Output: HDF5 with one dataset per line,
named by its 0-based line number, and `sentence_to_index` (a JSON string mapping each
sentence's text to its key, as the original writes it). An empty line gives an empty
dataset so keys stay line numbers.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Callable, Sequence

import fsspec
import h5py
import numpy as np
import torch
from tqdm import tqdm

from elmo_pipeline.formats.atomic import replace_atomically
from elmo_pipeline.model.bilm import BiLM, CarriedState, Embeddings
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.corpus.inputs import READ_ERRORS, open_input
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.runtime import autocast

OUTPUT_MODES = ("all", "top", "average")


def read_sentences(url: str, strip: bool = True) -> list[str]:
    """The lines of `url` without their line ends, and stripped of surrounding whitespace unless
    `strip` is False, decompressed as `extract` does: every frame of a .zst file, and an error,
    not fewer lines, for a truncated one."""
    try:
        with open_input(url) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            return [line.strip() if strip else line.rstrip("\n") for line in f]
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read {url}: not UTF-8 text ({exc.reason})") from exc
    except READ_ERRORS as exc:
        raise OSError(f"cannot read {url}: {type(exc).__name__}: {exc}") from exc


def _select(layers: np.ndarray, mode: str) -> np.ndarray:
    # layers (L+1, n, 2P) -> (L+1, n, 2P) | (n, 2P)
    if mode == "all":
        return layers
    if mode == "top":
        return layers[-1]
    return layers.mean(axis=0)


def _batches(tokens: Sequence[list[str]], batch_size: int, stateful: bool) -> list[list[int]]:
    order = list(range(len(tokens)))
    if not stateful:  # zero state: results do not depend on batching, so batch similar lengths
        order.sort(key=lambda i: len(tokens[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def embed_file(
    model: BiLM, input_url: str, output_url: str, mode: str = "all", batch_size: int = 64,
    stateful: bool = False, precision: str = "fp32", show_progress: bool = True, tab_separated: bool = False,
) -> int:
    """Embed every line of `input_url` into the HDF5 file `output_url`; returns the line count.
    `tab_separated`: a line's tokens are its tab-separated fields (an empty line has none)."""
    if mode not in OUTPUT_MODES:
        raise ValueError(f"mode must be one of {OUTPUT_MODES}, got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    lines = read_sentences(input_url, strip=not tab_separated)
    tokens = [(line.split("\t") if line else []) if tab_separated else line.split() for line in lines]
    width, n_layers = model.config.output_dim, model.config.n_output_layers
    empty_shape = {"all": (n_layers, 0, width), "top": (0, width), "average": (0, width)}[mode]
    runner = CarriedState(model) if stateful else None
    progress = progress_bar("embed-file", total=len(lines), enabled=show_progress)
    model.eval()

    def write(local: str) -> None:
        _write_hdf5(model, local, lines, tokens, mode, batch_size, runner, progress, empty_shape, stateful, precision)

    _publish(write, output_url)
    progress.close()
    return len(lines)


def _write_hdf5(model: BiLM, local: str, lines: list[str], tokens: list[list[str]], mode: str, batch_size: int,
                runner: CarriedState | None, progress: tqdm, empty_shape: tuple[int, ...],
                stateful: bool, precision: str) -> None:
    with h5py.File(local, "w") as out, torch.inference_mode(), autocast(model.device, precision):
        for batch in _batches(tokens, batch_size, stateful):
            sentences = [tokens[i] for i in batch]
            if any(sentences) or stateful:
                result: Embeddings = runner.embed(sentences) if runner else model.embed(sentences)
                layers = result.layers.float().cpu().numpy()
            for row, index in enumerate(batch):
                n = len(tokens[index])
                data = _select(layers[:, row, :n], mode) if n else np.zeros(empty_shape, np.float32)
                out.create_dataset(str(index), data=data.astype(np.float32))
            note_tokens(progress, len(batch), sum(len(s) for s in sentences))
        index_of = {line: str(i) for i, line in enumerate(lines)}
        ds = out.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
        ds[0] = dumps_strict(index_of, "sentence_to_index")


def _publish(write: Callable[[str], None], output_url: str) -> None:
    """`write(local_path)` fills the HDF5 file that `output_url` then names whole or not at all: a local
    one is written beside it, a remote one (HDF5 needs a local file) to a temporary file, then uploaded."""
    fs, path = fsspec.core.url_to_fs(output_url)
    if "file" in fs.protocol or "local" in fs.protocol:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        replace_atomically(fs, path, write)
        return

    def write_and_upload(partial: str) -> None:
        with tempfile.TemporaryDirectory(prefix="elmo-embed-") as tmp_dir:
            local = os.path.join(tmp_dir, "out.hdf5")
            write(local)
            fs.put_file(local, partial)

    replace_atomically(fs, path, write_and_upload)
