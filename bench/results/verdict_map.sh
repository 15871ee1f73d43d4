#!/usr/bin/env bash
# The verdict map (issue 26, item 4), seed-style workload: `bench demo` (five deployments of the same 8
# simulated GPUs, closed loop, 23-token prompts, max_tokens 256, concurrency 1,4,16,64, 2 requests per client,
# clocks 10x) for every box x drafter. Built-in fitted profiles = Kimi K2.5 on 8 x RTX PRO 6000 (the seed's
# measured rows); --preset = the step-cost model's profiles for that box (PCIe or NVLink TP scaling).
# Deployments whose weights do not fit are named (--preset fitted) or not run (a step-cost preset).
# Every run names its preset and drafter: the demo's own defaults (compose, eagle3-good) are not assumed.
# usage: bash bench/results/verdict_map.sh [OUT_DIR]   (default bench/results/verdict)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=bench/results/verdict
if [ $# -gt 0 ]; then OUT=$1; fi
PY=.venv/bin/python
mkdir -p "$OUT"
run() {  # name demo-flags...
  local name=$1; shift
  local before; before=$(cat /proc/loadavg)
  nice -n 10 $PY -m bench demo --concurrency 1,4,16,64 --max-tokens 256 --speedup 10 --out "/tmp/verdict-$name" "$@" \
    > "$OUT/demo-$name.txt" 2>&1
  cp "/tmp/verdict-$name/demo.json" "$OUT/demo-$name.json"
  echo "$name: load average before $before | after $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
}
run seed-fitted-eagle3 --preset fitted --drafter eagle3
run seed-fitted-eagle3-good --preset fitted --drafter eagle3-good
for preset in seed kimi-k25-h200-nvlink compose llama70b-h200-nvlink; do
  run "$preset-eagle3" --preset "$preset" --drafter eagle3
  run "$preset-eagle3-good" --preset "$preset" --drafter eagle3-good
done
# sensitivity: the chain's per-token acceptance (0.7 assumed) at the low end of its stated range
run seed-adaptive-a55 --preset seed --drafter eagle3 --adaptive-profile seed.adaptive-a55-tp8
run kimi-k25-h200-nvlink-adaptive-a55 --preset kimi-k25-h200-nvlink --drafter eagle3 --adaptive-profile kimi-k25-h200-nvlink.adaptive-a55-tp8
# sensitivity: the TP8 speculative servers' cap (SGLang's default 48) raised to 64, where the split won at 64 clients
run compose-eagle3-good-cap64 --preset compose --drafter eagle3-good --speculative-cap 64
run llama70b-h200-nvlink-eagle3-good-cap64 --preset llama70b-h200-nvlink --drafter eagle3-good --speculative-cap 64
# sensitivity: the same, the 0-step extend pass at the low end of its cost (kernels only, no per-forward fixed cost)
run compose-eagle3-good-cap64-xk --preset compose --drafter eagle3-good --speculative-cap 64 --adaptive-profile compose.adaptive-good-xk-tp8
run llama70b-h200-nvlink-eagle3-good-cap64-xk --preset llama70b-h200-nvlink --drafter eagle3-good --speculative-cap 64 --adaptive-profile llama70b-h200-nvlink.adaptive-good-xk-tp8
