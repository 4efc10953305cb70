"""Ctrl-C or SIGTERM on a job whose workers run here: the run's workers killed, what it wrote
undone, one line, and the process ended by the same signal (see `interrupt_ends_local_run` for
why Python's own KeyboardInterrupt and the default SIGTERM do not do this).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
from typing import Callable, Iterator, Sequence

from elmo_pipeline.formats.atomic import LOCAL_RENAMES
from elmo_pipeline.pipelines.beam_options import workers_run_here
from elmo_pipeline.pipelines.temp_folders import TempFolders
from elmo_pipeline.transforms.embed import close_progress_bars, remove_shared_model_files


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


# what a signal's end of a run undoes besides its Ending, registered by `undone_if_ended`
_UNDONE_AT_END: list[Callable[[], None]] = []


@contextlib.contextmanager
def undone_if_ended(undo: Callable[[], None]) -> Iterator[None]:
    """Within it, a signal that ends a local run (`interrupt_ends_local_run`) calls `undo` before
    the process dies: the process dies from the watcher thread, so the `finally` of the context
    that registered it never runs."""
    _UNDONE_AT_END.append(undo)
    try:
        yield
    finally:
        _UNDONE_AT_END.remove(undo)


class Ending:
    """What a signal's end of a local run undoes: `put_back` (set_aside's) and `temp` (the sinks'
    temporary folders) once they are set, and Beam's `scratch` folder."""

    def __init__(self, command: str, scratch: str) -> None:
        self.command, self.scratch = command, scratch
        self.put_back: Callable[[], None] | None = None
        self.temp: TempFolders | None = None


@contextlib.contextmanager
def interrupt_ends_local_run(args: Sequence[str], ending: Ending) -> Iterator[None]:
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
        killed = _beam_workers() - workers_before
        for pid in killed:  # they would go on for seconds, holding memory
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        # the line below starts a line of its own: this process's bars end theirs, and a killed
        # worker's bar (multi_processing) was left mid-line on the terminal they share
        close_progress_bars(None)
        if killed and sys.stderr.isatty():
            print(file=sys.stderr)
        LOCAL_RENAMES.acquire()  # kept: no thread of the job renames a file into place from now on
        where = ending.temp.remove_new() if ending.temp is not None else f"{ending.command} had not started writing"
        if ending.put_back is not None:
            ending.put_back()
        for undo in reversed(_UNDONE_AT_END):
            undo()
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
