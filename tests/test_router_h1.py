"""router.h1 (the upstream HTTP/1.1 client connection) and router.upstream's pools, from raw bytes."""
from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from router import upstream
from router.errors import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamLocalError,
    UpstreamTimeout,
)
from router.h1 import MAX_HEAD, Closed, Connection, ProtocolError, Response


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class Done:
    def __init__(self) -> None:
        self.calls: list[Connection | None] = []

    def __call__(self, conn: Connection | None) -> None:
        self.calls.append(conn)


def no_wait(waited: float | None) -> None:
    """Client.open's `placed`: nothing to record."""


def connection() -> tuple[Connection, FakeTransport]:
    conn = Connection(asyncio.get_running_loop())
    t = FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    return conn, t


def feed(conn: Connection, raw: bytes, piece: int) -> None:
    for i in range(0, len(raw), piece):
        conn.data_received(raw[i:i + piece])


async def exchange(conn: Connection, raw: bytes, piece: int) -> tuple[Response, bytes, Done]:
    done = Done()
    resp = Response(conn, done)
    conn.send(b"POST / HTTP/1.1\r\n\r\n", resp)
    feed(conn, raw, piece)
    await asyncio.wait_for(resp.wait_head(), 1)
    body = await asyncio.wait_for(resp.read(), 1)
    return resp, body, done


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"a\":1}\n\n\r\n"
           b"1D;name=value;x\r\ndata: {\"a\":2}\n\ndata: [DONE]\n\n\r\n"
           b"0\r\nX-Trailer: yes\r\nX-Other: 1\r\n\r\n")
CHUNKED_BODY = b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n"
LENGTH = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nContent-Type: application/json\r\n\r\n{\"ok\":true}"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + LENGTH


@pytest.mark.parametrize("raw, body, ctype", [
    (CHUNKED, CHUNKED_BODY, "text/event-stream"),  # extensions on a size line, trailers after the last chunk
    (LENGTH, b"{\"ok\":true}", "application/json"),
    (CONTINUE, b"{\"ok\":true}", "application/json"),  # interim 1xx answers are skipped
])
@pytest.mark.parametrize("piece", [1, 7, 10_000])
async def test_responses_split_anywhere_parse_the_same_and_the_connection_is_reused(raw, body, ctype, piece):
    conn, t = connection()
    for _ in range(2):
        resp, got, done = await exchange(conn, raw, piece)
        assert (resp.status, got, resp.content_type) == (200, body, ctype)
        assert resp.at_eof()
        resp.release()
        assert done.calls == [conn] and not t.closed  # a complete answer: back to the pool
    assert t.written.count(b"POST / HTTP/1.1") == 2


@pytest.mark.parametrize("piece", [1, 7])
async def test_body_until_close_ends_with_the_connection_and_is_not_reused(piece):
    conn, t = connection()
    done = Done()
    resp = Response(conn, done)
    conn.send(b"GET / HTTP/1.1\r\n\r\n", resp)
    feed(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", piece)
    await resp.wait_head()
    assert not resp.at_eof()
    conn.connection_lost(None)
    assert await resp.read() == b"all of it"
    resp.release()
    assert done.calls == [None] and conn.closed


@pytest.mark.parametrize("head", [b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
async def test_answers_without_a_body_end_at_their_head(head):
    conn, t = connection()
    resp, body, done = await exchange(conn, head, 3)
    assert body == b"" and resp.at_eof()
    resp.release()
    assert done.calls == [conn]


@pytest.mark.parametrize("head, reusable", [
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok-and-more", False),  # bytes past the end: never reuse
])
async def test_keep_alive_follows_version_and_connection_header(head, reusable):
    conn, t = connection()
    resp, body, done = await exchange(conn, head, 5)
    assert body == b"ok"
    resp.release()
    assert done.calls == [conn if reusable else None] and t.closed is not reusable


@pytest.mark.parametrize("raw, words", [
    (b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * MAX_HEAD + b"\r\n\r\n", "too large"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * (MAX_HEAD + 10), "too large"),  # no end of head in sight
    (b"SPDY/3 200 OK\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", "bad content-length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported transfer-encoding"),
    (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
])
@pytest.mark.parametrize("piece", [7, 100_000])
async def test_malformed_or_oversize_heads_fail_the_response_and_close(raw, words, piece):
    conn, t = connection()
    resp = Response(conn, Done())
    conn.send(b"x", resp)
    feed(conn, raw, piece)
    with pytest.raises(ProtocolError, match=words):
        await asyncio.wait_for(resp.wait_head(), 1)
    assert t.closed


@pytest.mark.parametrize("body, words", [(b"zz\r\nab\r\n", "bad chunk size"), (b"2\r\nabXX", "not followed by CRLF"),
                                         (b"1" * 9000, "too long")])
async def test_a_bad_chunk_fails_the_read_after_the_bytes_before_it(body, words):
    conn, t = connection()
    resp = Response(conn, Done())
    conn.send(b"x", resp)
    feed(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", 4)
    await resp.wait_head()
    assert await resp.read_chunk() == b"abc"
    conn.data_received(body)
    got = b""
    with pytest.raises(ProtocolError, match=words):
        while True:
            got += await resp.read_chunk()
    assert got in (b"", b"ab") and t.closed


async def test_a_connection_lost_mid_body_fails_the_read_and_drops_the_connection():
    conn, t = connection()
    done = Done()
    resp = Response(conn, done)
    conn.send(b"x", resp)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    await resp.wait_head()
    assert await resp.read_chunk() == b"abc"
    conn.connection_lost(ConnectionResetError())
    with pytest.raises(Closed):
        await resp.read_chunk()
    resp.release()
    assert done.calls == [None]


async def test_lost_before_the_head_fails_the_wait_and_close_is_reported_once():
    conn, t = connection()
    done = Done()
    resp = Response(conn, done)
    conn.send(b"x", resp)
    conn.connection_lost(None)
    with pytest.raises(Closed):
        await resp.wait_head()
    resp.close()
    resp.close()
    resp.release()
    assert done.calls == [None]


async def test_unread_bytes_past_the_high_water_pause_the_socket_until_read():
    conn, t = connection()
    resp = Response(conn, Done())
    conn.send(b"x", resp)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    await resp.wait_head()
    for _ in range(5):
        conn.data_received(b"a" * 100_000)
    assert t.paused
    assert len(await resp.read_chunk()) == 500_000
    assert not t.paused


async def test_set_exception_fails_the_next_read_after_the_buffered_bytes():
    conn, t = connection()
    resp = Response(conn, Done())
    conn.send(b"x", resp)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
    await resp.wait_head()
    reader = asyncio.ensure_future(resp.read_chunk())
    assert await reader == b"hi"
    reader = asyncio.ensure_future(resp.read_chunk())
    await asyncio.sleep(0)
    resp.set_exception(TimeoutError())  # the watchdog's idle deadline
    with pytest.raises(TimeoutError):
        await reader


async def test_bytes_nobody_asked_for_close_the_connection():
    conn, t = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\n")
    assert t.closed and conn.closed


# ---- the client over real sockets ----

async def _server(handler) -> tuple[asyncio.Server, str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _stop(client: upstream.Client, server: asyncio.Server) -> None:
    client.close()
    server.close()
    await asyncio.sleep(0.05)  # the handlers see the client's close and close their side


async def test_client_reuses_a_kept_alive_connection_and_sends_host_length_and_headers():
    seen: list[bytes] = []
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(head + await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    server, url = await _server(handler)
    client = upstream.Client(1.0, 10, 10)
    try:
        for _ in range(3):
            resp = await client.open(url + "/base", "/v1/x", b"{}", {"Content-Type": "application/json",
                                                                     "Evil": "a\r\nInjected: 1"}, no_wait)
            assert (resp.status, await resp.read_body()) == (200, b"ok")
            resp.end()
        assert accepted == 1 and len(seen) == 3
        host = url.removeprefix("http://").encode()
        assert seen[0] == (b"POST /base/v1/x HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 2\r\n"
                           b"Content-Type: application/json\r\n\r\n{}")
    finally:
        await _stop(client, server)


async def test_client_retries_once_on_a_fresh_connection_when_a_kept_alive_one_was_closed():
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if accepted == 1:
            await reader.readuntil(b"\r\n\r\n")  # the second request on this connection: closed unanswered

    server, url = await _server(handler)
    client = upstream.Client(1.0, 10, 10)
    try:
        for _ in range(2):
            status, body = await asyncio.wait_for(upstream.get(client, url, "/", None), 5)
            assert (status, body) == (200, b"ok")
        assert accepted == 2
    finally:
        await _stop(client, server)


async def test_client_without_keep_alive_opens_a_connection_per_request():
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()

    server, url = await _server(handler)
    client = upstream.Client(1.0, 10, 10, keep_alive=False)
    try:
        for _ in range(3):
            assert await upstream.get(client, url, "/health", None) == (200, b"")
        assert accepted == 3
    finally:
        await _stop(client, server)


async def test_client_limits_open_requests_across_backends():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    server, url = await _server(handler)
    client = upstream.Client(1.0, 1, 10)
    try:
        first = await client.request("GET", url, "/", None, None)
        second = asyncio.ensure_future(client.request("GET", url, "/", None, None))
        await asyncio.sleep(0.1)
        assert not second.done()  # waits for the first one's place
        first.close()
        (await asyncio.wait_for(second, 2)).close()
    finally:
        await _stop(client, server)


async def test_a_refused_connect_is_a_retryable_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = upstream.Client(1.0, 10, 10)
    with pytest.raises(UpstreamConnectError) as info:
        await client.open(refused, "/", b"", {}, no_wait)
    assert info.value.retryable and info.value.kind == "connect"


_KEY = "http://b:1"


@pytest.mark.parametrize("exc, phase, got_headers, cls, kind, retryable", [
    (upstream.ConnectTimeout(), upstream.FIRST_BYTE, False, UpstreamTimeout, "connect_timeout", True),
    (TimeoutError(), upstream.FIRST_BYTE, False, UpstreamTimeout, "first_byte_timeout", False),
    (TimeoutError(), upstream.IDLE, True, UpstreamTimeout, "idle_timeout", False),
    (upstream.ConnectFailed(OSError(errno.EMFILE, "Too many open files")), upstream.FIRST_BYTE, False,
     UpstreamLocalError, "local", True),
    (upstream.ConnectFailed(socket.gaierror(-3, "Temporary failure in name resolution")), upstream.FIRST_BYTE,
     False, UpstreamLocalError, "local", True),
    (upstream.ConnectFailed(ConnectionRefusedError(errno.ECONNREFUSED, "refused")), upstream.FIRST_BYTE, False,
     UpstreamConnectError, "connect", True),
    (Closed("gone"), upstream.FIRST_BYTE, False, UpstreamDisconnected, "disconnect", True),
    (Closed("gone"), upstream.IDLE, True, UpstreamDisconnected, "disconnect", False),
    (ProtocolError("bad chunk"), upstream.IDLE, True, UpstreamDisconnected, "disconnect", False),
    (ProtocolError("bad status line"), upstream.FIRST_BYTE, False, UpstreamError, None, False),
])
def test_map_error_table(exc, phase, got_headers, cls, kind, retryable):
    err = upstream.map_error(exc, _KEY, phase, got_headers=got_headers)
    assert type(err) is cls and err.retryable is retryable
    if kind is not None:
        assert err.kind == kind


async def test_gate_hands_a_freed_place_to_the_oldest_waiter_and_a_cancelled_waiter_passes_it_on():
    gate = upstream.Gate(1)
    assert gate.try_take() and not gate.try_take()
    first = asyncio.ensure_future(gate.take())
    second = asyncio.ensure_future(gate.take())
    await asyncio.sleep(0)
    gate.give()  # to `first`, which is cancelled before it runs: the place must reach `second`
    first.cancel()
    await asyncio.wait_for(second, 1)
    assert first.cancelled() and gate.free == 0
    gate.give()
    assert gate.free == 1 and gate.try_take()


async def test_the_pool_hands_out_the_newest_connection_and_drops_expired_ones():
    ep = upstream.Endpoint("http://127.0.0.1:1", None, max_idle=2)
    conns = [connection() for _ in range(4)]
    for conn, _ in conns[:2]:
        ep.put(conn)
    conns[0][0].idle_since -= upstream.KEEPALIVE_S  # the oldest has been idle too long
    ep.put(conns[2][0])  # drops the expired oldest, keeps the other two
    assert list(ep.idle) == [conns[1][0], conns[2][0]] and conns[0][1].closed
    ep.put(conns[3][0])  # full (max_idle 2): closed, not kept
    assert conns[3][1].closed and len(ep.idle) == 2
    now = upstream.time.monotonic()
    assert ep.take(now) is conns[2][0]  # newest first
    conns[1][0].connection_lost(None)  # the backend closed it while idle
    assert ep.take(now) is None and not ep.idle
