"""The one progress style of every long command: a tqdm bar on stderr.

It redraws at most once a second and stays silent when stderr is not a terminal (tqdm's
`disable=None`), so logs, CI output and cluster worker logs carry no progress noise; Beam's
counters and summary.json are the record there.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(desc: str, total: int | None = None, unit: str = "sentences", enabled: bool = True,
                 initial: int = 0, elapsed: float = 0.0) -> tqdm:
    """A bar counting `unit`s from `initial` (a resumed run's); `note_tokens` adds the running
    token count beside the rate. `elapsed`: the seconds its first count already took, for a bar
    made once that work is done (else the rates of its first line are that count over ~0 s)."""
    bar = tqdm(desc=desc, total=total, unit=unit, file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
               disable=None if enabled else True, initial=initial)
    if not bar.disable:  # tqdm's own clock, which its elapsed time and rates are measured from
        bar.start_t -= elapsed
        bar.last_print_t -= elapsed
    return bar


def note_tokens(bar: tqdm, items: int, tokens: int) -> None:
    """Count `items` done, `tokens` of them in all; tokens/s is the figure users compare."""
    bar.update(items)
    if not bar.disable:
        seen = getattr(bar, "tokens_seen", 0) + tokens
        bar.tokens_seen = seen
        elapsed = max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix_str(f"{seen:,} tokens, {seen / elapsed:,.0f} tokens/s", refresh=False)
