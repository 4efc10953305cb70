"""`elmo-pipeline prepare | pretrain | evaluate | export`: corpora to shards, training, perplexity,
a model folder to ship.

    elmo-pipeline prepare --input 'corpus/*.txt' --output prepared/ [--tokenizer whitespace]
    elmo-pipeline pretrain --data prepared/ --output runs/lm [--preset small-cpu] [--init MODEL] [--precision bf16]
    torchrun --nproc-per-node 4 -m elmo_pipeline.cli.training pretrain ...   (several processes)
    elmo-pipeline evaluate --model runs/lm/model --data 'held-out/*.txt' [--precision bf16]
    elmo-pipeline export runs/lm/best [runs/other/best ...] --output my_model/ [--dtype float16]

`pretrain` run again with the same command resumes from the newest checkpoint in --output.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Sequence

from elmo_pipeline.cli.parsing import parse_command
from elmo_pipeline.commands import options_given, run_command, use_help_formatter
from elmo_pipeline.corpus.options import (DEFAULT_MAX_DOCUMENT_MB, DEFAULT_MAX_SENTENCE_TOKENS, add_max_document_mb,
                                          int_in)
from elmo_pipeline.runtime_choices import (AUTO, EXPORT_DTYPES, KERNELS, MAX_TORCH_THREADS, PRECISIONS,
                                           TRAIN_PRECISIONS)
from elmo_pipeline.strict import dumps_strict

if TYPE_CHECKING:  # the training options import torch: loaded when a command needs it
    from elmo_pipeline.training.options import TrainArgs


def _prepare(args: argparse.Namespace) -> int:
    from elmo_pipeline.pipelines.prepare import run_and_print

    return run_and_print(args)


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values:  # an unset variable: an empty list was taken for none given (the config's cutoffs)
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def add_pretrain_args(p: argparse.ArgumentParser) -> None:
    io = p.add_argument_group("data and output")
    io.add_argument("--data", required=True, help="a prepared folder (elmo-pipeline prepare)")
    io.add_argument("--output", required=True,
                    help="run folder: checkpoints/, metrics.csv, best/ and model/; an existing run resumes")
    io.add_argument("--valid", default=None,
                    help="held-out data for perplexity: a prepared folder or whitespace-tokenized text glob")
    io.add_argument("--eval-every", type=int, default=0, help="evaluate --valid every N steps (0: at the end)")
    io.add_argument("--eval-batch-tokens", type=int, default=8192, help="padded tokens per batch of the validation")
    model = p.add_argument_group("model")
    model.add_argument("--preset", default=None,
                       help="tiny, small-cpu (the default model), wt2-gpu, small; not with --init or --model-config")
    model.add_argument("--model-config", default=None,
                       help="JSON file with the model fields of config.json; not with --init")
    model.add_argument("--init", default=None,
                       help="continue from a model: a native folder/URL, or OPTIONS.json,WEIGHTS.hdf5 (original "
                            "weights; a new softmax is built for the corpus's vocabulary)")
    model.add_argument("--no-grow-vocab", dest="grow_vocab", action="store_false",
                       help="with --init: keep the model's vocabulary instead of adding the corpus's new words")
    model.add_argument("--softmax", default=None, choices=("full", "sampled", "adaptive"),
                       help="the training softmax (default: the preset's or config's)")
    model.add_argument("--n-samples", type=int, default=None, help="sampled softmax: candidates per batch")
    model.add_argument("--cutoffs", type=_int_list, default=None, help="adaptive softmax: e.g. 2000,10000")
    model.add_argument("--kernel", default=AUTO, choices=KERNELS,
                       help="the validations' LSTM kernel; training runs the reference recurrence, or with "
                            "fused torch's LSTM op and its backward (cuDNN on a GPU; configs without clips only)")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=int, default=1, help="passes over --data")
    opt.add_argument("--max-steps", type=int, default=None,
                     help="stop after this many optimizer steps (before --epochs end)")
    opt.add_argument("--max-time", type=float, default=None,
                     help="seconds for this invocation; then a checkpoint, and the same command continues")
    opt.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per micro-batch per process")
    opt.add_argument("--max-batch-sentences", type=int, default=512, help="sentences per micro-batch, at most")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    opt.add_argument("--optimizer", default="adagrad", choices=("adagrad", "adam"),
                     help="adagrad as the original, or adam")
    opt.add_argument("--lr", type=float, default=None, help="default: 0.2 (adagrad), 0.001 (adam)")
    opt.add_argument("--adagrad-init", type=float, default=1.0, help="--optimizer adagrad: its initial accumulator")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="L2 weight decay of the optimizer")
    opt.add_argument("--schedule", default="constant", choices=("constant", "linear", "cosine"),
                     help="learning rate after the warm-up")
    opt.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warm-up from 0 to --lr")
    opt.add_argument("--min-lr-ratio", type=float, default=0.0,
                     help="--schedule linear or cosine: the learning rate they end at, as a fraction of --lr")
    opt.add_argument("--clip-norm", type=float, default=10.0, help="global gradient-norm clip (0: none)")
    opt.add_argument("--dropout", type=float, default=0.1, help="dropout in the biLM while training")
    opt.add_argument("--seed", type=int, default=0, help="seed of the initial weights, data order and dropout")
    run = p.add_argument_group("run")
    run.add_argument("--checkpoint-every", type=int, default=1000,
                     help="steps between checkpoints (0: only at the end)")
    run.add_argument("--checkpoint-seconds", type=float, default=None, help="also checkpoint every S seconds")
    run.add_argument("--keep-checkpoints", type=int, default=3,
                     help="the newest checkpoints kept; older ones are removed")
    run.add_argument("--log-every", type=int, default=50, help="steps between metrics.csv rows and log lines")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    run.add_argument("--precision", default=None, choices=TRAIN_PRECISIONS,
                     help="autocast precision: bf16 on CPU or GPU (parameters, gradients, optimizer and cell "
                          "state stay float32), auto = bf16 on CUDA, fp32 elsewhere (default: auto)")
    run.add_argument("--bf16", default=None, choices=("auto", "on", "off"),
                     help="the older spelling of --precision: on = bf16, off = fp32, auto = auto")
    run.add_argument("--threads", type=int_in(1, MAX_TORCH_THREADS), default=None, help="torch CPU threads")


def train_args_from_namespace(args: argparse.Namespace) -> "TrainArgs":
    """`pretrain`'s options as TrainArgs: every option is the field of its name. An option given
    where the other options make the run ignore it is refused (`check_options_read`)."""
    from elmo_pipeline.training.options import TrainArgs, check_options_read

    preset = args.preset
    if preset is None and args.model_config is None and args.init is None:
        preset = "small-cpu"
    given = {f.name: getattr(args, f.name) for f in fields(TrainArgs) if hasattr(args, f.name)}
    train_args = TrainArgs(**{**given, "preset": preset, "clip_norm": args.clip_norm or None})
    check_options_read(train_args, _given_on_command_line(args))
    return train_args


def _given_on_command_line(args: argparse.Namespace) -> set[str]:
    """The pretrain options whose value is not the parser's default. The command line's own
    defaults count here, not TrainArgs's: `--preset tiny` is given, though TrainArgs defaults to it."""
    return options_given(args, add_pretrain_args)


def _pretrain(args: argparse.Namespace) -> int:
    from elmo_pipeline.training.distributed import process_rank
    from elmo_pipeline.training.stopping import StoppedBySignal
    from elmo_pipeline.training.trainer import train

    try:
        result = train(train_args_from_namespace(args), given=_given_on_command_line(args))
    except StoppedBySignal as stopped:  # the checkpoint is written: one line, and the signal's status
        if process_rank() == 0:
            print(f"elmo-pipeline pretrain: {stopped}", file=sys.stderr)
        return 128 + stopped.signum
    if process_rank() == 0:  # under torchrun every process returns it: stdout holds one JSON document
        print(dumps_strict(result, "result", indent=2))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    import torch

    from elmo_pipeline.formats.files import model_shown
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.runtime import check_precision, resolve_device
    from elmo_pipeline.training.evaluate import check_max_document_mb, check_sentences, check_windows, evaluate

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    check_precision(device, args.precision)  # before the model loads: fp16 on CPU is refused here
    check_windows(args.data, args.max_sentence_tokens)  # before the model loads, too
    check_max_document_mb(args.data, args.max_document_mb)
    max_document_mb = DEFAULT_MAX_DOCUMENT_MB if args.max_document_mb is None else args.max_document_mb
    # an empty file is named, not "no sentences" after the load
    check_sentences(args.data, args.tokenizer, max_document_mb=max_document_mb)
    model = BiLM.load(args.model, kernel=args.kernel).to(device)
    if model.softmax is None:
        raise ValueError(f"{args.model or 'the default model'} has no softmax (original weights carry none): "
                         "fine-tune it with `pretrain --init` first")
    result = evaluate(model, args.data, tokenizer=args.tokenizer, max_sentence_tokens=args.max_sentence_tokens,
                      batch_tokens=args.batch_tokens, device=device, precision=args.precision, progress=True,
                      max_document_mb=max_document_mb)
    result["model"] = model_shown(args.model)
    print(dumps_strict(result, "result", indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from elmo_pipeline.formats.files import model_shown
    from elmo_pipeline.training.checkpointing import export_model

    model = export_model(args.sources, args.output, args.dtype, overwrite=args.overwrite)
    # the sources as every output names a model: a URL without the password or token that opened it
    print(dumps_strict({"output": args.output, "sources": [model_shown(s) for s in args.sources],
                        "averaged": len(args.sources), "dtype": args.dtype, "vocab_size": model.config.vocab_size},
                       "export", indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from elmo_pipeline.training.prepare import add_prepare_args

    p = subparsers.add_parser(
        "prepare", help="tokenize a corpus, build the vocabulary and write training shards (Apache Beam)",
        description="Beam options (--runner, ...) pass through; without --runner the job runs locally on the "
                    "FnApiRunner.")
    add_prepare_args(p)
    p.set_defaults(func=_prepare, accepts_beam_args=True)

    p = subparsers.add_parser(
        "pretrain", help="train or fine-tune the biLM on prepared shards (resumes from the newest checkpoint)",
        description="Joint loss 0.5 x (forward NLL + backward NLL). Launch with torchrun for several "
                    "processes or machines.")
    add_pretrain_args(p)
    p.set_defaults(func=_pretrain)

    p = subparsers.add_parser("evaluate", help="forward, backward and average perplexity (full softmax) as JSON")
    p.add_argument("--model", default=None, help="model folder/URL (default: the embedded model)")
    p.add_argument("--data", required=True,
                   help="a prepared folder, or a glob of whitespace-tokenized text (one sentence per line)")
    p.add_argument("--tokenizer", default="whitespace", choices=("whitespace",),
                   help="how raw text is split (prepare a corpus for spaCy tokenization)")
    p.add_argument("--max-sentence-tokens", type=int_in(1), default=None,
                   help=f"cut longer sentences into windows (default: {DEFAULT_MAX_SENTENCE_TOKENS} for text; a "
                        "prepared folder's as prepare cut them, or cut again at no more than that)")
    add_max_document_mb(p, f"a text line of more MiB is refused, not read (default: {DEFAULT_MAX_DOCUMENT_MB:g}; "
                           "text only: prepare read a prepared folder's lines)", default=None)
    p.add_argument("--batch-tokens", type=int_in(1), default=8192, help="padded tokens per batch")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="autocast precision of the biLM (default: fp32; fp16 on GPUs only); the softmax runs in "
                        "float32")
    p.add_argument("--kernel", default=AUTO, choices=KERNELS,
                   help="LSTM kernel: exact (clips; batch-invariant on CPU), fused (no clips), auto (exact on CPU)")
    p.add_argument("--threads", type=int_in(1, MAX_TORCH_THREADS), default=None, help="torch CPU threads")
    p.set_defaults(func=_evaluate)

    p = subparsers.add_parser(
        "export", help="write a trained model as a plain model folder; several sources are averaged",
        description="SOURCE is a checkpoint, best/ or model/ folder, any model folder, or the original "
                    "OPTIONS.json,WEIGHTS.hdf5. With several sources (checkpoints of one "
                    "run, or runs continued from one model) the weights are their element-wise mean; they "
                    "must share the configuration and the vocabulary.")
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="the model(s) to write; several are averaged")
    p.add_argument("--output", required=True, help="model folder to write (local path or fsspec URL)")
    p.add_argument("--dtype", default="float32", choices=EXPORT_DTYPES,
                   help="stored weight type; loading upcasts to float32")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder at --output")
    p.set_defaults(func=_export)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (for torchrun: `torchrun ... -m elmo_pipeline.cli.training pretrain ...`)."""
    parser = argparse.ArgumentParser(prog="elmo-pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    use_help_formatter(sub)
    return run_command(parse_command(parser, argv))


if __name__ == "__main__":
    sys.exit(main())
