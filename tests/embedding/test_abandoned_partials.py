"""The partial file a write killed by SIGKILL leaves (`<out>.<8 hex>.partial`) is removed by the
next write of that file, in real processes; one that a live process is writing is not."""

import errno
import fcntl
import signal
import stat
import subprocess
import sys
import time

import fsspec
import h5py

from elmo_pipeline.cli.main import main
from elmo_pipeline.formats.atomic import remove_abandoned_partials, write_bytes_atomically

# a process writing `sys.argv[1]` through replace_atomically, as embed-file does, that prints its
# partial file's path and waits for its stdin to close before the rename
LIVE_WRITER = """
import sys
import fsspec
from elmo_pipeline.formats.atomic import replace_atomically

def write(partial):
    print(partial, flush=True)
    sys.stdin.read()
    with open(partial, "w") as f:
        f.write("the live writer's")

replace_atomically(fsspec.filesystem("file"), sys.argv[1], write)
"""


def _partials(folder, name):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(name + ".") and p.name.endswith(".partial"))


def test_a_killed_embed_files_partial_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path):
    """embed-file killed by SIGKILL left out.hdf5.<8 hex>.partial, which no later run removed (a
    folder of them after a few killed jobs). A write holds a lock on its partial file until its
    rename; a later write of the same file removes the partial files no process holds."""
    long_input = tmp_path / "long.txt"
    long_input.write_text("".join(f"Line {i} of a long input to embed .\n" for i in range(3000)))
    (tmp_path / "in.txt").write_text("Hello world .\nA second line .\n")
    out = tmp_path / "out.hdf5"
    killed = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.cli.main", "embed-file", str(long_input),
                               str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not _partials(tmp_path, out.name) and killed.poll() is None:
            time.sleep(0.01)
        killed.send_signal(signal.SIGKILL)
    finally:
        killed.wait()
    assert killed.returncode == -signal.SIGKILL
    [left] = _partials(tmp_path, out.name)  # what was left, as before
    assert not out.exists()

    live = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        held = live.stdout.readline().strip()  # its partial file, locked, being written
        assert main(["embed-file", str(tmp_path / "in.txt"), str(out)]) == 0
        with h5py.File(out, "r") as f:
            assert sorted(f.keys()) == ["0", "1", "sentence_to_index"] and f["1"].shape[-2] == 4
        # the killed run's partial file is gone; the live writer's is there, and its write goes on
        assert _partials(tmp_path, out.name) == [held.rsplit("/", 1)[1]] and left not in held
    finally:
        live.stdin.close()
        live.wait()
    assert live.returncode == 0 and out.read_text() == "the live writer's"
    assert _partials(tmp_path, out.name) == []


def test_a_file_system_without_locks_is_written_unlocked_as_before(tmp_path, monkeypatch):
    """206b6c8 locked each local partial file and failed the write when the lock failed: on a file
    system without locks (NFS without its lock daemon: ENOLCK; Lustre without -o flock: ENOSYS), every
    summary.json, model file and embed-file output was '[Errno 37] cannot write ...'. None runs
    here, so flock raises as theirs does. The file is written unlocked, its mode kept; the cleaner,
    which cannot lock either, leaves a partial file there as it is."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    final = tmp_path / "summary.json"
    final.write_bytes(b"{}")
    final.chmod(0o600)
    write_bytes_atomically(fsspec.filesystem("file"), str(final), b'{"sentences": 3}')
    assert final.read_bytes() == b'{"sentences": 3}' and stat.S_IMODE(final.stat().st_mode) == 0o600
    other = tmp_path / "summary.json.0123abcd.partial"  # another run's, maybe live: there is no telling
    other.write_bytes(b"{")
    remove_abandoned_partials(str(final))
    assert _partials(tmp_path, final.name) == [other.name]
