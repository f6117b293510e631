#!/usr/bin/env bash
# vLLM plugin CI step (CPU only; called by .ci/run, also runnable alone):
#   bash .ci/vllm.sh [VENV_DIR]
# From scratch: a venv with vllm==0.33.0 (pulls its CUDA torch 2.14.0 and CUDA
# wheels, ~5 min / ~9 GB on a 2-core machine), dsv4 installed as pure Python
# (DSV4_CUDA=0: the CPU kernels are all the plugin tests need), then
# pytest tests/plugin (~2-3 min on 2 cores: it builds vLLM's tiny V4 / V4.1 models
# a few times). vLLM's compiled extensions cannot load without a GPU
# driver; vLLM tolerates that and the tests do not need them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${1:-$(mktemp -d /tmp/dsv4-vllm.XXXXXX)/venv}
PY=${PYTHON:-python3}
PIP=(-q --disable-pip-version-check)
t0=$SECONDS
# This machine's pip config lists file:// extra indexes that lack most projects;
# pip warns once per project. Drop those lines, keep everything else.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }; }

"$PY" -m venv "$VENV"
quiet "$VENV/bin/pip" install "${PIP[@]}" "vllm==0.33.0" "pytest>=8" "setuptools>=77" wheel
echo "vllm installed in $((SECONDS - t0))s; venv size $(du -sh "$VENV" | cut -f1)"

# Non-editable, from outside the checkout below, so the tests import the installed
# package (and never a dsv4/_C*.so that a CUDA build left in the source tree).
quiet env DSV4_CUDA=0 "$VENV/bin/pip" install "${PIP[@]}" --no-build-isolation --no-deps "$REPO"

cd "$VENV/.."
"$VENV/bin/python" - <<'PY'
import dsv4, dsv4_plugin, vllm
from importlib.metadata import entry_points
assert any(ep.value == "dsv4_plugin:register" for ep in entry_points(group="vllm.general_plugins"))
print(f"vllm {vllm.__version__}, dsv4 {dsv4.__version__} (CUDA extension: {dsv4.HAS_CUDA_EXTENSION})")
PY
# -rs prints the skip reason if the suite skipped; a skipped suite fails this step.
set +e
"$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "$REPO/tests/plugin" 2>&1 | tee "$VENV/../pytest.log"
rc=${PIPESTATUS[0]}
set -e
if grep -qE "^(SKIPPED|[0-9]+ skipped)" "$VENV/../pytest.log" && ! grep -qE "[0-9]+ passed" "$VENV/../pytest.log"; then
  echo "vLLM plugin tests were all skipped: vllm==0.33.0 did not install correctly" >&2
  exit 1
fi
echo "vLLM plugin step took $((SECONDS - t0))s"
exit "$rc"
