#!/usr/bin/env bash
# Set up unity-pcg in ./.venv: a CPU build of PyTorch where no GPU is present, then the package
# with its test extras.  Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! $VPY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found: installing the default (CUDA) torch build"
    $VPY -m pip install -q "torch>=2.3,<3"
  else
    echo "[setup] no GPU: installing a CPU build of torch"
    # torch==2.13.0 is a CPU wheel on this project's machines; elsewhere use PyTorch's CPU index
    $VPY -m pip install -q torch==2.13.0 2>/dev/null \
      || $VPY -m pip install -q "torch>=2.3,<3" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
echo "[setup] installing unity-pcg (editable) with test extras"
$VPY -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
# the package's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (containers, CI) every command would
# otherwise compile its modules again at start-up (~0.3 s, counted in a planning command's --budget)
$VPY -m compileall -q unity_pcg search substitutions verifier executor calibration rules_cache >/dev/null || true
$VPY -c "import unity_pcg, torch; print('[setup] ok: torch', torch.__version__)"
