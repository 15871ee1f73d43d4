"""Router-made errors in OpenAI shape (400/401/404/405/413), the allowlist, header limits, /metrics placement."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from tests.fixtures_router import CHAT_BODY, sim_stats

CHAT = "/v1/chat/completions"


@pytest.fixture
async def guarded(sim_factory, router_factory):
    sim = await sim_factory("eagle3-tp8")
    router = await router_factory([sim.url], [], api_key="sekrit", max_body_bytes=2048)
    return sim, router


async def call(method: str, url: str, *, data: bytes | None = None, headers: dict | None = None):
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data, headers=headers) as r:
        return r.status, r.headers, await r.read()


def assert_openai_error(status: int, raw: bytes, expected_status: int, type_: str, code: str) -> dict:
    assert status == expected_status
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (type_, code)
    assert body["error"]["message"]
    return body["error"]


AUTH = {"Authorization": "Bearer sekrit", "Content-Type": "application/json"}


@pytest.mark.parametrize(("headers", "ok"), [
    ({}, False),
    ({"Authorization": "Bearer wrong"}, False),
    ({"Authorization": "Bearer sekri"}, False),
    # Every prefix and extension of the key is refused: only the whole key, byte for byte, passes.
    ({"Authorization": "Bearer s"}, False),
    ({"Authorization": "Bearer "}, False),
    ({"Authorization": "Bearer sekrit2"}, False),
    ({"Authorization": "Bearer sekritsekrit"}, False),
    ({"Authorization": "Bearer SEKRIT"}, False),
    ({"Authorization": "Basic sekrit"}, False),
    ({"Authorization": "sekrit"}, False),
    ({"Authorization": "Bearer sekrit"}, True),
    ({"Authorization": "bearer sekrit"}, True),
])
async def test_api_key(guarded, headers, ok):
    sim, router = guarded
    status, _, raw = await call("POST", router.url + CHAT, data=json.dumps(CHAT_BODY).encode(),
                                headers={"Content-Type": "application/json", **headers})
    if ok:
        assert status == 200
    else:
        assert_openai_error(status, raw, 401, "authentication_error", "invalid_api_key")
        assert (await sim_stats(sim.url))["requests_total"] == 0
    # Liveness and readiness stay open for orchestrators.
    assert (await call("GET", router.url + "/health"))[0] == 200


async def test_api_key_with_openai_sdk(guarded):
    _, router = guarded
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            await client.chat.completions.create(model="m", messages=CHAT_BODY["messages"])
        assert info.value.body["code"] == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sekrit", max_retries=0) as client:
        assert (await client.models.list()).data


@pytest.mark.parametrize(("body", "code"), [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'"a string"', "invalid_json"),
    (b"", "invalid_json"),
    (b'{"messages": "\xff\xfe"}', "invalid_json"),
    (b"[" * 5000 + b"]" * 5000, "invalid_json"),
])
async def test_bad_bodies_are_400(guarded, body, code):
    sim, router = guarded
    limit_ok = len(body) <= 2048
    status, _, raw = await call("POST", router.url + CHAT, data=body, headers=AUTH)
    if limit_ok:
        assert_openai_error(status, raw, 400, "invalid_request_error", code)
    else:
        assert_openai_error(status, raw, 413, "invalid_request_error", "request_too_large")
    assert (await sim_stats(sim.url))["requests_total"] == 0


async def test_deep_nesting_within_the_limit_is_400(sim_factory, router_factory):
    sim = await sim_factory()
    router = await router_factory([sim.url], [], max_body_bytes=1 << 20)
    status, _, raw = await call("POST", router.url + CHAT, data=b"[" * 100_000 + b"]" * 100_000,
                                headers={"Content-Type": "application/json"})
    assert_openai_error(status, raw, 400, "invalid_request_error", "invalid_json")


async def test_body_over_limit_is_413_also_when_chunked(guarded):
    sim, router = guarded
    big = json.dumps({**CHAT_BODY, "pad": "x" * 5000}).encode()
    status, _, raw = await call("POST", router.url + CHAT, data=big, headers=AUTH)
    assert_openai_error(status, raw, 413, "invalid_request_error", "request_too_large")

    async def chunks():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=chunks(), headers=AUTH) as r:
        assert_openai_error(r.status, await r.read(), 413, "invalid_request_error", "request_too_large")
    assert (await sim_stats(sim.url))["requests_total"] == 0


@pytest.mark.parametrize("path", ["/v1/embeddings", "/generate", "/_sim/stats", "/v1/chat/completions/../../_sim/stats",
                                  "/v1/%2e%2e/_sim/faults", "/v1/chat%2Fcompletions", "//v1/chat/completions",
                                  "/abort_request", "/metrics/../_sim/faults"])
async def test_unknown_paths_are_404_and_never_forwarded(guarded, path):
    sim, router = guarded
    for method in ("GET", "POST", "DELETE"):
        status, _, raw = await call(method, router.url + path, data=b"{}", headers=AUTH)
        if status == 405:  # a normalised path that names a real route with the wrong method
            continue
        assert_openai_error(status, raw, 404, "not_found_error", "not_found")
    stats = await sim_stats(sim.url)
    assert stats["requests_total"] == 0 and stats["faults_injected"] == {}


async def test_wrong_method_is_405(guarded):
    _, router = guarded
    status, headers, raw = await call("GET", router.url + CHAT, headers=AUTH)
    assert_openai_error(status, raw, 405, "invalid_request_error", "method_not_allowed")
    assert headers["Allow"] == "POST"
    status, _, raw = await call("POST", router.url + "/v1/models", data=b"{}", headers=AUTH)
    assert_openai_error(status, raw, 405, "invalid_request_error", "method_not_allowed")


async def test_bad_pool_header_is_400(guarded):
    _, router = guarded
    status, _, raw = await call("POST", router.url + CHAT, data=json.dumps(CHAT_BODY).encode(),
                                headers={**AUTH, "X-Router-Pool": "fastest"})
    assert_openai_error(status, raw, 400, "invalid_request_error", "invalid_pool")


async def test_header_limits_are_4xx_not_5xx(guarded):
    _, router = guarded
    many = {f"X-H{i}": "v" for i in range(150)}
    status, _, _ = await call("POST", router.url + CHAT, data=b"{}", headers={**AUTH, **many})
    assert 400 <= status < 500
    status, _, _ = await call("POST", router.url + CHAT, data=b"{}", headers={**AUTH, "X-Big": "v" * 10000})
    assert 400 <= status < 500
    assert (await call("GET", router.url + "/health"))[0] == 200


async def test_metrics_on_a_separate_listener(sim_factory, router_factory):
    sim = await sim_factory()
    router = await router_factory([sim.url], [], metrics_host="127.0.0.1", metrics_port=0)
    assert (await call("GET", router.url + "/metrics"))[0] == 404
    status, headers, raw = await call("GET", router.state.metrics_url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b"router_inflight_requests{" in raw
    # The metrics listener serves nothing else.
    assert (await call("POST", router.state.metrics_url + CHAT, data=json.dumps(CHAT_BODY).encode()))[0] == 404


async def test_metrics_list_and_labels(sim_factory, router_factory):
    # A slow clock (one decode step ~10 ms) spaces the chunks, so the router sees several reads and records
    # inter-token gaps even on a loaded machine.
    sim = await sim_factory(speedup=1.0)
    router = await router_factory([], [sim.url], threshold=7)
    await call("POST", router.url + CHAT, data=json.dumps({**CHAT_BODY, "stream": True}).encode(),
               headers={"Content-Type": "application/json"})
    _, _, raw = await call("GET", router.url + "/metrics")
    text = raw.decode()
    for name in ("router_inflight_requests", "router_requests_total", "router_route_decisions_total",
                 "router_request_duration_seconds", "router_time_to_first_token_seconds",
                 "router_inter_token_latency_seconds", "router_prompt_tokens_total", "router_completion_tokens_total",
                 "router_backend_up", "router_threshold", "router_upstream_errors_total",
                 "router_client_disconnects_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert router.metric("router_threshold") == 7
    assert router.metric("router_backend_up", pool="baseline", backend=sim.url) == 1
    assert router.metric("router_requests_total", pool="baseline", backend=sim.url, code="200") == 1
    assert router.metric("router_time_to_first_token_seconds_count", pool="baseline") == 1
    assert router.metric("router_inter_token_latency_seconds_count", pool="baseline") > 0


async def test_slow_body_upload_does_not_block_others(guarded):
    sim, router = guarded
    started, finish = asyncio.Event(), asyncio.Event()

    async def trickle():
        body = json.dumps(CHAT_BODY).encode()[:20]
        yield body[:10]
        started.set()
        await finish.wait()  # the upload stays unfinished until the other request has its whole answer
        yield body[10:]

    async with aiohttp.ClientSession() as s:
        slow = asyncio.create_task(s.post(router.url + CHAT, data=trickle(), headers=AUTH))
        async with asyncio.timeout(10):
            await started.wait()
            async with s.post(router.url + CHAT, json=CHAT_BODY, headers={"Authorization": "Bearer sekrit"}) as r:
                assert r.status == 200 and (await r.json())["choices"]
        assert not slow.done()  # the other request was served while this body was still half-sent
        finish.set()
        resp = await slow
        assert_openai_error(resp.status, await resp.read(), 400, "invalid_request_error", "invalid_json")
        resp.release()


async def test_router_made_errors_are_counted_without_a_backend(guarded):
    sim, router = guarded
    await call("POST", router.url + CHAT, data=b"{}")  # no key
    await call("GET", router.url + "/nope")
    await call("POST", router.url + CHAT, data=b"[", headers=AUTH)
    assert router.metric("router_requests_total", pool="none", backend="none", code="401") == 1
    assert router.metric("router_requests_total", pool="none", backend="none", code="404") == 1
    assert router.metric("router_requests_total", pool="none", backend="none", code="400") == 1
    await sim.stop_listener()
    router.state.pools.backends[0].healthy = False  # as the probes would find it
    await call("POST", router.url + CHAT, data=json.dumps(CHAT_BODY).encode(), headers=AUTH)
    assert router.metric("router_requests_total", pool="none", backend="none", code="503") == 1


async def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read(4096)
    finally:
        writer.close()


@pytest.mark.parametrize("path", [CHAT.encode(), b"/nope", b"/v1/models"])
@pytest.mark.parametrize("value", [b"\x80\xff", b"something-else"])
async def test_odd_expect_header_is_417_not_500(guarded, path, value):
    _, router = guarded
    got = await _raw(router.url, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nExpect: " + value +
                     b"\r\nAuthorization: Bearer sekrit\r\nContent-Length: 2\r\n\r\n{}")
    assert got.startswith(b"HTTP/1.1 417 ")
    assert b'"code": "expectation_failed"' in got


async def test_expect_100_continue_works(guarded):
    _, router = guarded
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + CHAT, json=CHAT_BODY, expect100=True,
                          headers={"Authorization": "Bearer sekrit"}) as r:
            assert r.status == 200


async def test_unknown_v1_paths_need_the_key_too(guarded):
    sim, router = guarded
    status, _, raw = await call("POST", router.url + "/v1/embeddings", data=b"{}")
    assert_openai_error(status, raw, 401, "authentication_error", "invalid_api_key")
    status, headers, raw = await call("HEAD", router.url + "/health")
    assert status == 200
