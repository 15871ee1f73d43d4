"""The simulator's prefix cache (SGLang's RadixCache): its arithmetic, LRU eviction, locks, and how it is reported."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from bench.replay import STORY_SUFFIX, load_trace, trace_content
from bench.sim.engine import Engine, build_request, chat_key
from bench.sim.profiles import load_profile
from bench.sim.radix import RadixCache

pytestmark = pytest.mark.timeout(60)

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / "conversation_trace_first_30min.jsonl"


def toks(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ---- the tree -------------------------------------------------------------------------------------

def test_match_insert_and_split_count_tokens_exactly():
    c = RadixCache()
    assert c.insert(toks("a", 10))[0] == 0 and c.total_size == 10
    # a key sharing 6 tokens then diverging splits the edge; only the 4 new tokens are added
    key = toks("a", 6) + toks("b", 4)
    assert c.match_prefix(key)[0] == 6
    assert c.insert(key)[0] == 6 and c.total_size == 14
    assert c.match_prefix(toks("a", 10))[0] == 10 and c.match_prefix(toks("a", 3))[0] == 3
    assert c.match_prefix(toks("z", 5))[0] == 0
    assert c.evictable_size == 14 and c.protected_size == 0


def test_eviction_is_least_recently_used_and_never_touches_a_held_path():
    c = RadixCache()
    _, old = c.insert(toks("old", 10))
    _, held = c.insert(toks("held", 10))
    _, new = c.insert(toks("new", 10))
    c.lock(held)
    assert c.protected_size == 10 and c.evictable_size == 20
    c.match_prefix(toks("old", 10))  # used again: "new" is now the least recently used
    assert c.evict(5) == 10  # whole leaves go: "new"
    assert c.match_prefix(toks("new", 10))[0] == 0 and c.match_prefix(toks("old", 10))[0] == 10
    assert c.evict(1000) == 10  # only "old" is left to evict
    assert c.match_prefix(toks("held", 10))[0] == 10 and c.total_size == 10 == c.protected_size
    c.unlock(held)
    assert c.evict(1000) == 10 and c.total_size == 0


# ---- the engine: admission, shared capacity, locks ------------------------------------------------

async def _run_one(engine: Engine, key: list[str], max_tokens: int, rid: str) -> object:
    req = build_request(rid, " ".join(key), len(key), profile=engine.profile, seed=0, max_tokens=max_tokens,
                        stop=[], ignore_eos=True, stream=True, key=key)
    engine.submit(req)
    while True:
        if (await req.outbox.get())[1]:
            return req


async def test_a_repeated_prefix_is_cached_and_lru_eviction_frees_room_beyond_capacity():
    p = load_profile("baseline-tp8")
    engine = Engine(p, speedup=1000, max_total_tokens=100)
    engine.start()
    try:
        a = await _run_one(engine, toks("a", 40), 1, "a")
        assert a.cached_tokens == 0 and engine.cache.total_size == 40  # prompt in; a 1-token output adds nothing
        assert (await _run_one(engine, toks("b", 40), 1, "b")).cached_tokens == 0
        assert engine.cache.total_size == 80
        again = await _run_one(engine, toks("a", 40), 1, "a2")
        assert again.cached_tokens == 39  # all but the last prompt token, as SGLang matches
        # 41 more tokens do not fit beside 80 cached: the least recently used (b, not the reused a) goes
        c = await _run_one(engine, toks("c", 40), 1, "c")
        assert c.cached_tokens == 0 and engine.cache.evicted_total == 40
        assert (await _run_one(engine, toks("a", 40), 1, "a3")).cached_tokens == 39
        assert (await _run_one(engine, toks("b", 40), 1, "b2")).cached_tokens == 0
        assert engine.cache.total_size + engine.reserved_tokens <= 100
        assert engine.cached_tokens_total == 39 * 2 and engine.prompt_tokens_admitted == 40 * 6
    finally:
        await engine.close()


async def test_a_running_requests_tokens_are_never_evicted():
    p = load_profile("baseline-tp8")
    engine = Engine(p, speedup=1, max_total_tokens=100)  # real time: 40 decode steps take ~0.45 s
    engine.start()
    try:
        long = build_request("r", "r", 50, profile=p, seed=0, max_tokens=40, stop=[], ignore_eos=True,
                             stream=True, key=toks("r", 50))
        engine.submit(long)
        await long.outbox.get()  # prefilled: its 50 prompt tokens are in the tree, held by it
        assert engine.cache.protected_size == 50 and engine.reserved_tokens == 40
        other = build_request("s", "s", 50, profile=p, seed=0, max_tokens=1, stop=[], ignore_eos=True,
                              stream=True, key=toks("s", 50))
        engine.submit(other)
        for _ in range(5):  # it needs 51 tokens; only 10 are free and none of the tree is evictable: it waits
            await asyncio.sleep(0.01)
            assert other.state == "waiting" and engine.cache.match_prefix(toks("r", 50))[0] == 50
        while not (await long.outbox.get())[1]:
            pass
        while not (await other.outbox.get())[1]:
            pass
        # once it ended, its tokens (prompt + output but the last) were evictable and made room
        assert engine.cache.evicted_total >= 1 and engine.cache.protected_size == 0
    finally:
        await engine.close()


async def test_disabled_cache_charges_every_prompt_in_full():
    p = load_profile("baseline-tp8")
    engine = Engine(p, speedup=1000, radix_cache=False)
    engine.start()
    try:
        for i in range(2):
            req = await _run_one(engine, toks("a", 40), 3, f"a{i}")
            assert req.cached_tokens == 0
        assert engine.cache is None and engine.cached_tokens_total == 0 and engine.prefill_computed_total == 80
    finally:
        await engine.close()


def test_prefill_of_uncached_tokens_pays_attention_to_the_cached_prefix():
    p = load_profile("baseline-tp8")
    # 100k tokens in one go: the quadratic term is as large as the linear one at ~25,600 tokens of context
    linear = p.prefill_base_ms + 100_000 * p.prefill_ms_per_token
    pairs = 100_000 * 100_001 // 2
    assert p.prefill_ms(100_000, pairs) == pytest.approx(linear + pairs / 1e6 * p.prefill_attention_ms_per_mpair)
    assert p.prefill_ms(100_000, pairs) > 2.5 * linear
    assert p.prefill_ms(23, 23 * 24 // 2) < p.prefill_base_ms + 23 * p.prefill_ms_per_token + 0.001  # seed prompts


# ---- over HTTP: usage, metrics, /v1/loads, /_sim/stats, against SGLang's own models ---------------

async def _chat(url: str, content: str, *, stream: bool, max_tokens: int = 8) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        return {"raw": await r.text()}


async def _get(url: str, path: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        assert r.status == 200
        return await r.text()


def _events(raw: str) -> list[str]:
    return [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]


async def test_cached_tokens_reported_as_sglang_does_with_enable_cache_report(sim_factory, sglang_protocol):
    sim = await sim_factory(speedup=500, enable_cache_report=True)
    prompt = "the quick brown fox jumps over the lazy dog " * 30
    whole = (await _chat(sim.url, prompt, stream=False))["raw"]
    assert sglang_protocol.ChatCompletionResponse.model_validate_json(whole).model_dump_json(by_alias=True) == whole
    first = json.loads(whole)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    events = _events((await _chat(sim.url, prompt, stream=True))["raw"])
    usage_chunk = events[-2]
    model = sglang_protocol.ChatCompletionStreamResponse
    assert model.model_validate_json(usage_chunk).model_dump_json() == usage_chunk
    assert json.loads(usage_chunk)["usage"]["prompt_tokens_details"] == {"cached_tokens": first["prompt_tokens"] - 1}
    # completions, streamed (SGLang dumps that usage chunk with exclude_none) and whole
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/completions", json=body) as r:
            chunk = _events(await r.text())[-2]
        async with s.post(sim.url + "/v1/completions", json={**body, "stream": False}) as r:
            comp = await r.text()
    cm = sglang_protocol.CompletionStreamResponse
    assert cm.model_validate_json(chunk).model_dump_json(exclude_none=True) == chunk
    assert json.loads(chunk)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no chat template: new key
    assert sglang_protocol.CompletionResponse.model_validate_json(comp).model_dump_json(by_alias=True) == comp
    assert json.loads(comp)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the gauges and totals
    loads = json.loads(await _get(sim.url, "/v1/loads"))["loads"][0]
    assert 0.9 < loads["cache_hit_rate"] < 1.0  # the last prefill: all but the last token cached
    metrics = await _get(sim.url, "/metrics")
    rate = next(line for line in metrics.splitlines() if line.startswith("sglang:cache_hit_rate{"))
    assert float(rate.split()[-1]) == pytest.approx(loads["cache_hit_rate"], abs=1e-4)
    cached = [line for line in metrics.splitlines() if line.startswith("sglang:cached_tokens_total{")]
    assert len(cached) == 1 and 'cache_source="device"' in cached[0]
    stats = json.loads(await _get(sim.url, "/_sim/stats"))
    assert stats["cached_tokens_total"] == float(cached[0].split()[-1]) > 0
    assert stats["prompt_tokens_total"] > stats["cached_tokens_total"] and stats["radix_cache"]["tokens"] > 0


async def test_without_cache_report_usage_has_no_details_and_disabled_cache_reports_zero(sim_factory,
                                                                                         sglang_protocol):
    plain = await sim_factory(speedup=500)
    prompt = "one two three four five six seven " * 10
    for _ in range(2):
        whole = (await _chat(plain.url, prompt, stream=False))["raw"]
    assert json.loads(whole)["usage"]["prompt_tokens_details"] is None  # SGLang's default: no cache report
    assert json.loads(await _get(plain.url, "/_sim/stats"))["cached_tokens_total"] > 0  # ... but it did cache
    off = await sim_factory(speedup=500, enable_cache_report=True, disable_radix_cache=True)
    for _ in range(2):
        whole = (await _chat(off.url, prompt, stream=False))["raw"]
        assert sglang_protocol.ChatCompletionResponse.model_validate_json(whole).model_dump_json(
            by_alias=True) == whole
        assert json.loads(whole)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    stats = json.loads(await _get(off.url, "/_sim/stats"))
    assert stats["cached_tokens_total"] == 0 and stats["radix_cache"] is None
    assert json.loads(await _get(off.url, "/v1/loads"))["loads"][0]["cache_hit_rate"] == 0.0
    info = json.loads(await _get(off.url, "/server_info"))
    assert info["disable_radix_cache"] is True and info["enable_cache_report"] is True


# ---- a slice of Kimi's trace through a simulator ----------------------------------------------------

def _trace_slice(n: int) -> list:
    """The first n lines that share at least two blocks with an earlier line, each with the lines it shares."""
    reqs = load_trace(TRACE)[:3000]
    picked: list = []
    seen: dict[tuple, int] = {}
    for i, r in enumerate(reqs):
        best = None
        for k in range(len(r.hash_ids), 1, -1):
            if tuple(r.hash_ids[:k]) in seen:
                best = seen[tuple(r.hash_ids[:k])]
                break
        for k in range(1, len(r.hash_ids) + 1):
            seen.setdefault(tuple(r.hash_ids[:k]), i)
        if best is not None and len(picked) < 2 * n:
            for j in (best, i):
                if reqs[j] not in picked:
                    picked.append(reqs[j])
    return sorted(picked, key=lambda r: r.line)[:2 * n]


@pytest.mark.skipif(not TRACE.is_file(), reason=f"Kimi's Mooncake trace is not at {TRACE} (../shared/data/mooncake/)")
async def test_a_trace_slice_is_cached_exactly_as_its_shared_blocks_say(sim_factory):
    scale = 0.05  # 26-token blocks: the arithmetic is the same at any block size
    sim = await sim_factory(speedup=1000, enable_cache_report=True)
    reqs = _trace_slice(8)
    assert len({r.hash_ids[0] for r in reqs}) >= 1 and len(reqs) >= 8
    keys: list[list[str]] = []
    async with aiohttp.ClientSession() as s:
        for r in reqs:  # one at a time: each finds everything before it in the (unbounded here) cache
            content = f"Round 1: {trace_content(r, scale)} {STORY_SUFFIX}"
            key = chat_key([("user", content)])
            # what the tree holds: every earlier prompt (and its output, which no prompt here continues)
            expect = max((_lcp(key, k) for k in keys), default=0)
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(sim.url + "/v1/chat/completions", json=body) as resp:
                usage = json.loads(_events(await resp.text())[-2])["usage"]
            assert usage["prompt_tokens"] == len(key)
            assert usage["prompt_tokens_details"]["cached_tokens"] == min(expect, len(key) - 1), r.line
            keys.append(key)
    # the shared blocks show: at least two 26-token blocks of a later request came from the cache
    stats = json.loads(await _get(sim.url, "/_sim/stats"))
    assert stats["cached_tokens_total"] >= 8 * 2 * 26 * 0.5


def _lcp(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
