#!/usr/bin/env bash
# The verdict map on Kimi's trace (issue 26, item 4): bench/results/verdict_trace.py per box x drafter, the trace's
# first 900 s, one conversation in 20 (138 requests), slowdown 1 and 0.25 (0.15 and 0.62 req/s), clocks 30x.
# usage: bash bench/results/verdict_trace.sh [CASE...]   (outputs in bench/results/verdict/trace-$case.*)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
declare -A FLAGS=(
  [seed-fitted-eagle3]=""
  [seed-fitted-eagle3-good]="--drafter eagle3-good"
  [compose-eagle3]="--preset compose"
  [compose-eagle3-good]="--preset compose --drafter eagle3-good"
  [kimi-k25-h200-nvlink-eagle3]="--preset kimi-k25-h200-nvlink"
  [llama70b-h200-nvlink-eagle3-good]="--preset llama70b-h200-nvlink --drafter eagle3-good"
)
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(seed-fitted-eagle3 seed-fitted-eagle3-good compose-eagle3 compose-eagle3-good \
  kimi-k25-h200-nvlink-eagle3 llama70b-h200-nvlink-eagle3-good)
for c in "${cases[@]}"; do
  # shellcheck disable=SC2086
  nice -n 10 $PY bench/results/verdict_trace.py "$c" ${FLAGS[$c]} > /dev/null 2>&1 || echo "$c failed" >&2
  echo "$c done at $(date -u +%T), load average $(cat /proc/loadavg)" >&2
done
# Llama-70B at 0.62 req/s overloads every deployment (its prefill in the step-cost model is ~0.26 ms a token):
# the level between, 0.31 req/s, on fresh servers
#   .venv/bin/python bench/results/verdict_trace.py compose-eagle3-mid --preset compose --levels 0.5
#   .venv/bin/python bench/results/verdict_trace.py compose-eagle3-good-mid --preset compose --drafter eagle3-good --levels 0.5
