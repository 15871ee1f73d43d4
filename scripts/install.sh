#!/usr/bin/env bash
# Creates .venv with the project and its dev extras, plus the system tools the tests use
# (promtool/prometheus and docker-compose from Debian) and SGLang's protocol file (no GPU deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus docker-compose >/dev/null
    # The Debian package starts a system Prometheus on :9090; the tests start their own.
    (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || pkill -x prometheus) >/dev/null 2>&1 || true
  else
    echo "note: promtool/prometheus/docker-compose missing and apt-get unavailable; their tests will be skipped" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[dev]'
# SGLang's own pydantic protocol models are the contract the simulator is tested against.
.venv/bin/python -m pip install -q --no-deps 'sglang==0.5.23'
