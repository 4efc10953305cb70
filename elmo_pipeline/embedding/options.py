"""The options of `extract`, kept free of Beam so that the command line starts quickly."""

from __future__ import annotations

import argparse

from elmo_pipeline.embedding import DEFAULT_BATCH_TOKENS, DEFAULT_MAX_WHOLE_SENTENCE_TOKENS
from elmo_pipeline.corpus.options import add_input_args, add_tokenization_args, int_in, mib
from elmo_pipeline.runtime_choices import AUTO, KERNELS, MAX_TORCH_THREADS, PRECISIONS
from elmo_pipeline.corpus.schema import DTYPES, LAYER_CHOICES, LAYOUTS

MAX_CACHE_WORDS = 10**8  # a bound for typos (1e20 failed in every worker); far past any vocabulary
# Beam writes every shard asked for, as an empty file where no rows fall: a bound for typos (10**30
# failed the job once it had started, and a billion would have made a billion files)
MAX_SHARDS = 10**6


def add_whole_sentence_bound(parser: argparse.ArgumentParser | argparse._ArgumentGroup, sentence: str,
                             refused: str) -> None:
    """--max-sentence-tokens of a command that embeds each `sentence` whole (embed-file's line,
    similarity's sentence, probe's labelled sentence): a longer one is refused `refused`."""
    parser.add_argument("--max-sentence-tokens", type=int_in(1), default=DEFAULT_MAX_WHOLE_SENTENCE_TOKENS,
                        help=f"{sentence} of more tokens is refused {refused}: each is embedded whole, and its "
                             "memory grows with its length (default: %(default)s)")


def add_extract_args(parser: argparse.ArgumentParser) -> None:
    io = add_input_args(parser, output_help="output folder (path or URL) for Parquet, errors and summary",
                        overwrite_help="replace earlier output in --output")
    io.add_argument("--skip-id-check", action="store_true",
                    help="do not look for document ids used twice (saves a shuffle of the ids)")
    io.add_argument("--timestamp-field", default=None,
                    help="JSONL field / Parquet column with an ISO 8601 event time for the event_timestamp column "
                         "(with --event-time field only; a record without one is an error)")
    io.add_argument("--event-time", default="none", choices=("none", "field", "run"),
                    help="add an event_timestamp column from --timestamp-field or the run's start time")
    io.add_argument("--allow-unverified-counts", action="store_true",
                    help="exit 0 even when the runner cannot report the counters that summary.json checks "
                         "(summary.json then says counts_verified: false and why)")

    add_tokenization_args(parser)

    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="model folder or URL, or OPTIONS.json,WEIGHTS.hdf5 (default: the embedded model)")
    model.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")
    model.add_argument("--precision", default="fp32", choices=PRECISIONS,
                       help="autocast precision of the biLM (fp16 on GPUs only)")
    model.add_argument("--kernel", default=AUTO, choices=KERNELS,
                       help="LSTM kernel: exact (with clips; batch-invariant on CPU), fused (torch's LSTM, cuDNN "
                            "on GPU; no clips), auto = exact on CPU, on CUDA fused unless the model has clips or "
                            "projects to no fewer units than its cell (which fused cannot run)")
    model.add_argument("--batch-tokens", type=int_in(1), default=DEFAULT_BATCH_TOKENS,
                       help="tokens per model batch, <S>/</S> included (sentences are length-sorted first)")
    model.add_argument("--max-batch-sentences", type=int_in(1), default=1024, help="sentences per model batch, at most")
    model.add_argument("--sort-buffer-tokens", type=int_in(1), default=None,
                       help="sentences are length-sorted in buffers of this many tokens, which bounds memory "
                            "(default: 32 x --batch-tokens)")
    model.add_argument("--cache-size", type=int_in(0, MAX_CACHE_WORDS), default=100_000,
                       help="words in the char-CNN cache, at most (0: off; its memory grows with the words kept)")
    model.add_argument("--large-model", action="store_true", help="one model per machine, shared by its processes")
    model.add_argument("--torch-threads", type=int_in(0, MAX_TORCH_THREADS), default=0,
                       help="torch CPU threads per worker process (0: the machine's cores divided by the workers "
                            "that share it, where the runner's options say how many; else torch's default); "
                            f"at most {MAX_TORCH_THREADS}")

    out = parser.add_argument_group("features")
    out.add_argument("--layout", default="token", choices=LAYOUTS, help="a Parquet row per token or per sentence")
    out.add_argument("--layers", default="all", choices=LAYER_CHOICES,
                     help="layer columns written: every layer_j, the top one, or none (mixes only)")
    out.add_argument("--dtype", default="float16", choices=DTYPES, help="stored precision of the vectors")
    out.add_argument("--mix", action="append", default=[], metavar="NAME=SOURCE",
                     help="add column mix_NAME; SOURCE is a preset (average, top) or a mix JSON file; repeatable")
    out.add_argument("--num-shards", type=int_in(0, MAX_SHARDS), default=0,
                     help=f"Parquet shards (0: the runner decides), at most {MAX_SHARDS}")
    out.add_argument("--row-group-mb", type=mib, default=64.0, help="uncompressed vector MiB per row group")
