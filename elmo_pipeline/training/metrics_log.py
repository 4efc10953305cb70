"""metrics.csv: a row per training log line ("train") and per validation ("valid"), written by
the main process only. A resumed run first drops the rows after its checkpoint's step, which it
is about to redo, so that the file reads as one unbroken run.
"""

from __future__ import annotations

import csv
import os
from typing import Any

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
            with open(path, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow({k: row.get(k, "") for k in CSV_FIELDS})
