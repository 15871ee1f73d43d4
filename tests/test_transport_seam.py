"""The transport's guarantees that are each a leak or a stall when broken, seen through a running router with real
sockets: connection places given back (a retry, a failure), connections kept alive only when they can be trusted
(complete, not expired, no resend after response bytes), backpressure from a slow client to the backend, and a
stream that keeps talking never cut by idle_timeout. Assertions read counters and state, never durations.

Each docstring names the line that was broken on purpose to see the test fail.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from router import exchange, h1, upstream
from tests.fixtures_rawbackend import Conn, json_answer, reset_before_headers, sse_body
from tests.fixtures_router import poll
from tests.test_router_hotpath import stalled_reader

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**BODY, "stream": True}
# One probe round, long deadlines where nothing should time out: each request here is one attempt's story.
# No ejection: a backend failing on purpose stays where the test put it.
SETTINGS = {"health_interval": 60.0, "health_timeout": 10.0, "first_byte_timeout": 5.0, "connect_timeout": 5.0,
            "retries": 0, "eject_consecutive_errors": 0}
EVENT = {"id": "r", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
ANSWER = json.dumps({"id": "r", "choices": [{"index": 0, "message": {"content": "hi"}}]}).encode()


async def post(url: str, body: dict, pool: str | None = None) -> tuple[int, bytes]:
    headers = {"X-Router-Pool": pool} if pool else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.post(url + CHAT, json=body, headers=headers) as r:
        return r.status, await r.read()


def kept_json(body: bytes = ANSWER) -> bytes:
    """A complete answer that lets the connection live on (no Connection: close)."""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


def kept_stream(body: bytes) -> bytes:
    """A complete chunked event stream that lets the connection live on."""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))


class KeepAlive:
    """An action that serves every request of its connection in turn (HTTP/1.1 keep-alive): `answer(c, n)` writes
    the n-th answer (n counts over all connections) and says whether the connection lives on. Counts the
    connections opened, the requests served and the connections the router closed."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = self.requests = self.ended = 0

    async def __call__(self, c: Conn) -> None:
        self.connections += 1
        while True:
            self.requests += 1
            if not await self.answer(c, self.requests):
                return
            try:
                head = await c.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self.ended += 1  # the router closed its side
                return
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await c.reader.readexactly(length)


def writes(*raws: bytes):
    """KeepAlive's answer: the n-th request gets raws[n-1] (the last one for any later request), kept alive."""
    async def answer(c: Conn, n: int) -> bool:
        await c.write(raws[min(n, len(raws)) - 1])
        return True
    return answer


def places(router) -> dict[str, int]:
    """Free places under max_connections_per_backend, per backend."""
    return {url: gate.free for url, gate in router.state.limits.slots.items()}


# ---------------------------------------------------------------- (a), (g): places given back

def answers_503(c: Conn):
    return json_answer(503, {"error": {"message": "busy", "type": "x", "code": 503}})(c)


async def headers_then_close(c: Conn) -> None:
    await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n")
    await asyncio.sleep(0.05)
    c.writer.close()


def recorded(pools) -> list:
    """Every observation the pools are told of from now on, in order (Pools.report_done still runs)."""
    seen: list = []
    report_done = pools.report_done

    def recording(backend, obs, placement=None):
        seen.append(obs)
        report_done(backend, obs, placement)

    pools.report_done = recording
    return seen


@pytest.mark.parametrize("failing", [reset_before_headers(), answers_503, headers_then_close],
                         ids=["reset-before-headers", "503", "closed-after-headers"])
async def test_a_retry_gives_the_failed_backends_place_back(raw_backend_factory, router_factory, failing):
    """One place per backend. Each request fails on `bad` (before its headers, with a 503, or after its headers)
    and is served by `good` on retry; the place on `bad` comes back every time, so `bad` is tried, and fails,
    each time instead of leaving later requests waiting for a place it never gets back. Seen failing with
    Exchange._retry's `self.end_reply()` removed (the 503 and after-headers cases: the place and the connection
    stay with the abandoned answer for good), and with Client.open's `limits.give(url)` on a failure removed
    (the reset before the headers)."""
    bad = await raw_backend_factory({CHAT: failing})
    good = await raw_backend_factory({CHAT: json_answer(200, {"choices": []})})
    router = await router_factory([bad.url], [good.url], **{**SETTINGS, "retries": 1,
                                                            "max_connections_per_backend": 1})
    seen: list[dict[str, int]] = []
    retry = router.state.pools.acquire_retry

    def recording(failed, placement=None):
        got = retry(failed, placement)
        if got is not None:
            # Called while the failed attempt still holds everything: the place must come back right after.
            asyncio.get_running_loop().call_soon(lambda: seen.append(places(router)))
        return got

    router.state.pools.acquire_retry = recording
    for _ in range(3):
        assert (await post(router.url, BODY, "speculative"))[0] == 200
    await router.wait_idle()
    assert bad.chat_hits() == 3 and good.chat_hits() == 3
    assert places(router) == {bad.url: 1, good.url: 1}
    # While the retry ran on `good`, `bad`'s place was free already.
    assert [s[bad.url] for s in seen] == [1, 1, 1]


async def refused(b) -> None:
    await b.stop_listening()


@pytest.mark.parametrize("failing", ["refused", "reset-before-headers", "closed-after-headers", "garbage"])
async def test_a_failed_request_frees_its_place_under_max_connections(raw_backend_factory, router_factory,
                                                                     failing):
    """max_connections 1: three requests fail in a row (a refused connect, a reset before the headers, a close
    after them, a malformed answer), then the next one is served. Without the failed ones' places given back the
    fourth would wait for the only place until its first-byte deadline (a 504). Seen failing with
    Client.request's `self._slots.give()` on a failure (before the headers) removed."""
    async def garbage(c: Conn) -> None:
        await c.write(b"SPDY/9 what\r\n\r\n")
        await asyncio.sleep(0.5)

    actions = {"reset-before-headers": reset_before_headers(), "closed-after-headers": headers_then_close,
               "garbage": garbage}
    bad = await raw_backend_factory({CHAT: actions.get(failing, json_answer(200, {}))})
    good = await raw_backend_factory({CHAT: json_answer(200, {"choices": []})})
    router = await router_factory([bad.url], [good.url], **{**SETTINGS, "max_connections": 1,
                                                            "first_byte_timeout": 3.0})
    if failing == "refused":
        await refused(bad)
    for _ in range(3):
        assert (await post(router.url, BODY, "speculative"))[0] == 502
    assert (await post(router.url, BODY, "baseline"))[0] == 200
    await router.wait_idle()
    assert router.state.client._slots.free == 1


# ---------------------------------------------------------------- (b), (e), (f): which connections are reused

@pytest.mark.parametrize("stream", [False, True])
async def test_a_complete_answer_keeps_its_connection_for_the_next_request(raw_backend_factory, router_factory,
                                                                         stream):
    """Three requests in a row, each answered completely on a kept-alive connection: one connection carries all
    three. Seen failing with Reply.end always closing (`resp.close()` for a complete answer too): three
    connections."""
    events = sse_body(EVENT, "[DONE]")
    backend = KeepAlive(writes(kept_stream(events) if stream else kept_json()))
    b = await raw_backend_factory({CHAT: backend})
    router = await router_factory([b.url], [], **SETTINGS)
    for _ in range(3):
        assert await post(router.url, STREAM if stream else BODY) == (200, events if stream else ANSWER)
    await router.wait_idle()
    assert (backend.connections, backend.requests, backend.ended) == (1, 3, 0)


async def test_no_request_is_resent_once_the_reused_connection_returned_response_bytes(raw_backend_factory,
                                                                                     router_factory):
    """The second request goes out on the kept-alive connection, which answers half a status line and closes. The
    backend may have run it: it is not sent again on a new connection, the client gets a 502. (A kept-alive
    connection closed before any byte of the answer is resent: the backend never saw the request.) Seen failing
    with Client.request's `if fresh or conn.got_bytes` reduced to `if fresh`: a second connection, a 200."""
    async def answer(c: Conn, n: int) -> bool:
        if n == 2:
            await c.write(b"HTTP/1.1 200 O")
            c.writer.close()
            return False
        await c.write(kept_json())
        return True

    backend = KeepAlive(answer)
    b = await raw_backend_factory({CHAT: backend})
    router = await router_factory([b.url], [], **SETTINGS)
    assert await post(router.url, BODY) == (200, ANSWER)
    status, raw = await post(router.url, BODY)
    assert status == 502 and json.loads(raw)["error"]["code"] == "backend_disconnected"
    assert (backend.connections, backend.requests) == (1, 2)


async def test_an_expired_kept_alive_connection_is_never_reused(raw_backend_factory, router_factory):
    """After a complete answer the connection waits in the pool; once it has waited KEEPALIVE_S (backdated here,
    not slept) the next request opens a new connection and the expired one is closed, never sent on (a server
    closing it at the same moment would fail the request for nothing). Seen failing with Endpoint.take's
    `now - conn.idle_since < KEEPALIVE_S` test removed: one connection."""
    backend = KeepAlive(writes(kept_json()))
    b = await raw_backend_factory({CHAT: backend})
    router = await router_factory([b.url], [], **SETTINGS)
    assert await post(router.url, BODY) == (200, ANSWER)
    (conn,) = router.state.client.endpoint(b.url).idle
    conn.idle_since -= upstream.KEEPALIVE_S
    assert await post(router.url, BODY) == (200, ANSWER)
    assert (backend.connections, backend.requests) == (2, 2)
    await poll(lambda: backend.ended == 1, 5)  # the expired one was closed by the router
    assert conn.closed and list(router.state.client.endpoint(b.url).idle) != [conn]


# ---------------------------------------------------------------- (c), (d): a stream's pace

SOCKET_READ = 256 * 1024  # the most asyncio's socket transport reads at once
STILL_POLLS = 10  # polls in a row without progress that make a stalled backend (0.5 s at 0.05 s each)

async def test_a_slow_client_backpressures_the_backend_stream(raw_backend_factory, router_factory):
    """The backend has 256 MiB of events to send; the client reads its first bytes, then nothing. The router holds
    at most write_buffer_bytes for the client plus router.h1's HIGH_WATER unread from the backend, then stops
    reading the backend: the backend's own send buffer fills and it stays blocked, far from done. Seen failing
    with Exchange.stream's `await writer.drain()` (over write_buffer_bytes) removed: the router reads all 256 MiB
    into memory and the backend finishes."""
    total = 256 * 1024 * 1024
    event = b"data: " + json.dumps({**EVENT, "pad": "x" * 16_000}).encode() + b"\n\n"
    sent = {"bytes": 0, "done": False}
    backend_writer: list[asyncio.StreamWriter] = []

    async def flood(c: Conn) -> None:
        backend_writer.append(c.writer)
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        while sent["bytes"] < total:
            await c.write(b"%x\r\n%s\r\n" % (len(event), event))
            sent["bytes"] += len(event)
        await c.write(b"0\r\n\r\n")
        sent["done"] = True

    b = await raw_backend_factory({CHAT: flood})
    cap = 256 * 1024
    router = await router_factory([b.url], [], **{**SETTINGS, "write_buffer_bytes": cap, "write_timeout": 60.0,
                                                  "idle_timeout": 60.0})
    still = {"last": -1, "polls": 0}

    def stalled() -> bool:
        """The backend made no progress over the last STILL_POLLS polls."""
        still["polls"] = still["polls"] + 1 if sent["bytes"] == still["last"] else 0
        still["last"] = sent["bytes"]
        return still["polls"] >= STILL_POLLS

    async with stalled_reader(router.url, {**STREAM, "max_tokens": 100_000}):
        # The kernel's socket buffers (router to client, backend to router) fill first: some MiB on loopback.
        await poll(stalled, 30, lambda: sent, every=0.05)
        (ex,) = router.state.exchanges
        assert not sent["done"] and sent["bytes"] < total // 4
        assert backend_writer[0].transport.get_write_buffer_size() > 0  # the backend waits for the router
        # What the router itself holds, its write buffer to the client and the backend's unread bytes, is bounded:
        # it stops reading once HIGH_WATER bytes wait unread (one socket read more at most), and writes one read's
        # events before it waits for the client below write_buffer_bytes.
        one_read = h1.HIGH_WATER + SOCKET_READ
        assert ex.upstream._resp._size <= one_read
        assert ex.request.transport.get_write_buffer_size() <= cap + one_read


async def test_a_stream_that_keeps_talking_is_not_cut_by_idle_timeout(raw_backend_factory, router_factory):
    """idle_timeout 1 s; the backend sends an event every 0.1 s for 2.5 s in all: every event reaches the client
    and no idle timeout is counted, the idle deadline being measured from the latest chunk, not from the
    stream's start. Seen failing with Exchange.stream's `dog.last_chunk = time.monotonic()` removed: the
    stream is cut after 1 s with the in-band timeout."""
    n = 25

    async def steady(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(n):
            await c.write_chunked(sse_body(EVENT))
            await asyncio.sleep(0.1)
        await c.write_chunked(sse_body("[DONE]"))
        await c.write(b"0\r\n\r\n")

    b = await raw_backend_factory({CHAT: steady})
    router = await router_factory([b.url], [], **{**SETTINGS, "idle_timeout": 1.0})
    status, raw = await post(router.url, STREAM)
    assert (status, raw) == (200, sse_body(*[EVENT] * n, "[DONE]"))
    assert router.metric("router_upstream_errors_total", backend=b.url, kind="idle_timeout") == 0


# ---------------------------------------------------------------- each request ends once

async def test_each_request_is_counted_and_reported_once_whatever_ended_it(raw_backend_factory, router_factory,
                                                                          monkeypatch):
    """Five requests, each ended differently: the router's own 504 (no first byte in time), a reset before the
    headers, a close after them, a malformed answer, and a 200. Each is counted once in router_requests_total
    under the status the client got and once in the duration histogram, and each lease ends with exactly one
    observation through the learning seam (ok only for the 200), though finish() runs twice here. Seen failing
    with Exchange.finish's `if self not in exchanges: return` guard removed (each counted twice). mutmut: finish's
    guard inverted."""
    async def nth(c: Conn) -> None:
        n = b.chat_hits()
        if n == 1:
            await asyncio.Event().wait()  # silent: the first-byte deadline answers
        elif n == 2:
            c.reset()
        elif n == 3:
            await headers_then_close(c)
        elif n == 4:
            await c.write(b"SPDY/9 what\r\n\r\n")
        else:
            await json_answer(200, {"choices": []})(c)

    b = await raw_backend_factory({CHAT: nth})
    router = await router_factory([b.url], [], **{**SETTINGS, "first_byte_timeout": 1.0})
    finish = exchange.Exchange.finish

    def twice(ex) -> None:
        finish(ex)
        finish(ex)

    monkeypatch.setattr(exchange.Exchange, "finish", twice)
    pools = router.state.pools
    seen: list[bool] = []
    report_done = pools.report_done

    def recording(backend, obs, placement=None):
        seen.append(obs.ok)
        report_done(backend, obs, placement)

    pools.report_done = recording
    statuses = [(await post(router.url, BODY))[0] for _ in range(5)]
    assert statuses == [504, 502, 502, 502, 200]
    await router.wait_idle()
    counted = {code: router.metric("router_requests_total", pool="speculative", backend=b.url, code=code)
               for code in ("504", "502", "200")}
    assert counted == {"504": 1, "502": 3, "200": 1}
    assert router.metric("router_request_duration_seconds_count", pool="speculative") == 5
    assert seen == [False, False, False, False, True]


async def test_a_stream_runs_from_its_first_token_not_from_its_sending(raw_backend_factory, router_factory):
    """Stream A runs; stream B is sent to the same backend, which holds it until A has ended (one place on the
    backend, in effect). What B reports with its first token: nothing ran beside it then, and it waited for A's
    release. Counted from its sending instead (as a request not streamed is), it would report A beside it and no
    wait. Seen failing with Exchange.placed's `if not self.streamed` forced true (`self.streamed = None`)."""
    a_may_end, b_may_answer = asyncio.Event(), asyncio.Event()
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"

    async def act(c: Conn) -> None:
        if b.chat_hits() == 1:
            await c.write(head)
            await c.write_chunked(sse_body(EVENT))
            await a_may_end.wait()
        else:
            await b_may_answer.wait()
            await c.write(head)
            await c.write_chunked(sse_body(EVENT))
        await c.write_chunked(sse_body("[DONE]"))
        await c.write(b"0\r\n\r\n")

    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **SETTINGS)
    pools = router.state.pools
    seen = recorded(pools)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(router.url + CHAT, json=STREAM) as first:
            assert first.status == 200 and await first.content.readuntil(b"\n\n")
            second = asyncio.ensure_future(post(router.url, STREAM))
            await poll(lambda: b.chat_hits() == 2, 10)
            a_may_end.set()
            await first.read()
        await poll(lambda: router.inflight() == {b.url: 1}, 10)  # A's lease ended; B's holds
        b_may_answer.set()
        assert await second == (200, sse_body(EVENT, "[DONE]"))
    a, b_obs = seen
    assert (a.running_beside, b_obs.running_beside) == (0, 0)
    assert a.waited_s is None and b_obs.waited_s is not None and b_obs.waited_s > 0



async def test_a_request_not_streamed_runs_from_its_sending_and_reports_no_first_token_figures(
        raw_backend_factory, router_factory):
    """One place on the backend, held by stream A; request C (not streamed) waits for it, is sent once A has
    ended, and is answered whole. C counts as running from its sending (the backend shows no first token), and
    what ran beside it and its wait are first-token figures: a buffered answer reports neither. mutmut:
    end_upstream's `running_beside=... if (streamed) or True` and `waited_s=... if (streamed) or True` (C's
    lease then reports A's release as its wait and 0 beside)."""
    a_may_end = asyncio.Event()

    async def act(c: Conn) -> None:
        if c.request.body and b'"stream": true' in c.request.body:
            await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                          b"Connection: close\r\n\r\n")
            await c.write_chunked(sse_body(EVENT))
            await a_may_end.wait()
            await c.write_chunked(sse_body("[DONE]"))
            await c.write(b"0\r\n\r\n")
        else:
            await json_answer(200, {"choices": []})(c)

    b = await raw_backend_factory({CHAT: act})
    router = await router_factory([b.url], [], **{**SETTINGS, "max_connections_per_backend": 1})
    pools = router.state.pools
    seen = recorded(pools)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(router.url + CHAT, json=STREAM) as first:
            assert first.status == 200 and await first.content.readuntil(b"\n\n")
            second = asyncio.ensure_future(post(router.url, BODY))
            labels = {"pool": "speculative", "backend": b.url}
            await poll(lambda: router.metric("router_upstream_waiting_requests", **labels) == 1, 10)
            a_may_end.set()
            await first.read()
        assert (await second)[0] == 200
    a, c = seen
    assert (a.ttft_s is not None, a.running_beside) == (True, 0)
    assert (c.ttft_s, c.running_beside, c.waited_s) == (None, None, None)
