#!/usr/bin/env bash
# Installs everything the suite needs and runs lint plus the whole test suite.
# --real-engine (first argument): also install the `engine` extra (scripts/install_engine.sh; builds llama.cpp once
# into a wheel cache) so tests/test_real_engine.py runs against real llama.cpp servers instead of skipping.
# Any other arguments go to pytest (e.g. `bash scripts/test.sh --real-engine -m real_engine` runs only those).
set -euo pipefail
cd "$(dirname "$0")/.."
real_engine=0
if [ "${1:-}" = "--real-engine" ]; then
  real_engine=1
  shift
fi
bash scripts/install.sh
if [ "$real_engine" = 1 ]; then
  bash scripts/install_engine.sh
  # A missing engine is then a failure, not a skip.
  export SPEC_ROUTER_REAL_ENGINE=1
fi
.venv/bin/ruff check router bench tests
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
