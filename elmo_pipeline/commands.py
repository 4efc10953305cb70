"""How every command ends: its exit status, with a user's error as one line and no traceback.
Shared by `elmo-pipeline`, the torchrun entry and `python -m elmo_pipeline.pipelines.<command>`."""

from __future__ import annotations

import argparse
import sys

# What a command raises for input it cannot use (a ConfigError or CheckpointError is a
# ValueError), or for a package the input needs that is not installed (fsspec's "Install s3fs
# to access S3"): a message and exit 2, no traceback. Anything else keeps its traceback.
USER_ERRORS = (OSError, ValueError, RuntimeError, ImportError)


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
