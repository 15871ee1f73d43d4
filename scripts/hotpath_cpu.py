"""Router CPU time per request and per streamed chunk (psutil), the hot path's figure that host load does not skew.

`.venv/bin/python scripts/hotpath_cpu.py [--requests N] [--streams S] [--tokens T] [--router-flags "..."]`: one
fast fake backend (bench.fastbackend) and one router (spillover) as subprocesses; N non-streamed requests at c=1 and at c=16, then
S concurrent streams of T tokens sent as fast as the backend writes them. Wall-clock rates on a shared machine
follow the other jobs; the router's own CPU seconds per unit of work do not (much).
"""
from __future__ import annotations

import argparse
import asyncio
import json

import psutil

from bench import procs
from bench.cli import wait_serving
from bench.rawhttp import open_all, request_bytes

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

PATH = "/v1/chat/completions"


async def requests(url: str, body: dict, n: int, c: int) -> int:
    raw = request_bytes(url, PATH, json.dumps(body).encode())
    conns = await open_all(url, c)

    async def worker(conn) -> None:
        for _ in range(n // c):
            await conn.send(raw)

    await asyncio.gather(*(worker(x) for x in conns))
    total = sum(x.total_events for x in conns)
    for x in conns:
        x.close()
    return total


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def main(ns: argparse.Namespace, url: str, pid: int) -> dict:
    p = psutil.Process(pid)
    out = {}
    await wait_serving(url)
    await requests(url, CHAT, 200, 1)  # warm-up
    for c in (1, 16):
        t0 = cpu(p)
        await requests(url, CHAT, ns.requests, c)
        out[f"cpu_us_per_request_c{c}"] = round((cpu(p) - t0) / ns.requests * 1e6, 1)
    body = dict(CHAT, stream=True, max_tokens=ns.tokens)
    t0 = cpu(p)
    events = await requests(url, body, ns.streams, ns.streams)
    used = cpu(p) - t0
    out["stream_events"] = events
    out["cpu_us_per_chunk"] = round(used / max(1, events) * 1e6, 2)
    out["chunks_per_cpu_second"] = round(events / used) if used else None
    return out


def run() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--router-flags", default="", help='more spec-router flags, e.g. "--prefix-routing false"')
    ns = ap.parse_args()
    with procs.ProcGroup() as group:
        backend = group.add(procs.start("fast backend", ["bench.fastbackend", "--port", "0"]))
        router = group.add(procs.start_router([backend.url], [], "spillover", 10**6,
                                              extra=["--log-level", "warning", *ns.router_flags.split()]))
        res = asyncio.run(main(ns, router.url, router.pid))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
