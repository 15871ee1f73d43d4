#!/usr/bin/env bash
# Installs everything the suite needs and runs lint plus the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check router bench tests
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
