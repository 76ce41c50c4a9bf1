#!/usr/bin/env bash
# One command: set up (when needed), then run the main job end to end on the bundled default model:
# export -> import -> calibrate -> optimize -> explain -> train on local processes (unity_pcg/demo.py).
# Arguments pass through to the demo (./run.sh --help lists them).
set -euo pipefail
cd "$(dirname "$0")"
# setup runs on a fresh checkout and whenever pyproject.toml changed since the last successful setup
stamp=.venv/.setup-done
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! .venv/bin/python -c "import unity_pcg, torch" 2>/dev/null; then
  bash scripts/setup.sh
  touch "$stamp"
fi
exec .venv/bin/python -m unity_pcg.demo "$@"
