"""`elmo-pipeline extract`: the Beam feature-extraction job (pipelines/extract.py)."""

from __future__ import annotations

import argparse


def _extract(args: argparse.Namespace) -> int:
    from elmo_pipeline.pipelines.extract import run_and_report

    return run_and_report(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    from elmo_pipeline.embedding.options import add_extract_args

    p = subparsers.add_parser(
        "extract", help="tokenize, embed and write Parquet features with Apache Beam",
        description="Beam options (--runner, --num_workers, --project, ...) pass through to the pipeline; an "
                    "argument that neither extract nor Beam knows is an error. Without --runner the job runs "
                    "locally on the FnApiRunner.")
    add_extract_args(p)
    p.set_defaults(func=_extract, accepts_beam_args=True)
