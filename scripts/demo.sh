#!/usr/bin/env bash
# Installs the project into .venv (once) and runs the demo: the same 8 simulated GPUs deployed five ways (TP8
# baseline, TP4+TP4 split + router, co-located TP8 pair + router, TP8 EAGLE-3, TP8 adaptive speculation) for
# Llama-3.3-70B on 8x RTX PRO 6000 (the compose default; every deployment fits), a short load run of each, which
# wins where. Extra arguments go to `spec-bench demo` (see `.venv/bin/python -m bench demo --help`).
# Measured from a fresh clone on 2 shared cores (load average 1.6-2.2): install 19 s, demo 44 s, 63 s in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Already installed from this directory: no pip at all.
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys, bench, matplotlib, aiohttp; from pathlib import Path
sys.exit(Path(bench.__file__).resolve().parents[1] != Path.cwd().resolve())' 2>/dev/null; then
  echo "using .venv (the project is installed there)" >&2
else
  log=.venv/install.log
  printf 'creating .venv and installing the project with its bench extra (about 20 s, longer while pip downloads; log: %s) ' "$log" >&2
  start=$(date +%s)
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -e '.[bench]' >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do printf '.' >&2; sleep 2; done
  if ! wait "$pid"; then
    echo " failed; the last lines of $log:" >&2
    tail -n 15 "$log" >&2
    exit 1
  fi
  echo " done in $(( $(date +%s) - start )) s" >&2
fi
case " $* " in
  *" -h "*|*" --help "*) ;;
  *) echo "running the demo (about 45 s: five deployments x four loads, simulated)" >&2 ;;
esac
exec .venv/bin/python -m bench demo "$@"
