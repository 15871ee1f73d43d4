"""A minimal keep-alive HTTP/1.1 client on asyncio protocols: load without a client library's own cost."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

_HEAD, _LENGTH, _SIZE, _DATA, _DATA_END, _TRAILER, _UNTIL_CLOSE = range(7)


class HTTPFailure(Exception):
    """A response that was not a complete 2xx answer, or a connection that broke; one line."""


@dataclass
class Reply:
    status: int
    sent: float  # perf_counter() when the request was written
    first_body: float | None  # ... when the first body byte arrived
    end: float  # ... when the response was complete
    body_bytes: int
    events: int  # SSE events (blank-line separated) in the body


def request_bytes(url: str, path: str, body: bytes) -> bytes:
    host = urlsplit(url).netloc
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Connection(asyncio.Protocol):
    """One keep-alive connection; `await send(raw)` writes a request and returns its Reply."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[Reply] | None = None
        self.closed = False
        self.total_events = 0  # across requests: a rate over a window reads it before and after
        self.total_replies = 0
        self._reset()

    def _reset(self) -> None:
        self.state = _HEAD
        self.status = 0
        self.remaining = 0
        self.sent = 0.0
        self.first: float | None = None
        self.body_bytes = 0
        self.events = 0
        self.last_byte = 0

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urlsplit(url)
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, parts.hostname, parts.port)
        return conn

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.state == _UNTIL_CLOSE:
                self._finish(time.perf_counter())
            else:
                self.waiter.set_exception(HTTPFailure(f"connection closed mid-response ({exc or 'EOF'})"))

    def send(self, raw: bytes) -> asyncio.Future[Reply]:
        if self.closed or self.transport is None:
            raise HTTPFailure("connection is closed")
        self._reset()
        self.waiter = asyncio.get_running_loop().create_future()
        self.sent = time.perf_counter()
        self.transport.write(raw)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _payload(self, now: float, chunk: bytes | bytearray) -> None:
        if not chunk:
            return
        if self.first is None:
            self.first = now
        self.body_bytes += len(chunk)
        # An event boundary split across two reads is "\n" at the end of one and "\n" at the start of the next.
        n = chunk.count(b"\n\n") + (self.last_byte == 10 and chunk[0] == 10)
        self.events += n
        self.total_events += n
        self.last_byte = chunk[-1]

    def _finish(self, now: float) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():
            return
        self.total_replies += 1
        if 200 <= self.status < 300:
            waiter.set_result(Reply(self.status, self.sent, self.first, now, self.body_bytes, self.events))
        else:
            waiter.set_exception(HTTPFailure(f"HTTP {self.status}"))

    def data_received(self, data: bytes) -> None:
        try:
            self._parse(data)
        except (HTTPFailure, ValueError) as exc:
            waiter, self.waiter = self.waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_exception(HTTPFailure(f"bad response: {exc}"))
            self.close()

    def _parse(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf
        buf += data
        while buf:
            state = self.state
            if state == _HEAD:
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    return
                self._head(bytes(buf[:i]))
                del buf[:i + 4]
            elif state == _LENGTH or state == _DATA:
                take = min(len(buf), self.remaining)
                self._payload(now, buf[:take])
                del buf[:take]
                self.remaining -= take
                if self.remaining == 0:
                    if state == _LENGTH:
                        self._finish(now)
                        self.state = _HEAD
                    else:
                        self.state = _DATA_END
            elif state == _SIZE:
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                size = int(bytes(buf[:i]).split(b";")[0], 16)
                del buf[:i + 2]
                if size == 0:
                    self.state = _TRAILER
                else:
                    self.remaining = size
                    self.state = _DATA
            elif state == _DATA_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise HTTPFailure("chunk data longer than its size line said")
                del buf[:2]
                self.state = _SIZE
            elif state == _TRAILER:
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                del buf[:i + 2]
                if i == 0:
                    self._finish(now)
                    self.state = _HEAD
            else:  # _UNTIL_CLOSE
                self._payload(now, buf)
                buf.clear()
        if self.state == _LENGTH and self.remaining == 0 and self.waiter is not None:
            self._finish(now)
            self.state = _HEAD

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        try:
            self.status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise HTTPFailure(f"bad status line {lines[0][:80]!r}") from None
        length, chunked = None, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            self.state = _SIZE
        elif length is not None:
            self.state, self.remaining = _LENGTH, length
        else:
            self.state = _UNTIL_CLOSE


async def open_all(url: str, n: int) -> list[Connection]:
    """`n` keep-alive connections to `url`, opened in batches of 100: a burst of SYNs larger than the listen
    backlog is not what a load measures."""
    conns: list[Connection] = []
    for i in range(0, n, 100):
        conns += await asyncio.wait_for(
            asyncio.gather(*(Connection.open(url) for _ in range(min(100, n - i)))), 30)
    return conns
