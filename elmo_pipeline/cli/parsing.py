"""Command lines to parsed commands, shared by `elmo-pipeline` and the torchrun entry."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from elmo_pipeline.commands import option_strings, refuse_repeated_options, unknown_arguments


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Our options parsed; what is left over goes to Beam (`args.beam_args`) for the commands
    that launch a pipeline, and is an error naming it for every other command."""
    args, extra = parser.parse_known_args(argv)
    command = _subcommand_parser(parser, args)  # its usage, and its options to suggest
    refuse_repeated_options(command, sys.argv[1:] if argv is None else argv)
    if extra and not getattr(args, "accepts_beam_args", False):
        problems = unknown_arguments(extra, option_strings(command))
        command.error("unrecognized argument" + ("s" if len(problems) > 1 else "") + ": " + "; ".join(problems))
    args.beam_args = extra
    return args


def _subcommand_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command `args` holds (`args.command`), else `parser` itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(getattr(args, "command", None), parser)
    return parser
