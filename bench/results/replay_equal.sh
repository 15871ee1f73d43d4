#!/usr/bin/env bash
# Kimi's trace against the deployments of the same 8 simulated GPUs (issue 24, item 4), KV budgets from
# bench/sim/memory.py (Kimi K2.5 on 8 x RTX PRO 6000 96 GB, SGLang 0.5.23's default mem_fraction_static):
# the deployments that do not fit are reported, not run. Every server runs with --enable-cache-report.
# Workload: the trace's first 900 s, one conversation in 20 (whole conversations, so their prefix reuse is
# kept), at three load levels (slowdown 2, 1, 0.5 = 1/40, 1/20, 1/10 of the trace's rate).
# usage: K=30 bash bench/results/replay_equal.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-$(mktemp -d)}
K=${K:-30}
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace_first_30min.jsonl}
PY=.venv/bin/python
mkdir -p "$OUT"
echo "load average at start: $(cat /proc/loadavg)" | tee "$OUT/loadavg.txt"
read -r BASE_KV SPEC_KV < <($PY - <<'PYEOF'
from bench.sim import memory as m
fits = m.fit_all(m.KIMI_K25, m.SEED_BOX)
print(fits["tp-baseline"].servers[0].max_total_num_tokens, fits["tp-eagle3"].servers[0].max_total_num_tokens)
for name in ("split", "colocated"):
    print(f"{name}: {fits[name].reason}", file=open("/dev/stderr", "w"))
PYEOF
)
echo "KV budgets (max_total_num_tokens): tp8-baseline $BASE_KV, tp8-eagle3 $SPEC_KV" | tee -a "$OUT/loadavg.txt"
pids=()
start_sim() {  # name profile extra-flags...
  local name=$1 profile=$2; shift 2
  $PY -m bench sim --profile "$profile" --port 0 --speedup "$K" --enable-cache-report "$@" >"$OUT/sim_$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do grep -q '^listening on ' "$OUT/sim_$name.log" && break; sleep 0.05; done
  sed -n 's/^listening on //p' "$OUT/sim_$name.log"
}
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
B=$(start_sim base baseline-tp8 --max-total-tokens "$BASE_KV")
S=$(start_sim spec eagle3-tp8 --max-total-tokens "$SPEC_KV")
B1M=$(start_sim base1m baseline-tp8)
BNC=$(start_sim basenc baseline-tp8 --max-total-tokens "$BASE_KV" --disable-radix-cache)
$PY -m bench replay --trace "$TRACE" --sample-conversations 20 --window-end 900 --speedup "$K" \
  --mooncake-slowdown-factor 2,1,0.5 --slo-ttft 5000 --slo-tpot 100 \
  --target "tp8-baseline=$B" --target "tp8-eagle3=$S" --target "tp8-baseline-1M-KV=$B1M" \
  --target "tp8-baseline-no-cache=$BNC" --out "$OUT" --name replay_equal | tee "$OUT/table.txt"
echo "load average at end: $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
