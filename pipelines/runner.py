"""Running a pipeline: locally on Beam's FnApiRunner (which downloads nothing) unless a runner is named.

Beam ignores an option it does not know (it logs "Discarding unparseable args" and runs on), so
`check_beam_args` refuses, before any work, every argument that neither our command nor one of
Beam's PipelineOptions classes knows, and runners that cannot run our jobs correctly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import difflib
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Callable, Iterator, NamedTuple, Sequence

import fsspec

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options import pipeline_options
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, PortableOptions, StandardOptions
from apache_beam.runners.runner import PipelineResult

from elmo_pipeline.commands import JobFailed, option_strings, unknown_arguments
from elmo_pipeline.filesystems import is_local
from elmo_pipeline.formats.atomic import nearest_existing
from elmo_pipeline.transforms.embed import remove_shared_model_files
from elmo_pipeline.transforms.write import TEMP_FOLDER
from elmo_pipeline.corpus.tokenization import absolute_spacy_model
from elmo_pipeline.formats.files import absolute_local
from elmo_pipeline.formats.pretrained import absolute_model_location

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
    from `add_own_args`, included), a value Beam's parser rejects, and a runner that cannot run
    our jobs (DaskRunner, by short name or import path, or a subclass of it)."""
    args = list(beam_args)
    runner, _ = _options_parser().parse_known_args(args)
    if runner.runner:
        _check_runner(runner.runner)
    parser = _options_parser()  # again: the runner's module may have added options classes
    parsed, unknown = parser.parse_known_args(args)
    _check_worker_counts(parsed)
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
        if value is not None and int(value) < 0:
            raise BeamArgsError(f"--{option} must be >= 0, got {value}")


# runners whose workers are this process, its threads or processes it starts on this machine
_HERE = {LOCAL_RUNNER, *(f"apache_beam.runners.direct.direct_runner.{name}"
                         for name in ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")),
         "apache_beam.runners.test.TestDirectRunner"}


def workers_run_here(beam_args: Sequence[str]) -> bool:
    """Whether the job's workers run on this machine (no `--runner`: our local FnApiRunner, or
    one of Beam's direct runners), so that what this process finds (a GPU, jieba) holds for them."""
    runner = PipelineOptions(list(beam_args)).view_as(StandardOptions).runner
    return runner is None or resolve_runner(runner) in _HERE


class WorkerLayout(NamedTuple):
    """How many SDK workers share one machine's cores, and whether they are separate processes
    (else threads of one process: the launching one, on the local runner)."""

    workers: int
    separate_processes: bool


def worker_layout(options: PipelineOptions) -> WorkerLayout:
    """What the options say about the workers on one machine: the local runner's
    `--direct_num_workers` in multi_processing or multi_threading mode (0: one per CPU), or a
    portable runner's `--sdk_worker_parallelism` (processes); one worker where they say nothing."""
    direct = options.view_as(DirectOptions)
    if direct.direct_running_mode in ("multi_processing", "multi_threading"):
        return WorkerLayout(direct.direct_num_workers or os.cpu_count() or 1,
                            direct.direct_running_mode == "multi_processing")
    parallelism = options.view_as(PortableOptions).sdk_worker_parallelism
    return WorkerLayout(max(1, int(parallelism or 1)), True)


def run_pipeline(build: Callable[[beam.Pipeline], None], beam_args: Sequence[str], command: str,
                 output: str, earlier: Sequence[str] = (),
                 writes: Callable[[str], bool] | None = None) -> PipelineResult:
    """Build a pipeline with `build`, run it to the end and return its result (with metrics).

    `earlier`: the entries of an earlier run in the folder `output` that this one replaces
    (`--overwrite`); they go only once the job succeeded (`set_aside`). `writes(name)`: whether
    a name in `output` is one the job writes there itself. A job that fails takes away, in a
    local `output`, the sinks' temporary folders it made (partial shards) and the new entries
    `writes` names, before its error goes on. Run here, a Ctrl-C or SIGTERM ends the `command`
    at once, with one line and exit status 130 or 143, after the same and after ending the
    run's worker processes."""
    args = list(beam_args)
    if not any(arg == "--runner" or arg.startswith("--runner=") for arg in args):
        args.append(f"--runner={LOCAL_RUNNER}")
    p = beam.Pipeline(options=PipelineOptions(args))
    try:
        build(p)
    except BaseException:
        shutil.rmtree(p.local_tempdir, ignore_errors=True)  # Beam removes it only in run()
        raise
    # the signals are taken first, so that one arriving while the earlier run is moved aside or
    # put back still puts it back; the cleanups register with `ending` as they start
    ending = _Ending(command, p.local_tempdir)
    with (_interrupt_ends_local_run(args, ending), set_aside(output, earlier, writes, ending),
          _TempFolders(output) as temp):
        ending.temp = temp
        try:
            result = p.run()
            result.wait_until_finish()
        except Exception as exc:  # the runner's own error types: a worker's, a channel's, a step's
            raise JobFailed(str(exc).strip() or type(exc).__name__) from exc
        finally:
            if workers_run_here(args):
                remove_shared_model_files()
    return result


ASIDE_PREFIX = ".earlier-run-"  # the hidden folder an earlier run waits in while the next one runs


@contextlib.contextmanager
def set_aside(output: str, entries: Sequence[str], writes: Callable[[str], bool] | None = None,
              ending: "_Ending | None" = None) -> Iterator[Callable[[], None]]:
    """The local `entries` of the folder `output` moved into a hidden folder in it while the block
    runs, put back if it fails (a runner that cannot start, a wrong job endpoint) and removed once
    it succeeded; gives the function that puts them back, which first removes the entries that
    appeared meanwhile and that `writes` names (what the failed job wrote). It is given to
    `ending` before anything moves, may be called from two threads at once (the second waits),
    and does nothing once the block succeeded. Where a rename is a copy (object stores) the
    entries are deleted at once instead, and nothing is put back."""
    fs, root = fsspec.core.url_to_fs(output)
    if not is_local(fs):
        for entry in entries:
            fs.rm(entry, recursive=True)
        yield lambda: None
        return
    aside = tempfile.mkdtemp(prefix=ASIDE_PREFIX, dir=root) if entries else None
    moved: list[tuple[str, str]] = []
    present = set(os.listdir(root)) if os.path.isdir(root) else set()
    lock, settled = threading.Lock(), []

    def put_back() -> None:
        with lock:
            if settled:  # put back already, or the job succeeded
                return
            settled.append(True)
            if writes is not None and os.path.isdir(root):
                for name in set(os.listdir(root)) - present - {os.path.basename(aside or "")}:
                    if writes(name):
                        _remove(os.path.join(root, name))
            for where, entry in moved:
                if not os.path.lexists(where):  # a signal came between the note and the move
                    continue
                if os.path.lexists(entry):  # the failed job's, under the same name
                    _remove(entry)
                os.rename(where, entry)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)

    if ending is not None:
        ending.put_back = put_back
    try:
        for entry in entries:
            moved.append((os.path.join(aside, os.path.basename(entry.rstrip("/"))), entry))  # noted, then moved
            os.rename(entry, moved[-1][0])
        yield put_back
    except BaseException:
        put_back()
        raise
    with lock:
        settled.append(True)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _temp_folders(root: str) -> set[str]:
    """The sinks' temporary folders (where they write each shard until finalize) at any depth under
    the local folder `root`."""
    return {os.path.join(folder, name) for folder, names, _ in os.walk(root) for name in names
            if TEMP_FOLDER.fullmatch(name)}


class _TempFolders:
    """The sinks' temporary folders that appear under a local `output` while it is entered: taken
    away if the block fails (`remove_new` on an interrupt)."""

    def __init__(self, output: str) -> None:
        self.output = output
        fs, self.root = fsspec.core.url_to_fs(output)
        self.local = is_local(fs)
        self.before: set[str] = set()

    def __enter__(self) -> "_TempFolders":
        self.before = _temp_folders(self.root) if self.local else set()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.remove_new()

    def remove_new(self) -> str:
        """Removes them; says what is left, for the one line a command ends with."""
        if not self.local:
            return f"its temporary folders (beam-temp-*) under {self.output} may remain"
        for folder in sorted(_temp_folders(self.root) - self.before):
            shutil.rmtree(folder, ignore_errors=True)
        left = sorted(_temp_folders(self.root) - self.before)  # a thread still writing made one again
        return f"{self.output} holds no temporary folder of it" if not left else f"left {', '.join(left)}"


def _beam_workers() -> set[int]:
    """Beam's SDK worker processes that this process started (at any depth, the shell Beam starts
    them through included), read from /proc; none where there is no /proc. Only those: a program
    that calls a command's `main` may have children of its own."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return set()
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])  # the name in () may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(entry))

    def is_worker(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"apache_beam.runners.worker.sdk_worker_main" in f.read()
        except OSError:
            return False

    found: set[int] = set()
    todo = [(os.getpid(), False)]
    while todo:
        pid, under_worker = todo.pop()
        for child in children.get(pid, ()):
            worker = under_worker or is_worker(child)
            if worker:
                found.add(child)
            todo.append((child, worker))
    return found


_ENDING_SIGNALS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}


def _die_by(signum: int) -> None:
    """Ends the process by `signum` with its default action, from any thread (Python's
    signal.signal works in the main thread only, so libc's is called): a shell then sees the
    signal, and a loop around the command stops on Ctrl-C. Exit status 128 + signum otherwise."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).signal(signum, 0)  # 0: SIG_DFL
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    os._exit(128 + signum)


class _Ending:
    """What a signal's end of a local run undoes: `put_back` (set_aside's) and `temp` (the sinks'
    temporary folders) once they are set, and Beam's `scratch` folder."""

    def __init__(self, command: str, scratch: str) -> None:
        self.command, self.scratch = command, scratch
        self.put_back: Callable[[], None] | None = None
        self.temp: _TempFolders | None = None


@contextlib.contextmanager
def _interrupt_ends_local_run(args: Sequence[str], ending: _Ending) -> Iterator[None]:
    """Within it, SIGINT or SIGTERM on a job run here kills the Beam workers the run started,
    removes the sinks' temporary folders that appeared (before the earlier run, which may hold
    some, is put back), puts the earlier run back, removes Beam's scratch folder and its model
    server's files, prints one
    line and ends the process by the same signal (a shell sees 130 or 143, and a loop around
    the command stops on Ctrl-C). A signal the process was started ignoring stays ignored.

    Python's KeyboardInterrupt does not end a local run cleanly: Beam turns it into a
    RuntimeError and logs its traceback per bundle, its worker threads go on with their bundles,
    and its worker processes, which a terminal's Ctrl-C reaches too, print their own; SIGTERM
    (what `timeout`, schedulers and container runtimes send) would end the process with none of
    this done. And Python runs a signal's handler in the main thread only, which waits on the
    job in C for as long as a bundle takes: a watcher thread takes the signals instead."""
    if not workers_run_here(args) or threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = {signum for signum in _ENDING_SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN}
    if not taken:
        yield
        return
    workers_before = _beam_workers()

    def end(signum: int) -> None:
        # the watcher's alone, and it does not come back: a second signal waits unread
        # what the bundles and threads in flight log or raise from now on says nothing more
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda _: None
        for pid in _beam_workers() - workers_before:  # they would go on for seconds, holding memory
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        where = ending.temp.remove_new() if ending.temp is not None else f"{ending.command} had not started writing"
        if ending.put_back is not None:
            ending.put_back()
        shutil.rmtree(ending.scratch, ignore_errors=True)
        remove_shared_model_files()
        print(f"elmo-pipeline {ending.command}: {_ENDING_SIGNALS[signum]}; {where}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        _die_by(signum)

    finished = threading.Event()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)

    def watch() -> None:
        # Whichever thread the kernel gives a signal to (the threads that predate this have it
        # unblocked), Python's C-level handler writes its number to the wake-up pipe at once.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, taken)
        while True:
            signum = os.read(wake_read, 1)[0]
            if finished.is_set():
                return
            if signum in taken:
                end(signum)

    # Blocked here, the signals stay blocked in every thread and worker process the run starts
    # (both inherit the mask): a terminal's Ctrl-C then reaches only the watcher, or a thread
    # that predates this, and the workers do not see it.
    # Python's handler does nothing: only its C-level part matters, which writes to the pipe. Run
    # in the main thread, `end` could wait for a lock that the main thread holds (a put_back).
    previous = {signum: signal.signal(signum, lambda *_: None) for signum in taken}
    previous_wakeup = signal.set_wakeup_fd(wake_write)
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, taken)
    watcher = threading.Thread(target=watch, name="elmo-pipeline-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        os.write(wake_write, b"\0")
        watcher.join()
        signal.set_wakeup_fd(previous_wakeup)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_read)
        os.close(wake_write)


def make_paths_absolute(args: argparse.Namespace) -> None:
    """The local paths a job's workers read or write (`output`, `model`, `spacy_model`, where
    `args` has them) made absolute, as the inputs are: a portable runner's or a cluster's workers
    run in a folder of their own, where `out/` wrote the shards beside them while the launcher
    reported success."""
    if getattr(args, "output", None):
        args.output = absolute_local(args.output)
    if getattr(args, "model", None):
        args.model = absolute_model_location(args.model)
    if getattr(args, "spacy_model", None):
        args.spacy_model = absolute_spacy_model(args.spacy_model)


def check_beam_writable(output: str) -> None:
    """Raises ValueError for a folder Beam's file sinks cannot write (memory://, say): found now,
    not after the job ran. Local paths, gs://, s3://, hdfs:// and azfs:// pass."""
    try:
        FileSystems.get_filesystem(output)
    except ValueError as exc:
        raise ValueError(f"--output {output}: Beam's file sinks cannot write there ({exc})") from exc
    fs, path = fsspec.core.url_to_fs(output)
    if is_local(fs):
        _check_local_writable(fs, output, os.path.abspath(path))


def _check_local_writable(fs: fsspec.AbstractFileSystem, output: str, path: str) -> None:
    """A local folder, or the nearest existing folder above it, that this process cannot write (a
    read-only mount stops root too) fails here, not as Beam's traceback once the job started."""
    existing = nearest_existing(fs, path)
    if existing is not None and os.path.isdir(existing) and not os.access(existing, os.W_OK | os.X_OK):
        where = "it is" if existing == path else f"{existing}, where it would be made, is"
        raise ValueError(f"--output {output} cannot be written: {where} not writable by this process")
