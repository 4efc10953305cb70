"""A training run asked to stop by SIGINT or SIGTERM (Ctrl-C, `timeout`, a scheduler, a spot
machine's notice): the signal is noted, the step in progress ends, a checkpoint of it is written
and the command ends with the signal's exit status; the same command resumes from that step.
The same signal a second time ends the process at once, as if it had never been taken.

Stopping at a step boundary is what saves the work: killed mid-step, a run loses every step
since its last periodic checkpoint (up to --checkpoint-seconds of compute)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

STOP_SIGNALS = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}


class StoppedBySignal(Exception):
    """Raised once the stopped run's checkpoint is written: the command's exit status is
    128 + `signum`, as a shell reports a process the signal ended."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopRequest:
    """The first stopping signal received while `taken()` is entered, read between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def taken(self, notice: str | None = None) -> Iterator["StopRequest"]:
        """SIGINT and SIGTERM noted instead of acted on, in the main thread only (Python runs
        signal handlers there), with `notice` written to stderr at once (a step can take seconds);
        a signal the process was started ignoring stays ignored, and one whose handler Python did
        not install (None) is left alone. Handlers restored on exit."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: handler for signum in STOP_SIGNALS
                    if (handler := signal.getsignal(signum)) not in (signal.SIG_IGN, None)}
        received: set[int] = set()

        def note(signum: int, _frame: Any) -> None:
            if signum in received:  # again: what it would have done before
                signal.signal(signum, previous[signum])
                os.kill(os.getpid(), signum)
                return
            # the other one, first (torchrun's SIGTERM to its workers after a terminal's Ctrl-C
            # reached them too), is noted and waits as well
            received.add(signum)
            if self.signum is None:
                self.signum = signum
                if notice:  # to the file descriptor: the handler may have interrupted a write to sys.stderr
                    with contextlib.suppress(OSError):
                        os.write(2, f"\n{STOP_SIGNALS[signum]}: {notice}\n".encode())

        for signum in previous:
            signal.signal(signum, note)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
