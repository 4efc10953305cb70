"""`elmo-pipeline embed-file`: a drop-in for the removed `allennlp elmo` command.

Input: one whitespace-tokenized sentence per line (or, with `tab_separated`, tokens separated by
tabs, as ELMoForManyLangs' own command reads them, so that a token may hold a space). Output: HDF5 with one dataset per line,
named by its 0-based line number, and `sentence_to_index` (a JSON string mapping each
sentence's text to its key, as the original writes it). An empty line gives an empty
dataset so keys stay line numbers.

With `sentence_keys` (the original's `--use-sentence-keys`) each dataset is named by its
sentence's text instead, and no `sentence_to_index` is written; with `sentence_index=False`
(`--forget-sentences`) none is written either.

Lines are read as `extract` reads text (`read_text_lines`): only "\n" ends a line (a "\r"
before it is dropped; a lone "\r" stays in the line, where whitespace splitting treats it as a
space), so keys are the numbers of "\n"-ended lines; a UTF-8 BOM is dropped. A line that is
not UTF-8 or holds NUL, and with `tab_separated` an empty or blank field in a line that is not
blank, fail the command with an error naming the (1-based) line: nothing is written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from array import array
from typing import Callable, Iterable, Iterator, Sequence

import fsspec
import h5py
import numpy as np
import torch
from tqdm import tqdm

from elmo_pipeline.filesystems import is_local
from elmo_pipeline.formats.atomic import (check_output_file, missing_folders, remove_abandoned_partials,
                                          remove_empty_folders, replace_atomically)
from elmo_pipeline.model.bilm import BiLM, CarriedState, Embeddings
from elmo_pipeline.strict import dumps_strict
from elmo_pipeline.embedding import (DEFAULT_BATCH_TOKENS, DEFAULT_MAX_WHOLE_SENTENCE_TOKENS, padded_length_batches,
                                     too_long)
from elmo_pipeline.corpus.readers import read_text_lines
from elmo_pipeline.corpus.records import ErrorRecord
from elmo_pipeline.progress import note_tokens, progress_bar
from elmo_pipeline.runtime import HeapTrimmer, autocast

OUTPUT_MODES = ("all", "top", "average")


def read_sentences(url: str, strip: bool = True, max_document_mb: float | None = None) -> list[str]:
    """Every line of `url` as `extract`'s text format reads it (see the module docstring), stripped
    of surrounding whitespace unless `strip` is False; decompressed as `extract` does: every frame
    of a .zst file, and an error, not fewer lines, for a truncated one. A line that is not UTF-8,
    holds NUL or is longer than `max_document_mb` (`read_text_lines`) is a ValueError naming it
    (the first such line, once the whole file has been read: a file that cannot be read is named
    for that first)."""
    lines: list[str] = []
    bad: tuple[int, str] | None = None
    # one line at a time: a list of every (number, text) held some 100 bytes a line more
    for number, text in read_text_lines(url, max_document_mb):
        if isinstance(text, ErrorRecord):
            bad = bad or (number, text.reason)
        elif bad is None:
            lines.append(text.strip() if strip else text)
    if bad is not None:
        raise ValueError(f"{url}, line {bad[0]}: {bad[1]}")
    return lines


def _tokens(url: str, number: int, line: str, tab_separated: bool) -> list[str]:
    """The tokens of line `number` (1-based): its whitespace-separated words, or with
    `tab_separated` its tab-separated fields. A blank line has none either way; an empty or blank
    field in another line is a ValueError naming the line: embedded, it would be a token of no
    text (from a doubled or trailing tab), and dropped, it would shift the columns after it."""
    if not tab_separated:
        return line.split()
    if not line.strip():
        return []
    fields = line.split("\t")
    for k, field in enumerate(fields, 1):
        if not field.strip():
            raise ValueError(f"{url}, line {number}: field {k} of {len(fields)} is empty or blank (tab-separated "
                             "input: every field is a token)")
    return fields


# where standard input is held for `embed-file -`: read twice (its first bytes say whether it is
# compressed), it cannot stay a pipe; messages about its lines name this URL
STDIN_URL = "memory://stdin"


@contextlib.contextmanager
def stdin_as_file(url: str) -> Iterator[str]:
    """`url`, or for "-" (standard input, as the original command took it) STDIN_URL holding every
    byte of standard input for the length of the context: the command holds every sentence in
    memory anyway."""
    if url != "-":
        yield url
        return
    fs, path = fsspec.core.url_to_fs(STDIN_URL)
    fs.pipe_file(path, sys.stdin.buffer.read())
    try:
        yield STDIN_URL
    finally:
        fs.rm_file(path)


def _select(layers: np.ndarray, mode: str) -> np.ndarray:
    # layers (L+1, n, 2P) -> (L+1, n, 2P) | (n, 2P)
    if mode == "all":
        return layers
    if mode == "top":
        return layers[-1]
    return layers.mean(axis=0)


def _batches(lengths: Sequence[int], batch_size: int, stateful: bool, batch_tokens: int) -> Iterator[list[int]]:
    """Line indexes per model call. Stateful: `batch_size` lines in file order, as the original
    (a row's state goes to the same row of the next batch). Zero state: results do not depend on
    batching, so lines are sorted by length and a batch also holds at most `batch_tokens` padded
    tokens, boundaries included, or one line (64 lines of 10,000 tokens were one call: some 5.6 GB at the
    8.8 KB a padded token measured for 16 sentences of 1,000 with the default model)."""
    if stateful:
        return (list(range(i, min(i + batch_size, len(lengths)))) for i in range(0, len(lengths), batch_size))
    return padded_length_batches(lengths, batch_size, batch_tokens)


def _token_counts(url: str, lines: Sequence[str], tab_separated: bool) -> array:
    """Each line's token count, every line's tokens checked (`_tokens`) before any is embedded. The
    tokens themselves are cut from the line again as its batch is embedded: held for the whole file,
    as lists of str, they took some 100 bytes a token (681 MB peak for WikiText-2 train)."""
    return array("q", (len(_tokens(url, number, line, tab_separated)) for number, line in enumerate(lines, 1)))


def _check_lengths(url: str, lengths: Sequence[int], max_sentence_tokens: int) -> None:
    """A line is embedded whole, as one sentence (see DEFAULT_MAX_WHOLE_SENTENCE_TOKENS): a line past the
    bound is refused by number before the model runs, where it failed in torch's allocator naming
    no line, or was killed."""
    for number, n_tokens in enumerate(lengths, 1):
        why = too_long(n_tokens, max_sentence_tokens)
        if why is not None:
            raise ValueError(f"{url}, line {number}: {why}")


def embed_file(
    model: BiLM, input_url: str, output_url: str, mode: str = "all", batch_size: int = 64,
    stateful: bool = False, precision: str = "fp32", show_progress: bool = True, tab_separated: bool = False,
    model_files: Sequence[str] = (), sentence_keys: bool = False, sentence_index: bool = True,
    batch_tokens: int = DEFAULT_BATCH_TOKENS, max_sentence_tokens: int = DEFAULT_MAX_WHOLE_SENTENCE_TOKENS,
    max_document_mb: float | None = None,
) -> int:
    """Embed every line of `input_url` into the HDF5 file `output_url`; returns the line count.
    `tab_separated`: a line's tokens are its tab-separated fields (a blank line has none). An
    `output_url` that is a folder, lies under a file, or is the input or one of `model_files`
    (the files the model was read from: `pretrained.model_files`) is refused before any work.
    `sentence_keys`: datasets named by their sentence (`_check_sentence_keys`), no
    `sentence_to_index`; `sentence_index=False`: no `sentence_to_index`. Memory: `batch_tokens`
    padded tokens per call without `stateful` (`_batches`), a line at most `max_sentence_tokens`
    (`_check_lengths`); across the file, each line's text and token count (`_token_counts`); a line
    of more than `max_document_mb` is refused unread (`read_text_lines`)."""
    if mode not in OUTPUT_MODES:
        raise ValueError(f"mode must be one of {OUTPUT_MODES}, got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    # a folder there would take the file inside it, under another name; the input or the model's
    # weights there would be replaced by the HDF5
    check_output_file(output_url, [("the input file", input_url)]
                      + [(f"the model's file {f}", f) for f in model_files])
    lines = read_sentences(input_url, strip=not tab_separated, max_document_mb=max_document_mb)
    if sentence_keys:
        _check_sentence_keys(input_url, lines)
    lengths = _token_counts(input_url, lines, tab_separated)
    _check_lengths(input_url, lengths, max_sentence_tokens)
    width, n_layers = model.config.output_dim, model.config.n_output_layers
    empty_shape = {"all": (n_layers, 0, width), "top": (0, width), "average": (0, width)}[mode]
    runner = CarriedState(model) if stateful else None
    progress = progress_bar("embed-file", total=len(lines), enabled=show_progress)
    model.eval()

    def write(local: str) -> None:
        _write_hdf5(model, local, input_url, lines, tab_separated, sentence_keys, mode,
                    _batches(lengths, batch_size, stateful, batch_tokens), runner, progress, empty_shape, precision,
                    sentence_index and not sentence_keys)

    _publish(write, output_url)
    progress.close()
    return len(lines)


def _write_hdf5(model: BiLM, local: str, url: str, lines: list[str], tab_separated: bool, sentence_keys: bool,
                mode: str, batches: Iterable[list[int]], runner: CarriedState | None, progress: tqdm,
                empty_shape: tuple[int, ...], precision: str, sentence_index: bool) -> None:
    """`runner` carries the LSTM state from batch to batch (stateful); None: every line from a zero state."""
    # a batch's tensors and arrays are freed below what stays (HDF5's metadata, the next batch's), and
    # glibc kept those pages (see HeapTrimmer): over the first 10,000 lines of WikiText-2 train RSS grew by
    # 229 MB in 135 s, trimmed by 98 MB, and 100,000 lines passed 4 GB
    trim_heap = HeapTrimmer()
    # HDF5's own lock of the file (a flock) would fail on replace_atomically's, which marks the
    # partial file as a live write's until its rename
    with h5py.File(local, "w", locking=False) as out, torch.inference_mode(), autocast(model.device, precision):
        for batch in batches:
            # cut again from the text (`_token_counts` checked every line's)
            sentences = [_tokens(url, i + 1, lines[i], tab_separated) for i in batch]
            # stateful, a blank line among others runs as <S> </S> and moves its row's state, as in the
            # original; a batch of one blank line never reached its model (allennlp's embed_batch answers
            # [[]] with an empty embedding), so the state it would have moved stays
            if any(sentences) or (runner is not None and len(sentences) > 1):
                result: Embeddings = runner.embed(sentences) if runner else model.embed(sentences)
                layers = result.layers.float().cpu().numpy()
            for row, (index, sentence) in enumerate(zip(batch, sentences)):
                n = len(sentence)
                data = _select(layers[:, row, :n], mode) if n else np.zeros(empty_shape, np.float32)
                if not np.isfinite(data).all():  # a model whose finite weights overflow on this input
                    raise ValueError(f"line {index + 1}: the model gives NaN or infinite vectors for it; nothing "
                                     "was written")
                out.create_dataset(lines[index] if sentence_keys else str(index), data=data.astype(np.float32))
            note_tokens(progress, len(batch), sum(len(s) for s in sentences))
            trim_heap()
        if sentence_index:
            index_of = {line: str(index) for index, line in enumerate(lines)}
            ds = out.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
            ds[0] = dumps_strict(index_of, "sentence_to_index")


def _check_sentence_keys(url: str, lines: Sequence[str]) -> None:
    """Each line's text must name one dataset of its own: a blank line names none, "." is the file's
    root, a "/" would make the sentence a path of groups, and a sentence twice would take one key
    twice (the original failed there after embedding the lines before it)."""
    first_seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        why = ("is blank" if not line.strip() else "is '.', the file's own root" if line == "." else
               "holds '/', which HDF5 reads as groups" if "/" in line else None)
        if why is None and line in first_seen:
            why = f"repeats line {first_seen[line]}"
        if why is not None:
            raise ValueError(f"{url}, line {number}: with sentence keys every sentence names its dataset, and "
                             f"this one {why}; leave out --use-sentence-keys (keys are then line numbers)")
        first_seen[line] = number


def _publish(write: Callable[[str], None], output_url: str) -> None:
    """`write(local_path)` fills the HDF5 file that `output_url` then names whole or not at all: a local
    one is written beside it, a remote one (HDF5 needs a local file) to a temporary file, then uploaded."""
    fs, path = fsspec.core.url_to_fs(output_url)
    if is_local(fs):
        folder = os.path.dirname(os.path.abspath(path))
        made = missing_folders(folder)
        os.makedirs(folder, exist_ok=True)
        remove_abandoned_partials(os.path.realpath(path))  # what runs killed by SIGKILL left beside it
        try:
            replace_atomically(fs, path, write)
        except BaseException:  # a refused line, NaN vectors, Ctrl-C: nothing written, no new empty folder either
            remove_empty_folders(made)
            raise
        return

    def write_and_upload(partial: str) -> None:
        with tempfile.TemporaryDirectory(prefix="elmo-embed-") as tmp_dir:
            local = os.path.join(tmp_dir, "out.hdf5")
            write(local)
            fs.put_file(local, partial)

    replace_atomically(fs, path, write_and_upload)
