"""Diagnostic: a cold adaptive router in front of the llama.cpp pair, two closed-loop clients, N requests: which
engine each request went to, and whether another of ours was in flight there when it was sent.

Run (repository root): .venv/bin/python -m bench engines (two `listening on URL` lines), then
.venv/bin/python bench/results/ab-s40/llama-decisions.py SPEC_URL BASE_URL [N]   (output: llama-decisions*.txt)
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

sys.path.insert(0, ".")
from bench.procs import start  # noqa: E402

SPEC, BASE = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 40
MODEL = "gemma-3-270m"
PROMPTS = [json.loads(line)["messages"] for line in open("bench/prompts/coding.jsonl")]


async def drive(url: str) -> list[tuple]:
    recs: list[tuple] = []
    todo = iter(range(N))
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:

        async def client() -> None:
            for i in todo:
                body = {"model": MODEL, "messages": PROMPTS[i % len(PROMPTS)], "max_tokens": 24,
                        "temperature": 0, "stream": True}
                sent = time.monotonic() - t0
                first = None
                async with s.post(url + "/v1/chat/completions", json=body) as resp:
                    pool = resp.headers["X-Router-Pool"]
                    async for line in resp.content:
                        if first is None and line.startswith(b"data:"):
                            first = time.monotonic() - t0
                recs.append((i, sent, pool, first - sent, time.monotonic() - t0 - sent))

        await asyncio.gather(client(), client())
    # Others of ours on the same engine, sent before and not yet ended when this one was sent.
    return [(i, round(sent, 2), pool, sum(1 for j, s2, p2, _, d2 in recs if j != i and p2 == pool and s2 < sent < s2 + d2),
             round(ttft, 2), round(dur, 2)) for i, sent, pool, ttft, dur in sorted(recs)]


async def main() -> None:
    router = start("router", ["router", "serve", "--speculative", SPEC, "--baseline", BASE,
                              "--port", "0", "--policy", "adaptive", "--health-path", "/openapi.json",
                              "--load-signal", "backend", "--load-interval", "0.5"])
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                async with s.get(router.url + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.2)
        recs = await drive(router.url)
        async with aiohttp.ClientSession() as s, s.get(router.url + "/router/state") as resp:
            state = await resp.json()
        for rec in recs:
            print(*rec)
        print("doubled:", sum(1 for r in recs if r[3] > 0), "of", len(recs),
              "spec share", sum(r[2] == "speculative" for r in recs) / len(recs))
        for b in state["model"]["backends"]:
            print(b["pool"], b["samples"], b["max_running"], b["max_running_from"], b.get("running_seen"),
                  b.get("queue_witnesses"), b["tok_s_alone"], b["spread"], b["request_tok_s"]["1"], b["request_tok_s"]["2"])
        async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("router_route_decisions_total{"):
                    print(line)
        print("decisions", state["model"]["decisions"])
    finally:
        router.stop(grace=5)


asyncio.run(main())
