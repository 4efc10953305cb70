"""The suite's own $TMPDIR (tests/conftest.py): a folder where Beam's leftovers go and are removed
with the session, short enough below the user's temp folder for a socket of multiprocessing."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a user's temp folder of this length: with the suite's $TMPDIR in pytest's session folder under it, a
# socket's path there was past the 107 bytes an AF_UNIX address may have; with it right in it, 55 fit
USERS_TEMP_CHARS = 50


def test_the_suites_temp_folder_takes_a_socket_and_what_beam_leaves_there():
    # what a DataLoader's worker does to pass a tensor: a Listener in a pymp-* folder of $TMPDIR (in a
    # process of its own, which removes that folder as it exits)
    listen = ("from multiprocessing.connection import Listener\n"
              "with Listener(family='AF_UNIX') as listener: print(listener.address)")
    address = subprocess.run([sys.executable, "-c", listen], capture_output=True, text=True)
    assert address.returncode == 0, address.stderr[-2000:]
    assert address.stdout.startswith(tempfile.gettempdir() + os.sep)
    assert os.environ["TMPDIR"] == tempfile.gettempdir()
    tempfile.mkdtemp(prefix="beam-pipeline-temp")  # as a Beam pipeline built and never run leaves it


def test_a_long_temp_folder_of_the_user_takes_the_suites_sockets_and_keeps_nothing_of_it():
    """Under a temp folder of 50 characters the suite's $TMPDIR, then a folder in pytest's session
    folder, left no room for a socket's path: 'OSError: AF_UNIX path too long' in a DataLoader's
    worker, and the loader waited for it for good."""
    base = tempfile.mkdtemp(prefix="u")
    if len(base) >= USERS_TEMP_CHARS:
        pytest.skip(f"the suite's temp folder {base} leaves no room to make one of {USERS_TEMP_CHARS} characters")
    users = Path(base, "t" * (USERS_TEMP_CHARS - len(base) - 1))
    users.mkdir()
    assert len(str(users)) == USERS_TEMP_CHARS
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_the_suites_temp_folder_takes_a_socket_and_what_beam_leaves_there"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(users)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    # pytest's session folders, and nothing else: the suite's folder went with what was left in it
    assert [p.name for p in users.iterdir() if not p.name.startswith("pytest-of-")] == []


def test_a_temp_folder_too_long_for_a_loader_workers_socket_skips_its_tests_with_the_reason():
    """Under a user's temp folder of 56 characters or more the suite's $TMPDIR left no room for a
    DataLoader worker's socket, and test_rank_and_worker_shares_are_disjoint_and_complete waited for
    good; it is skipped, saying why, and the tests around it run."""
    base = tempfile.mkdtemp(prefix="u")
    users = Path(base, "t" * max(1, 80 - len(base) - 1))
    users.mkdir()
    test = "tests/downstream/test_downstream_dataset.py::test_rank_and_worker_shares_are_disjoint_and_complete"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test,
                          "tests/downstream/test_downstream_dataset.py::test_file_order_without_shuffle_and_a_new_order_per_epoch"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(users)},
                         timeout=300)  # a bound on the wait that this test is about, not a measurement
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed, 1 skipped" in run.stdout
    assert re.search(r"SKIPPED \[1\] tests/support.py:\d+: DataLoader worker 0: the temp "
                     rf"folder {re.escape(str(users))}{re.escape(os.sep)}elmo-tests-\w+ \(\d+ bytes\) leaves no room",
                     run.stdout), run.stdout[-3000:]
