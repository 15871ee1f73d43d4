"""The hot path's own guarantees: the lease follows the backend's work, write stalls end, and the fault fixes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket

import aiohttp
import openai

from router.pools import Backend
from tests.fixtures_router import CHAT_BODY, poll, sim_stats, wait_stat

LONG_STREAM = {"model": "m", "messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 20000,
               "ignore_eos": True, "stream": True}


@contextlib.asynccontextmanager
async def stalled_reader(router_url: str, body: dict):
    """A raw-socket client that sends one streamed request, reads the first bytes, then stops reading."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    try:
        # A small receive window, so the router's writes back up quickly.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        host, port = router_url.removeprefix("http://").rsplit(":", 1)
        await loop.sock_connect(sock, (host, int(port)))
        data = json.dumps(body).encode()
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: "
                                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        head = await asyncio.wait_for(loop.sock_recv(sock, 1024), 10)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        yield sock
    finally:
        sock.close()


async def read_until_closed(sock: socket.socket, within: float) -> int:
    """Read what is left until the router closes the connection; returns the bytes read."""
    loop = asyncio.get_running_loop()
    n = 0
    async with asyncio.timeout(within):
        while True:
            try:
                got = await loop.sock_recv(sock, 1 << 16)
            except ConnectionResetError:
                return n
            if not got:
                return n
            n += len(got)


async def test_slow_reader_lease_ends_with_the_backend_and_its_connection_after_write_timeout(
        sim_factory, router_factory):
    """Regression (issue 11): a client that stopped reading kept its in-flight count until it closed the socket,
    and writes to it had no deadline. Before the fix the in-flight count stayed 1 and the connection stayed open.
    """
    sim = await sim_factory("baseline-tp8", speedup=1000.0)
    router = await router_factory(baseline=[sim.url], write_timeout=1.0, idle_timeout=30.0,
                                  write_buffer_bytes=64 * 1024 * 1024)
    async with stalled_reader(router.url, LONG_STREAM) as sock:
        # The backend finishes its 20,000 tokens while the client reads nothing more ...
        assert await wait_stat(sim.url, "completed_total", 1, within=30) == 1
        # ... and the lease went with it.
        assert await router.wait_idle(within=5) == {sim.url: 0}
        # Nothing else is disturbed: another request is served in full meanwhile.
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        async with client:
            resp = await client.chat.completions.create(model="m", messages=CHAT_BODY["messages"], max_tokens=8)
        assert resp.choices[0].message.content
        # The stalled connection is closed (within write_timeout .. 1.5 x of its last progress) and counted
        # as a disconnect, while the client still reads nothing; what it reads then ends with the close.
        assert await poll(lambda: router.metric("router_client_disconnects_total", pool="baseline") == 1, 10)
        await read_until_closed(sock, within=20)
    assert router.metric("router_requests_total", pool="baseline", backend=sim.url, code="499") == 1
    assert router.metric("router_requests_total", pool="baseline", backend=sim.url, code="200") == 1


# ---------------------------------------------------------------- faults (issue 11), each a regression test

def test_release_below_zero_is_loud(caplog):
    """Regression (issue 11): _release clamped at 0 and so hid any accounting bug. Now a count below 0 is logged
    as an error (the router_factory fixture fails any test that logs it). Before the fix nothing was logged."""
    b = Backend("http://127.0.0.1:1", "baseline")
    b.lease()
    b._release()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    b._release()  # a release no lease accounts for
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "in-flight count of backend http://127.0.0.1:1 went below 0: a lease was released twice"]
    assert b.inflight == 0  # still routable, not idle-looking for ever


async def test_shutdown_cut_with_a_pending_client_disconnect_is_a_disconnect(sim_factory, router_factory):
    """Regression (issue 11): with the drain's cut and a client disconnect pending together, absorb_cut took back
    both cancellations and the handler answered a 503 after the stream's headers went out. Before the fix this
    request was counted as a 503 and not as a disconnect."""
    sim = await sim_factory("baseline-tp8", speedup=5.0)
    router = await router_factory(baseline=[sim.url])
    st = router.state
    async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/chat/completions", json={
            **CHAT_BODY, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        (ex,) = st.exchanges
        ex.task.cancel()  # what aiohttp does when the client's connection drops
        ex.cut_now()  # the drain time ran out at the same moment
        await router.wait_idle()
        assert await poll(lambda: router.metric("router_client_disconnects_total", pool="baseline") == 1)
    assert router.metric("router_requests_total", pool="baseline", backend=sim.url, code="499") == 1
    assert router.metric("router_requests_total", pool="baseline", backend=sim.url, code="503") == 0


@contextlib.asynccontextmanager
async def headers_then_close_backend():
    """A backend that is healthy, answers a generation with 200 and SSE headers, then closes with no chunk."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            if length:
                await reader.readexactly(int(length.group(1)))
            if head.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_disconnect_after_headers_before_the_first_chunk_is_retried(sim_factory, router_factory):
    """Regression (issue 11): a backend closing the connection after its response headers but before the first
    chunk was not retried, though the client had received nothing. Before the fix the client got a 502."""
    good = await sim_factory("baseline-tp8", speedup=50.0)
    async with headers_then_close_backend() as bad:
        # spillover sends below-threshold traffic to the speculative pool first: the bad backend.
        router = await router_factory(speculative=[bad], baseline=[good.url], retries=1)
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        async with client:
            stream = await client.chat.completions.create(model="m", messages=CHAT_BODY["messages"], max_tokens=6,
                                                          stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text
        assert router.metric("router_upstream_errors_total", backend=bad, kind="disconnect") == 1
        assert router.metric("router_retries_total", pool="baseline") == 1
        assert router.metric("router_requests_total", pool="baseline", backend=good.url, code="200") == 1
        assert await router.wait_idle() == {bad: 0, good.url: 0}


async def test_per_backend_connection_limit_makes_requests_wait_visibly(sim_factory, router_factory):
    """Regression (issue 11): there was only a global upstream limit, and requests over it waited unseen inside
    aiohttp. Now max_connections_per_backend bounds each backend and the wait is exported. Before the fix the
    setting did not exist and both requests ran on the backend at once."""
    sim = await sim_factory("baseline-tp8", speedup=10.0)
    router = await router_factory(baseline=[sim.url], max_connections_per_backend=1)
    body = {**CHAT_BODY, "max_tokens": 60, "ignore_eos": True}

    async def one() -> int:
        async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status

    tasks = [asyncio.create_task(one()) for _ in range(2)]
    waiting = ("router_upstream_waiting_requests", {"pool": "baseline", "backend": sim.url})
    assert await poll(lambda: router.metric(waiting[0], **waiting[1]) == 1, 10)
    assert (await sim_stats(sim.url))["running"] + (await sim_stats(sim.url))["queued"] <= 1
    assert await asyncio.gather(*tasks) == [200, 200]
    assert router.metric(waiting[0], **waiting[1]) == 0
    assert router.metric("router_upstream_wait_seconds_count", pool="baseline") == 1
    assert (await sim_stats(sim.url))["requests_total"] == 2
