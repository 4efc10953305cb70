"""Command lines to parsed commands, shared by `elmo-pipeline` and the torchrun entry."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

# What a command raises for input it cannot use (a ConfigError or CheckpointError is a
# ValueError), or for a package the input needs that is not installed (fsspec's "Install s3fs
# to access S3"): a message and exit 2, no traceback. Anything else keeps its traceback.
USER_ERRORS = (OSError, ValueError, RuntimeError, ImportError)


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Our options parsed; what is left over goes to Beam (`args.beam_args`) for the commands
    that launch a pipeline, and is an error naming it for every other command."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_beam_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.beam_args = extra
    return args


def run_command(args: argparse.Namespace) -> int:
    """`args.func(args)`, with a user's error as one line on stderr (exit 2) and Ctrl-C as one
    line (exit 130, as a shell reports SIGINT)."""
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"elmo-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elmo-pipeline {args.command}: interrupted", file=sys.stderr)
        return 130
