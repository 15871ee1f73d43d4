#!/usr/bin/env bash
# `spec-bench plan --fleet`: the planner's answer for the deployments bench/results/goodput/run.sh measured on the
# simulator (the same trace window, sampling and class mix), on the simulator's own server profiles and on the
# step-cost model's. Seconds each; pure model, no servers.
# usage: bash bench/results/fleet/run.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEFAULT_OUT=bench/results/fleet
OUT=${1:-$DEFAULT_OUT}
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace_first_30min.jsonl}
PY=.venv/bin/python
mkdir -p "$OUT"
plan() { local name=$1; shift; { echo "\$ spec-bench plan $*"; $PY -m bench plan "$@" | sed -n '/^Fleet/,$p'; } > "$OUT/$name.txt"; }
for M in 4 2; do
  plan "kimi-4x-sim-profiles-M$M" --preset seed --fleet 4 --trace "$TRACE" --window-end 600 --sample-conversations "$M" \
    --fleet-profiles baseline-tp8,eagle3-tp8
  plan "kimi-4x-stepcost-M$M" --preset seed --fleet 4 --trace "$TRACE" --window-end 600 --sample-conversations "$M" \
    --speculative tree
done
for M in 20 10; do
  plan "compose-split-M$M" --preset compose --fleet 2 --fleet-tp 4 --trace "$TRACE" --window-end 1200 \
    --sample-conversations "$M" --speculative chain3-good
done
