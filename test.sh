#!/usr/bin/env bash
# One command: set up, then run the test suite (slow tests are excluded; `-m slow` runs them).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
