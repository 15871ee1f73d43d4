"""The verdict map's tables from the committed runs in bench/results/verdict/ (demo-*.json: closed loop;
trace-*.json: Kimi's trace). `.venv/bin/python bench/results/verdict_table.py` prints them as markdown: first the
map's two summary tables with each cell's range (bench.verdictmap, as docs/BENCH.md carries them), then every run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "verdict"
sys.path.insert(0, str(HERE.parent.parent.parent))  # run as a script from anywhere: the checkout's bench package
NOISE = 0.03
TRACE_BAND = 0.10
SHORT = {"tp8-baseline": "TP8 baseline", "tp8-eagle3": "TP8 EAGLE-3", "tp8-adaptive": "TP8 adaptive",
         "split+balanced": "split", "colocated+global": "co-located"}


def winners(values: dict[str, float], higher: bool = True, band: float = NOISE) -> str:
    """The best, and every other within the band of it ("a = b")."""
    best = (max if higher else min)(values, key=values.get)
    top = values[best]
    near = [n for n, v in values.items() if (v >= top * (1 - band) if higher else v <= top * (1 + band))]
    near.sort(key=lambda n: -values[n] if higher else values[n])
    return " = ".join(SHORT.get(n, n) for n in near)


def demo_table(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    res, prof, unfit = d["results"], d["profiles"], d.get("unfit") or {}
    names = list(res)
    base = {f["concurrency"]: f["output_throughput"] for f in res["tp8-baseline"]}
    lines = [f"**{path.stem}** (profiles: " + ", ".join(f"{k} {v}" for k, v in prof.items()) + ")",
             "does not fit: " + ("; ".join(f"{k}: {v}" for k, v in unfit.items()) if unfit else "none")
             + ("" if not unfit or "split+balanced" not in res else " (run anyway, as if it did: never recommended)"),
             "", "| conc | " + " | ".join(f"{SHORT.get(n, n)} tok/s (x baseline)" for n in names) + " | winner (3% band) |",
             "|---:|" + "---:|" * len(names) + "---|"]
    for i, c in enumerate(base):
        vals = {n: res[n][i]["output_throughput"] for n in names if i < len(res[n]) and res[n][i].get("completed")}
        fit_vals = {n: v for n, v in vals.items() if not ((n == "split+balanced" and "split" in unfit)
                                                            or (n == "colocated+global" and "colocated" in unfit))}
        cells = [f"{vals[n]:.0f} ({vals[n] / base[c]:.2f}x)" if n in vals else "-" for n in names]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {winners(fit_vals)} |")
    return lines


def trace_table(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    res = d["results"]
    names = list(res)
    lines = [f"**{path.stem}**", "", "| offered req/s | " + " | ".join(SHORT.get(n, n) for n in names)
             + " | most goodput (requests/s within both SLOs; 10% band: one run of 138 requests), then lowest TPOT |", "|---:|" + "---|" * len(names) + "---|"]
    for i, f0 in enumerate(res[names[0]]):
        cells, score = [], {}
        for n in names:
            f = res[n][i]
            cells.append(f"{f['output_throughput']:.0f} tok/s, TTFT {f['median_ttft_ms'] / 1000:.1f} s, TPOT "
                         f"{f['mean_tpot_ms']:.0f} ms, good {f['request_goodput']:.2f}/s")
            score[n] = f["request_goodput"]
        if max(score.values()) < 0.05:  # every deployment overloaded: goodput cannot tell them apart
            out = {n: res[n][i]["output_throughput"] for n in names}
            verdict = f"none meets the SLOs; most output: {winners(out, band=TRACE_BAND)}"
        else:
            top = max(score.values())
            tied = {n: res[n][i]["mean_tpot_ms"] for n, v in score.items() if v >= top * (1 - TRACE_BAND)}
            verdict = winners(score, band=TRACE_BAND)
            if len(tied) > 1:
                verdict += f"; of those, lowest TPOT: {winners(tied, higher=False, band=TRACE_BAND)}"
        lines.append(f"| {f0['request_rate']:.2f} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def main() -> int:
    from bench import verdictmap

    out = verdictmap.summary_table(HERE) + [""] + verdictmap.map_table(HERE) + [""]
    for path in sorted(HERE.glob("demo-*.json")):
        out += demo_table(path) + [""]
    for path in sorted(HERE.glob("trace-*.json")):
        out += trace_table(path) + [""]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
