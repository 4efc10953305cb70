"""Command lines to parsed commands, shared by `elmo-pipeline` and the torchrun entry."""

from __future__ import annotations

import argparse
from typing import Sequence


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Our options parsed; what is left over goes to Beam (`args.beam_args`) for the commands
    that launch a pipeline, and is an error naming it for every other command."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_beam_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.beam_args = extra
    return args
