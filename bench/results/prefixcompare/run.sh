#!/usr/bin/env bash
# Cache-aware routing side by side (issue 25, item 5): each router in front of its own fresh simulators, the same
# slice of Kimi's Mooncake trace at the same load, one after another. Three invocations of at most ~10 minutes
# each on a 2-core machine (speedup 8). usage: bash bench/results/prefixcompare/run.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=bench/results/prefixcompare
if [ $# -gt 0 ]; then OUT=$1; fi
PY=.venv/bin/python
mkdir -p "$OUT"
echo "load average at start: $(cat /proc/loadavg)" | tee "$OUT/loadavg.txt"
nice -n 10 $PY -m bench prefixcompare --deployments pool --instances 4 --out "$OUT" --name pool-4
echo "load average after pool-4: $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
nice -n 10 $PY -m bench prefixcompare --deployments pool --instances 8 --out "$OUT" --name pool-8
echo "load average after pool-8: $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
nice -n 10 $PY -m bench prefixcompare --deployments split,colocated --out "$OUT" --name two-pool
echo "load average at end: $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
