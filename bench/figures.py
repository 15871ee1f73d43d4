"""Figures from request records (bench_serving's names and formulas), terminal tables, JSON/CSV, plots."""
from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.load import LevelRun

STATS = ("mean", "median", "p90", "p95", "p99")
METRICS = ("ttft", "tpot", "itl", "e2e_latency")


def tput(fig: dict) -> float:
    """The throughput compare and calibrate decide on: bench_serving's output_throughput. The steady
    figure is shown next to it but not used: with a few requests per client it catches round-robin
    before its imbalance has built up (see docs/BENCH.md)."""
    return fig["output_throughput"]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile's default (bench_serving uses it)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {s: math.nan for s in STATS}
    return {
        "mean": sum(values) / len(values),
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (latency - ttft) / (tokens - 1); undefined for 1 token."""
    if output_tokens <= 1:
        return None
    return (latency - ttft) / (output_tokens - 1)


def itls(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive chunks carrying text (a speculative chunk may hold several tokens)."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]


def compute(run: LevelRun, speedup: float = 1.0) -> dict:
    """All figures of one level. `speedup` K: the target's clock ran K times faster than the wall clock,
    so throughputs are divided by K and latencies multiplied by K to report the simulated deployment."""
    ok = [r for r in run.records if r.ok]
    failed = [r for r in run.records if not r.ok]
    k = float(speedup)
    duration = run.duration * k
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft * k for r in ok]
    e2es = [r.latency * k for r in ok]
    tpots = [t * k for r in ok if (t := tpot(r.latency, r.ttft, r.output_tokens)) is not None]
    gaps = [g * k for r in ok for g in itls(r.chunk_times)]
    steady, window = steady_throughput(run, ok)
    fig: dict = {
        "concurrency": run.concurrency,
        "request_rate": run.request_rate,
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / duration if duration > 0 else 0.0,
        # Not a bench_serving figure: output tok/s while every client still had work (see steady_throughput).
        "steady_output_throughput": steady / k,
        "steady_window_s": window * k,
        # Little's law over the run: how many requests were in flight on average.
        "mean_concurrency": sum(e2es) / duration if duration > 0 else 0.0,
        "accept_length": run.accept_length,
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        # Behind a router: the share of the level's completed requests it sent to the speculative pool.
        "speculative_share": (sum(1 for r in ok if r.pool == "speculative") / len(ok)
                              if ok and any(r.pool for r in ok) else None),
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", gaps), ("e2e_latency", e2es)):
        for stat, v in summarize(vals).items():
            fig[f"{stat}_{name}_ms"] = v * 1000.0
    fig["errors"] = dict(Counter(_error_kind(r.error) for r in failed).most_common(5))
    return fig


def steady_throughput(run: LevelRun, ok: list) -> tuple[float, float]:
    """Output tok/s from the first request's start to the last request's start, while all clients were
    still busy (wall seconds). A closed loop of a few requests per client ends with a drain where fewer
    and fewer requests run; when the clients' requests differ in speed (a router mixing a fast and a slow
    pool) that tail drags `output_throughput` below the steady rate. Tokens of a chunk are spread evenly
    over a request's chunks. Falls back to the whole run when the window is under a quarter of it."""
    if not run.records or run.duration <= 0:
        return 0.0, 0.0
    t0 = min(r.start for r in run.records)
    t1 = max(r.start for r in run.records)
    if t1 - t0 < 0.25 * run.duration:
        return sum(r.output_tokens for r in ok) / run.duration, run.duration
    tokens = 0.0
    for r in ok:
        if r.chunk_times:
            per = r.output_tokens / len(r.chunk_times)
            tokens += per * sum(1 for t in r.chunk_times if t <= t1)
    return tokens / (t1 - t0), t1 - t0


def _error_kind(err: str | None) -> str:
    return (err or "")[:120]


# ---- output --------------------------------------------------------------------------------------

def level_key(fig: dict) -> str:
    if fig.get("request_rate") is not None:
        return f"{fig['request_rate']:g}/s"
    return str(fig["concurrency"])


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def grid(rows: list[list[str]]) -> list[str]:
    """Right-aligned text columns; the first row is the header, underlined with dashes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def render_table(results: dict[str, list[dict]], title: str | None = None,
                 gpus: dict[str, int | None] | None = None) -> str:
    """Load rows, one column per target: output throughput with each target's ratio to the first,
    then median TTFT / ITL / E2E and failures, each as its own block. With `gpus` a line under the
    tables says how many GPUs each column uses, and warns in that line when they differ."""
    names = list(results)
    first = names[0]
    open_loop = bool(results[first]) and results[first][0].get("request_rate") is not None
    levels = [level_key(f) for f in results[first]]
    rows_by = {n: {level_key(f): f for f in results[n]} for n in names}
    blocks = [("output throughput (tok/s)", "output_throughput", 1, 1.0, True),
              ("output throughput until the last request was sent (tok/s; no drain, see docs/BENCH.md)",
               "steady_output_throughput", 1, 1.0, True),
              ("median TTFT (ms)", "median_ttft_ms", 0, 1.0, False),
              # Mean, not median: with a fast simulated clock several chunks can arrive in one read
              # (gap 0); the mean keeps their sum, the median collapses.
              ("mean ITL (ms)", "mean_itl_ms", 1, 1.0, False),
              ("median E2E latency (s)", "median_e2e_latency_ms", 2, 0.001, False)]
    if any(f["failed"] for n in names for f in results[n]):
        blocks.append(("failed requests", "failed", 0, 1.0, False))
    out = [title] if title else []
    for label, key, digits, scale, ratios in blocks:
        head = ["rate" if open_loop else "conc"] + names
        if ratios:
            head += [f"{n}/{first}" for n in names[1:]]
        body = []
        for lv in levels:
            figs = [rows_by[n].get(lv) for n in names]
            row = [lv] + [_fmt(f[key] * scale if f and f[key] is not None else None, digits) for f in figs]
            if ratios:
                base = figs[0][key] if figs[0] else 0
                row += [f"{f[key] / base:.2f}x" if f and base else "-" for f in figs[1:]]
            body.append(row)
        widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
        out.append(label)
        out.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
        out.append("  ".join("-" * w for w in widths))
        out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
        out.append("")
    if gpus:
        out.append(gpus_line(names, gpus))
    return "\n".join(out).rstrip("\n")


def gpus_label(n: int | None) -> str:
    return "? GPUs" if n is None else f"{n} GPU" + ("" if n == 1 else "s")


def hardware_note(names: list[str], gpus: dict[str, int | None]) -> str:
    """Empty when every named deployment uses the same known number of GPUs, else the warning that has to
    sit in the same line as any comparison of them."""
    counts = {gpus.get(n) for n in names}
    if len(counts) == 1 and None not in counts:
        return ""
    parts = ", ".join(f"{n} {gpus_label(gpus.get(n))}" for n in names)
    return f"UNEQUAL HARDWARE: {parts}"


def gpus_line(names: list[str], gpus: dict[str, int | None]) -> str:
    note = hardware_note(names, gpus)
    return "GPUs per column: " + ", ".join(f"{n} {gpus_label(gpus.get(n))}" for n in names) + (
        f" ({note})" if note else " (equal hardware)")


def render_markdown(results: dict[str, list[dict]]) -> str:
    names = list(results)
    first = names[0]
    rows_by = {n: {level_key(f): f for f in results[n]} for n in names}
    head = ["concurrency"] + [f"{n} tok/s" for n in names] + [f"{n} TTFT p50 ms" for n in names] \
        + [f"{n} E2E p50 s" for n in names] + [f"{n} failed" for n in names]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f0 in results[first]:
        lv = level_key(f0)
        figs = [rows_by[n].get(lv) for n in names]
        row = [lv] + [_fmt(f and f["output_throughput"]) for f in figs] \
            + [_fmt(f and f["median_ttft_ms"], 0) for f in figs] \
            + [_fmt(f and f["median_e2e_latency_ms"] / 1000.0, 2) for f in figs] \
            + [str(f["failed"]) if f else "-" for f in figs]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def _clean(obj):
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(_clean(payload), indent=2) + "\n", encoding="utf-8")


def write_run(out: Path, name: str, config: dict, rows: list[dict], text: str, write_rows) -> list[Path]:
    """A lab run's three outputs in `out`: NAME.json (config and rows), NAME.csv (`write_rows(path, rows)`) and
    NAME.txt (the table as printed); says where it wrote them."""
    paths = [out / f"{name}.json", out / f"{name}.csv", out / f"{name}.txt"]
    write_json(paths[0], {"config": config, "rows": rows})
    write_rows(paths[1], rows)
    paths[2].write_text(text + "\n", encoding="utf-8")
    print("wrote " + ", ".join(str(x) for x in paths))
    return paths


CSV_FIELDS = ["target", "concurrency", "request_rate", "completed", "failed", "duration_s",
              "total_output_tokens", "total_input_tokens", "request_throughput", "output_throughput",
              "steady_output_throughput", "steady_window_s", "total_token_throughput", "mean_concurrency", "accept_length"] + [
    f"{s}_{m}_ms" for m in METRICS for s in STATS] + ["gpus"]


def write_csv(path: Path, results: dict[str, list[dict]], gpus: dict[str, int | None] | None = None) -> None:
    """One row per target and level; the `gpus` column is empty where the GPU count is not known."""
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for name, figs in results.items():
            for f in figs:
                w.writerow(_clean({**f, "target": name, "gpus": (gpus or {}).get(name)}))


# (figure key, panel title, y-axis label): one panel each, in this order.
PANELS = (("output_throughput", "Output throughput", "output throughput (tok/s)"),
          ("median_ttft_ms", "Time to first token (median)", "median TTFT (ms, log scale)"),
          ("mean_itl_ms", "Inter-token latency (mean)", "mean ITL (ms)"))


def figure(results: dict[str, list[dict]], title: str = "", gpus: dict[str, int | None] | None = None):
    """The matplotlib Figure `plot` saves: three titled panels vs load, one line per target (the legend names
    each target, with its GPU count when `gpus` gives it). The caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    open_loop = any(f.get("request_rate") is not None for figs in results.values() for f in figs)
    xkey = "request_rate" if open_loop else "concurrency"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, (key, panel_title, ylabel) in zip(axes, PANELS, strict=True):
        for name, figs in results.items():
            pts = [(f[xkey], f[key]) for f in figs if f.get(key) is not None and not math.isnan(f[key])]
            if pts:
                legend = f"{name} [{gpus[name]} GPUs]" if gpus and gpus.get(name) else name
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=legend)
        ax.set_xscale("log")
        xs = sorted({f[xkey] for figs in results.values() for f in figs if f.get(xkey) is not None})
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if key == "median_ttft_ms":
            ax.set_yscale("log")  # queueing at high load would flatten every other level to 0
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.set_title(panel_title)
        ax.set_xlabel("request rate (req/s, log scale)" if open_loop else "concurrent clients (log scale)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(title="deployment", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(path: Path, results: dict[str, list[dict]], title: str = "",
         gpus: dict[str, int | None] | None = None) -> Path:
    """Save `figure(results, title, gpus)` as a PNG at `path`."""
    fig = figure(results, title, gpus)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
