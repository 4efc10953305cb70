"""Command lines to parsed commands, shared by `elmo-pipeline` and the torchrun entry."""

from __future__ import annotations

import argparse
import difflib
from typing import Sequence


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Our options parsed; what is left over goes to Beam (`args.beam_args`) for the commands
    that launch a pipeline, and is an error naming it for every other command."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_beam_args", False):
        command = _subcommand_parser(parser, args)  # its usage, and its options to suggest
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


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def unknown_arguments(args: list[str], known: list[str]) -> list[str]:
    """A line per argument nobody knows, with the nearest known option; a plain word right after
    an unknown option is taken for its value."""
    problems = []
    previous_unknown_option = False
    for arg in args:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            problems.append(f"{name}" + (f" (did you mean {nearest[0]}?)" if nearest else ""))
            previous_unknown_option = "=" not in arg
        elif previous_unknown_option:
            previous_unknown_option = False
        else:
            problems.append(f"{arg!r} (not an option)")
    return problems
