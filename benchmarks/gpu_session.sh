#!/usr/bin/env bash
# Every GPU measurement of the project in one call (a lent GPU machine's time is short), in this order:
#   1. the executor's overhead on one GPU against eager PyTorch (issue 8, point 8): executor_gpu_overhead.py
#   2. kernel calibration per operator class and math mode (issue 9): unity-pcg calibrate --device cuda
#   3. the zoo's single-GPU training steps at paper size, fp32/tf32/bf16, with per-op profiles: gpu_cost.py
# Each step has its own time limit and writes as it goes, so a cut-short step keeps what it measured.
# Results go to $OUT (default benchmarks/results/gpu_session/); predict them here afterwards with
#   python benchmarks/gpu_cost.py --from OUT/gpu_cost.json --machine OUT/h100_calibrated.json:1x1 ...
# Usage: bash benchmarks/gpu_session.sh [OVERHEAD_S CALIBRATE_S COST_S]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T1=${1:-120}; T2=${2:-150}; T3=${3:-240}
{
  date -u; nvidia-smi -L || true
  # the package importable as unity_pcg.* (editable install; no network needed, no dependencies pulled)
  $PY -c "import unity_pcg.search" 2>/dev/null \
    || $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    || { for d in search substitutions verifier executor rules_cache; do ln -sfn "../$d" "unity_pcg/$d"; done; }
  $PY -c "import torch, unity_pcg.search.cost, unity_pcg.executor.train; print('torch', torch.__version__, torch.version.cuda)"
  echo "== 1. executor overhead ($T1 s)"; date -u
  timeout "$T1" $PY benchmarks/executor_gpu_overhead.py --models resnext50,inception_v3,bert_large --eager-no-sync \
    --out "$OUT/executor_gpu_overhead.json" --workdir /tmp/unity-pcg-overhead
  echo "rc $?"
  echo "== 2. calibrate --device cuda ($T2 s)"; date -u
  timeout "$T2" $PY -m unity_pcg.cli calibrate --device cuda -o "$OUT/h100_calibrated.json"
  echo "rc $?"
  echo "== 3. gpu_cost measurements ($T3 s)"; date -u
  timeout "$T3" $PY benchmarks/gpu_cost.py --measure-only --profile /tmp/unity-pcg-profiles --out "$OUT/gpu_cost.json"
  echo "rc $?"
  tar czf "$OUT/profiles.tar.gz" -C /tmp unity-pcg-profiles 2>/dev/null || true
  date -u
} 2>&1 | tee "$OUT/session.log"
