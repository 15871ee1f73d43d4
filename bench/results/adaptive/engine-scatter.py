"""Diagnostic: each llama.cpp engine of the pair alone, one request at a time, every coding prompt twice: how much
one request's seconds per token (what adaptive's model samples) scatter, and what explains it (prompt and output
length, time to first token, the engine itself).

Run (repository root): .venv/bin/python -m bench engines (two `listening on URL` lines), then
.venv/bin/python bench/results/adaptive/engine-scatter.py SPEC_URL BASE_URL   (output: engine-scatter.txt)
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import time

import aiohttp

SPEC, BASE = sys.argv[1], sys.argv[2]
MODEL = "gemma-3-270m"
PROMPTS = [json.loads(line)["messages"] for line in open("bench/prompts/coding.jsonl")]


async def one(s: aiohttp.ClientSession, url: str, messages: list) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first, usage, chunks = None, None, 0
    async with s.post(url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            d = json.loads(line[5:])
            if d.get("choices") and d["choices"][0].get("delta", {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.monotonic() - t0
            if d.get("usage"):
                usage = d["usage"]
    dur = time.monotonic() - t0
    # llama-cpp-python sends no usage chunk: the tokens are the chunks carrying text (as the router counts them)
    return {"dur": dur, "ttft": first, "prompt": usage["prompt_tokens"] if usage else len(json.dumps(messages)) // 4,
            "tokens": usage["completion_tokens"] if usage else chunks}


def sd_log(xs: list[float]) -> float:
    ls = [math.log(x) for x in xs]
    return statistics.pstdev(ls)


async def main() -> None:
    async with aiohttp.ClientSession() as s:
        res = {"speculative": [], "baseline": []}
        for rnd in range(2):
            for i, m in enumerate(PROMPTS):
                for name, url in (("speculative", SPEC), ("baseline", BASE)):
                    r = await one(s, url, m)
                    r["i"], r["round"] = i, rnd
                    res[name].append(r)
    for name, rs in res.items():
        y = [r["dur"] / r["tokens"] for r in rs]
        dec = [(r["dur"] - r["ttft"]) / (r["tokens"] - 1) for r in rs]
        print(f"{name}: {len(rs)} requests; tokens min {min(r['tokens'] for r in rs)} median "
              f"{statistics.median(r['tokens'] for r in rs)}; prompt tokens {min(r['prompt'] for r in rs)}-"
              f"{max(r['prompt'] for r in rs)} (about: characters / 4); ttft median {statistics.median(r['ttft'] for r in rs):.3f} s")
        print(f"  s/token (duration/tokens): mean {statistics.mean(y):.4f}, sd of log {sd_log(y):.3f}; "
              f"decode only: mean {statistics.mean(dec):.4f}, sd of log {sd_log(dec):.3f}; "
              f"tok/s of the whole set {sum(r['tokens'] for r in rs) / sum(r['dur'] for r in rs):.2f}")
        # the same prompt twice: how much of the scatter is the prompt's, how much the engine's own
        by = {}
        for r in rs:
            by.setdefault(r["i"], []).append(r["dur"] / r["tokens"])
        within = [abs(math.log(a / b)) / math.sqrt(2) for a, b in by.values()]
        print(f"  same prompt twice: sd of log within a prompt {math.sqrt(statistics.mean(w * w for w in within)):.3f}")
    # per prompt: speculative over baseline
    ratio = [res["speculative"][k]["dur"] / res["speculative"][k]["tokens"] / (res["baseline"][k]["dur"] / res["baseline"][k]["tokens"])
             for k in range(len(PROMPTS) * 2)]
    print(f"speculative/baseline s/token per request: median {statistics.median(ratio):.3f}, "
          f"min {min(ratio):.3f}, max {max(ratio):.3f}, sd of log {sd_log(ratio):.3f}")
    print("per prompt (round 0): i prompt_tokens tokens spec_s/tok base_s/tok spec_ttft base_ttft")
    for k in range(len(PROMPTS)):
        a, b = res["speculative"][k], res["baseline"][k]
        print(k, a["prompt"], a["tokens"], round(a["dur"] / a["tokens"], 4), round(b["dur"] / b["tokens"], 4),
              round(a["ttft"], 3), round(b["ttft"], 3))


asyncio.run(main())
