#!/usr/bin/env bash
# The real llama.cpp pair (prompt-lookup vs plain, bench engines) judged at 1-2 clients.
# Usage: bash bench/results/judge/llamacpp.sh [NAME] [REQUESTS]   (default llamacpp, 8 requests a level; the committed
# run: bash bench/results/judge/llamacpp.sh llamacpp-96 96, outputs in bench-out/llamacpp-96.{md,json})
cd "$(dirname "$0")/../../.."
.venv/bin/python -m bench engines > /tmp/judge-engines.out 2>/tmp/judge-engines.err &
EP=$!
for i in $(seq 1 120); do [ "$(grep -c 'listening on' /tmp/judge-engines.out)" -ge 2 ] && break; sleep 1; done
S=$(grep 'listening on' /tmp/judge-engines.out | sed -n 1p | awk '{print $3}')
B=$(grep 'listening on' /tmp/judge-engines.out | sed -n 2p | awk '{print $3}')
echo "spec $S base $B"
timeout $((300 * ${2:-8})) .venv/bin/python -m bench judge --speculative "$S" --baseline "$B" --speedup 1 --levels 1,2 \
  --thresholds 1 --repeats 3 --cold-runs 2 --min-requests "${2:-8}" --rounds 4 --max-tokens 24 --warmup-levels 1,2 \
  --router-arg=--health-path=/openapi.json --out bench-out --name "${1:-llamacpp}"
echo "judge rc=$?"
kill $EP; wait $EP
