"""The `elmo-pipeline` command line. Each subcommand is a thin wrapper over a library call."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Sequence

from elmo_pipeline import __version__
from elmo_pipeline.cli.parsing import parse_command
from elmo_pipeline.corpus.options import add_max_document_mb, int_in
from elmo_pipeline.embedding import DEFAULT_BATCH_TOKENS
from elmo_pipeline.embedding.options import add_whole_sentence_bound
from elmo_pipeline.commands import run_command, use_help_formatter
from elmo_pipeline.strict import ConfigError
from elmo_pipeline.runtime_choices import AUTO, KERNELS, PRECISIONS

if TYPE_CHECKING:  # the model imports torch: loaded by the commands that run it, not for --help
    from elmo_pipeline.model.bilm import BiLM


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None,
                       help="native model directory or URL (config.json + model.safetensors), or the "
                            "original OPTIONS.json,WEIGHTS.hdf5; default: the model embedded in the package")
    group.add_argument("--options", default=None, help="original options.json (with --weights) instead of --model")
    group.add_argument("--weights", default=None, help="original weights HDF5 (with --options)")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    group.add_argument("--kernel", default=AUTO, choices=KERNELS,
                       help="LSTM kernel: exact (with clips; batch-invariant on CPU), fused (torch's LSTM, "
                            "cuDNN on GPU; no clips, so refused for a model with clips), auto = exact on CPU, on "
                            "CUDA fused unless the model has clips or projects to no fewer units than its cell (default: "
                            "auto)")


def check_original_files(options: str | None, weights: str | None) -> None:
    """Refuses an empty or blank --options or --weights by name (an unset variable, say): taken
    for unset, `--options ''` had embed-file drop --weights and embed with the embedded model."""
    for option, value in (("--options", options), ("--weights", weights)):
        if value is not None and not value.strip():
            raise ConfigError(f"{option} {value!r} names no file; give the original {option[2:]} file (path or URL)")


def load_model_from_args(args: argparse.Namespace) -> BiLM:
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.runtime import resolve_device

    check_original_files(args.options, args.weights)
    if (args.options is None) != (args.weights is None):
        raise ConfigError("--options and --weights go together")
    if args.options is not None and args.model is not None:
        raise ConfigError("give either --model or --options/--weights, not both")
    if args.options is not None:
        model = BiLM.from_allennlp(args.options, args.weights, kernel=args.kernel)
    else:
        model = BiLM.load(args.model, kernel=args.kernel)  # our folder, or OPTIONS.json,WEIGHTS.hdf5
    return model.to(resolve_device(args.device)).eval()


def _import_allennlp(args: argparse.Namespace) -> int:
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.formats.native import check_model_destination, publish_pretrained

    check_original_files(args.options, args.weights)
    check_model_destination(args.output, args.overwrite, reads=(args.options, args.weights))
    model = BiLM.from_allennlp(args.options, args.weights)
    publish_pretrained(model, args.output, overwrite=args.overwrite)
    print(f"wrote {args.output} (config.json, model.safetensors); sha256 of the source files {model.checksum}")
    return 0


def _import_formanylangs(args: argparse.Namespace) -> int:
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.formats.formanylangs import build_model, read_formanylangs
    from elmo_pipeline.formats.native import check_model_destination, publish_pretrained
    from elmo_pipeline.formats.sources import model_folder

    # the model may lie one folder down: --output naming that folder would delete it too
    reads = (args.model, model_folder(args.model), *([args.network_config] if args.network_config else []))
    check_model_destination(args.output, args.overwrite, reads=reads)
    source = read_formanylangs(args.model, args.network_config)
    model = build_model(BiLM, source)
    publish_pretrained(model, args.output, overwrite=args.overwrite)
    words = f", {len(model.vocab)} words" if model.vocab is not None else ", no word embedding"
    print(f"wrote {args.output} (config.json, model.safetensors, chars.json{', vocab.json' if model.vocab else ''}): "
          f"{len(model.chars)} characters{words}; network config: {source.network_where}; "
          f"sha256 of the source files {model.checksum}")
    return 0


def _take_original_names(args: argparse.Namespace) -> None:
    """The removed `allennlp elmo` command's --options-file, --weight-file and --cuda-device, as
    ours: a script written for it runs unchanged; given beside our name for the same option, the
    two are refused rather than one of them dropped."""
    given = {}
    for theirs, ours in (("options_file", "options"), ("weight_file", "weights")):
        given[ours] = f"--{ours}"
        if getattr(args, theirs) is not None:
            if getattr(args, ours) is not None:
                raise ConfigError(f"--{theirs.replace('_', '-')} and --{ours} name the same file: give one")
            setattr(args, ours, getattr(args, theirs))
            given[ours] = f"--{theirs.replace('_', '-')}"
    if (args.options is None) != (args.weights is None):  # named as the user typed them
        raise ConfigError(f"{given['options']} and {given['weights']} go together")
    if args.cuda_device is not None:
        if args.device != "auto":
            raise ConfigError(f"--cuda-device {args.cuda_device} and --device {args.device} both name the device: "
                              "give one")
        args.device = "cpu" if args.cuda_device < 0 else f"cuda:{args.cuda_device}"


def _embed_file(args: argparse.Namespace) -> int:
    from elmo_pipeline.embedding.hdf5_file import embed_file, stdin_as_file
    from elmo_pipeline.formats.pretrained import model_files

    for name, value, or_stdin in (("input_file", args.input_file, " (or - for standard input)"),
                                  ("output_file", args.output_file, "")):
        if not value:  # an unset variable: named the current folder ("cannot read : IsADirectoryError")
            raise ConfigError(f"{name} {value!r} names no file; give a path or URL{or_stdin}")
    _take_original_names(args)
    model = load_model_from_args(args)
    files = [args.options, args.weights] if args.options is not None else model_files(args.model)
    with stdin_as_file(args.input_file) as input_url:
        n = embed_file(model, input_url, args.output_file, mode=args.mode, batch_size=args.batch_size,
                       stateful=args.stateful, precision=args.precision, show_progress=not args.quiet,
                       tab_separated=args.tab_separated, model_files=files, sentence_keys=args.use_sentence_keys,
                       sentence_index=not args.forget_sentences, batch_tokens=args.batch_tokens,
                       max_sentence_tokens=args.max_sentence_tokens, max_document_mb=args.max_document_mb)
    print(f"wrote {n} sentences to {args.output_file}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elmo-pipeline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"elmo-pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("import-allennlp", help="convert original options.json + weights.hdf5 to our format")
    p.add_argument("--options", required=True, help="options.json (path or URL)")
    p.add_argument("--weights", required=True, help="weights HDF5 (path or URL)")
    p.add_argument("--output", required=True, help="output directory (path or URL); new or empty")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder at --output")
    p.set_defaults(func=_import_allennlp)

    p = sub.add_parser("import-formanylangs", help="convert an ELMoForManyLangs model (a folder, or its .zip, "
                                                   ".tar.bz2, .tar.xz, .tar.gz or .tar) to our format")
    p.add_argument("model", metavar="MODEL",
                   help="the model folder, or its .zip / .tar.bz2 / .tar.xz / .tar.gz / .tar (path or URL)")
    p.add_argument("--output", required=True, help="output directory (path or URL); new or empty")
    p.add_argument("--network-config", default=None,
                   help="the network config (JSON) to use instead of the one config.json names")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder at --output")
    p.set_defaults(func=_import_formanylangs)

    p = sub.add_parser("embed-file", help="embed a file of whitespace-tokenized sentences into HDF5")
    p.add_argument("input_file", help="one sentence per line (path or URL, compression by extension or first "
                                      "bytes; - reads standard input)")
    p.add_argument("output_file", help="HDF5 output (path or URL)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--all", dest="mode", action="store_const", const="all",
                      help="all layers: (L+1, n_tokens, 2P) per sentence (default)")
    mode.add_argument("--top", dest="mode", action="store_const", const="top", help="top layer: (n_tokens, 2P)")
    mode.add_argument("--average", dest="mode", action="store_const", const="average",
                      help="mean of the layers: (n_tokens, 2P)")
    p.set_defaults(mode="all")
    # checked as parsed: 0 was refused only once the model had loaded
    p.add_argument("--batch-size", type=int_in(1), default=64, help="sentences per batch (default: 64)")
    p.add_argument("--batch-tokens", type=int_in(1), default=DEFAULT_BATCH_TOKENS,
                   help="padded tokens per batch, <S>/</S> included, at most (a longer line is a batch alone; "
                        "not with --stateful, whose batches are --batch-size lines) (default: %(default)s)")
    add_whole_sentence_bound(p, "a line", "before any line is embedded")
    add_max_document_mb(p, "a line of more MiB is refused, not read (default: %(default)s)")
    p.add_argument("--tab-separated", action="store_true",
                   help="tokens are separated by tabs, not whitespace (a token may then hold spaces)")
    p.add_argument("--stateful", action="store_true",
                   help="carry LSTM state from batch to batch as the original did (default: zero state)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="autocast precision (default: fp32)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--use-sentence-keys", action="store_true",
                   help="name each dataset by its sentence, not its line number (the original's flag)")
    p.add_argument("--forget-sentences", action="store_true",
                   help="write no sentence_to_index (the original's flag)")
    add_model_args(p)
    original = p.add_argument_group("the original command's names for model options")
    original.add_argument("--options-file", default=None, help="--options")
    original.add_argument("--weight-file", default=None, help="--weights")
    original.add_argument("--cuda-device", type=int_in(-1), default=None,
                          help="N: --device cuda:N; -1: --device cpu")
    p.set_defaults(func=_embed_file)

    for register in _registrars():
        register(sub)
    use_help_formatter(sub)
    return parser


def _registrars() -> list:
    """Subcommands that live beside their own library code (imported here, not at module load,
    so that `import elmo_pipeline.cli.main` stays light)."""
    from elmo_pipeline.cli import downstream, extract, feast, training

    return [extract.register, training.register, downstream.register, feast.register]


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_command(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
