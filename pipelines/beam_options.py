"""Beam's command-line options: checked before any work, and what they say about the runner.

Beam ignores an option it does not know (it logs "Discarding unparseable args" and runs on), so
`check_beam_args` refuses, before any work, every argument that neither our command nor one of
Beam's PipelineOptions classes knows, and runners that cannot run our jobs correctly. The
commands also ask the options where the workers run (`workers_run_here`: what this process finds,
a GPU or jieba, holds for them) and how many share a machine (`worker_layout`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
from typing import Callable, NamedTuple, Sequence

from apache_beam.options import pipeline_options
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, PortableOptions, StandardOptions

from elmo_pipeline.commands import option_strings, repeated_options, unknown_arguments

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
_REFUSED = {  # runners that would write part of the data and report success: why
    DASK_RUNNER: "Beam 2.77's DaskRunner drops what a DoFn emits in finish_bundle (the embedding "
                 "sort buffer's last batches, prepare's word counts), leaves file sinks unfinalized and "
                 "cannot report metrics, while the job reports success",
}


class BeamArgsError(ValueError):
    """An argument passed on to Beam that Beam would ignore or reject; raised before any work."""


class _Parser(pipeline_options._BeamArgumentParser):  # knows add_value_provider_argument
    def error(self, message: str):
        if "expected one argument" in message:
            # the command's own parser cannot know that a Beam option takes a value, and gives
            # a separate word to its positional argument when it has one (probe's data folder)
            message += "; if you gave it one, write it as --option=VALUE"
        raise BeamArgsError(message)


def _options_parser() -> _Parser:
    """Every option of the PipelineOptions classes loaded now, parsed as Beam parses them
    (its direct subclasses, no abbreviations)."""
    parser = _Parser(allow_abbrev=False, add_help=False)
    classes = {str(cls): cls for cls in PipelineOptions.__subclasses__()}
    for cls in classes.values():
        cls._add_argparse_args(parser)
    return parser


def resolve_runner(name: str) -> str:
    """The import path Beam makes of a `--runner` value (`FlinkRunner`, `flink`, or a full path)."""
    known = {path.rsplit(".", 1)[-1].lower(): path for path in StandardOptions.ALL_KNOWN_RUNNERS}
    known["daskrunner"] = DASK_RUNNER  # not in Beam's list, but refused by short name too
    return known.get(name.lower(), known.get(name.lower() + "runner", name))


def _check_runner(name: str) -> None:
    path = resolve_runner(name)
    if path in _REFUSED:
        named = name if name == path else f"{name} ({path})"
        raise BeamArgsError(f"--runner {named} cannot run this job: {_REFUSED[path]}. "
                            "Use the local FnApiRunner (the default), Dataflow, Flink or Spark.")
    module, dot, cls_name = path.rpartition(".")
    if not dot:
        stems = {n.lower().removesuffix("runner"): n for n in StandardOptions.KNOWN_RUNNER_NAMES}
        suggestion = difflib.get_close_matches(name.lower().removesuffix("runner"), list(stems), n=1)
        hint = f" (did you mean {stems[suggestion[0]]}?)" if suggestion else ""
        raise BeamArgsError(f"--runner {name}: unknown runner{hint}; give one of "
                            f"{', '.join(StandardOptions.KNOWN_RUNNER_NAMES)} or the import path of a PipelineRunner")
    try:  # importing the runner also registers the options classes its module defines
        runner_cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        raise BeamArgsError(f"--runner {name}: cannot load {path}: {exc}") from exc
    for base in getattr(runner_cls, "__mro__", ()):
        refused = f"{base.__module__}.{base.__qualname__}"
        if refused in _REFUSED:
            raise BeamArgsError(f"--runner {name} is a {refused} and cannot run this job: {_REFUSED[refused]}")


def check_beam_args(beam_args: Sequence[str],
                    add_own_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Raises BeamArgsError naming every argument in `beam_args` (what our command's own parser
    left over) that no Beam PipelineOptions class knows, with the nearest known option (ours,
    from `add_own_args`, included), a value Beam's parser rejects, an option of one value given
    twice with different values, `--runtime_type_check`, `--type_check_strictness=ALL_REQUIRED`, and a
    runner that cannot run our jobs (DaskRunner, by short name or import path, or a subclass of it)."""
    args = list(beam_args)
    runner, _ = _options_parser().parse_known_args(args)
    if runner.runner:
        _check_runner(runner.runner)
    parser = _options_parser()  # again: the runner's module may have added options classes
    parsed, unknown = parser.parse_known_args(args)
    _check_worker_counts(parsed)
    if getattr(parsed, "runtime_type_check", False):
        raise BeamArgsError("--runtime_type_check: Beam 2.77's runtime type check fails the finalize step of "
                            "every file sink (a plain WriteToText too), after the whole job has run; leave it out "
                            "(--performance_runtime_type_check works)")
    if getattr(parsed, "type_check_strictness", None) == "ALL_REQUIRED":
        raise BeamArgsError("--type_check_strictness=ALL_REQUIRED: Beam 2.77's own transforms (Create, the file "
                            "sinks) declare no output type, so no pipeline that writes files can be built with it "
                            "(it failed with a traceback); leave it out (DEFAULT_TO_ANY)")
    repeated = repeated_options(parser, args)
    if repeated:  # Beam keeps the last value without a word, as argparse does
        raise BeamArgsError("given more than once with different values, of which only the last would count: "
                            + "; ".join(repeated) + "; give each once")
    if not unknown:
        return
    known = option_strings(parser)
    if add_own_args is not None:
        own = argparse.ArgumentParser(add_help=False)
        add_own_args(own)
        known += option_strings(own)
    problems = unknown_arguments(unknown, known)
    raise BeamArgsError("unrecognized argument" + ("s" if len(problems) > 1 else "") + ", neither ours nor "
                        "a Beam pipeline option: " + "; ".join(problems))


def _check_worker_counts(parsed: argparse.Namespace) -> None:
    """A negative worker count would fail inside the runner, after the output folder was cleared."""
    for option in ("direct_num_workers", "sdk_worker_parallelism"):
        value = getattr(parsed, option, None)
        if value is None:
            continue
        try:  # Beam parses --sdk_worker_parallelism as text: "x" failed naming no option
            number = int(value)
        except ValueError:
            raise BeamArgsError(f"--{option}: invalid int value: {value!r}") from None
        if number < 0:
            raise BeamArgsError(f"--{option} must be >= 0, got {value}")


# runners whose workers are this process, its threads or processes it starts on this machine
_HERE = {LOCAL_RUNNER, *(f"apache_beam.runners.direct.direct_runner.{name}"
                         for name in ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")),
         "apache_beam.runners.test.TestDirectRunner"}


def workers_run_here(beam_args: Sequence[str]) -> bool:
    """Whether the job's workers run on this machine (no `--runner`: our local FnApiRunner, or
    one of Beam's direct runners), so that what this process finds (a GPU, jieba) holds for them."""
    return _runs_here(PipelineOptions(list(beam_args)))


def _runs_here(options: PipelineOptions) -> bool:
    runner = options.view_as(StandardOptions).runner
    return runner is None or resolve_runner(runner) in _HERE


class WorkerLayout(NamedTuple):
    """How many SDK workers share one machine's cores, and whether they are separate processes
    (else threads of one process: the launching one, on the local runner)."""

    workers: int
    separate_processes: bool


def worker_layout(options: PipelineOptions) -> WorkerLayout:
    """What the options say about the workers on one machine: on the local runner (or one of Beam's
    direct runners) `--direct_num_workers` (0: one per CPU; processes in multi_processing mode, else
    threads of this process), or a portable runner's `--sdk_worker_parallelism` (processes); one worker where
    they say nothing."""
    direct = options.view_as(DirectOptions)
    # in_memory with several workers runs their bundles at once in this process's threads, as
    # multi_threading does (Beam logs that it should not: measured, 4 bundles at once with 4);
    # another runner ignores these options (a stray --direct_num_workers 4 beside a portable
    # runner's --sdk_worker_parallelism 2 was taken for 4 threads, its 2 processes' torch undivided)
    if _runs_here(options) and (direct.direct_running_mode in ("multi_processing", "multi_threading")
                                or direct.direct_num_workers != 1):
        return WorkerLayout(direct.direct_num_workers or os.cpu_count() or 1,
                            direct.direct_running_mode == "multi_processing")
    parallelism = options.view_as(PortableOptions).sdk_worker_parallelism
    return WorkerLayout(max(1, int(parallelism or 1)), True)
