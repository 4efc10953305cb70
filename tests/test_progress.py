"""The one progress style: a bar with counts and token rates on a terminal, nothing elsewhere."""

from __future__ import annotations

import io
import re
import sys

from elmo_pipeline.progress import note_tokens, progress_bar
from support import Terminal


def _run(monkeypatch, stream: io.StringIO, enabled: bool = True) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    bar = progress_bar("embed-file", total=10, enabled=enabled)
    note_tokens(bar, 4, 37)
    note_tokens(bar, 6, 63)
    bar.close()
    return stream.getvalue()


def test_on_a_terminal_the_bar_shows_items_and_the_running_token_count(monkeypatch):
    shown = _run(monkeypatch, Terminal())
    last = shown.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("embed-file: 100%")
    assert "10/10" in last and "100 tokens" in last and "tokens/s" in last


def test_off_a_terminal_or_when_disabled_nothing_is_written(monkeypatch):
    assert _run(monkeypatch, io.StringIO()) == ""
    assert _run(monkeypatch, Terminal(), enabled=False) == ""


def test_a_resumed_count_starts_where_it_stopped(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress_bar("pretrain", total=20, unit="steps", initial=15)
    bar.update(5)
    assert bar.n == 20
    bar.close()
    assert "20/20" in sys.stderr.getvalue()


def test_a_bar_made_once_its_first_batch_is_done_counts_that_batchs_time(monkeypatch):
    """extract's bar is made as a worker's first batch ends: its line said that batch's tokens over
    ~0 s ('6,312 tokens, 211,795,575 tokens/s'). 1,000 tokens that took 4 s are 250 a second or less
    on the bar's last line, and its time is past the 4 s; a disabled bar takes `elapsed` too."""
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress_bar("embed", elapsed=4.0)
    note_tokens(bar, 10, 1000)
    bar.close()
    last = sys.stderr.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    minutes, seconds, rate = re.search(r"\[(\d+):(\d\d).*, 1,000 tokens, ([\d,]+) tokens/s\]", last).groups()
    assert 60 * int(minutes) + int(seconds) >= 4 and int(rate.replace(",", "")) <= 250, last
    progress_bar("embed", enabled=False, elapsed=4.0).close()
