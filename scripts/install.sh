#!/usr/bin/env bash
# Installs dsv4 for development and runs the main job: the first command of README.md.
#
#   bash scripts/install.sh              then: .venv/bin/python -m pytest tests
#
# 1. Python: ./.venv (created with python3 -m venv when missing), or the interpreter
#    DSV4_PYTHON names (e.g. DSV4_PYTHON=python to install into the active environment).
# 2. setuptools and wheel (a fresh venv has no bdist_wheel), then torch if it is missing:
#    DSV4_TORCH (pip arguments, default torch==2.14.0: vllm 0.33.0 requires exactly that
#    release, so `pip install vllm==0.33.0` into the same venv keeps this torch and the
#    dsv4._C built against it; .ci/run tests that sequence). An installed torch is kept.
# 3. If torch has CUDA: the build prerequisite ninja (parallel nvcc jobs).
# 4. dsv4 editable with its test extras (pip install --no-build-isolation -e ".[test]").
#    setup.py builds dsv4._C when torch has CUDA and it finds the toolkit nvcc belongs to;
#    DSV4_CUDA=0|1 forces pure Python / requires the build. Its decision is printed here
#    (pip hides it) and the full pip log kept in build/install.log.
# 5. The main job, scripts/decode_latency.py, when a Hopper GPU and dsv4._C are there.
#    Without a GPU it prints its one-line reason, and the tiny CPU reference run
#    (--cpu-reference, under a minute) shows the same tables and plots instead.
#    A Hopper GPU without dsv4._C is an error: exit status 1, with the reason.
# Results land in decode_latency_results/ (gitignored). MAX_JOBS sets the nvcc jobs.
set -euo pipefail
cd "$(dirname "$0")/.."

bold() { if [ -t 1 ]; then printf '\033[1m%s\033[0m\n' "$*"; else printf '%s\n' "$*"; fi; }
step() { printf '\n'; bold "==> $*"; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
banner() { printf '\n'; bold "########################################################################"; bold "# $*"
           bold "########################################################################"; }

# 1. the interpreter
if [ -n "${DSV4_PYTHON:-}" ]; then
  PY=$(command -v "$DSV4_PYTHON") || die "DSV4_PYTHON=$DSV4_PYTHON is not an executable"
else
  PY=.venv/bin/python
  if [ ! -x "$PY" ]; then
    step "creating the virtual environment .venv ($(python3 --version 2>&1))"
    python3 -m venv .venv || die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv), or set DSV4_PYTHON"
  fi
fi
PIP=("$PY" -m pip install --disable-pip-version-check)
# pip -q, without the one warning per project that a pip config's missing file:// index gives
pipq() { "${PIP[@]}" -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }; }
"$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null \
  || die "dsv4 needs Python >= 3.10; $PY is $("$PY" --version 2>&1)"

# 2. build tools, torch
step "build tools (setuptools, wheel) into $PY"
pipq "setuptools>=77" wheel
if TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  step "torch $TORCH_VERSION is installed: kept"
else
  read -r -a TORCH_ARGS <<< "${DSV4_TORCH:-torch==2.14.0}"
  step "installing torch (${TORCH_ARGS[*]}; several GB for a CUDA build)"
  pipq "${TORCH_ARGS[@]}" numpy
fi
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)

# 3. build prerequisites of the CUDA extension
if [ -n "$TORCH_CUDA" ] && [ "${DSV4_CUDA:-}" != 0 ]; then
  step "torch has CUDA $TORCH_CUDA: build prerequisite (ninja)"
  pipq ninja
fi

# 4. dsv4, editable, test extras
step "dsv4 editable with its test extras (a CUDA build takes minutes; MAX_JOBS=${MAX_JOBS:-auto})"
mkdir -p build
LOG=build/install.log
set +e
: > "$LOG"  # before tail follows it: the background pip opens it only once it is forked
# pip -v passes setup.py's output through: show its dsv4 lines and ninja's progress
"${PIP[@]}" -v --no-build-isolation -e ".[test]" >> "$LOG" 2>&1 &
pip_pid=$!
tail -n +1 -f --pid=$pip_pid "$LOG" \
  | grep --line-buffered -E '^ *(dsv4: |\[[0-9]+/[0-9]+\] )' \
  | sed -u -E 's/^ *(\[[0-9]+\/[0-9]+\]) .* -c ([^ ]+).*/\1 compiling \2/; t; s/^ *(\[[0-9]+\/[0-9]+\]) .*/\1 linking/; t; s/^ *//' \
  | awk '!seen[$0]++ { print; fflush() }'
wait $pip_pid
rc=$?
set -e
if [ $rc -ne 0 ]; then
  tail -n 40 "$LOG" >&2
  die "pip install failed (status $rc); the full log is $LOG"
fi

# what was built, said loudly
read -r HAS_EXT HOPPER WHY < <("$PY" - <<'PY'
import torch, dsv4
hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
print(int(dsv4.HAS_CUDA_EXTENSION), int(hopper), dsv4._ops.EXTENSION_ERROR or "")
PY
)
DECISION=$(grep -E '^ *dsv4: building' "$LOG" | tail -n 1 | sed -E 's/^ *//' || true)
if [ "$HAS_EXT" = 1 ]; then
  banner "dsv4 installed WITH the CUDA extension dsv4._C"
else
  banner "dsv4 installed WITHOUT the CUDA extension: CPU reference kernels only"
  [ -n "$DECISION" ] && echo "${DECISION}"
  if grep -qE '^ *dsv4: building the CUDA extension' "$LOG"; then
    die "setup.py built dsv4._C but it does not load: $WHY"
  fi
  if [ "$HOPPER" = 1 ]; then
    die "a Hopper GPU is here but dsv4._C was not built (${DECISION#dsv4: }); install the CUDA toolkit of torch's CUDA major version ($TORCH_CUDA) and run this again"
  fi
fi

# 5. the main job
step "the main job: python scripts/decode_latency.py"
set +e
"$PY" scripts/decode_latency.py
rc=$?
set -e
if [ $rc -eq 1 ]; then  # no usable GPU: decode_latency printed the reason in one line
  step "no usable GPU for the main job: the tiny CPU reference run instead (--cpu-reference)"
  "$PY" scripts/decode_latency.py --cpu-reference
elif [ $rc -ne 0 ]; then
  die "scripts/decode_latency.py failed (status $rc)"
fi
banner "done; the tests: ${PY} -m pytest tests"
