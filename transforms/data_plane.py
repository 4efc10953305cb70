"""Whole elements between the threads of Beam's in-process runner.

Beam 2.77's in-process gRPC workers (`--direct_running_mode multi_threading`) flush every output
stream once a second from a timer thread, wherever the thread writing it is. Encoding an element
with a coder written in Python (an Arrow table, anything pickled: most of ours) lets go of the GIL
midway, so an element could be cut in two across data messages, which the runner decodes one by
one: rows dropped without an error, garbage values, or a length read from the wrong bytes (one
such run took 24 GB before it was killed). Beam's worker processes (`multi_processing`, the
portable runners, Dataflow) have no such timer: they flush at 10 MB of whole elements and at the
bundle's end, and the in-process workers do the same once the timer is off.
"""

from __future__ import annotations

from apache_beam.runners.portability.fn_api_runner import worker_handlers


def keep_elements_whole() -> None:
    """Turns the in-process workers' timer flush off (0: flush by size, between elements). The
    value is read when a job starts its workers, so it holds for every job started after."""
    worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 0
