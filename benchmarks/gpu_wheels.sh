#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, manylinux x86-64, no package index there) that it
# lacks for benchmarks/gpu_suite.py: pydantic and zstandard (the library), apache-beam 2.77 and
# spaCy with their dependencies (the end-to-end section), and this package's own wheel; plus the
# shared data the suite reads. Each is fetched with --no-deps at the version this project's
# environment is tested with; what the machine already has (the device README's KINDS.md package
# list, 2026-11-17) is not fetched. The script then checks that every requirement of every wheel
# is either fetched or on that list.
#
#     benchmarks/gpu_wheels.sh [DIR]          # DIR defaults to .whl (git-ignored)
#
# One device call carries at most 64 MiB, the working tree included (about 17 MB here, the
# default model being 16 MB of it), and Beam + spaCy + their dependencies are about 90 MB: they
# cannot travel in one call. So the wheels are packed into folders DIR/<stage>/, each small
# enough to travel with the tree in one call: DIR/suite/ (this package without the default
# model's weights, which the tree carries; pydantic, zstandard, the data; about 10 MB) is what the
# suite needs to run at all, DIR/train/ the default-model run's data, and DIR/extra-1/, DIR/extra-2/,
# ... hold Beam and spaCy. The extra folders travel in calls that only carry them (the machine
# keeps carried folders while it stays warm, 30 s after a call), then DIR/suite and DIR/train in
# the main call, which installs every folder there and runs benchmarks/gpu_session.py (the suite,
# then the training). If the machine went back in between, the suite runs without Beam and spaCy
# and says so. The script fails loudly when a folder would not fit in one call, and ends with
# `python -m benchmarks.gpu_session plan`: the calls, timed to a fresh session's 15 minutes.
set -euo pipefail

cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PYTHON="${PYTHON:-python3}"
# the weights the tree carries, so the wheel leaves them out (the install line copies them back)
DEFAULT_WEIGHTS=$("$PYTHON" -c 'from benchmarks.gpu_session import DEFAULT_WEIGHTS; print(DEFAULT_WEIGHTS)')
CALL_LIMIT_MIB=64     # the device tool's limit on what one call carries, the working tree included
MARGIN_MIB=2          # room for the tree to grow between now and the run
SUITE_LIMIT_MIB=60    # the folder the suite cannot run without

CORE=(  # the library's own needs that the machine lacks (pydantic 2.14 wants typing-extensions >= 4.16)
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 zstandard==0.25.0
)
BEAM=(
  apache-beam==2.77.0 beartype==0.22.9 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 fastavro==1.13.1
  fasteners==0.20 httplib2==0.32.1 jsonpickle==4.1.4 objsize==0.7.1 pymongo==4.20.1 dnspython==2.9.2
  proto-plus==1.29.0 pytz==2026.6
)
SPACY=(
  spacy==3.8.18 spacy-legacy==3.0.12 spacy-loggers==1.0.5 thinc==8.3.14 blis==1.3.4 cymem==2.0.16
  murmurhash==1.0.16 preshed==3.0.15 srsly==2.5.6 catalogue==2.0.10 confection==1.3.4 wasabi==1.1.3
  weasel==1.0.1 cloudpathlib==0.26.0 smart-open==9.0.2
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_31 \
         manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${p}_x86_64")
done

fetch() {  # fetch DEST SPEC...: one wheel per spec, no dependencies
  local dest=$1; shift
  for spec in "$@"; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$dest" "$spec"
  done
}

# The folder is emptied first, so it must be one this script made or a new one; and the device
# tool carries only git-ignored paths inside the checkout, named relative to it.
refuse() { echo "gpu_wheels.sh: $DIR: $1" >&2; exit 2; }
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || refuse "$PWD is not a git checkout (what travels is its working tree)"
case "$DIR" in
  /* | .. | ../* | */.. | */../*) refuse "give a folder inside the checkout, relative to it (the default is .whl)" ;;
esac
git check-ignore -q "$DIR/" || refuse "not ignored by git: its files would travel in every device call (.whl is)"
if [ -e "$DIR" ] && { [ ! -d "$DIR" ] || { [ -n "$(ls -A "$DIR")" ] && [ ! -f "$DIR/device-provides.txt" ]; }; }; then
  refuse "exists and is not a folder this script made (no device-provides.txt in it): not emptying it"
fi
rm -rf "$DIR"
mkdir -p "$DIR/suite" "$DIR/all-extra"
echo "fetching ${#CORE[@]} + ${#BEAM[@]} + ${#SPACY[@]} wheels for CPython 3.12, manylinux x86-64 into $DIR" >&2
fetch "$DIR/suite" "${CORE[@]}"
fetch "$DIR/all-extra" "${BEAM[@]}" "${SPACY[@]}"
# setuptools copies the sources into build/ and never empties it: a module deleted since an
# earlier build would ship too
rm -rf build
"$PYTHON" -m pip wheel -q --no-deps -w "$DIR/suite" . >"$DIR/pip-wheel.log" 2>&1 || { cat "$DIR/pip-wheel.log" >&2; exit 1; }
rm "$DIR/pip-wheel.log"
# The default model's weights already travel in the working tree: the wheel leaves them out (file
# and RECORD line) and the install line copies them from the tree, so one call does not carry them twice.
"$PYTHON" - "$DIR/suite" "$DEFAULT_WEIGHTS" <<'EOF'
import sys
import zipfile
from pathlib import Path

folder, drop = Path(sys.argv[1]), sys.argv[2]
wheel = next(folder.glob("elmo_pipeline-*.whl"))
stripped = wheel.with_suffix(".stripped")
with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as target:
    if drop not in source.namelist():
        sys.exit(f"gpu_wheels.sh: {wheel.name} has no {drop}")
    for item in source.infolist():
        if item.filename == drop:
            continue
        data = source.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line + b"\n" for line in data.splitlines() if not line.startswith(f"{drop},".encode()))
        target.writestr(item, data)
stripped.replace(wheel)
EOF
DATA=$("$PYTHON" -c 'from benchmarks.common import shared_data_dir; print(shared_data_dir())')
mkdir -p "$DIR/suite/data/wikitext2"
cp -r "$DATA/allennlp_elmo" "$DIR/suite/data/"
cp "$DATA/wikitext2/wiki.valid.tokens" "$DIR/suite/data/wikitext2/"
chmod -R u+w "$DIR/suite/data"
# WikiText-2 prepared for benchmarks/gpu_train_default.py (the default-model run after the suite)
"$PYTHON" -m benchmarks.gpu_train_default pack --out "$DIR/train" >/dev/null

TREE_BYTES=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
              | awk '{s += $1} END {print s + 0}')

"$PYTHON" - "$DIR" "$TREE_BYTES" "$CALL_LIMIT_MIB" "$MARGIN_MIB" "$SUITE_LIMIT_MIB" <<'EOF'
"""Check every wheel's requirements against what was fetched and what the machine has; pack the
extra wheels into folders that each fit in one call; write what the wheels leave to the machine
(device-provides.txt); print the sizes."""
import re
import shutil
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

directory, tree, limit, margin, suite_limit = Path(sys.argv[1]), int(sys.argv[2]), *map(int, sys.argv[3:6])
MIB = 2**20
# KINDS.md, "Python packages already there" (nvidia-h200, the kind lent, read 2026-11-17)
DEVICE_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
MACHINE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def metadata(wheel: Path) -> tuple[str, list[Requirement]]:
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Name:"))
    reqs = [Requirement(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return norm(name), [r for r in reqs if r.marker is None or r.marker.evaluate(MACHINE)]


wheels = sorted(directory.glob("*/*.whl"))
fetched = {metadata(w)[0]: w for w in wheels}
unfetched = [(name, r) for name, w in fetched.items() for r in metadata(w)[1] if norm(r.name) not in fetched]
missing = sorted({f"{name} needs {r}" for name, r in unfetched if norm(r.name) not in DEVICE_HAS})
if missing:
    sys.exit("gpu_wheels.sh: requirements neither fetched nor on the GPU machine:\n  " + "\n  ".join(missing))
if len(fetched) != len(wheels):
    sys.exit("gpu_wheels.sh: two versions of one package: " + ", ".join(map(str, wheels)))
# what the wheels leave to the machine, as requirement lines: gpu_rehearse.sh installs them
(directory / "device-provides.txt").write_text("".join(f"{r}\n" for r in sorted({str(r) for _, r in unfetched})))


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


room = (limit - margin) * MIB - tree
suite, train = directory / "suite", directory / "train"
if size(suite) > min(room, suite_limit * MIB):
    sys.exit(f"gpu_wheels.sh: {suite} is {size(suite) / MIB:.1f} MiB: over {suite_limit} MiB or over what one call "
             f"can carry beside the {tree / MIB:.1f} MiB working tree ({room / MIB:.1f} MiB)")
if size(suite) + size(train) > room:
    sys.exit(f"gpu_wheels.sh: {suite} and {train} ({(size(suite) + size(train)) / MIB:.1f} MiB) cannot travel in one "
             f"call beside the {tree / MIB:.1f} MiB working tree ({room / MIB:.1f} MiB)")
extras = sorted((directory / "all-extra").glob("*.whl"), key=lambda w: -w.stat().st_size)
bins: list[list[Path]] = []
for wheel in extras:  # first fit, largest first
    if wheel.stat().st_size > room:
        sys.exit(f"gpu_wheels.sh: {wheel.name} ({wheel.stat().st_size / MIB:.1f} MiB) cannot travel in one call "
                 f"beside the {tree / MIB:.1f} MiB working tree ({room / MIB:.1f} MiB left)")
    target = next((b for b in bins if sum(w.stat().st_size for w in b) + wheel.stat().st_size <= room), None)
    if target is None:
        bins.append(target := [])
    target.append(wheel)
stages = []
for i, members in enumerate(bins, 1):
    stage = directory / f"extra-{i}"
    stage.mkdir()
    for wheel in members:
        shutil.move(str(wheel), stage / wheel.name)
    stages.append(stage)
(directory / "all-extra").rmdir()

print(f"working tree that travels: {tree / MIB:.1f} MiB; room per call: {room / MIB:.1f} MiB (limit {limit} MiB, "
      f"margin {margin} MiB)")
total = 0
for stage in [*stages, suite, train]:
    total += size(stage)
    names = ", ".join(sorted(w.name.split("-")[0] for w in stage.glob("*.whl")))
    print(f"  {stage}: {size(stage) / MIB:.1f} MiB ({names + ', data' if stage == suite else names or 'WikiText-2 packed'})")
print(f"  all: {total / MIB:.1f} MiB of wheels and data in {len(stages) + 2} folders")
EOF
# the calls of a fresh session (15 minutes); with less left, run the plan again with status()'s figure
echo
"$PYTHON" -m benchmarks.gpu_session plan --budget-left 900 --wheels "$DIR"
