"""The router's own endpoints and middlewares (router.handlers) over HTTP in front of raw backends: exact bodies
of /v1/models, /ready and /health, the 404/405 texts, which paths need the key, what is counted as a rejection.
Expected documents are written out by hand; each test's docstring names the mutmut mutants it kills."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST

from tests.fixtures_rawbackend import json_answer
from tests.fixtures_router import poll

CHAT = "/v1/chat/completions"


async def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s, s.request(method, url, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def all_probed(router) -> None:
    assert await poll(lambda: all(b.ever_probed for b in router.state.pools.backends), 10)


async def test_served_model_name_answers_without_asking_backends(raw_backend_factory, router_factory):
    """mutmut: every key and value of the fixed model entry, the `if st.settings.served_model_name` branch."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [], served_model_name="my-model")
    status, _, raw = await get(router.url + "/v1/models")
    assert (status, json.loads(raw)) == (200, {"object": "list", "data": [
        {"id": "my-model", "object": "model", "created": 0, "owned_by": "spec-router"}]})
    assert be.hits["/v1/models"] == 0


async def test_models_keeps_well_formed_entries_first_seen_wins_and_asks_only_healthy_backends(
        raw_backend_factory, router_factory):
    """Entries that are not objects or have no string id are skipped; an id listed twice keeps the first
    backend's entry (speculative pool first); a backend that is down is not asked; each is asked with its
    pool's key. mutmut: the entry filters (`isinstance(m, dict)`, `isinstance(m.get("id"), str)`), `setdefault`
    order, `if b.healthy`, `headers=b.auth_headers`, the `object: list` wrapper."""
    first = await raw_backend_factory({"/v1/models": json_answer(200, {"data": [
        {"id": "a", "owned_by": "first"}, "junk", {"id": 7}, {"name": "no id"}, {"id": "b"}]})})
    second = await raw_backend_factory({"/v1/models": json_answer(200, {"data": [
        {"id": "a", "owned_by": "second"}, {"id": "c"}]})})
    down = await raw_backend_factory({"/health": json_answer(503, {}),
                                      "/v1/models": json_answer(200, {"data": [{"id": "never"}]})})
    router = await router_factory([first.url, down.url], [second.url], wait_ready=False,
                                  speculative_api_key="spec-key")
    await all_probed(router)
    status, _, raw = await get(router.url + "/v1/models")
    assert (status, json.loads(raw)) == (200, {"object": "list", "data": [
        {"id": "a", "owned_by": "first"}, {"id": "b"}, {"id": "c"}]})
    assert down.hits["/v1/models"] == 0
    models_req = [r for r in first.requests if r.path == "/v1/models"][0]
    assert models_req.headers.get("authorization") == "Bearer spec-key"
    assert "authorization" not in [r for r in second.requests if r.path == "/v1/models"][0].headers


async def test_models_with_no_healthy_backend_is_503_with_its_message(raw_backend_factory, router_factory):
    """mutmut: the NoHealthyBackend message of /v1/models."""
    down = await raw_backend_factory({"/health": json_answer(503, {})})
    router = await router_factory([down.url], [], wait_ready=False)
    await all_probed(router)
    status, _, raw = await get(router.url + "/v1/models")
    assert (status, json.loads(raw)) == (503, {
        "error": {"message": f"no healthy backend: {down.url} (speculative): down, GET /health -> 503",
                  "type": "service_unavailable", "code": "no_healthy_backend"},
        "probes": {down.url: {"pool": "speculative", "state": "down", "last_probe": "GET /health -> 503"}}})


async def test_ready_and_health_documents(raw_backend_factory, router_factory):
    """mutmut: /ready's `backends` map and status words, its 503 message, /health's body."""
    up = await raw_backend_factory({})
    down = await raw_backend_factory({"/health": json_answer(503, {})})
    router = await router_factory([up.url], [down.url], wait_ready=False)
    await all_probed(router)
    status, _, raw = await get(router.url + "/ready")
    assert (status, json.loads(raw)) == (200, {
        "status": "ready", "backends": {up.url: True, down.url: False},
        "probes": {up.url: {"pool": "speculative", "state": "up", "last_probe": "GET /health -> 200"},
                   down.url: {"pool": "baseline", "state": "down", "last_probe": "GET /health -> 503"}}})
    up.routes["/health"] = json_answer(503, {})
    assert await poll(lambda: not router.state.pools.backends[0].healthy, 10)
    status, _, raw = await get(router.url + "/ready")
    assert (status, json.loads(raw)) == (503, {
        "error": {"message": f"no backend is healthy yet: {up.url} (speculative): down, GET /health -> 503; "
                             f"{down.url} (baseline): down, GET /health -> 503",
                  "type": "service_unavailable", "code": "no_healthy_backend"},
        "backends": {up.url: False, down.url: False},
        "probes": {up.url: {"pool": "speculative", "state": "down", "last_probe": "GET /health -> 503"},
                   down.url: {"pool": "baseline", "state": "down", "last_probe": "GET /health -> 503"}}})
    status, _, raw = await get(router.url + "/health")
    assert (status, json.loads(raw)) == (200, {"status": "ok"})


async def test_ready_says_an_ejected_backend_is_out_of_rotation(raw_backend_factory, router_factory):
    """A backend whose probes pass but that outlier detection ejected is not in rotation: `backends` says
    false beside its "ejected" state, and true again once it is on trial (the same state in both fields)."""
    from router.observe import Attempt

    ejected = await raw_backend_factory({})
    other = await raw_backend_factory({})
    router = await router_factory([ejected.url], [other.url], eject_base_seconds=30)
    await all_probed(router)
    pools = router.state.pools
    a = pools.backends[0]
    for _ in range(pools.outlier_cfg.consecutive_errors):
        pools.report_attempt(a, Attempt("refused", 0))
    status, _, raw = await get(router.url + "/ready")
    body = json.loads(raw)
    assert status == 200 and a.healthy
    assert body["backends"] == {ejected.url: False, other.url: True}
    assert body["probes"][ejected.url] == {"pool": "speculative", "state": "ejected", "last_probe": "GET /health -> 200"}
    pools.tick(now=a.outlier.until)  # the ejection has run its time: on trial, let through again
    body = json.loads((await get(router.url + "/ready"))[2])
    assert body["backends"][ejected.url] is True and body["probes"][ejected.url]["state"] == "trial"


async def test_unrouted_paths_say_what_is_served(raw_backend_factory, router_factory):
    """mutmut: the 404 and 405 messages, the path cut to 200 characters, the sorted Allow list without "*"."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [])
    status, _, raw = await get(router.url + "/nope")
    assert (status, json.loads(raw)["error"]["message"]) == (404, (
        "no route for '/nope'; the router serves only /v1/chat/completions, /v1/completions, /v1/models, "
        "/health, /ready, /metrics and /router/state"))
    long = "/x" * 150
    status, _, raw = await get(router.url + long)
    assert json.loads(raw)["error"]["message"].startswith(f"no route for {long[:200]!r};")
    status, headers, raw = await get(router.url + "/ready", method="DELETE")
    assert (status, headers["Allow"], json.loads(raw)["error"]["message"]) == (
        405, "GET,HEAD", "method DELETE not allowed on /ready")
    assert be.chat_hits() == 0


async def test_which_paths_need_the_key(raw_backend_factory, router_factory):
    """/v1/ and /router/ need the key; /health, /ready, /metrics do not; the scheme is case-insensitive and
    spaces around the token do not matter. mutmut: the path prefixes, `scheme.lower()`, `token.strip()`."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [], api_key="sekrit")
    for path in ("/v1/models", "/router/state"):
        status, _, raw = await get(router.url + path)
        assert (status, json.loads(raw)["error"]["message"]) == (
            401, "missing or invalid API key; send Authorization: Bearer KEY")
        assert (await get(router.url + path, {"Authorization": "BEARER  sekrit "}))[0] == 200
    for path in ("/health", "/ready", "/metrics"):
        assert (await get(router.url + path))[0] == 200


async def test_rejections_are_counted_once_and_backend_answers_are_not(raw_backend_factory, router_factory):
    """A 404 from the router counts under pool "none"; a backend's own 500 (it carries X-Router-Backend) and
    a 200 do not. mutmut: `resp.status >= 400` -> `> 400`/`< 400`, `BACKEND_HEADER not in` -> `in`, the labels."""
    be = await raw_backend_factory({CHAT: json_answer(500, {"error": "boom"})})
    router = await router_factory([be.url], [])
    await get(router.url + "/nope")
    await get(router.url + "/health")
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json={"model": "m"}) as r:
        assert r.status == 500
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=b"[") as r:
        assert r.status == 400
    none = {code: router.metric("router_requests_total", pool="none", backend="none", code=code)
            for code in ("400", "404", "200", "500")}
    assert none == {"400": 1, "404": 1, "200": 0, "500": 0}


async def test_metrics_content_type(raw_backend_factory, router_factory):
    """mutmut: the Content-Type of /metrics."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [])
    status, headers, raw = await get(router.url + "/metrics")
    assert (status, headers["Content-Type"]) == (200, CONTENT_TYPE_LATEST)
    assert b"router_requests_total" in raw


async def test_expect_continue_in_any_case_and_not_on_http_1_0(raw_backend_factory, router_factory):
    """`Expect: 100-Continue` is the same header; an HTTP/1.0 client gets no interim line. mutmut: `.lower()`
    dropped, `request.version == HttpVersion11` -> `!=`, the interim status line."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [])
    host, port = router.url.removeprefix("http://").split(":")
    for version in (b"1.1", b"1.0"):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"POST " + CHAT.encode() + b" HTTP/" + version + b"\r\nHost: x\r\nExpect: 100-Continue\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(10):
                if version == b"1.1":
                    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
                writer.write(b"{}")
                await writer.drain()
                got = await reader.read()
        finally:
            writer.close()
        assert got.startswith(b"HTTP/1.1 200 ") or got.startswith(b"HTTP/1.0 200 ")
    assert be.chat_hits() == 2


async def test_other_expectations_are_417_with_the_supported_one_named(raw_backend_factory, router_factory):
    """mutmut: the ExpectationFailed message."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [])
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=b"{}",
                                                    headers={"Expect": "202-accepted"}) as r:
        assert (r.status, await r.json()) == (417, {"error": {
            "message": "only 'Expect: 100-continue' is supported", "type": "invalid_request_error",
            "code": "expectation_failed"}})
    assert be.chat_hits() == 0


async def test_models_skips_lists_of_the_wrong_shape(raw_backend_factory, router_factory):
    """A backend answering a bare JSON list, or `data` that is a number, contributes nothing (not a 500).
    mutmut: `isinstance(got, dict)` and `isinstance(data, list)` forced true in the model-list fetch."""
    good = await raw_backend_factory({"/v1/models": json_answer(200, {"data": [{"id": "ok"}]})})
    bare = await raw_backend_factory({"/v1/models": json_answer(200, [{"id": "bare"}])})
    number = await raw_backend_factory({"/v1/models": json_answer(200, {"data": 5})})
    router = await router_factory([good.url, bare.url, number.url], [])
    status, _, raw = await get(router.url + "/v1/models")
    assert (status, json.loads(raw)) == (200, {"object": "list", "data": [{"id": "ok"}]})
