"""The hot path's own guarantees: the lease follows the backend's work, write stalls end, and the fault fixes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import openai

from tests.fixtures_router import CHAT_BODY, poll, wait_stat

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
