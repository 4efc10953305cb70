"""A glob's wildcards skip names starting with a dot, as a shell's and Python's glob do."""

import argparse
import glob
import os
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.corpus.input_files import InputError, expand_patterns
from elmo_pipeline.downstream.dataset import expand_sources

FILES = ["a.txt", ".DS_Store", ".hidden.txt", "sub/b.txt", "sub/.c.txt", ".git/x.txt", ".git/.y.txt"]


@pytest.fixture
def tree(tmp_path):
    for name in FILES:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x\n")
    return tmp_path


@pytest.mark.parametrize("pattern", ["*", "**", "*.txt", "**/*.txt", ".*", ".git/*", ".*/*", ".*/.*", "**/.*",
                                     "sub/*", "?DS_Store", "[.]*", "*/*.txt", ".git/**"])
def test_expanded_globs_are_pythons(tree, pattern):
    # `*` took .DS_Store and .hidden.txt, `**` also every file under .git/
    expected = sorted(p for p in glob.glob(str(tree / pattern), recursive=True) if os.path.isfile(p))
    if not expected:
        with pytest.raises(InputError, match="matches"):
            expand_patterns([str(tree / pattern)])
    else:
        assert expand_patterns([str(tree / pattern)]) == expected


def test_a_hidden_file_named_whole_or_inside_a_hidden_folder_named_literally_is_read(tree):
    assert expand_patterns([str(tree / ".DS_Store"), str(tree / ".git" / "*.txt")]) == [
        str(tree / ".DS_Store"), str(tree / ".git" / "x.txt")]


def test_a_pattern_that_matches_only_hidden_files_says_so(tmp_path):
    (tmp_path / ".notes.txt").write_text("x\n")
    with pytest.raises(InputError) as caught:
        expand_patterns([str(tmp_path / "*.txt")])
    assert str(caught.value) == (
        f"input pattern {str(tmp_path / '*.txt')!r} matches only hidden files ({str(tmp_path / '.notes.txt')!r}: a "
        "name on its path starts with '.', which a wildcard does not match, as in a shell); write the dot in the "
        "pattern ('data/.*') to read them")


def test_hidden_names_on_an_object_store_are_skipped_too():
    fs = fsspec.filesystem("memory")
    root = f"/hidden-{uuid.uuid4().hex}"
    for name in ("a.txt", ".b.txt", ".cache/c.txt"):
        fs.pipe(f"{root}/{name}", b"x\n")
    try:
        assert expand_patterns([f"memory://{root}/**"]) == [f"memory://{root}/a.txt"]
    finally:
        fs.rm(root, recursive=True)


def test_a_features_folder_skips_a_hidden_parquet_file(tmp_path):
    # macOS leaves `._NAME` files beside what it copies: read as Parquet, `._part.parquet` stopped
    # the whole dataset ("not a readable Parquet file")
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "part.parquet")
    (tmp_path / "._part.parquet").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    assert expand_sources(str(tmp_path)) == [str(tmp_path / "part.parquet")]
    assert expand_sources(str(tmp_path / "*.parquet")) == [str(tmp_path / "part.parquet")]


def test_probe_data_folder_skips_an_editors_hidden_swap_file(tmp_path):
    from elmo_pipeline.pipelines.probe import resolve_files

    for name in ("en-ud-train.conllu", "en-ud-dev.conllu", ".en-ud-train.conllu.swp"):
        (tmp_path / name).write_text("1\tx\t_\tX\n\n")
    args = argparse.Namespace(data=str(tmp_path), train=None, dev=None)
    # "expected one *train*.conllu file, found [...en-ud-train.conllu, ....en-ud-train.conllu.swp]"
    assert resolve_files(args) == {"train": str(tmp_path / "en-ud-train.conllu"),
                                   "dev": str(tmp_path / "en-ud-dev.conllu")}
