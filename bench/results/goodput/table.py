"""The goodput tables of docs/BENCH.md ("Latency targets: goodput on Kimi's trace") from the committed runs: the main
run (goodput-*.json) and the run before it (repeat-*.json), as markdown.

Run: .venv/bin/python bench/results/goodput/table.py [DIR]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict:
    rows = json.loads(path.read_text())["rows"]
    return {(r["deployment"], r["sample_conversations"]): r for r in rows}


def n(v, d=0) -> str:
    return "-" if v is None else f"{v:,.{d}f}"


def pct(c: dict) -> str:
    return "-" if c["attainment"] is None else f"{100 * c['attainment']:.0f}%"


def table(main: dict, repeat: dict) -> list[str]:
    out = ["| deployment | router | targets sent | offered req/s | goodput/s (repeat) | interactive met | flex met | "
           "flex shed | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | out tok/s | spec / base served |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in main.items():
        if "skipped" in r:
            out.append(f"| {r['deployment']} | {r['router']} | skipped: {r['skipped']} |")
            continue
        rep = repeat.get(key)
        again = n(rep["class_goodput"], 3) if rep and "skipped" not in rep else "-"
        c = r["classes"]
        out.append(
            f"| {r['deployment']} | {r['router']} | {'yes' if r['send_targets'] else 'no'} | {n(r['request_rate'], 2)} "
            f"| **{n(r['class_goodput'], 3)}** ({again}) | {pct(c['interactive'])} | {pct(c['flex'])} "
            f"| {c['flex']['shed']} | {n(r['median_ttft_ms'])} / {n(r['p90_ttft_ms'])} / {n(r['p99_ttft_ms'])} "
            f"| {n(r['median_tpot_ms'])} / {n(r['p90_tpot_ms'])} / {n(r['p99_tpot_ms'])} | {n(r['output_throughput'])} "
            f"| {r['served_speculative']} / {r['served_baseline']} |")
    return out


def main() -> int:
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    for group in ("kimi", "compose"):
        print(f"\n{group}\n")
        print("\n".join(table(load(d / f"goodput-{group}.json"), load(d / f"repeat-{group}.json"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
