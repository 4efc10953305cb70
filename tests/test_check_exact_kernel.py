"""benchmarks/check_exact_kernel.py: what the command line gives it."""

import sys

import pytest

from benchmarks import check_exact_kernel


def test_an_argument_is_an_error_naming_it_not_ignored(monkeypatch, capsys):
    """It read no command line: `python -m benchmarks.check_exact_kernel --kernel fused` ran every
    check as without it and exited 0, as if the fused kernel had been checked."""
    monkeypatch.setattr(sys, "argv", ["check_exact_kernel", "--kernel", "fused"])
    with pytest.raises(SystemExit) as ended:
        check_exact_kernel.main()
    assert ended.value.code == 2
    assert "check_exact_kernel: error: unrecognized arguments: --kernel fused" in capsys.readouterr().err
