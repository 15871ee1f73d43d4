"""Prefix affinity through real sockets: a conversation's turns stay on the instance that holds its prefix (the
simulators report the cached tokens rising), move when that instance is overloaded, and the metrics say so."""
from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack

import aiohttp
import openai
import pytest

from tests.fixtures_router import poll

pytestmark = pytest.mark.timeout(60)

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def user_turn(conv: int, turn: int, n: int = 300) -> str:
    return " ".join(f"{WORDS[(conv * 7 + turn * 3 + i) % len(WORDS)]}{conv}" for i in range(n))


class Conversation:
    def __init__(self, client: openai.AsyncOpenAI, conv: int) -> None:
        self.client = client
        self.conv = conv
        self.messages: list[dict] = [{"role": "system", "content": f"conversation {conv}. " + "be brief. " * 40}]
        self.backends: list[str] = []
        self.cached: list[int] = []
        self.prompt: list[int] = []

    async def turn(self, extra_body: dict | None = None, stream: bool = False) -> None:
        self.messages.append({"role": "user", "content": user_turn(self.conv, len(self.backends))})
        if stream:
            raw = await self.client.chat.completions.with_raw_response.create(
                model="m", messages=self.messages, max_tokens=8, extra_body=extra_body, stream=True,
                stream_options={"include_usage": True})
            text, usage = [], None
            async for chunk in raw.parse():
                text += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            content = "".join(text)
        else:
            raw = await self.client.chat.completions.with_raw_response.create(
                model="m", messages=self.messages, max_tokens=8, extra_body=extra_body)
            resp = raw.parse()
            usage, content = resp.usage, resp.choices[0].message.content
        self.backends.append(raw.headers["x-router-backend"])
        assert usage is not None and usage.prompt_tokens_details is not None
        self.cached.append(usage.prompt_tokens_details.cached_tokens or 0)
        self.prompt.append(usage.prompt_tokens)
        self.messages.append({"role": "assistant", "content": content})


async def test_turns_stay_on_the_instance_holding_their_prefix_under_moderate_load(sim_factory, router_factory):
    sims = [await sim_factory(speedup=200, enable_cache_report=True) for _ in range(3)]
    router = await router_factory([], [s.url for s in sims])
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        convs = [Conversation(client, i) for i in range(6)]

        async def run(c: Conversation) -> None:
            for _ in range(5):
                await c.turn(stream=True)

        # Six conversations at once: each instance has work from others while a conversation's next turn arrives.
        # Streamed, as chat clients do: the router sees each first token, so a request decoding on an instance
        # no longer counts as prefill queued there (a non-streamed one does until its answer: docs/ROUTER.md).
        await asyncio.gather(*(run(c) for c in convs))
    for c in convs:
        assert len(set(c.backends)) == 1, c.backends  # every turn where its prefix is
        assert c.cached[0] < 20  # the chat template's first tokens only
        for k in range(1, 5):
            # the whole previous prompt (and the answer the simulator generated) is cached on the next turn
            assert c.cached[k] >= c.prompt[k - 1] - 1, (k, c.cached, c.prompt)
        assert c.cached == sorted(c.cached)
    assert len({c.backends[0] for c in convs}) >= 2  # new conversations spread by load
    m = router.metric
    assert m("router_prefix_decisions_total", pool="baseline", reason="prefix_affinity") >= 6 * 4
    reported = m("router_cached_tokens_total", pool="baseline")
    assert reported == sum(sum(c.cached) for c in convs)
    share = reported / m("router_cache_reported_prompt_tokens_total", pool="baseline")
    assert 0.6 < share < 1.0
    expected = m("router_prefix_expected_cached_tokens_total", pool="baseline")
    assert expected / m("router_prefix_prompt_tokens_total", pool="baseline") > 0.4
    async with aiohttp.ClientSession() as s, s.get(router.url + "/router/state") as r:
        state = await r.json()
    assert sum(b["prefix_blocks"] for b in state["backends"]) > 0
    assert state["prefix"]["bytes_per_token"] != 4.0  # learned from the simulator's own token counts


async def test_an_overloaded_instance_loses_the_conversation_and_the_new_one_caches_it(sim_factory, router_factory):
    sims = [await sim_factory(speedup=2, enable_cache_report=True, max_running_requests=2) for _ in range(2)]
    router = await router_factory([], [s.url for s in sims], load_signal="backend", load_interval=0.05)
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client, \
            AsyncExitStack() as stack:
        c = Conversation(client, 1)
        await c.turn()
        await c.turn()
        home = c.backends[0]
        assert c.backends == [home, home] and c.cached[1] > 0
        # Twelve long requests straight to the home instance (not through this router): its /v1/loads says so.
        session = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}


        async def hold() -> None:
            async with session.post(home + "/v1/chat/completions", json=body) as resp:
                await resp.read()

        tasks = [asyncio.create_task(hold()) for _ in range(12)]
        stack.callback(lambda: [t.cancel() for t in tasks])
        b = router.state.pools.by_url[home]
        assert await poll(lambda: (b.reported or 0) >= 12, 5.0)
        await c.turn()
        away = c.backends[2]
        assert away != home and c.cached[2] == 0  # moved: the prefix is prefilled again there
        assert router.metric("router_prefix_decisions_total", pool="baseline", reason="load_override") == 1
        await c.turn()
        assert c.backends[3] == away and c.cached[3] >= c.prompt[2] - 1  # and stays where it now is


async def test_prefix_routing_off_spreads_turns_by_load(sim_factory, router_factory):
    sims = [await sim_factory(speedup=200, enable_cache_report=True) for _ in range(2)]
    router = await router_factory([], [s.url for s in sims], prefix_routing=False)
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        convs = [Conversation(client, i) for i in range(4)]
        for _ in range(4):
            for c in convs:
                await c.turn()  # one at a time: both instances idle at every decision, so ties are random
    assert any(len(set(c.backends)) > 1 for c in convs)
    assert router.metric("router_prefix_decisions_total", pool="baseline", reason="prefix_affinity") == 0
    async with aiohttp.ClientSession() as s, s.get(router.url + "/router/state") as r:
        state = await r.json()
    assert "prefix" not in state and "prefix_blocks" not in state["backends"][0]


@pytest.mark.parametrize("payload, kind", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
     "image"),
    ({"messages": [{"role": "user", "content": ""}]}, "no_text"),
])
async def test_requests_without_text_route_by_load_and_say_so(sim_factory, router_factory, payload, kind):
    sims = [await sim_factory(speedup=200) for _ in range(2)]
    router = await router_factory([], [s.url for s in sims])
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(router.url + "/v1/chat/completions", json={"model": "m", "max_tokens": 2, **payload}) as r:
                await r.read()
    assert router.metric("router_prefix_decisions_total", pool="baseline", reason=kind) == 3
    assert all(router.state.pools.affinity.index.size(x.url) == 0 for x in sims)


async def test_a_malformed_or_too_large_body_does_not_grow_the_index(sim_factory, router_factory):
    sims = [await sim_factory(speedup=200) for _ in range(2)]
    router = await router_factory([], [s.url for s in sims], max_body_bytes=100_000)
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w " * 100_000}]}).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", data=big,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413
        async with s.post(router.url + "/v1/chat/completions", data=b'{"messages": [{"role": "user", "content": "'
                          + b"a" * 5000, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
    assert all(router.state.pools.affinity.index.size(x.url) == 0 for x in sims)


async def test_a_streams_prompt_counts_as_queued_prefill_until_its_first_token_a_buffered_one_until_its_end(
        sim_factory, router_factory):
    sim = await sim_factory(speedup=5, enable_cache_report=True)
    router = await router_factory([], [sim.url])
    b = router.state.pools.by_url[sim.url]
    body = {"model": "m", "messages": [{"role": "user", "content": user_turn(1, 0, 2000)}], "max_tokens": 200,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status == 200
            await r.content.readany()  # the first chunk: the prompt is prefilled, it is decoding now
            assert b.inflight == 1 and b.pending_tokens == 0
            await r.read()
        other = {**body, "messages": [{"role": "user", "content": user_turn(2, 0, 2000)}]}  # not cached
        task = asyncio.create_task(s.post(router.url + "/v1/chat/completions", json=other))
        assert await poll(lambda: b.inflight == 1, 5.0)
        assert b.pending_tokens > 1000  # nothing tells the router its first token came
        resp = await task
        assert resp.status == 200
        await resp.read()
    assert b.inflight == 0 and b.pending_tokens == 0
