#!/usr/bin/env bash
# The lent GPU machine's software, rehearsed on this CPU machine before any device time is spent:
# Python 3.12, torch 2.11 (its CUDA build, which runs on CPU), numpy 2.5 (above Beam's pin), the
# newest pyarrow, and this project's wheels installed from .whl/ exactly as the device's install
# line does it (--no-deps --target, PYTHONSAFEPATH=1). Then the device's main call
# (benchmarks/gpu_session.py run: the suite in quick mode, a tiny model trained on the data that
# travels) and the whole test suite against the installed wheel, from a copy of the checkout that
# has no library sources (so nothing can be imported from the checkout by mistake).
#
#     benchmarks/gpu_rehearse.sh     # after benchmarks/gpu_wheels.sh; minutes on 2 cores once its venv exists
#
# Left out, as the device has neither: tests/test_architecture.py (it reads the checkout's
# sources) and tests/feast (Feast pins numpy < 2.5). The first run downloads about 3 GB (torch
# with its CUDA libraries) into $REHEARSE_DIR/venv (REHEARSE_DIR defaults to /tmp/elmo-rehearse).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
WORK="${REHEARSE_DIR:-/tmp/elmo-rehearse}"   # venv/ (kept between runs), site/, tree/, train/, session/, runs/
VENV="$WORK/venv"
find_python312() {
  if python3.12 -c '' 2>/dev/null; then command -v python3.12; return; fi
  ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1
}
PY312="${PY312:-$(find_python312)}"
[ -x "$PY312" ] || { echo "gpu_rehearse.sh: no Python 3.12 found (set PY312)" >&2; exit 1; }
ls .whl/suite/elmo_pipeline-*.whl .whl/device-provides.txt >/dev/null 2>&1 || { echo "gpu_rehearse.sh: run benchmarks/gpu_wheels.sh first" >&2; exit 1; }

# The device's versions where KINDS.md gives them, and the newest pyarrow (above Beam's pin: the
# machine's own is not on record); the rest of what the wheels leave to the machine
# (gpu_wheels.sh's device-provides.txt, less those four) at what their requirements allow.
DEVICE_PINNED=(torch==2.11.0 numpy==2.5.2 safetensors==0.8.0 pyarrow)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# the project's test extra (aiohttp, jieba, ...), less Feast, whose tests are left out below
mapfile -t TESTS < <("$VENV/bin/python" -c 'import tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]:
    if not r.startswith("feast"):
        print(r)')
grep -v -E '^(torch|numpy|safetensors|pyarrow)([^A-Za-z0-9_.-]|$)' .whl/device-provides.txt >"$WORK/device-provides.txt"
"$VENV/bin/python" -m pip install -q "${DEVICE_PINNED[@]}" "${TESTS[@]}" -r "$WORK/device-provides.txt"

SITE="$WORK/site"
TREE="$WORK/tree"
rm -rf "$SITE" "$TREE"
# the device's own install line (gpu_session.install_line), its python3 this venv's, its folder $SITE
INSTALL=$("$VENV/bin/python" -c 'import sys; from benchmarks.gpu_session import install_line
print(install_line(".whl", sys.argv[1]))' "$SITE")
PATH="$VENV/bin:$PATH" bash -c "set -o pipefail; $INSTALL"
mkdir -p "$TREE"
git ls-files | grep -v -E '^(elmo_pipeline|transforms|pipelines)/' | tar -cf - -T - | tar -xf - -C "$TREE"

export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PATH="$SITE/bin:$PATH"
DATA="${ELMO_PIPELINE_DATA:-$(PYTHONPATH="$SITE:$ROOT" "$VENV/bin/python" -c 'from benchmarks.common import shared_data_dir; print(shared_data_dir())')}"
PYTHONPATH="$SITE" "$VENV/bin/python" -c 'import sys, numpy, pyarrow, torch
print(f"rehearsal: Python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}, "
      f"pyarrow {pyarrow.__version__}")'
# the device's main call (its environment line, run in the checkout): the suite in quick mode,
# then the tiny preset trained on CPU, on 300 lines of each split packed here (validating on the
# whole of WikiText-2 valid, 217k tokens through a full softmax, takes a CPU minutes). 330 s: a
# suite slowed by a busy machine to its limit (125 + 40 s) still leaves the training 75 s.
rm -rf "$WORK/session" "$WORK/runs"
PYTHONPATH="$SITE:$ROOT" "$VENV/bin/python" -m benchmarks.gpu_train_default pack --out "$WORK/train" --max-lines 300 \
  >/dev/null
PYTHONPATH="$SITE:$ROOT" ELMO_PIPELINE_DATA="$ROOT/.whl/suite/data" "$VENV/bin/python" -m benchmarks.gpu_session run \
  --out "$WORK/session" --seconds 330 --suite-seconds 125 --quick --train-data "$WORK/train" --runs "$WORK/runs" \
  --finish-seconds 90 --min-train-seconds 30 -- --preset tiny --device cpu --variants 0.3,0.45/fused --warmup-steps 4 \
  --batch-tokens 2048 --threads 1 >"$WORK/session.log" 2>&1 || { tail -40 "$WORK/session.log"; exit 1; }
sed -n '/^=== session:/,$p' "$WORK/session.log"
grep -q '"matches_checkout": true' "$WORK/session/suite/report.json" \
  || { echo "gpu_rehearse.sh: the installed wheel is not this checkout's: rerun gpu_wheels.sh" >&2; exit 1; }
# both issues' files, as the device brings them back (the log it tees is the eighth)
for f in suite/report.json suite/report.md model/summary.json model/config.json model/vocab.json \
         model/model.safetensors.part-00; do
  [ -s "$WORK/session/$f" ] || { echo "gpu_rehearse.sh: the main call left no $f (the session's lines above)" >&2; exit 1; }
done
# every test against the installed wheel
cd "$TREE"
PYTHONPATH="$SITE" ELMO_PIPELINE_DATA="$DATA" "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests \
  --ignore tests/test_architecture.py --ignore tests/feast
