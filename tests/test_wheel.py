"""The wheel users install, built from the sources and run from outside the checkout.

Every other test imports the editable install, which reads the checkout itself: a module left
out of `packages`, a model file left out of `package-data`, or a folder mapped under another
name would pass them all and break every installed copy."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from elmo_pipeline import BiLM

ROOT = Path(__file__).resolve().parents[1]
# the source folder behind each import name, as pyproject.toml's package-dir maps them
FOLDERS = {"elmo_pipeline": "elmo_pipeline", "elmo_pipeline/transforms": "transforms",
           "elmo_pipeline/pipelines": "pipelines"}


def _project_files(*paths: str) -> list[str]:
    """The files under `paths` that a commit of the checkout would hold: tracked or new, not
    ignored (a fresh clone's, once committed), and present."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", *paths],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    return sorted({p for p in listed if p and (ROOT / p).is_file()})


def _shipped_sources() -> dict[str, bytes]:
    """Wheel member name -> bytes, for every file of the three code folders."""
    expected = {}
    for path in _project_files(*FOLDERS.values()):
        folder, rest = path.split("/", 1)
        name = next(k for k, v in FOLDERS.items() if v == folder)
        expected[f"{name}/{rest}"] = (ROOT / path).read_bytes()
    return expected


def _copy_sources(tree: Path) -> None:
    """What a wheel is built from, copied to `tree` (the build writes `build/` and egg-info beside
    the sources: the checkout's stay as they are)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the project's files")
    for path in _project_files("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", *FOLDERS.values()):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / path, tree / path)


def _packaged_files(wheel: zipfile.ZipFile) -> set[str]:
    """The files a wheel installs into site-packages: not its .dist-info folder, no folder entries."""
    return {n for n in wheel.namelist() if not n.startswith("elmo_pipeline-") and not n.endswith("/")}


# pip wheel with the build tools of this environment: no download
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-index"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the project's files."""
    tree = tmp_path_factory.mktemp("source")
    _copy_sources(tree)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([*PIP_WHEEL, "--no-deps", "-w", str(out), str(tree)], check=True, capture_output=True)
    (built,) = out.glob("elmo_pipeline-*.whl")
    return built


def test_the_wheel_holds_every_source_file_and_the_default_model_byte_for_byte(wheel):
    expected = _shipped_sources()
    assert "elmo_pipeline/default_model/model.safetensors" in expected
    assert "elmo_pipeline/transforms/__init__.py" in expected and "elmo_pipeline/pipelines/__init__.py" in expected
    with zipfile.ZipFile(wheel) as z:
        members = _packaged_files(z)
        assert sorted(set(expected) - members) == []  # nothing left out
        assert sorted(members - set(expected)) == []  # nothing extra: no tests, benchmarks or caches
        for name, data in expected.items():
            assert hashlib.sha256(z.read(name)).digest() == hashlib.sha256(data).digest(), name
        (entry_points,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert "elmo-pipeline = elmo_pipeline.cli.main:main" in z.read(entry_points).decode()
        (top_level,) = [n for n in z.namelist() if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["elmo_pipeline"]  # no top-level `transforms` to clash


def test_the_readmes_command_for_the_workers_wheel_ships_no_module_an_earlier_build_left(tmp_path):
    # setuptools copies the sources into build/ and never empties it: a checkout built before
    # keeps there a module deleted since, which a plain `pip wheel .` puts in the new wheel
    # spaces as any white space: a reflowed README wraps the sentence, or the command, anywhere
    found = re.findall(r"build\s+a\s+wheel\s+with\s+`([^`]+)`", (ROOT / "README.md").read_text())
    assert len(found) == 1, f"README.md says 'build a wheel with `COMMAND`' {len(found)} times, not once"
    command = " ".join(found[0].split())
    assert "pip wheel" in command, command
    tree = tmp_path / "checkout"
    _copy_sources(tree)
    deleted = tree / "build" / "lib" / "elmo_pipeline" / "deleted_module.py"
    deleted.parent.mkdir(parents=True)
    deleted.write_text("LEFT = True\n")
    command = command.replace("pip wheel", shlex.join(PIP_WHEEL))
    subprocess.run(["bash", "-c", command], cwd=tree, check=True, capture_output=True)
    (built,) = (tree / "dist").glob("elmo_pipeline-*.whl")
    with zipfile.ZipFile(built) as z:
        members = _packaged_files(z)
    assert sorted(members - set(_shipped_sources())) == []
    assert "elmo_pipeline/default_model/model.safetensors" in members


# The first release of a dependency that has what the code uses: pip may install the lowest
# version the wheel allows (an older one already there, or another package's pin), and the
# README's commands must run on it. Each found by running them on the release before.
FIRST_RELEASE_USED = {
    # pyarrow 14.0.1 (Beam 2.77's own lowest): "Unhandled type for Arrow to Parquet schema
    # conversion: halffloat", every job of the default --dtype float16 failed; 15.0.0 ran them, but
    # extract --format parquet failed there on "module 'pyarrow.types' has no attribute
    # 'is_string_view'" (corpus/readers.py's check of the text column); 16.0.0 runs both
    "pyarrow": ("16.0.0", "pa.types.is_string_view, which --format parquet's column check calls"),
    "h5py": ("3.11", "Group.visititems_links, which reads the original weights"),
    # fsspec 2025.7.0 expanded filecache::file://D/*.txt to D/c.txt, the cache and the chain in the
    # ids lost; 2023.12.2 also could not read a folder named run[1] (FileNotFoundError) and 2023.6.0
    # failed on a file name holding a newline (re.error): tests/corpus and tests/downstream say so
    "fsspec": ("2025.9.0", "a chained pattern's matches that keep their chain"),
    # pydantic 2.5.0 and 2.5.1 left a dict item's key out of its errors' location: a mix file's
    # {"m": {"weights": [1, 2, 3], "layer_norm": 1}} was "mixes.json: layer_norm: ...", naming no mix
    "pydantic": ("2.5.2", "the key of a dict's item in its errors' location"),
    # safetensors 0.4.0 and 0.4.1 cannot read a float8 tensor: such weights were "not a readable
    # safetensors file ('F8_E4M3')", where 0.4.2 lets the loader name the tensor and its dtype; up to
    # 0.4.3 a tensor of no element (an adaptive softmax's last tail under a projection below 16)
    # made the model's own save_pretrained unreadable: "both buffer length (0) and count (-1) must
    # not be 0"
    "safetensors": ("0.4.4", "tensors of no element, and float8 ones, which the loader refuses by name"),
    # spaCy 3.7.0 has no memory zones: a corpus's new words stayed in its strings (9,049 where 3.8
    # keeps 2,649), memory the README says is bounded; up to 3.8.7 spaCy guessed a language for a
    # tag (--lang en-US or EN ran as en, pt_BR as pt), which 3.8.8 refuses, as the README says
    "spacy": ("3.8.8", "memory zones, and no language guessed for a tag such as en-US"),
}


def test_no_dependency_is_allowed_below_the_release_that_has_what_the_code_uses(wheel):
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(metadata).decode().splitlines()
    required = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    for name, (first, uses) in FIRST_RELEASE_USED.items():
        (requirement,) = [r for r in required if r.name == name and r.marker is None]
        lowest = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
        assert lowest and max(lowest) >= Version(first), f"{requirement}: {name} before {first} lacks {uses}"


def test_the_installed_wheel_runs_the_readme_job_outside_the_checkout(wheel, tmp_path):
    # The README's first command, `elmo-pipeline extract` on examples/sample.txt with the
    # embedded default model, run by the wheel's own console script from another folder.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copyfile(ROOT / "examples" / "sample.txt", work / "sample.txt")
    # the target folder first on the path: the editable install's finder then never answers
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import elmo_pipeline.transforms, elmo_pipeline.pipelines as p, "
                            "elmo_pipeline as e; print(e.__file__); print(p.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(w).is_relative_to(target) for w in where), where
    script = target / "bin" / "elmo-pipeline"
    done = subprocess.run([sys.executable, str(script), "extract", "--input", "sample.txt", "--output", "features",
                           "--overwrite"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = pq.read_table(sorted(glob.glob(str(work / "features" / "tokens-*.parquet"))))
    assert table.num_rows > 60
    # the vectors are the checkout's model's: the first document's first sentence, every layer
    rows = table.sort_by([("doc_id", "ascending"), ("sentence_index", "ascending"), ("token_index", "ascending")])
    doc = rows["doc_id"][0]
    first = rows.filter(pc.and_(pc.equal(rows["doc_id"], doc), pc.equal(rows["sentence_index"], 0)))
    tokens = first["token"].to_pylist()
    assert tokens[:4] == ["The", "bank", "raised", "its"]
    with torch.inference_mode():
        expected = BiLM.from_pretrained(None).eval().embed([tokens]).layers[:, 0, : len(tokens)]
    for layer in range(expected.shape[0]):
        got = torch.tensor(first[f"layer_{layer}"].to_pylist(), dtype=torch.float32)
        # written as float16 (the default --dtype): within its rounding of the float32 vectors
        torch.testing.assert_close(got, expected[layer], rtol=1e-3, atol=1e-6)
