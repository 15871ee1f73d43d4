"""router.exchange seen from outside: a streamed answer's headers, what each exchange reports through the learning
seam (`Pools.report_done` / `report_attempt`, recorded by wrapping them on a running router), its metrics, and the
stream's endings (trailing bytes, a stall after several chunks).

Raw backends write each event only after the client has read the one before, so every event is its own read
and the counts below are exact, whatever the machine's load. Each docstring names the mutmut mutants of
router/exchange.py it kills (`bash scripts/mutation.sh router/exchange.py`), numbered as in the run at f899a00
(or, for the tests written then, by their diff).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from router.observe import Attempt, Observation
from tests.fixtures_rawbackend import Conn, headers_then, json_answer, reset_before_headers, sse, sse_body
from tests.fixtures_router import poll, sim_stats
from tests.test_router_hotpath import LONG_STREAM, stalled_reader

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**BODY, "stream": True}
SETTINGS = {"health_interval": 60.0, "health_timeout": 10.0, "first_byte_timeout": 5.0, "retries": 0}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def event(content: str | None = None, *, usage: dict | None = None) -> dict:
    ev: dict = {"id": "r", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": content}}] if content else []}
    if usage is not None:
        ev["usage"] = usage
    return ev


class Seam:
    """Everything the router reports through Pools.report_done / report_attempt (the real ones still run)."""

    def __init__(self, router) -> None:
        pools = router.state.pools
        self.done: list[Observation] = []
        self.attempts: list[Attempt] = []
        done, attempt = pools.report_done, pools.report_attempt

        def report_done(backend, obs: Observation, placement=None) -> None:
            self.done.append(obs)
            done(backend, obs, placement)

        def report_attempt(backend, att: Attempt) -> None:
            self.attempts.append(att)
            attempt(backend, att)

        pools.report_done, pools.report_attempt = report_done, report_attempt


def lockstep(*events: dict | str, then=None):
    """A 200 stream: the first event at once (the router answers only once it has it), each later one as its own
    chunk once `gate` is set (the client has read the one before)."""
    gate = asyncio.Event()

    async def act(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
        for i, e in enumerate(events):
            if i:
                await gate.wait()
                gate.clear()
            await c.write_chunked(sse_body(e))
        if then is not None:
            await then(c)
        else:
            await c.write(b"0\r\n\r\n")
    return act, gate


async def read_events(resp: aiohttp.ClientResponse, gate: asyncio.Event, n: int) -> bytes:
    """Read the stream, opening the gate for the next event each time a whole one has arrived."""
    got = b""
    async with asyncio.timeout(20):
        while True:
            piece = await resp.content.readany()
            if not piece:
                return got
            seen = got.count(b"\n\n")
            got += piece
            if seen < got.count(b"\n\n") < n + 1:
                gate.set()


async def test_a_streamed_answer_reports_each_read_and_its_timing(raw_backend_factory, router_factory, caplog):
    """Three events, each its own read, then usage and [DONE]: one Observation with chunks 5, a ttft within the
    exchange, ok and the usage's completion tokens; the inter-chunk gaps sum to less than the exchange took; the
    answer carries the backend's content type, no-cache and the pool/backend headers.
    mutmut (numbers of the run at f899a00): stream 8-9 (Cache-Control's value), 45-47 (`chunks` = 1 / -= /
    += 2), 50 (`now + t0`), 53 (`now + last`), 59-64 (done_sent: None, lstrip, the [DONE] text), 95
    (end_upstream(None): ok None), 97-99 (flush without its transport or an argument: an error after the answer
    went out)."""
    events = [event("a"), event("b"), event("c"), event(usage=USAGE), "[DONE]"]
    act, gate = lockstep(*events)
    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **SETTINGS)
    seam = Seam(router)
    t0 = time.monotonic()
    asked = {**STREAM, "stream_options": {"include_usage": True}}  # nothing stripped: every event is seen
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=asked) as r:
        headers = r.headers
        got = await read_events(r, gate, len(events))
    took = time.monotonic() - t0
    assert got == sse_body(*events)
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert headers["Cache-Control"] == "no-cache"
    assert (headers["X-Router-Pool"], headers["X-Router-Backend"]) == ("speculative", b.url)
    (obs,) = seam.done
    assert (obs.pool, obs.url, obs.chunks, obs.ok, obs.completion_tokens) == ("speculative", b.url, 5, True, 3)
    assert obs.data_events == 5  # one per read, summed (stream's `data_events +=`)
    assert 0 <= obs.ttft_s <= obs.duration_s <= took
    assert (obs.inflight_at_start, obs.inflight_at_end) == (1, 1)
    itl_sum = router.metric("router_inter_token_latency_seconds_sum", pool="speculative")
    assert router.metric("router_inter_token_latency_seconds_count", pool="speculative") == 4
    assert 0 <= itl_sum <= took
    assert router.metric("router_time_to_first_token_seconds_count", pool="speculative") == 1
    assert 0 <= router.metric("router_time_to_first_token_seconds_sum", pool="speculative") <= took
    assert seam.attempts == [Attempt("ok", 200)]
    # Nothing failed after the answer went out (the final flush included).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("body", [sse_body(event("a"), event("b")), sse_body(event("a"), final_blank_line=False)],
                         ids=["two-events", "no-whole-event"])
async def test_a_stream_ending_without_done_is_not_ok(raw_backend_factory, router_factory, body):
    """An answer that ends cleanly but without [DONE] was not finished by the backend (ok False), also when no
    whole event ever came (only the tail, forwarded at the end). Regression: with no whole event forwarded (no
    ttft) a stream was reported ok, as if it were a buffered answer. mutmut: stream 15 (`done_sent = True`)."""
    b = await raw_backend_factory({CHAT: sse(body)})
    router = await router_factory([b.url], [], **SETTINGS)
    seam = Seam(router)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=STREAM) as r:
        assert r.status == 200 and await r.read() == body
    (obs,) = seam.done
    assert obs.ok is False
    assert obs.completion_tokens is None  # no usage came: none reported, not 0 (end_upstream 34)


async def test_a_stream_failing_before_its_first_whole_event_is_not_ok(raw_backend_factory, router_factory):
    """Half an event, then silence: the idle timeout in-band, and the exchange reported failed (it was reported
    ok before the fix, having no ttft). mutmut: stream 15 (`done_sent = True`) on the error path."""
    async def half_then_stall(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(b'data: {"id":')
        await asyncio.Event().wait()

    b = await raw_backend_factory({CHAT: half_then_stall})
    router = await router_factory([b.url], [], **{**SETTINGS, "idle_timeout": 0.5})
    seam = Seam(router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s, \
            s.post(router.url + CHAT, json=STREAM) as r:
        got = await r.read()
    assert r.status == 200 and got.endswith(b'"code": "upstream_timeout"}}\n\ndata: [DONE]\n\n')
    (obs,) = seam.done
    assert (obs.ok, obs.ttft_s, obs.chunks) == (False, None, 0)


async def test_a_stall_after_several_chunks_is_an_idle_timeout_and_not_ok(raw_backend_factory, router_factory):
    """Two events (two reads), then silence: the idle deadline still holds after later chunks, the stream ends
    with the in-band timeout, and the exchange is reported failed. mutmut: stream 84 (`dog.last_chunk = None`:
    the watchdog dies on its next check and the stream hangs), 26 and 28 (the watchdog given no transport / no
    response)."""
    async def stall(c: Conn) -> None:
        await asyncio.Event().wait()

    act, gate = lockstep(event("a"), event("b"), then=stall)
    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **{**SETTINGS, "idle_timeout": 0.5})
    seam = Seam(router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s, \
            s.post(router.url + CHAT, json=STREAM) as r:
        got = await read_events(r, gate, 2)
    error = {"error": {"message": f"backend {b.url} sent no next chunk in time", "type": "timeout_error",
                       "code": "upstream_timeout"}}
    assert got == sse_body(event("a"), event("b")) + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
    (obs,) = seam.done
    assert obs.ok is False and obs.chunks == 2
    assert seam.attempts == [Attempt("ok", 200), Attempt("idle_timeout")]


@pytest.mark.parametrize("asked", [False, True])
async def test_a_last_usage_event_without_its_blank_line_is_still_scanned(raw_backend_factory, router_factory,
                                                                        asked):
    """The stream's tail (no final blank line) is a usage-only event: counted, and stripped unless the client
    asked for it. mutmut: stream 90 (scan_usage(buf, None, ...)), 91 (strip None: kept when not asked)."""
    body = sse_body(event("a"), event(usage=USAGE), final_blank_line=False)
    b = await raw_backend_factory({CHAT: sse(body, piece=7)})
    router = await router_factory([b.url], [], **SETTINGS)
    req = {**STREAM, "stream_options": {"include_usage": True}} if asked else STREAM
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=req) as r:
        got = await r.read()
    assert got == (body if asked else sse_body(event("a")))
    assert router.metric("router_completion_tokens_total", pool="speculative") == 3


async def test_an_error_answer_mentioning_usage_counts_no_tokens(raw_backend_factory, router_factory):
    """Only a 200 answer's usage is counted. mutmut: buffered 6 (`status == 200 or "usage" in body`)."""
    answer = {"error": {"message": "bad", "type": "x", "code": 400}, "usage": USAGE}
    b = await raw_backend_factory({CHAT: json_answer(400, answer)})
    router = await router_factory([b.url], [], **SETTINGS)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=BODY) as r:
        assert (r.status, await r.json()) == (400, answer)
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 0
    assert router.metric("router_completion_tokens_total", pool="speculative") == 0


async def test_a_retry_is_a_decision_of_its_pool_and_reports_its_own_start(raw_backend_factory, router_factory):
    """The first backend resets before its headers; the retry goes to the other pool's backend. mutmut: _retry 11
    (inflight_at_start None), 14 and 15 (the decision counted under no pool / no reason)."""
    bad = await raw_backend_factory({CHAT: reset_before_headers()})
    good = await raw_backend_factory({CHAT: json_answer(200, {"choices": [], "usage": USAGE})})
    router = await router_factory([bad.url], [good.url], **{**SETTINGS, "retries": 1})
    seam = Seam(router)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=BODY,
                                                    headers={"X-Router-Pool": "speculative"}) as r:
        assert r.status == 200 and r.headers["X-Router-Backend"] == good.url
    (obs,) = seam.done
    assert (obs.url, obs.inflight_at_start, obs.ok, obs.completion_tokens) == (good.url, 1, True, 3)
    assert router.metric("router_route_decisions_total", pool="baseline", reason="retry") == 1
    assert [a.kind for a in seam.attempts] == ["disconnected", "ok"]


async def test_an_unclassified_failure_is_reported_as_a_disconnect(raw_backend_factory, router_factory):
    """A garbage status line is a generic upstream error; the learning seam sees it as a disconnect, never as an
    attempt of no kind. mutmut: upstream_failed 9 and 12 (no Attempt / `Attempt(None)`)."""
    async def garbage(c: Conn) -> None:
        await c.write(b"SPDY/9 what\r\n\r\n")
        await asyncio.sleep(0.5)

    b = await raw_backend_factory({CHAT: garbage})
    router = await router_factory([b.url], [], **SETTINGS)
    seam = Seam(router)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=BODY) as r:
        assert r.status == 502
    assert [a.kind for a in seam.attempts] == ["disconnected"]


async def test_a_client_that_stops_reading_does_not_hold_the_backend(sim_factory, router_factory):
    """The router keeps reading the backend at its pace while a client reads nothing (writes never wait for the
    client below write_buffer_bytes): the backend finishes and the lease ends long before the 60 s write
    timeout would cut the client. mutmut: write 4 and 5 (the events written with aiohttp's default
    `drain=True`: every 64 KiB the router waits for the client, so the backend waits too)."""
    sim = await sim_factory("baseline-tp8", speedup=1000.0)
    router = await router_factory(baseline=[sim.url], write_timeout=60.0, idle_timeout=60.0,
                                  write_buffer_bytes=64 * 1024 * 1024)
    async with stalled_reader(router.url, LONG_STREAM):
        assert await router.wait_idle(within=20) == {sim.url: 0}
        assert (await sim_stats(sim.url))["completed_total"] == 1


async def test_streams_that_stall_before_their_first_whole_event_eject(raw_backend_factory, router_factory):
    """Three streams in a row that stall after half an event are three consecutive failures: the backend is
    ejected and the next request goes to the other pool. Regression: each such stream was also reported ok
    (no ttft), a success that reset the failure streak, so the backend was never ejected. mutmut: stream 15
    (`done_sent = True`: the same wrong success, from the other side)."""
    async def half_then_stall(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(b'data: {"id":')
        await asyncio.Event().wait()

    spec = await raw_backend_factory({CHAT: half_then_stall})
    base = await raw_backend_factory({})
    router = await router_factory([spec.url], [base.url], **{**SETTINGS, "idle_timeout": 0.3, "threshold": 100,
                                                             "eject_consecutive_errors": 3,
                                                             "eject_trial_requests": 2, "eject_base_seconds": 60})
    pools = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for _ in range(4):
            async with s.post(router.url + CHAT, json=STREAM) as r:
                pools.append(r.headers["X-Router-Pool"])
                await r.read()
    assert pools == ["speculative"] * 3 + ["baseline"]
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="idle_timeout") == 1


@pytest.mark.parametrize(("sent", "forwarded"), [
    ({}, {"content-type": "application/json", "accept": "*/*"}),
    ({"Content-Type": "application/json; charset=utf-8", "Accept": "text/event-stream"},
     {"content-type": "application/json; charset=utf-8", "accept": "text/event-stream"}),
])
async def test_content_type_and_accept_are_forwarded_or_defaulted(raw_backend_factory, router_factory, sent,
                                                                  forwarded):
    """A client's Content-Type and Accept go to the backend as sent; missing, they default to JSON and */*.
    The exchange is then forgotten and its duration recorded under its pool, within the time it took.
    mutmut: upstream_headers 2-12 (the two lookups and their defaults), finish 1
    (`exchanges.discard(None)`: every exchange kept for ever), 16 and 19 (duration under no pool / `+ t0`)."""
    b = await raw_backend_factory({CHAT: json_answer(200, {"choices": []})})
    router = await router_factory([b.url], [], **SETTINGS)
    body = json.dumps(BODY).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in sent.items())
    host, port = router.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: r\r\n{head}Connection: close\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        async with asyncio.timeout(20):
            answer = await reader.read()
    finally:
        writer.close()
    took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 200 ")
    (req,) = [r for r in b.requests if r.path == CHAT]
    assert {k: req.headers[k] for k in ("content-type", "accept")} == forwarded
    assert "authorization" not in req.headers
    assert router.state.exchanges == set()
    assert router.metric("router_request_duration_seconds_count", pool="speculative") == 1
    assert 0 <= router.metric("router_request_duration_seconds_sum", pool="speculative") <= took


@pytest.mark.parametrize("first", ["503", "closed-after-headers"])
async def test_a_retried_response_gives_its_connection_back(raw_backend_factory, router_factory, first):
    """With one connection allowed to all backends together, the retry after a 503 or a stream closed after
    its headers can only be sent if the failed response was closed first. mutmut: start 43 and 77
    (`_retry(None)`: the failed response keeps the only connection, the retry waits until the first-byte
    deadline)."""
    fail = (json_answer(503, {"error": {"message": "busy"}}) if first == "503"
            else headers_then("close", stream=True))
    bad = await raw_backend_factory({CHAT: fail})
    good = await raw_backend_factory({})
    router = await router_factory([bad.url], [good.url], **{**SETTINGS, "retries": 1, "max_connections": 1,
                                                            "first_byte_timeout": 10.0})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.post(router.url + CHAT, json=STREAM) as r:
        assert (r.status, r.headers["X-Router-Backend"]) == (200, good.url)
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    assert (bad.chat_hits(), good.chat_hits()) == (1, 1)


@pytest.mark.parametrize("retries", [0, 1, 2, 3])
async def test_retry_budget_when_every_stream_dies_after_its_headers(raw_backend_factory, router_factory,
                                                                     retries):
    """Four backends whose streams all close after their headers: exactly 1 + retries attempts, then 502.
    mutmut: start 78-80 (`attempts` = 1, -= 1, += 2 in the after-headers retry path)."""
    backends = [await raw_backend_factory({CHAT: headers_then("close", stream=True)}) for _ in range(4)]
    router = await router_factory([b.url for b in backends[:2]], [b.url for b in backends[2:]],
                                  **{**SETTINGS, "retries": retries})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.post(router.url + CHAT, json=STREAM) as r:
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "backend_disconnected"
    assert sum(b.chat_hits() for b in backends) == 1 + retries


@pytest.mark.parametrize(("stream", "answer"), [
    (True, json_answer(400, {"error": {"message": "bad", "type": "x", "code": 400}})),
    (True, json_answer(200, {"choices": []})),
    (False, sse(sse_body(event("a"), "[DONE]"))),
])
async def test_only_a_200_event_stream_for_a_streamed_request_is_streamed(raw_backend_factory, router_factory,
                                                                          stream, answer):
    """Anything else (an error for a streamed request, a JSON 200 for it, an event stream nobody asked for)
    is answered whole: with its Content-Length and without the stream's Cache-Control. mutmut: start 57 and 58
    (the `sse` condition's `and` -> `or`)."""
    b = await raw_backend_factory({CHAT: answer})
    router = await router_factory([b.url], [], **SETTINGS)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=STREAM if stream else BODY) as r:
        got = await r.read()
        assert int(r.headers["Content-Length"]) == len(got) > 0
        assert "Cache-Control" not in r.headers


async def test_a_request_still_waiting_for_headers_at_the_drain_deadline_gets_503(raw_backend_factory,
                                                                                  router_factory):
    """Shutdown while the backend has not answered: at the drain deadline the client gets the router's 503
    document with the pool headers, counted as a 503. mutmut: proxy 98-107 (the error None / its message, the
    code recorded, the response without the error or the headers)."""
    async def hang(c: Conn) -> None:
        await asyncio.Event().wait()

    b = await raw_backend_factory({CHAT: hang})
    router = await router_factory([b.url], [], **{**SETTINGS, "drain_timeout": 0.3, "first_byte_timeout": 30.0})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        pending = asyncio.ensure_future(s.post(router.url + CHAT, json=BODY))
        assert await poll(lambda: b.chat_hits() == 1, 10)
        await router.close()
        r = await pending
        assert (r.status, await r.json()) == (503, {"error": {
            "message": "the router is shutting down; retry the request", "type": "service_unavailable",
            "code": "router_shutting_down"}})
        assert (r.headers["X-Router-Pool"], r.headers["X-Router-Backend"]) == ("speculative", b.url)
        r.release()
    assert router.metric("router_requests_total", pool="speculative", backend=b.url, code="503") == 1


async def test_a_bad_pool_pin_names_the_pools(raw_backend_factory, router_factory):
    """mutmut: pinned_pool 12 (the pools joined with another separator in the message)."""
    b = await raw_backend_factory({})
    router = await router_factory([b.url], [], **SETTINGS)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=BODY,
                                                    headers={"X-Router-Pool": "fast"}) as r:
        assert (r.status, await r.json()) == (400, {"error": {
            "message": "X-Router-Pool must be one of speculative, baseline", "type": "invalid_request_error",
            "code": "invalid_pool"}})
    assert b.chat_hits() == 0


# ---------------------------------------------------------------- written for the run at f60e691 (issue 27)

CACHED_USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 4}}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "buffered"])
async def test_the_usage_and_its_cached_tokens_reach_the_seam_and_the_metrics(raw_backend_factory, router_factory,
                                                                              stream):
    """A usage with prompt_tokens_details.cached_tokens: the Observation carries the prompt and cached tokens and
    the time-weighted in-flight mean (1: this request alone), and the cache-share counters count them per pool.
    mutmut: end_upstream's Observation without inflight_mean / prompt_tokens / cached_tokens (None or the
    argument dropped), `u.prompt if (u.seen) and False`; finish's cached_tokens and
    cache_reported_prompt_tokens increments (no value, no metric, no pool, arguments dropped)."""
    if stream:
        body = sse_body(event("a"), event(usage=CACHED_USAGE), "[DONE]")
        act = sse(body)
    else:
        act = json_answer(200, {"id": "r", "object": "chat.completion", "choices": [], "usage": CACHED_USAGE})
    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **SETTINGS)
    seam = Seam(router)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=STREAM if stream else BODY) as r:
        assert r.status == 200
        await r.read()
    await poll(lambda: len(seam.done) == 1, 10)
    (obs,) = seam.done
    assert (obs.ok, obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (True, 7, 4, 3)
    assert obs.inflight_mean == pytest.approx(1.0)
    await poll(lambda: router.metric("router_requests_total", pool="speculative", backend=b.url, code="200") == 1, 10)
    assert router.metric("router_cached_tokens_total", pool="speculative") == 4
    assert router.metric("router_cache_reported_prompt_tokens_total", pool="speculative") == 7
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 7


async def test_without_a_usage_no_token_counts_are_reported(raw_backend_factory, router_factory):
    """No usage came: prompt, cached and completion tokens are None (not 0), and no cache counter moves.
    mutmut: end_upstream `u.prompt if (u.seen) or True` (0 reported)."""
    b = await raw_backend_factory({CHAT: sse(sse_body(event("a"), "[DONE]"))})
    router = await router_factory([b.url], [], **SETTINGS)
    seam = Seam(router)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=STREAM) as r:
        assert r.status == 200
        await r.read()
    await poll(lambda: len(seam.done) == 1, 10)
    (obs,) = seam.done
    assert (obs.ok, obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (True, None, None, None)
    assert router.metric("router_cached_tokens_total", pool="speculative") == 0


async def test_a_stream_whose_done_went_out_is_ok_though_the_backend_then_fails(raw_backend_factory, router_factory):
    """[DONE] went out, then the backend resets the connection instead of ending the body: the client has the
    whole answer, so the exchange is ok (the failure after it is still counted for the backend).
    mutmut: stream's error path `end_upstream(None)` (ok False)."""
    async def reset(c: Conn) -> None:
        c.reset()

    act, gate = lockstep(event("a"), "[DONE]", then=reset)
    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **SETTINGS)
    seam = Seam(router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s, \
            s.post(router.url + CHAT, json=STREAM) as r:
        got = await read_events(r, gate, 2)
    assert got.startswith(sse_body(event("a"), "[DONE]"))
    await poll(lambda: len(seam.done) == 1, 10)
    (obs,) = seam.done
    assert obs.ok is True and obs.chunks == 2
    assert seam.attempts == [Attempt("ok", 200), Attempt("disconnected")]


async def test_a_client_leaving_after_it_took_done_is_a_complete_answer(raw_backend_factory, router_factory):
    """The client read [DONE] and left while the backend still held the body open: the answer was delivered, so
    it counts as a 200 (no disconnect) and the backend's exchange is ok. mutmut: finish `end_upstream(None)`
    (the delivered answer reported not ok)."""
    async def hold(c: Conn) -> None:
        await asyncio.Event().wait()

    act, gate = lockstep(event("a"), "[DONE]", then=hold)
    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **{**SETTINGS, "idle_timeout": 60.0})
    seam = Seam(router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(router.url + CHAT, json=STREAM) as r:
            got = b""
            while not got.endswith(b"data: [DONE]\n\n"):
                got += await r.content.readany()
                gate.set()
            r.close()  # leave: the router's handler is cancelled
    await poll(lambda: len(seam.done) == 1, 10)
    (obs,) = seam.done
    assert obs.ok is True
    await poll(lambda: router.metric("router_requests_total", pool="speculative", backend=b.url, code="200") == 1, 10)
    assert router.metric("router_client_disconnects_total", pool="speculative") == 0


async def test_with_no_backend_at_all_the_503_says_so(raw_backend_factory, router_factory):
    """The pools emptied at run time (discovery removed every member): a 503 with the bare message and an empty
    probe report. mutmut: no_backend's message ternary forced to the summary (`or True`) and its text changed."""
    b = await raw_backend_factory({})
    router = await router_factory([b.url], [], **SETTINGS)
    router.state.pools.remove_backend(b.url)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=BODY) as r:
        assert (r.status, await r.json()) == (503, {"error": {
            "message": "no healthy backend", "type": "service_unavailable", "code": "no_healthy_backend"},
            "probes": {}})


class FlushTransport:
    """What flush() sees of the client's transport, recorded."""

    def __init__(self, pending: int, closing: bool = False, closes_while_draining: bool = False) -> None:
        self.pending, self.closing, self.closes_while_draining = pending, closing, closes_while_draining
        self.limits = (16, 64)  # (low, high), as get_write_buffer_limits() returns them
        self.calls: list = []

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.pending

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.limits

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self.calls.append(("limits", high, low))


class FlushWriter:
    def __init__(self, transport: FlushTransport) -> None:
        self.transport = transport

    async def drain(self) -> None:
        t = self.transport
        t.calls.append(("drain", t.calls[-1] if t.calls else None))
        t.pending = 0
        t.closing = t.closes_while_draining


@pytest.mark.parametrize("pending, closing, closes, calls", [
    (0, False, False, []),  # nothing waits: nothing to do
    (10, True, False, []),  # closing: its bytes go or it is aborted, not ours to wait for
    (10, False, False, [("limits", 0, None), ("drain", ("limits", 0, None)), ("limits", 64, 16)]),
    (10, False, True, [("limits", 0, None), ("drain", ("limits", 0, None))]),  # closed meanwhile: left alone
], ids=["empty", "closing", "pending", "closed-while-draining"])
async def test_the_final_flush_waits_for_an_empty_buffer_and_restores_the_limits(pending, closing, closes, calls):
    """flush() after write_eof: with bytes waiting it sets the high-water mark to 0 (the writer pauses until the
    buffer is empty), drains, and puts the transport's own limits back unless it closed meanwhile; nothing when
    the buffer is empty or the transport is closing. A unit test: where the last bytes of a real stream lie when
    write_eof returns depends on the kernel's buffers. mutmut: flush 1-10 (the guard's `and` / inverted test,
    the limits read as None, high None / 1, the restore inverted or with high / low missing or None)."""
    from router.exchange import flush

    t = FlushTransport(pending, closing, closes)
    await flush(FlushWriter(t), t)
    assert t.calls == calls


LONG_PROMPT = {**STREAM, "messages": [{"role": "user", "content": "a shared system prompt, " * 20}]}
PREFIX = {**SETTINGS, "prefix_routing": True, "prefix_block_bytes": 64}


async def test_prefix_routing_learns_from_each_finished_exchange(raw_backend_factory, router_factory):
    """With prefix routing on, the finished exchange's placement goes back with its Observation: the pool's
    prefill cost gets its first sample. mutmut: __init__ `placement = None`, end_upstream's report_done with
    the placement None or dropped."""
    body = sse_body(event("a"), event("b"), event(usage=CACHED_USAGE), "[DONE]")
    b = await raw_backend_factory({CHAT: sse(body)})
    router = await router_factory([b.url], [], **PREFIX)
    affinity = router.state.pools.affinity
    assert affinity.state()["pools"].get("speculative", {}).get("samples", 0) == 0
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=LONG_PROMPT) as r:
        assert r.status == 200
        await r.read()
    await poll(lambda: affinity.state()["pools"].get("speculative", {}).get("samples") == 1, 10)


async def test_a_retried_request_leaves_its_prefix_on_the_backend_that_serves_it(raw_backend_factory,
                                                                                 router_factory):
    """The first backend tried closes before its headers; the retry's backend gets the prompt's blocks in the
    prefix index, as the first choice did. mutmut: _retry's acquire_retry with the placement None or dropped."""
    hits = []

    async def first_resets(c: Conn) -> None:
        hits.append(c)
        if len(hits) == 1:
            c.reset()
            return
        await sse(sse_body(event("a"), "[DONE]"))(c)

    one, two = await raw_backend_factory({CHAT: first_resets}), await raw_backend_factory({CHAT: first_resets})
    router = await router_factory([one.url, two.url], [], **{**PREFIX, "retries": 1})
    index = router.state.pools.affinity.index
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=LONG_PROMPT) as r:
        assert r.status == 200
        await r.read()
        served = r.headers["X-Router-Backend"]
    tried = one.url if served == two.url else two.url
    assert len(hits) == 2 and index.size(tried) > 0
    assert index.size(served) == index.size(tried)


async def test_a_client_leaving_before_the_first_whole_event_is_a_499(raw_backend_factory, router_factory):
    """The headers went out with half an event; the client leaves while the backend is silent: a client
    disconnect (499, counted), and the backend's exchange not ok. mutmut: __init__ `delivered = True` (the
    leaving client then counted as a 200)."""
    async def half_then_hold(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(b'data: {"id":')
        await asyncio.Event().wait()

    b = await raw_backend_factory({CHAT: half_then_hold})
    router = await router_factory([b.url], [], **{**SETTINGS, "idle_timeout": 60.0})
    seam = Seam(router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(router.url + CHAT, json=STREAM) as r:
            assert r.status == 200
            r.close()
    await poll(lambda: router.metric("router_client_disconnects_total", pool="speculative") == 1, 10)
    assert router.metric("router_requests_total", pool="speculative", backend=b.url, code="499") == 1
    (obs,) = seam.done
    assert obs.ok is False


async def test_a_retry_that_runs_out_of_time_waiting_for_a_place_is_a_clean_504(raw_backend_factory,
                                                                               router_factory):
    """One place per backend; `busy` streams to a first client and holds its place. A second request goes to
    the idle `resets`, which closes before its headers; the retry to `busy` waits for a place until the first-byte
    deadline: a clean 504, and every place is given back once. mutmut: give_slot `slot = ""` (the retry's
    given-back place handed back again at the end: a KeyError instead of the 504)."""
    async def stream_and_hold(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(sse_body(event("a")))
        await asyncio.Event().wait()

    async def reset(c: Conn) -> None:
        c.reset()

    busy = await raw_backend_factory({CHAT: stream_and_hold})
    resets = await raw_backend_factory({CHAT: reset})
    router = await router_factory([busy.url, resets.url], [], **{
        **SETTINGS, "retries": 1, "max_connections_per_backend": 1, "first_byte_timeout": 1.0,
        "idle_timeout": 60.0})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        first = await s.post(router.url + CHAT, json=STREAM, headers={"X-Router-Pool": "speculative"})
        if first.headers["X-Router-Backend"] != busy.url:  # it went to `resets` first and was retried: fine too
            assert resets.chat_hits() == 1
        assert first.status == 200 and busy.chat_hits() == 1
        tried = resets.chat_hits()
        async with s.post(router.url + CHAT, json=BODY) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (504, "upstream_timeout")
            assert r.headers["X-Router-Backend"] == busy.url
        assert resets.chat_hits() == tried + 1 and busy.chat_hits() == 1
        first.close()
    await router.wait_idle()


async def test_running_out_of_time_waiting_for_the_first_place_is_a_clean_504(raw_backend_factory, router_factory):
    """One place, held by a stream; a second request waits for it until the first-byte deadline: a clean 504,
    and no place is given back that was never taken. mutmut: __init__ `slot = ""` (a place given back for ""
    at the end: a KeyError instead of the 504)."""
    async def stream_and_hold(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(sse_body(event("a")))
        await asyncio.Event().wait()

    b = await raw_backend_factory({CHAT: stream_and_hold})
    router = await router_factory([b.url], [], **{**SETTINGS, "max_connections_per_backend": 1,
                                                  "first_byte_timeout": 1.0, "idle_timeout": 60.0})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        first = await s.post(router.url + CHAT, json=STREAM)
        assert first.status == 200
        async with s.post(router.url + CHAT, json=BODY) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (504, "upstream_timeout")
        assert b.chat_hits() == 1
        first.close()
    await router.wait_idle()


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_each_prefix_placement_is_counted_with_its_prompt_and_expected_cached_tokens(raw_backend_factory,
                                                                                          router_factory, path):
    """Prefix routing on (the default), a prompt of some 500 bytes in 64-byte blocks, twice: each placement counted
    once under its pool and reason, the router's prompt-token estimate and the expected cached tokens (none the
    first time, the whole prefix the second) added as the affinity computed them; a prompt too short to hash is
    counted as a decision only. The prompt is read from `messages` (chat) or `prompt` (completions) in blocks of
    prefix_block_bytes. mutmut: proxy's prompt None (or the ternary forced off), prompt_of without messages /
    prompt / the block setting, place() without the prompt, `placement is None`, prefix_decisions with no pool
    or reason, the prompt-token and expected-cached increments."""
    b = await raw_backend_factory({path: json_answer(200, {"id": "r", "choices": []})})
    router = await router_factory([b.url], [], **{**SETTINGS, "prefix_block_bytes": 64})
    pools = router.state.pools
    placements = []
    place = pools.place

    def recording(pinned=None, prompt=None):
        got = place(pinned, prompt)
        placements.append(got[2])
        return got

    pools.place = recording
    text = "the same long system prompt, " * 17
    body = {"model": "m", "max_tokens": 4, **({"messages": [{"role": "user", "content": text}]} if path == CHAT
                                               else {"prompt": text})}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(router.url + path, json=body) as r:
                assert r.status == 200
        async with s.post(router.url + path, json={**body, **({"messages": [{"role": "user", "content": "hi"}]}
                                                             if path == CHAT else {"prompt": "hi"})}) as r:
            assert r.status == 200
    first, second, short = placements
    assert first.prompt.hashed and short is not None and not short.prompt.hashed
    assert (first.reason, second.reason) == ("single", "single")
    assert first.prompt_tokens == second.prompt_tokens == int(first.prompt.nbytes / 4.0) > 0
    assert short.prompt_tokens == int(short.prompt.nbytes / 4.0) > 0  # not hashed, still an estimate of its size
    assert first.expected_cached == 0 < second.expected_cached
    m = router.metric
    assert m("router_prefix_decisions_total", pool="speculative", reason="single") == 2
    assert m("router_prefix_decisions_total", pool="speculative", reason=short.reason) == 1
    assert m("router_prefix_prompt_tokens_total", pool="speculative") == 2 * first.prompt_tokens
    assert m("router_prefix_expected_cached_tokens_total", pool="speculative") == second.expected_cached


async def test_a_stream_without_usage_counts_its_tokens_by_its_data_events(raw_backend_factory, router_factory):
    """An engine that sends no usage chunk (llama-cpp-python ignores stream_options) sends one token per event:
    four content events and [DONE] in ONE read are 1 chunk and 5 data events, 4 tokens; a "data:" inside the
    content (JSON escapes its newline) is not an event. The adaptive policy and the prefix costs learn from it."""
    events = [event("a"), event("b\ndata: c"), event("d"), event("e"), "[DONE]"]

    async def act(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(sse_body(*events))
        await c.write(b"0\r\n\r\n")

    spec = await raw_backend_factory({CHAT: act})
    base = await raw_backend_factory({CHAT: act})
    router = await router_factory([spec.url], [base.url], policy="adaptive", **SETTINGS)
    seam = Seam(router)
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=STREAM) as r:
        assert await r.read() == sse_body(*events)
    await poll(lambda: len(seam.done) == 1, 10)
    (obs,) = seam.done
    assert (obs.ok, obs.completion_tokens, obs.chunks, obs.data_events, obs.tokens()) == (True, None, 1, 5, 4)
    async with aiohttp.ClientSession() as s, s.get(router.url + "/router/state") as r:
        learned = (await r.json())["model"]
    # No usage, so no prompt_tokens: the prompt's size is the router's estimate from its bytes (a prompt shorter
    # than a prefix block included), and the prefill model learns from it (adaptive's prompt covariate). The
    # speed sample is in the model unmoved, kept for the rebuild once that covariate is measured
    # (router.tuning.Tuning.max_early).
    assert obs.prompt_tokens is None and learned["pools"][obs.pool]["prefill_samples"] == 1
    assert learned["samples_unmoved"] == 1 and learned["pools"][obs.pool]["samples"] == 1


def test_observation_tokens_prefers_the_usage_and_needs_a_stream_for_the_fallback():
    def obs(**kw) -> Observation:
        return Observation(**({"pool": "speculative", "url": "u", "inflight_at_start": 1, "inflight_at_end": 1,
                               "duration_s": 1.0, "ttft_s": 0.1, "completion_tokens": None, "chunks": 1,
                               "ok": True} | kw))

    assert obs(completion_tokens=7, data_events=3).tokens() == 7  # the usage wins
    assert obs(data_events=3).tokens() == 2  # [DONE] is not a token
    assert obs(data_events=1).tokens() is None  # [DONE] alone says nothing
    assert obs(ttft_s=None, data_events=3).tokens() is None  # not streamed: the body carried no usage
