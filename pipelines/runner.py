"""Running a pipeline: locally on Beam's FnApiRunner (which downloads nothing) unless a runner is named."""

from __future__ import annotations

from typing import Callable, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.runner import PipelineResult

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"


def run_pipeline(build: Callable[[beam.Pipeline], None], beam_args: Sequence[str]) -> PipelineResult:
    """Build a pipeline with `build`, run it to the end and return its result (with metrics)."""
    args = list(beam_args)
    if not any(arg == "--runner" or arg.startswith("--runner=") for arg in args):
        args.append(f"--runner={LOCAL_RUNNER}")
    p = beam.Pipeline(options=PipelineOptions(args))
    build(p)
    result = p.run()
    result.wait_until_finish()
    return result
