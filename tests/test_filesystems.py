"""Which file system a URL is on: the one helper every part asks."""

import fsspec
import pytest

from elmo_pipeline.filesystems import is_local, local_folder, shown


def test_only_this_machines_file_system_is_local():
    assert is_local(fsspec.filesystem("file"))
    assert not is_local(fsspec.filesystem("memory"))
    # a protocol named as a string, not a tuple: "file" is a substring of it, and it is no local disk
    cached = fsspec.filesystem("filecache", target_protocol="memory")
    assert cached.protocol == "filecache" and not is_local(cached)


def test_a_path_is_shown_as_written_and_a_url_with_its_protocol():
    assert shown(fsspec.filesystem("file"), "/data/a.parquet") == "/data/a.parquet"
    assert shown(fsspec.filesystem("memory"), "/data/a.parquet") == "memory:///data/a.parquet"


def test_a_local_folder_is_a_path_or_a_file_url_and_another_file_system_is_refused():
    assert local_folder("runs/a", "--output", "why") == "runs/a"
    assert local_folder("file:///runs/a", "--output", "why") == "/runs/a"
    with pytest.raises(ValueError, match=r"^--output s3://b/r: it runs there, not a s3:// URL; give a local path$"):
        local_folder("s3://b/r", "--output", "it runs there")
