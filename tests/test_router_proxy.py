"""Proxying through the router with simulator backends: the openai SDK, byte equality, usage, models, headers."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest

from tests.fixtures_router import CHAT_BODY, sim_stats

# SGLang (and the simulator) give every response a fresh random id and the current second as `created`;
# everything else must match byte for byte.
_VOLATILE = re.compile(rb'"id":"[0-9a-f]{32}"|"created":\d+')


def normalise(body: bytes) -> bytes:
    return _VOLATILE.sub(b"<volatile>", body)


async def raw_post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url + path, data=data, headers=hdrs) as r:
        return r.status, dict(r.headers), await r.read()


@pytest.fixture
async def pair(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", speedup=50.0)
    base = await sim_factory("baseline-tp8", speedup=50.0)
    router = await router_factory([spec.url], [base.url], threshold=4)
    return spec, base, router


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_bytes_equal_direct(pair, path, stream):
    spec, _, router = pair
    body = dict(CHAT_BODY) if path.endswith("chat/completions") else {"model": "m", "prompt": "once upon",
                                                                       "max_tokens": 12}
    body.update(stream=stream, seed=11)
    if stream:
        body["stream_options"] = {"include_usage": True}
    st_d, h_d, direct = await raw_post(spec.url, path, body)
    st_r, h_r, routed = await raw_post(router.url, path, body)
    assert st_d == st_r == 200
    assert h_r["X-Router-Pool"] == "speculative" and h_r["X-Router-Backend"] == spec.url
    assert h_r["Content-Type"] == h_d["Content-Type"]
    assert normalise(routed) == normalise(direct)
    assert routed.count(b'"id"') == direct.count(b'"id"') > 0


async def test_stream_usage_is_stripped_unless_asked_and_still_counted(pair):
    spec, _, router = pair
    body = {**CHAT_BODY, "stream": True, "seed": 3}
    _, _, direct = await raw_post(spec.url, "/v1/chat/completions", body)
    _, _, routed = await raw_post(router.url, "/v1/chat/completions", body)
    assert b'"usage"' not in routed.replace(b'"usage":null', b"")
    assert normalise(routed) == normalise(direct)
    assert router.metric("router_completion_tokens_total", pool="speculative") == 12
    assert router.metric("router_prompt_tokens_total", pool="speculative") > 0
    # Non-streaming usage is counted too.
    await raw_post(router.url, "/v1/chat/completions", {**CHAT_BODY, "max_tokens": 5})
    assert router.metric("router_completion_tokens_total", pool="speculative") == 17


async def test_openai_sdk_async_stream_and_not(pair):
    _, _, router = pair
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0) as client:
        resp = await client.chat.completions.create(model="m", messages=CHAT_BODY["messages"], max_tokens=8)
        assert resp.choices[0].message.content and resp.usage.completion_tokens == 8
        stream = await client.chat.completions.create(model="m", messages=CHAT_BODY["messages"], max_tokens=8,
                                                      stream=True)
        text = []
        async for chunk in stream:
            assert chunk.usage is None  # the extra usage chunk the router asked for never shows up
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        assert "".join(text) == resp.choices[0].message.content
        comp = await client.completions.create(model="m", prompt="hello", max_tokens=4, stream=True,
                                               stream_options={"include_usage": True})
        usage = [c.usage async for c in comp if c.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 4


async def test_openai_sdk_sync_stream_and_not(pair):
    _, _, router = pair

    def run() -> tuple[str, str, list]:
        with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0) as client:
            whole = client.completions.create(model="m", prompt="the sea", max_tokens=6, seed=5)
            parts = [c.choices[0].text for c in client.completions.create(
                model="m", prompt="the sea", max_tokens=6, seed=5, stream=True) if c.choices]
            models = [m.id for m in client.models.list()]
        return whole.choices[0].text, "".join(parts), models

    whole, streamed, models = await asyncio.to_thread(run)
    assert whole and streamed == whole
    assert models == ["moonshotai/Kimi-K2.5"]  # both sims serve the same model: listed once


async def test_models_merges_distinct_names(sim_factory, router_factory):
    a = await sim_factory("eagle3-tp8", model="spec-name")
    b = await sim_factory(model="base-name")
    router = await router_factory([a.url], [b.url])
    async with aiohttp.ClientSession() as s, s.get(router.url + "/v1/models") as r:
        assert r.status == 200
        ids = sorted(m["id"] for m in (await r.json())["data"])
    assert ids == ["base-name", "spec-name"]
    named = await router_factory([a.url], [b.url], served_model_name="kimi")
    async with aiohttp.ClientSession() as s, s.get(named.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["kimi"]


async def test_backend_errors_pass_through_unchanged(pair):
    spec, _, router = pair
    bad = {"model": "m", "messages": "not a list"}
    st_d, _, direct = await raw_post(spec.url, "/v1/chat/completions", bad)
    st_r, _, routed = await raw_post(router.url, "/v1/chat/completions", bad)
    assert st_d == st_r == 400
    assert routed == direct
    assert router.metric("router_requests_total", pool="speculative", backend=spec.url, code="400") == 1


async def test_pinned_pool_header(pair):
    spec, base, router = pair
    for pool, url in (("baseline", base.url), ("speculative", spec.url)):
        st, headers, _ = await raw_post(router.url, "/v1/chat/completions", CHAT_BODY, {"X-Router-Pool": pool})
        assert st == 200 and headers["X-Router-Pool"] == pool and headers["X-Router-Backend"] == url
        assert router.metric("router_route_decisions_total", pool=pool, reason="pinned") == 1


async def test_client_authorization_is_not_forwarded_and_backend_key_is(aiohttp_capture, router_factory):
    router = await router_factory([aiohttp_capture.url], [], api_key="client-key",
                                  speculative_api_key="backend-key")
    st, _, _ = await raw_post(router.url, "/v1/chat/completions?x=1", CHAT_BODY,
                              {"Authorization": "Bearer client-key", "X-Secret": "s", "Cookie": "c=1"})
    assert st == 200
    seen = [r for r in aiohttp_capture.requests if r["path"].startswith("/v1/")]
    assert len(seen) == 1
    assert seen[0]["path"] == "/v1/chat/completions"  # fixed path: no query string, nothing else
    assert seen[0]["headers"].get("Authorization") == "Bearer backend-key"
    assert "X-Secret" not in seen[0]["headers"] and "Cookie" not in seen[0]["headers"]
    assert json.loads(seen[0]["body"]) == CHAT_BODY  # body forwarded as sent


@pytest.fixture
async def aiohttp_capture():
    """A real HTTP server that records what reaches it and answers like a healthy backend."""
    from aiohttp import web

    class Capture:
        requests: list[dict] = []
        url = ""

    cap = Capture()
    cap.requests = []

    async def record(request: web.Request) -> web.Response:
        cap.requests.append({"path": request.path_qs, "headers": dict(request.headers), "body": await request.read()})
        if request.path == "/health":
            return web.Response(status=200)
        return web.json_response({"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    cap.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield cap
    await runner.cleanup()


async def test_stream_is_forwarded_as_it_arrives(sim_factory, router_factory):
    # At real speed this generation lasts ~20 s; the first events must reach the client while it still runs.
    sim = await sim_factory(speedup=1.0)
    router = await router_factory([sim.url], [])
    body = {**CHAT_BODY, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/chat/completions", json=body) as r:
        for _ in range(3):
            event = await r.content.readuntil(b"\n\n")
            assert event.startswith(b"data: {")
        stats = await sim_stats(sim.url)
        assert stats["running"] == 1 and stats["completed_total"] == 0
        r.close()


async def test_include_usage_requested_with_other_stream_options(pair):
    spec, _, router = pair
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": False}}
    _, _, routed = await raw_post(router.url, "/v1/chat/completions", body)
    _, _, direct = await raw_post(spec.url, "/v1/chat/completions", body)
    assert normalise(routed) == normalise(direct)
    assert router.metric("router_completion_tokens_total", pool="speculative") == 12
