"""`elmo-pipeline extract`: the Beam feature-extraction job (pipelines/extract.py)."""

from __future__ import annotations

import argparse
import json


def _extract(args: argparse.Namespace) -> int:
    from .pipelines.extract import run

    summary = run(args, args.beam_args)
    print(json.dumps(summary, indent=2))
    return 0 if summary["documents_reconcile"] and summary["tokens_reconcile"] else 1


def register(subparsers) -> None:
    from .extract_options import add_extract_args

    p = subparsers.add_parser(
        "extract", help="tokenize, embed and write Parquet features with Apache Beam",
        description="Beam options (--runner, --num_workers, --project, ...) pass through to the pipeline; "
                    "without --runner the job runs locally on the FnApiRunner.")
    add_extract_args(p)
    p.set_defaults(func=_extract, accepts_beam_args=True)
