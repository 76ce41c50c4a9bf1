#!/usr/bin/env bash
# One command: set up, then run the main job end to end on the bundled default model.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m unity_pcg.demo "$@"
