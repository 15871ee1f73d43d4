#!/usr/bin/env bash
# Acceptance sweep of the simulator against the seed table (issue 2): closed loop, max_tokens 512,
# concurrency 1..250, eagle3-tp8 and baseline-tp8, general prompts (the table's c=1 figure is for those).
# Each level gets its own simulator with a speedup chosen so the stream rate (chunks/s) stays within what
# this 2-core machine can carry: low levels run at K=50, the busiest baseline levels at K=7.
# The bench reports throughput / K, so every cell is in the seed table's units.
# usage: bash bench/results/sim_sweep.sh [OUT_DIR]   (prints the table; writes OUT_DIR/*.csv)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-$(mktemp -d)}
PY=.venv/bin/python
declare -A K=(
  [eagle3-tp8:1]=50 [eagle3-tp8:2]=50 [eagle3-tp8:5]=50 [eagle3-tp8:10]=50 [eagle3-tp8:30]=50
  [eagle3-tp8:70]=40 [eagle3-tp8:100]=40 [eagle3-tp8:250]=40
  [baseline-tp8:1]=50 [baseline-tp8:2]=38 [baseline-tp8:5]=19 [baseline-tp8:10]=13 [baseline-tp8:30]=9
  [baseline-tp8:70]=7 [baseline-tp8:100]=7 [baseline-tp8:250]=7
)
ROUNDS=${ROUNDS:-2}
start=$(date +%s.%N)
for profile in eagle3-tp8 baseline-tp8; do
  for c in 1 2 5 10 30 70 100 250; do
    k=${K[$profile:$c]}
    log="$OUT/sim_${profile}_c${c}.log"
    $PY -m bench sim --profile "$profile" --port 0 --speedup "$k" >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do grep -q '^listening on ' "$log" && break; sleep 0.05; done
    url=$(sed -n 's/^listening on //p' "$log")
    rounds=$ROUNDS; [ "$c" = 250 ] && rounds=1
    $PY -m bench sweep --target "$profile=$url" --speedup "$k" --concurrency "$c" --max-tokens 512 \
      --prompts general --rounds "$rounds" --out "$OUT" --name "${profile}_c${c}" --no-plot >/dev/null
    kill "$pid"; wait "$pid" || true
  done
done
end=$(date +%s.%N)
$PY - "$OUT" "$start" "$end" <<'PYEOF'
import csv, sys
from pathlib import Path
out, t0, t1 = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
seed = {}
for line in Path("/work/shared/data/seed_benchmark.csv").read_text().splitlines():
    if line and not line.startswith("#") and not line.startswith("concurrency"):
        c, e, b = line.split(",")
        seed[int(c)] = {"eagle3-tp8": float(e), "baseline-tp8": float(b)}
print("| concurrency | eagle3-tp8 sim | seed | error | baseline-tp8 sim | seed | error |")
print("|---:|---:|---:|---:|---:|---:|---:|")
worst = 0.0
for c in sorted(seed):
    cells = []
    for prof in ("eagle3-tp8", "baseline-tp8"):
        row = next(csv.DictReader((out / f"{prof}_c{c}.csv").open()))
        got, want = float(row["output_throughput"]), seed[c][prof]
        err = got / want - 1
        worst = max(worst, abs(err))
        assert int(row["failed"]) == 0, (prof, c, row["failed"])
        cells += [f"{got:.1f}", f"{want:.1f}", f"{100 * err:+.1f}%"]
    print(f"| {c} | " + " | ".join(cells) + " |")
print(f"\nworst cell error {100 * worst:.1f}%; wall time for both profiles {t1 - t0:.0f} s")
PYEOF
