"""metrics.csv: a row per training log line ("train") and per validation ("valid"), written by
the main process only. A resumed run first drops the rows after its checkpoint's step, which it
is about to redo, so that the file reads as one unbroken run.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from elmo_pipeline.formats.atomic import write_url_atomically

CSV_FIELDS = ["kind", "step", "epoch", "elapsed_s", "tokens", "tokens_per_s", "loss", "perplexity",
              "forward_perplexity", "backward_perplexity", "lr", "grad_norm", "peak_memory_gib"]


class MetricsLog:
    def __init__(self, path: str, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        rows = []
        if resume_step is not None and os.path.exists(path):  # drop rows the resumed run redoes
            rows = [r for r in _rows(path) if int(r["step"]) <= resume_step]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        # renamed over the old file: written in place, a kill while the kept rows were written back
        # (a scheduler restarting the job) left the file cut short and the run's history gone
        write_url_atomically(path, text.getvalue().encode("utf-8"))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow({k: row.get(k, "") for k in CSV_FIELDS})


def _rows(path: str) -> list[dict[str, str]]:
    """The rows of an earlier metrics.csv. Its last row may be torn (a kill while it was appended):
    that one is left out, since its step comes after the checkpoint and is redone; a damaged row
    before it, or a file that is not such a CSV, is an error naming the file and line."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = reader.fieldnames or []
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: cannot be read as metrics.csv ({exc}); move it away and resume") from exc
    if "step" not in header:
        raise ValueError(f"{path}: its header has no 'step' column ({','.join(header)[:80]!r}); move it away and "
                         "resume")
    kept = []
    for number, row in enumerate(rows, 2):
        whole = None not in row and all(row.get(k) is not None for k in header) and row["step"].isdigit()
        if not whole:
            if number == len(rows) + 1:
                break
            raise ValueError(f"{path}, line {number}: not a whole row of {len(header)} fields; move the file away "
                             "and resume")
        kept.append(row)
    return kept
