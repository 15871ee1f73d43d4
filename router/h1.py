"""One HTTP/1.1 client connection to a backend: writes a request, parses the response as bytes arrive."""
from __future__ import annotations

import asyncio

# Limits on what a backend may send before the body; past them the response is malformed, not waited for.
MAX_HEAD = 64 * 1024
MAX_LINE = 8 * 1024
# Body bytes the router holds unread per response before it stops reading the socket (backpressure).
HIGH_WATER = 256 * 1024

_HEAD, _LENGTH, _SIZE, _DATA, _CRLF, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)
_NO_BODY = frozenset((204, 304))
_KEPT = frozenset((b"content-type", b"content-length", b"transfer-encoding", b"connection"))


class ProtocolError(Exception):
    """The backend's bytes are not an HTTP/1.1 response this client can read."""


class Closed(ConnectionError):
    """The connection ended before the response did."""


class Response:
    """One response: status and headers once they came, then its body as the bytes arrive."""

    __slots__ = ("status", "ctype", "conn", "on_done", "_parts", "_size", "_waiter", "_exc",
                 "_eof", "_head")

    def __init__(self, conn: Connection, on_done) -> None:
        self.status = 0
        self.ctype: str | None = None  # the Content-Type field as sent; the only field the router forwards
        self.conn: Connection | None = conn
        # Called once, by release() or close(): with the connection when it can serve another request, else None.
        self.on_done = on_done
        self._parts: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future | None = None
        self._exc: BaseException | None = None
        self._eof = False
        self._head: asyncio.Future | None = conn.loop.create_future()

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower case (aiohttp's default when absent)."""
        value = self.ctype
        if not value:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    async def wait_head(self) -> None:
        assert self._head is not None
        await self._head

    # ---- fed by the connection ----
    def _got_head(self) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """Fail the response: a read that has no bytes left raises `exc` (also the watchdog's idle timeout)."""
        if self._eof and not self._parts:
            return
        self._exc = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: a caller that was cancelled first never awaits it
        self._wake()

    # ---- read by the exchange ----
    async def read_chunk(self) -> bytes:
        """Every body byte received since the last call, waiting for some; b"" at the end."""
        while True:
            if self._parts:
                parts = self._parts
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                self._parts = []
                if self._size > HIGH_WATER and self.conn is not None:
                    self.conn.resume()
                self._size = 0
                return data
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = self.conn.loop.create_future() if self.conn is not None else None
            if self._waiter is None:
                raise Closed("the response was closed")
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def at_eof(self) -> bool:
        return self._eof and not self._parts

    def release(self) -> None:
        """Done with it: a complete response gives its connection back for reuse, any other closes it."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if self._eof and self._exc is None and conn.reusable():
            conn.resp = None
            self.on_done(conn)
        else:
            conn.close()
            self.on_done(None)

    def close(self) -> None:
        """Drop the connection whatever the state: an unfinished answer's backend sees the client leave."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
            self.on_done(None)
        self._wake()


class Connection(asyncio.Protocol):
    """The socket's side: one request at a time, the response parsed incrementally (no copy of a body chunk
    beyond the slice that removes its framing)."""

    __slots__ = ("loop", "transport", "endpoint", "resp", "closed", "keep_alive", "idle_since", "got_bytes",
                 "_buf", "_state", "_left", "_paused")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.endpoint = None  # the router.upstream.Endpoint whose pool it returns to
        self.resp: Response | None = None
        self.closed = False
        self.keep_alive = True
        self.idle_since = 0.0
        self.got_bytes = False  # any byte of the current response
        self._buf = b""
        self._state = _DONE
        self._left = 0
        self._paused = False

    # ---- asyncio callbacks ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        resp = self.resp
        if resp is None:
            return
        if self._state == _UNTIL_CLOSE:
            resp._end()  # a body without a length ends with the connection
        elif self._state != _DONE:
            resp.set_exception(Closed("the backend closed the connection"))

    def eof_received(self) -> bool:
        return False  # half-closed is closed: let the transport end

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or self._state == _DONE:
            self.close()  # bytes nobody asked for: this connection cannot be trusted with another request
            return
        self.got_bytes = True
        try:
            self._parse(resp, self._buf + data if self._buf else data)
        except ProtocolError as exc:
            resp.set_exception(exc)
            self.close()
            return
        if resp._parts:
            resp._wake()
            if resp._size > HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()

    # ---- the connection's user ----
    def send(self, data: bytes, resp: Response) -> None:
        self.resp = resp
        self._state = _HEAD
        self._buf = b""
        self.got_bytes = False
        assert self.transport is not None
        self.transport.write(data)

    def reusable(self) -> bool:
        return self.keep_alive and not self.closed and self._state == _DONE and not self._buf

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # ---- the parser ----
    def _parse(self, resp: Response, buf: bytes) -> None:
        # An index walks the buffer: slicing off each parsed piece would copy the rest every time (quadratic
        # in a large read of many small chunks).
        self._buf = b""
        pos, size = 0, len(buf)
        while pos < size:
            state = self._state
            if state == _DATA or state == _LENGTH:
                n = self._left
                if size - pos < n:
                    resp._feed(buf[pos:] if pos else buf)
                    self._left = n - (size - pos)
                    return
                resp._feed(buf[pos:pos + n] if pos or n < size else buf)
                pos += n
                if state == _DATA:
                    self._state = _CRLF
                else:
                    self._finish(resp, size - pos)
                    return
            elif state == _CRLF:
                if size - pos < 2:
                    self._buf = buf[pos:]
                    return
                if buf[pos:pos + 2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                pos += 2
                self._state = _SIZE
            elif state == _SIZE and (pos := self._chunks(resp, buf, pos, size)) >= size:
                return  # every whole chunk taken by the fast loop; the tail (if any) is kept
            elif state == _SIZE or state == _TRAILER:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_LINE:
                        raise ProtocolError("chunk size line too long")
                    self._buf = buf[pos:]
                    return
                line = buf[pos:end]
                pos = end + 2
                if state == _TRAILER:
                    if not line:
                        self._finish(resp, size - pos)
                        return
                    continue  # trailer fields are dropped: the router forwards only the body
                try:
                    n = int(line.partition(b";")[0].strip(), 16)  # chunk extensions are ignored
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {line[:40]!r}") from None
                if n < 0:
                    raise ProtocolError("negative chunk size")
                if n == 0:
                    self._state = _TRAILER
                else:
                    self._state, self._left = _DATA, n
            elif state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if size - pos > MAX_HEAD:
                        raise ProtocolError("response headers too large")
                    self._buf = buf[pos:]
                    return
                if end - pos > MAX_HEAD:
                    raise ProtocolError("response headers too large")
                head = buf[pos:end]
                pos = end + 4
                self._head(resp, head)
                if self._state == _DONE:
                    self._finish(resp, size - pos)
                    return
            elif state == _UNTIL_CLOSE:
                resp._feed(buf[pos:] if pos else buf)
                return
            else:  # _DONE: bytes after the end of the response
                self.keep_alive = False
                return

    def _chunks(self, resp: Response, buf: bytes, pos: int, size: int) -> int:
        """The common case in one tight loop: whole `SIZE CRLF DATA CRLF` chunks (an SSE stream: one event
        each). Returns where it stopped; anything else (a split chunk, extensions, the last chunk) is left to
        the general state machine, which also keeps the tail at the end of the buffer."""
        parts = resp._parts
        taken = 0
        find = buf.find
        while True:
            end = find(b"\r\n", pos)
            if end < 0:
                break
            try:
                n = int(buf[pos:end], 16)
            except ValueError:
                break
            start = end + 2
            stop = start + n
            if n <= 0 or stop + 2 > size or buf[stop:stop + 2] != b"\r\n":
                break
            parts.append(buf[start:stop])
            taken += n
            pos = stop + 2
        resp._size += taken
        if pos >= size:
            self._buf = b""
        return pos if pos < size else size

    def _head(self, resp: Response, head: bytes) -> None:
        """Parse a status line and its fields; an interim (1xx) response is skipped (the state stays _HEAD)."""
        lines = head.split(b"\r\n")
        status_line = lines[0]
        version, _, rest = status_line.partition(b" ")
        code = rest.partition(b" ")[0]
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ProtocolError(f"bad status line {status_line[:60]!r}")
        status = int(code)
        if status < 200:
            if status == 101:
                raise ProtocolError("the backend switched protocols")
            return  # 100 Continue, 103 Early Hints: the real response follows
        # Only the fields the router acts on are kept (memory per open stream); all are checked for shape.
        fields: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"bad header line {line[:60]!r}")
            name = name.lower()
            if name in _KEPT:
                fields[name] = value.strip()
        resp.status = status
        ctype = fields.get(b"content-type")
        resp.ctype = None if ctype is None else ctype.decode("latin-1")
        conn_tokens = fields.get(b"connection", b"").lower()
        if version == b"HTTP/1.0":
            self.keep_alive = b"keep-alive" in conn_tokens
        elif b"close" in conn_tokens:
            self.keep_alive = False
        te = fields.get(b"transfer-encoding")
        length = fields.get(b"content-length")
        if status in _NO_BODY:
            self._state = _DONE
        elif te is not None:
            if te.lower().rsplit(b",", 1)[-1].strip() != b"chunked":
                raise ProtocolError(f"unsupported transfer-encoding {te[:40]!r}")
            self._state = _SIZE
        elif length is not None:
            if not length.isdigit():
                raise ProtocolError(f"bad content-length {length[:40]!r}")
            self._left = int(length)
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False
        resp._got_head()

    def _finish(self, resp: Response, rest: int) -> None:
        self._state = _DONE
        if rest:
            self.keep_alive = False  # more bytes than the response: never reuse
        resp._end()
