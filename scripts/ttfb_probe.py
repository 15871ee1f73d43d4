"""Stream time to first byte as a client library sees it, direct to a paced fake backend and through the router.

`.venv/bin/python scripts/ttfb_probe.py [--clients 1,4] [--runs 3] [--seconds 3] [--pace-ms 5]`: one fake SGLang
backend (bench.fastbackend, one token every --pace-ms) and one router (spillover) as subprocesses, the router
pinned to a core of its own; for each client count, N keep-alive aiohttp clients each stream requests in a
closed loop for --seconds, direct and through the router in turn (--runs times, interleaved). TTFB: from the
request's send to the first body bytes (the first SSE event). Prints the median of the runs' medians, per
target, and the router's added milliseconds. Independent of `spec-bench overhead`'s client (bench.rawhttp).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import aiohttp

from bench import procs
from bench.fastbackend import set_mode
from bench.procs import pinned, plan_cpus

BODY = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


async def run(url: str, clients: int, seconds: float) -> float:
    """Median TTFB (ms) of `clients` keep-alive clients streaming in a closed loop for `seconds`."""
    ttfbs: list[float] = []
    end = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def client() -> None:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                async with s.post(url + "/v1/chat/completions", json=BODY) as r:
                    await r.content.readany()
                    ttfbs.append(time.perf_counter() - t0)
                    await r.read()

        for _ in range(clients):  # warm the keep-alive connections
            async with s.post(url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
        await asyncio.gather(*(client() for _ in range(clients)))
    return statistics.median(ttfbs) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="scripts/ttfb_probe.py", allow_abbrev=False)
    p.add_argument("--clients", default="1,4", help="comma list of concurrent clients (default 1,4)")
    p.add_argument("--runs", type=int, default=3, help="runs per target and client count (default 3)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per run (default 3)")
    p.add_argument("--pace-ms", type=float, default=5.0, help="gap between the backend's tokens (default 5)")
    ns = p.parse_args()
    cpus = plan_cpus(True)
    out = {"cores": os.cpu_count(), "cpus": {k: sorted(v) if v else None for k, v in cpus.items()},
           "loadavg_start": os.getloadavg()}
    with procs.ProcGroup() as group:
        with pinned(cpus["backend"]):
            backend = group.add(procs.start("fast backend", ["bench.fastbackend", "--port", "0"]))
        with pinned(cpus["proxy"]):
            router = group.add(procs.start_router([backend.url], [], "spillover", 10**6,
                                                  extra=["--log-level", "warning"]))
        if cpus["load"]:
            os.sched_setaffinity(0, cpus["load"])

        async def measure() -> dict:
            from bench.cli import wait_serving

            await wait_serving(router.url)
            await set_mode(backend.url, pace_ms=ns.pace_ms, hold_s=0)
            res = {}
            for c in (int(x) for x in ns.clients.split(",")):
                got: dict[str, list[float]] = {"direct": [], "router": []}
                for _ in range(ns.runs):
                    for name, url in (("direct", backend.url), ("router", router.url)):
                        got[name].append(await run(url, c, ns.seconds))
                med = {k: round(statistics.median(v), 3) for k, v in got.items()}
                res[f"c{c}"] = {"ttfb_p50_ms": med, "runs_ms": got,
                                "router_added_ms": round(med["router"] - med["direct"], 3)}
            return res

        out["results"] = asyncio.run(measure())
    out["loadavg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
