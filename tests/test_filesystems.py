"""Which file system a URL is on: the one helper every part asks."""

import re

import fsspec
import pytest

from elmo_pipeline.filesystems import is_local, local_folder, open_url, shown, url_to_fs


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


@pytest.mark.parametrize("url, resolved", [
    ("memory://a/../b", "memory://b"), ("memory:///a/./x/../b/", "memory:///a/b/"),
    ("gs://bucket/runs/../m", "gs://bucket/m"), ("file:///tmp/x/../y", "file:///tmp/y"),
    ("s3://b/a//c", "s3://b/a//c"),  # an empty component is another key on S3: kept
    ("memory://a.b/..c/.d", "memory://a.b/..c/.d"),  # names that only start with dots
    ("runs/../m", "runs/../m"), ("simplecache::s3://b/a/../c", "simplecache::s3://b/a/../c"),
    # an HTTP URL's query is not its path: `?file=x/../y.txt` was cut to `https://host/y.txt`
    ("https://host/dl?file=x/../y.txt", "https://host/dl?file=x/../y.txt"),
    ("https://host/a/../dl?file=x/./y#part/../z", "https://host/dl?file=x/./y#part/../z"),
    ("s3://b/k?x/../y", "s3://b/y"),  # a key's `?` is a character of its name
])
def test_a_urls_dot_components_are_resolved_as_a_local_paths_are(url, resolved):
    from elmo_pipeline.filesystems import resolve_dots

    assert resolve_dots(url) == resolved


def test_a_dot_dot_above_a_urls_root_is_refused_naming_it():
    from elmo_pipeline.filesystems import resolve_dots

    with pytest.raises(ValueError, match=r"^memory://a/\.\./\.\./b: its '\.\.' goes above the root of memory://$"):
        resolve_dots("memory://a/../../b")
    # an object store's bucket and an HTTP host are no folders: gs://b/../c/m was bucket c's m
    for url, top in (("gs://bucket/runs/../../other/m", "gs://bucket"), ("https://host/../x", "https://host")):
        with pytest.raises(ValueError, match=rf"^{re.escape(url)}: its '\.\.' goes above {re.escape(top)}$"):
            resolve_dots(url)


def test_an_input_url_with_dot_dot_reads_the_file_it_points_to():
    # "input pattern 'memory://ROOT/x/../a.txt' matches no files"
    from elmo_pipeline.corpus.input_files import expand_patterns

    memory = fsspec.filesystem("memory")
    memory.pipe("/dots-input/a.txt", b"x\n")
    try:
        assert expand_patterns(["memory:///dots-input/x/../a.txt", "memory:///dots-input/./x/../*.txt"]) == [
            "memory:///dots-input/a.txt"]
    finally:
        memory.rm("/dots-input", recursive=True)


def test_a_pathlib_path_is_opened_and_missed_as_its_str_is(tmp_path):
    """fsspec takes a pathlib.Path as a local path; our HTTP options split it as a str and failed
    ('PosixPath' object has no attribute 'split': ReadDocuments(Path) and a Path's missing file)."""
    (tmp_path / "a.txt").write_bytes(b"one\ntwo\n")
    with open_url(tmp_path / "a.txt") as f:
        assert f.read() == b"one\ntwo\n"
    fs, path = url_to_fs(tmp_path / "a.txt")
    assert is_local(fs) and path == str(tmp_path / "a.txt")
    with pytest.raises(FileNotFoundError):
        with open_url(tmp_path / "missing.txt"):
            pass
