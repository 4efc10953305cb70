"""metrics.csv over a run's life: a resumed run trims it to its checkpoint's step, and a kill
while it does so loses no row of the earlier invocations."""

import subprocess
import sys
import textwrap

from elmo_pipeline.training.metrics_log import CSV_FIELDS, MetricsLog

# In a process of its own: trim to step 60, and die by SIGKILL the moment the kept rows are being
# written (the scheduler that restarted the job kills it again).
_KILLED_WHILE_TRIMMING = textwrap.dedent("""
    import csv, os, signal, sys
    from elmo_pipeline.training.metrics_log import MetricsLog
    csv.DictWriter.writerows = lambda self, rows: os.kill(os.getpid(), signal.SIGKILL)
    MetricsLog(sys.argv[1], True, 60)
""")


def _rows(count: int) -> list[dict]:
    return [{"kind": "train", "step": 10 * (i + 1), "epoch": 0, "loss": 9.0 - i / 100} for i in range(count)]


def test_a_kill_while_a_resumed_run_trims_metrics_csv_keeps_the_earlier_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    log = MetricsLog(str(path), True, None)
    for row in _rows(8):  # steps 10 .. 80; a checkpoint at 60, rows 70 and 80 to be redone
        log.write(row)
    before = path.read_text(encoding="utf-8")
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_TRIMMING, str(path)], check=False)
    assert killed.returncode == -9
    assert path.read_text(encoding="utf-8") == before  # all 8 rows, not a header or nothing
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]  # no partial file left beside it
    MetricsLog(str(path), True, 60)  # the next resume trims it as it should
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == ",".join(CSV_FIELDS)
    assert [line.split(",")[1] for line in lines[1:]] == ["10", "20", "30", "40", "50", "60"]
    assert lines[6].split(",")[6] == "8.95"
