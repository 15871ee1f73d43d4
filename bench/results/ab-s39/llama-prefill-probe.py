"""s39: where the llama.cpp pair's per-request scatter comes from. Each coding prompt (max_tokens 24, streamed) to the
speculative engine, then to the baseline one, one at a time, no router: whole duration and time to first token.
Run: .venv/bin/python -m bench engines (two `listening on URL` lines), then
.venv/bin/python bench/results/ab-s39/llama-prefill-probe.py SPEC_URL BASE_URL   (output: llama-prefill-probe.txt)
With `--queue` after the URLs: prompts i and i + 1 both to the baseline engine at once (it serves one request at a
time), each one's time to first token and duration (output: llama-queue-probe.txt)."""
import asyncio
import json
import sys
import time

import aiohttp

from bench.load import build_body, load_prompts

PROMPTS = load_prompts("coding")


async def one(client: aiohttp.ClientSession, url: str, i: int) -> tuple[float, float | None, dict | None]:
    """One streamed request: (seconds, seconds to the first content token, usage if the engine sent one)."""
    body = json.loads(build_body(PROMPTS[i % len(PROMPTS)], "gemma-3-270m", 24, None))
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    start, first, usage = time.perf_counter(), None, None
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return time.perf_counter() - start, first, usage


async def main(spec: str, base: str) -> None:
    async with aiohttp.ClientSession() as client:
        await one(client, spec, 0)  # warm both engines
        await one(client, base, 0)
        for i in range(len(PROMPTS)):
            ds, fs, us = await one(client, spec, i)
            db, fb, ub = await one(client, base, i)
            print(f"{i:2d} prompt={us and us.get('prompt_tokens')} tok={us and us.get('completion_tokens')} "
                  f"spec {ds:.2f}s ttft {fs:.2f} | base {db:.2f}s ttft {fb:.2f}", flush=True)


async def queue(base: str) -> None:
    async with aiohttp.ClientSession() as client:
        await one(client, base, 0)
        for i in range(0, len(PROMPTS), 2):
            (da, fa, _), (db, fb, _) = await asyncio.gather(one(client, base, i), one(client, base, i + 1))
            print(f"{i:2d} together: prompt {i} {da:.2f}s ttft {fa:.2f} | prompt {i + 1} {db:.2f}s ttft {fb:.2f}",
                  flush=True)


if __name__ == "__main__":
    asyncio.run(queue(sys.argv[2]) if sys.argv[3:] == ["--queue"] else main(sys.argv[1], sys.argv[2]))
