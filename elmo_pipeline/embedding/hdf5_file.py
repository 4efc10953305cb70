"""`elmo-pipeline embed-file`: a drop-in for the removed `allennlp elmo` command.

Input: one whitespace-tokenized sentence per line. Output: HDF5 with one dataset per line,
named by its 0-based line number, and `sentence_to_index` (a JSON string mapping each
sentence's text to its key, as the original writes it). An empty line gives an empty
dataset so keys stay line numbers.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Sequence

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


def read_sentences(url: str) -> list[str]:
    """The stripped lines of `url`, decompressed as `extract` does: every frame of a .zst file, and
    an error, not fewer lines, for a truncated one."""
    try:
        with open_input(url) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            return [line.strip() for line in f]
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
    stateful: bool = False, precision: str = "fp32", show_progress: bool = True,
) -> int:
    """Embed every line of `input_url` into the HDF5 file `output_url`; returns the line count."""
    if mode not in OUTPUT_MODES:
        raise ValueError(f"mode must be one of {OUTPUT_MODES}, got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    lines = read_sentences(input_url)
    tokens = [line.split() for line in lines]
    width, n_layers = model.config.output_dim, model.config.n_output_layers
    empty_shape = {"all": (n_layers, 0, width), "top": (0, width), "average": (0, width)}[mode]
    runner = CarriedState(model) if stateful else None
    progress = progress_bar("embed-file", total=len(lines), enabled=show_progress)
    local, tmp_dir = _local_target(output_url)
    model.eval()
    try:
        _write_hdf5(model, local, lines, tokens, mode, batch_size, runner, progress, empty_shape, stateful, precision)
        _publish(local, output_url, tmp_dir)
    finally:  # on success only the final file is left; on failure nothing
        if os.path.exists(local):
            os.remove(local)
        if tmp_dir is not None:
            os.rmdir(tmp_dir)
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


def _local_target(output_url: str) -> tuple[str, str | None]:
    """HDF5 needs a local file: write remote outputs to a temporary file, upload at the end."""
    fs, path = fsspec.core.url_to_fs(output_url)
    if "file" in fs.protocol or "local" in fs.protocol:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        return path + ".partial", None
    tmp_dir = tempfile.mkdtemp(prefix="elmo-embed-")
    return os.path.join(tmp_dir, "out.hdf5"), tmp_dir


def _publish(local: str, output_url: str, tmp_dir: str | None) -> None:
    """Moves the finished file to its final name, which only ever holds a complete file: an upload
    goes to `<name>.partial` first (a failed one is removed) and is then moved."""
    fs, path = fsspec.core.url_to_fs(output_url)
    if tmp_dir is None:
        os.replace(local, path)
        return
    replace_atomically(fs, path, lambda partial: fs.put_file(local, partial))
