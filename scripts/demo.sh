#!/usr/bin/env bash
# Installs the project and runs the demo: the same 8 simulated GPUs deployed four ways (TP8 baseline, TP4+TP4
# split + router, co-located TP8 pair + router, TP8 EAGLE-3), a short load run of each, which wins where.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -e '.[bench]'
exec .venv/bin/python -m bench demo "$@"
