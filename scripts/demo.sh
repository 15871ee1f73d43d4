#!/usr/bin/env bash
# Installs the project and runs the demo: two simulated SGLang backends, the router, a short load run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -e '.[bench]'
exec .venv/bin/python -m bench demo "$@"
