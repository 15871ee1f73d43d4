"""`python -m router.overhead`: measure the latency the router adds (time to first byte and to the end, direct vs routed)."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

BODY = {"model": "m", "messages": [{"role": "user", "content": "say something short"}], "max_tokens": 4,
        "stream": True}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=BODY) as r:
        first = await r.content.readany()
        ttfb = time.perf_counter() - t0
        if r.status != 200 or not first:
            raise RuntimeError(f"{url} answered {r.status}")
        await r.read()
    return ttfb, time.perf_counter() - t0


def _cpu_seconds(pid: int) -> float:
    import psutil  # dev dependency, only this tool needs it

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _measure(direct: str, routed: str, n: int, concurrency: int, router_pid: int) -> dict:
    results: dict[str, dict[str, list[float]]] = {k: {"ttfb": [], "total": []} for k in ("direct", "router")}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        for url in (direct, routed):  # warm up connections and code paths
            await asyncio.gather(*(_one(session, url) for _ in range(concurrency)))
        cpu = 0.0
        for _ in range(max(1, n // concurrency)):
            # Interleave direct and routed batches so drift on a busy host hits both alike.
            for name, url in (("direct", direct), ("router", routed)):
                before = _cpu_seconds(router_pid) if name == "router" else 0.0
                batch = await asyncio.gather(*(_one(session, url) for _ in range(concurrency)))
                if name == "router":
                    cpu += _cpu_seconds(router_pid) - before
                for ttfb, total in batch:
                    results[name]["ttfb"].append(ttfb)
                    results[name]["total"].append(total)
    out: dict = {"requests_per_side": len(results["direct"]["ttfb"]), "concurrency": concurrency,
                 "router_cpu_ms_per_request": round(cpu / len(results["router"]["ttfb"]) * 1e3, 3)}
    for metric in ("ttfb", "total"):
        for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            d, r = _pct(results["direct"][metric], q), _pct(results["router"][metric], q)
            out[f"{metric}_{label}_ms"] = {"direct": round(d * 1e3, 3), "router": round(r * 1e3, 3),
                                           "added": round((r - d) * 1e3, 3)}
        out[f"{metric}_mean_added_ms"] = round(
            (statistics.fmean(results["router"][metric]) - statistics.fmean(results["direct"][metric])) * 1e3, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.overhead", description=__doc__)
    p.add_argument("--requests", type=int, default=400, help="streamed requests per side and concurrency level")
    p.add_argument("--concurrency", type=int, action="append", help="levels (repeatable; default 1 and 32)")
    p.add_argument("--speedup", type=float, default=1000.0, help="simulator speedup (high: backend time ~0)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per request (more: more chunks per stream)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1:
        p.error("--requests and --max-tokens must be >= 1")
    from bench.procs import ProcError, start_router, start_sim  # bench tooling, not a router dependency

    levels = args.concurrency or [1, 32]
    BODY["max_tokens"] = args.max_tokens
    try:
        sim = start_sim("baseline-tp8", args.speedup)
    except ProcError as exc:
        print(f"overhead: {exc}", file=sys.stderr)
        return 2
    try:
        router = start_router([sim.url], [], "spillover", threshold=10**6, extra=["--log-level", "warning"])
    except ProcError as exc:
        sim.stop()
        print(f"overhead: {exc}", file=sys.stderr)
        return 2
    try:
        time.sleep(1.0)  # the router's first health probe
        figures = {str(c): asyncio.run(_measure(sim.url, router.url, args.requests, c, router.pid)) for c in levels}
    finally:
        router.stop()
        sim.stop()
    print("| concurrency | TTFB p50 direct / router (added) ms | TTFB p99 direct / router (added) ms |"
          " total p50 added ms | router CPU ms per request |")
    print("|---|---|---|---|---|")
    for c, f in figures.items():
        t50, t99 = f["ttfb_p50_ms"], f["ttfb_p99_ms"]
        print(f"| {c} | {t50['direct']} / {t50['router']} ({t50['added']:+}) | {t99['direct']} / {t99['router']} "
              f"({t99['added']:+}) | {f['total_p50_ms']['added']:+} | {f['router_cpu_ms_per_request']} |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
