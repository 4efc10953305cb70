"""benchmarks/bf16_training_quality.py: its table of training losses."""

import json
import sys

import torch

from benchmarks import bf16_training_quality
from support import data_path


def test_a_run_of_fewer_steps_than_log_every_shows_its_last_loss(tmp_path, monkeypatch, capsys):
    """--steps 3 --log-every 25: metrics.csv holds step 3's loss alone, and the table of losses
    (steps --log-every, twice that and multiples of 50) printed its header with no row."""
    data_path("wikitext2")
    monkeypatch.setattr(sys, "argv", [
        "bf16_training_quality", "--preset", "tiny", "--train-lines", "40", "--valid-lines", "10", "--steps", "3",
        "--log-every", "25", "--warmup-steps", "1", "--batch-tokens", "512", "--threads", "1",
        "--work", str(tmp_path)])
    threads = torch.get_num_threads()
    try:
        bf16_training_quality.main()
    finally:
        torch.set_num_threads(threads)  # main sets them for the process
    printed = capsys.readouterr().out.splitlines()
    runs = [json.loads(line) for line in printed if line.startswith('{"precision"')]
    assert [(r["precision"], r["steps"], list(r["loss_curve"])) for r in runs] == [("fp32", 3, ["3"]),
                                                                                   ("bf16", 3, ["3"])]
    fp32, bf16 = (r["loss_curve"]["3"] for r in runs)
    assert 0 < fp32 < 20 and 0 < bf16 < 20
    # the loss table is the last lines printed: its header, then step 3 with both runs' losses
    assert printed[-3:] == ["| step | fp32 (seed 1) | bf16 (seed 1) |", "|---|---|---|",
                            f"| 3 | {fp32:.4f} | {bf16:.4f} |"]
