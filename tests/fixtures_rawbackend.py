"""A hand-written HTTP/1.1 backend on 127.0.0.1 port 0 that misbehaves on purpose, for black-box router tests.

The simulator always writes whole SSE events and well-formed answers; this backend can split a stream into
1- or 7-byte pieces, end it without the final blank line, close or reset the connection after its headers,
hang, answer 5xx, refuse connections, or stop completing TCP handshakes (a full accept backlog), so every
failure branch of the router's hot path can be driven from outside. Each path's behaviour is an `Action`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

__all__ = ["Conn", "RawBackend", "RawRequest", "headers_then", "hang", "json_answer", "raw_backend_factory",
           "reset_before_headers", "sse", "sse_body"]


@dataclass
class RawRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Conn:
    """One accepted connection and the request read from it; actions write to it however they like."""

    request: RawRequest
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def write_chunked(self, data: bytes, piece: int | None = None, pause: float = 0.002) -> None:
        """`data` as HTTP chunks of `piece` bytes each, with a pause so each piece is a separate read."""
        step = piece or max(1, len(data))
        for i in range(0, len(data), step):
            part = data[i:i + step]
            await self.write(b"%x\r\n%s\r\n" % (len(part), part))
            if piece:
                await asyncio.sleep(pause)

    def reset(self) -> None:
        """Close with a TCP RST (SO_LINGER 0) instead of a FIN."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


Action = Callable[[Conn], Awaitable[None]]


def _head(status: int, ctype: str, *, length: int | None = None, chunked: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}", "Connection: close"]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_answer(status: int = 200, body: bytes | dict | list = b"{}", ctype: str = "application/json") -> Action:
    """A complete answer with a Content-Length."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def act(c: Conn) -> None:
        await c.write(_head(status, ctype, length=len(raw)) + raw)
    return act


def sse(body: bytes, piece: int | None = None) -> Action:
    """A 200 event stream (chunked, as uvicorn sends it) carrying exactly `body`, in `piece`-byte reads."""
    async def act(c: Conn) -> None:
        await c.write(_head(200, "text/event-stream", chunked=True))
        await c.write_chunked(body, piece)
        await c.write(b"0\r\n\r\n")
    return act


def sse_body(*events: dict | str, final_blank_line: bool = True) -> bytes:
    """`data: ...` events (dicts as compact JSON), each ended by a blank line except, optionally, the last."""
    parts = [b"data: " + (json.dumps(e, separators=(",", ":")).encode() if isinstance(e, dict) else e.encode())
             for e in events]
    out = b"\n\n".join(parts)
    return out + b"\n\n" if final_blank_line else out


def headers_then(end: str, *, stream: bool) -> Action:
    """200 headers, then the connection ends (`close`: FIN, `reset`: RST) before the first body byte."""
    async def act(c: Conn) -> None:
        if stream:
            await c.write(_head(200, "text/event-stream", chunked=True))
        else:
            await c.write(_head(200, "application/json", length=200))
        await asyncio.sleep(0.05)  # headers first, on their own: the router must have them before the end
        if end == "reset":
            c.reset()
        else:
            c.writer.close()
    return act


def reset_before_headers() -> Action:
    async def act(c: Conn) -> None:
        c.reset()
    return act


def hang() -> Action:
    """Read the request and never answer (until the backend is closed)."""
    async def act(c: Conn) -> None:
        await asyncio.Event().wait()
    return act


CHAT_EVENTS = sse_body(
    {"id": "r", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]},
    {"id": "r", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    "[DONE]")


@dataclass
class RawBackend:
    """Routes map a path to an Action; `hits` counts requests per path, `requests` keeps them in order."""

    routes: dict[str, Action] = field(default_factory=dict)
    hits: Counter = field(default_factory=Counter)
    requests: list[RawRequest] = field(default_factory=list)
    port: int = 0
    _server: asyncio.base_events.Server | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _blackhole: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        defaults = {"/health": json_answer(200, b"{}"),
                    "/v1/models": json_answer(200, {"object": "list", "data": [{"id": "raw", "object": "model"}]}),
                    "/v1/chat/completions": sse(CHAT_EVENTS),
                    "/v1/completions": json_answer(200, {"choices": [{"text": "hi"}]})}
        self.routes = {**defaults, **self.routes}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat_hits(self) -> int:
        return self.hits["/v1/chat/completions"] + self.hits["/v1/completions"]

    async def start(self, port: int = 0) -> RawBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        self._writers.add(writer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each piece leaves on its own
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *rest = head.decode("latin-1").split("\r\n")
            method, target, _ = line.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            path = target.split("?", 1)[0]
            req = RawRequest(method, path, headers, body)
            self.hits[path] += 1
            self.requests.append(req)
            action = self.routes.get(path, json_answer(404, {"error": "not found"}))
            await action(Conn(req, reader, writer))
            if not writer.is_closing():
                writer.close()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            writer.transport.abort()
        except asyncio.CancelledError:
            # close() cancels hanging actions; ending normally keeps asyncio's stream callback from logging it.
            writer.transport.abort()
        finally:
            self._writers.discard(writer)
            self._tasks.discard(asyncio.current_task())

    async def stop_listening(self) -> None:
        """From now on connections to the port are refused (accepted ones carry on)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def blackhole(self) -> None:
        """From now on a connection attempt to the port never completes (its accept backlog is full)."""
        await self.stop_listening()
        lsock = socket.socket()
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("127.0.0.1", self.port))
        lsock.listen(0)  # one queued connection fills it; later SYNs are dropped by the kernel
        self._blackhole.append(lsock)
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            self._blackhole.append(filler)
        await asyncio.sleep(0.05)
        probe = socket.socket()
        probe.setblocking(False)
        try:
            probe.connect_ex(("127.0.0.1", self.port))
            _, writable = await _wait_writable(probe, 0.3)
            assert not writable, "the kernel completed a handshake on a full backlog; cannot make a blackhole"
        finally:
            probe.close()

    async def close(self) -> None:
        await self.stop_listening()
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        for s in self._blackhole:
            s.close()
        self._blackhole.clear()


async def _wait_writable(sock: socket.socket, within: float) -> tuple[socket.socket, bool]:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: fut.done() or fut.set_result(True))
    try:
        async with asyncio.timeout(within):
            await fut
        return sock, True
    except TimeoutError:
        return sock, False
    finally:
        loop.remove_writer(sock.fileno())


@pytest.fixture
async def raw_backend_factory():
    """`await raw_backend_factory(**{path: action}) -> RawBackend`, started on 127.0.0.1 port 0, closed at teardown."""
    made: list[RawBackend] = []

    async def make(routes: dict[str, Action] | None = None) -> RawBackend:
        b = RawBackend(routes=dict(routes or {}))
        made.append(b)
        return await b.start()

    yield make
    for b in made:
        await b.close()


def refused_url() -> str:
    """A loopback URL nothing listens on (the port was just free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
