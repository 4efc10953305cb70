"""A progress line on stderr for long local commands: counts, rates, at most one update a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "items",
                 stream: TextIO | None = None, interval: float = 1.0) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = 0
        self.tokens = 0
        self.start = self.last = time.monotonic()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._write(end="\r" if self.tty else "\n")

    def close(self) -> None:
        self._write(end="\n")

    def _write(self, end: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        of = f"/{self.total}" if self.total is not None else ""
        rate = f", {self.tokens / elapsed:,.0f} tokens/s" if self.tokens else ""
        self.stream.write(f"{self.label}: {self.done}{of} {self.unit}{rate}, {elapsed:.1f}s{end}")
        self.stream.flush()
