"""How good a router's latency predictions are, request by request: the `X-Router-Predicted-TTFT-Ms` /
`X-Router-Predicted-TPOT-Ms` answer headers (router.headers) against the TTFT and TPOT the client measured, as
predicted/measured percentiles per pool, overall and after a warm-up counted in requests (the first N requests
each pool was predicted for), so the warm-up reads the same at any simulator --speedup. Both sides are on the
wall clock the router and the client share, so the ratio needs no scaling."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import figures

TTFT_HEADER, TPOT_HEADER = "X-Router-Predicted-TTFT-Ms", "X-Router-Predicted-TPOT-Ms"
KINDS = ("ttft", "tpot")
WARMUP_REQUESTS = 50  # default N: the first N requests of each pool with a prediction are the warm-up
# The stated rule a pool's predictions are judged by after its warm-up: the median |log(predicted/measured)| at
# most log 1.25 (half the requests within a factor 1.25 either way).
GOOD_LOG_ERROR = math.log(1.25)
ALL = "all"


@dataclass(frozen=True, slots=True)
class Predicted:
    """One request with a prediction: when it started (any clock), the pool that served it, the router's
    predictions (ms, None: no header) and what the client measured (seconds; TPOT None for one token)."""

    start: float
    pool: str | None
    ttft_ms: float | None
    tpot_ms: float | None
    ttft_s: float | None
    tpot_s: float | None
    ahead: int | None = None  # requests the client had in flight on its pool as it started (None: not counted)


def parse_ms(value: str | None) -> float | None:
    """A header's milliseconds; None when absent or not a positive finite number."""
    if value is None:
        return None
    try:
        v = float(value)
    except ValueError:
        return None
    return v if math.isfinite(v) and v > 0 else None


def ratios(items: Iterable[Predicted]) -> dict[str, dict[str, list[float]]]:
    """pool -> kind -> predicted/measured of each request in start order (pool "all": every request)."""
    out: dict[str, dict[str, list[float]]] = {}
    for it in sorted(items, key=lambda i: i.start):
        for kind, pred, got in (("ttft", it.ttft_ms, it.ttft_s), ("tpot", it.tpot_ms, it.tpot_s)):
            if pred is None or got is None or got <= 0:
                continue
            r = pred / 1000.0 / got
            for pool in (it.pool or "-", ALL):
                out.setdefault(pool, {k: [] for k in KINDS})[kind].append(r)
    return out


def stats(rs: Sequence[float]) -> dict:
    """n, p10/p50/p90 of the ratio, the median |log ratio| and the share within a factor 1.25."""
    if not rs:
        return {"n": 0, "mean": None, "p10": None, "p50": None, "p90": None, "median_abs_log": None,
                "within_1_25": None}
    logs = [abs(math.log(r)) for r in rs]
    return {"n": len(rs), "mean": sum(rs) / len(rs), "p10": figures.percentile(rs, 10), "p50": figures.percentile(rs, 50),
            "p90": figures.percentile(rs, 90), "median_abs_log": figures.percentile(logs, 50),
            "within_1_25": sum(1 for x in logs if x <= GOOD_LOG_ERROR + 1e-12) / len(rs)}


def settled_after(rs: Sequence[float], window: int) -> int | None:
    """The warm-up the data shows: the fewest requests w (a multiple of `window`) such that every later window of
    `window` requests has a median |log ratio| within the rule; None when the last window is not."""
    if window <= 0 or not rs:
        return None
    chunks = [rs[i:i + window] for i in range(0, len(rs), window)]
    good = [figures.percentile([abs(math.log(r)) for r in c], 50) <= GOOD_LOG_ERROR + 1e-12 for c in chunks]
    if not good[-1]:
        return None
    k = len(good)
    while k > 0 and good[k - 1]:
        k -= 1
    return k * window


def summarize(items: Iterable[Predicted], warmup: int = WARMUP_REQUESTS) -> dict | None:
    """Per pool and kind: the ratio's figures over all its requests, the first `warmup` and the rest, and the
    warm-up the data shows (settled_after in windows of `warmup`); None when no request carried a prediction."""
    by_pool = ratios(items)
    if not by_pool:
        return None
    rows = []
    for pool in sorted(by_pool, key=lambda p: (p == ALL, p)):
        for kind in KINDS:
            rs = by_pool[pool][kind]
            if not rs:
                continue
            rows.append({"pool": pool, "kind": kind, "all": stats(rs), "warmup": stats(rs[:warmup]),
                         "after": stats(rs[warmup:]), "settled_after": settled_after(rs, warmup),
                         "windows": [figures.percentile(rs[i:i + warmup], 50) for i in range(0, len(rs), warmup)]})
    return {"warmup_requests": warmup, "rule_log_error": GOOD_LOG_ERROR, "rows": rows}


def _r(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render(results: dict[str, list[dict]]) -> list[str]:
    """The predictions table of every target and level that carried predictions (fig["predictions"])."""
    figs = [(name, f) for name, fs in results.items() for f in fs if f.get("predictions")]
    if not figs:
        return []
    w = figs[0][1]["predictions"]["warmup_requests"]
    head = ["target", "slowdown", "pool", "kind"]
    for phase in ("all", f"first {w}", f"after {w}"):
        head += [f"{phase}: n", "mean", "p10", "p50", "p90", "|log| p50"]
    rows = [head + ["settled after", f"p50 per {w} requests"]]
    for name, f in figs:
        for row in f["predictions"]["rows"]:
            cells = [name, f"{f['slowdown']:g}", row["pool"], row["kind"]]
            for phase in ("all", "warmup", "after"):
                s = row[phase]
                cells += [str(s["n"]), _r(s["mean"]), _r(s["p10"]), _r(s["p50"]), _r(s["p90"]),
                          _r(s["median_abs_log"], 3)]
            cells.append("-" if row["settled_after"] is None else str(row["settled_after"]))
            cells.append(" ".join(f"{m:.2f}" for m in row["windows"]))
            rows.append(cells)
    return ["", f"predictions: the router's X-Router-Predicted-* headers over what the client measured "
                f"(predicted/measured; 1 = exact); per pool in request order, the first {w} requests are the "
                f"warm-up; |log| p50: the median |log ratio| (rule: at most log 1.25 = {GOOD_LOG_ERROR:.3f}); "
                f"settled after: requests until every later window of {w} keeps to the rule (-: the last does not)"] \
        + figures.grid(rows)


LOAD_BANDS = ((0, 0), (1, 2), (3, 5), (6, 9), (10, None))  # requests in flight on the pool as one started


def by_load(items: Iterable[Predicted], skip: int) -> list[dict]:
    """Per pool, after its first `skip` requests, by the load each request came in with (its `ahead`): TPOT's
    predicted/measured p50 and the predicted and measured TPOT (ms: p50, and the measured mean)."""
    by_pool: dict[str, list[Predicted]] = {}
    for it in sorted(items, key=lambda i: i.start):
        if it.ahead is not None and it.tpot_ms is not None and it.tpot_s:
            by_pool.setdefault(it.pool or "-", []).append(it)
    out = []
    for pool in sorted(by_pool):
        for lo, hi in LOAD_BANDS:
            got = [i for i in by_pool[pool][skip:] if i.ahead >= lo and (hi is None or i.ahead <= hi)]
            if got:
                measured = [i.tpot_s * 1000 for i in got]
                out.append({"pool": pool, "ahead": f"{lo}+" if hi is None else f"{lo}-{hi}", "n": len(got),
                            "ratio_p50": figures.percentile([i.tpot_ms / m for i, m in zip(got, measured, strict=True)], 50),
                            "predicted_p50_ms": figures.percentile([i.tpot_ms for i in got], 50),
                            "measured_p50_ms": figures.percentile(measured, 50),
                            "measured_mean_ms": sum(measured) / len(measured)})
    return out


def render_by_load(name: str, rows: list[dict], skip: int) -> list[str]:
    grid = [["target", "pool", "in flight ahead", "n", "TPOT pred/meas p50", "predicted p50 ms", "measured p50 ms",
             "measured mean ms"]]
    grid += [[name, r["pool"], r["ahead"], str(r["n"]), _r(r["ratio_p50"]), _r(r["predicted_p50_ms"]),
              _r(r["measured_p50_ms"]), _r(r["measured_mean_ms"])] for r in rows]
    return ["", f"TPOT by the load each request came in with (requests in flight on its pool as it started, the "
                f"client's count), after each pool's first {skip}; ms on the wall clock"] + figures.grid(grid)


def from_replay(data: dict, warmup: int) -> dict[str, list[dict]]:
    """A `spec-bench replay` JSON's results with the predictions summarised again at `warmup` from the
    per-request rows it keeps (fig["predicted_requests"])."""
    out: dict[str, list[dict]] = {}
    for name, figs in data["results"].items():
        for f in figs:
            items = [Predicted(t, pool, pt, pp, None if mt is None else mt / 1000, None if mp is None else mp / 1000,
                               *rest[:1]) for t, pool, pt, pp, mt, mp, *rest in f.get("predicted_requests") or []]
            out.setdefault(name, []).append({"slowdown": f["slowdown"], "predictions": summarize(items, warmup),
                                             "by_load": by_load(items, warmup)})
    return out


def main(argv: list[str]) -> int:
    """python -m bench.predictions REPLAY.json [--warmup N]: the predictions table again, at another warm-up, and
    TPOT by the load each request came in with where the JSON has it."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m bench.predictions", description=main.__doc__)
    p.add_argument("replay_json", type=Path)
    p.add_argument("--warmup", type=int, default=WARMUP_REQUESTS, help="requests per pool (default %(default)s)")
    ns = p.parse_args(argv)
    if ns.warmup < 1:
        print("python -m bench.predictions: --warmup must be at least 1", file=sys.stderr)
        return 2
    try:
        data = json.loads(ns.replay_json.read_text(encoding="utf-8"))
        results = from_replay(data, ns.warmup)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"python -m bench.predictions: {ns.replay_json}: not a replay JSON ({exc})", file=sys.stderr)
        return 2
    lines = render(results)
    if not lines:
        print(f"python -m bench.predictions: {ns.replay_json}: no request carried a prediction", file=sys.stderr)
        return 1
    for name, figs in results.items():
        for f in figs:
            if f["by_load"]:
                lines += render_by_load(name, f["by_load"], ns.warmup)
    print("\n".join(lines[1:]))
    return 0


__all__ = ["GOOD_LOG_ERROR", "by_load", "TPOT_HEADER", "TTFT_HEADER", "WARMUP_REQUESTS", "Predicted", "parse_ms", "ratios",
           "render", "settled_after", "stats", "summarize"]


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main(sys.argv[1:]))
