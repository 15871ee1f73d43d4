#!/usr/bin/env bash
# SLO goodput on Kimi's trace with a class mix (issue 56, item 2): every row on fresh simulated servers, one after
# another, the same class draw (seed 0) in every row. Two invocations of `spec-bench goodput`:
#   kimi:    4 seed boxes (32 simulated RTX PRO 6000 GPUs) as 4 TP8 Kimi K2.5 servers, the trace's first 600 s,
#            one conversation in 4 and in 2 (0.73 and 1.53 req/s offered), clocks 8x;
#   compose: one seed box (8 GPUs) of Llama-3.3-70B, the trace's first 1200 s, one conversation in 20 and in 10
#            (0.16 and 0.33 req/s), clocks 20x.
# Token scale 1 (the trace's own lengths); KV budgets from bench/sim/memory.py. About 30 minutes on 2 shared cores.
# usage: bash bench/results/goodput/run.sh [OUT_DIR]   (NAME=stem, ROUTER_FLAGS="--router-flag=... ...")
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=bench/results/goodput
if [ $# -gt 0 ]; then OUT=$1; fi
NAME=${NAME:-goodput}
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace_first_30min.jsonl}
PY=.venv/bin/python
# shellcheck disable=SC2206
FLAGS=(${ROUTER_FLAGS:-})
mkdir -p "$OUT"
echo "load average at start: $(cat /proc/loadavg); commit $(git rev-parse --short HEAD)" | tee "$OUT/$NAME-loadavg.txt"
nice -n 10 $PY -m bench goodput --trace "$TRACE" --groups kimi --kimi-sample 4,2 --window-end 600 \
  --kimi-speedup 8 "${FLAGS[@]}" --out "$OUT" --name "$NAME-kimi"
echo "load average after kimi: $(cat /proc/loadavg)" | tee -a "$OUT/$NAME-loadavg.txt"
nice -n 10 $PY -m bench goodput --trace "$TRACE" --groups compose --compose-sample 20,10 --window-end 1200 \
  --compose-speedup 20 "${FLAGS[@]}" --out "$OUT" --name "$NAME-compose"
echo "load average at end: $(cat /proc/loadavg)" | tee -a "$OUT/$NAME-loadavg.txt"
