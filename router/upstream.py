"""The HTTP/1.1 client to backends and the exchange's one seam to them: keep-alive pools, both connection limits
(per backend, total), the connect deadline, a proxied answer's life (Reply: read, give back for reuse, close), and
the one place where transport exceptions become router errors. Only this module (and router.h1 under it) touches
HTTP/1 connections and connection limits."""
from __future__ import annotations

import asyncio
import collections
import errno
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from router.errors import (
    Failure,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamLocalError,
    UpstreamTimeout,
)
from router.h1 import Closed, Connection, ProtocolError, Response
from router.settings import Settings

# Phases of an upstream exchange, each named by the failure a timeout in it is.
CONNECT, FIRST_BYTE, IDLE = Failure.CONNECT_TIMEOUT, Failure.FIRST_BYTE_TIMEOUT, Failure.IDLE_TIMEOUT
# Connect errors that come from this host's own limits, whatever the backend's state.
_LOCAL_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL))
# An idle kept-alive connection is dropped after this long: uvicorn (SGLang, vLLM) and llama.cpp's server close
# theirs after 5 s, and a request sent on a connection the server is closing fails for nothing.
KEEPALIVE_S = 4.0


class ConnectFailed(Exception):
    """Opening a connection to a backend failed; `os_error` says why."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class ConnectTimeout(TimeoutError):
    """Opening a connection took longer than connect_timeout."""


# What the client raises for a transport failure. On the hot path only the functions below catch it,
# so every failure reaches the proxy as one UpstreamError shape.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (ConnectFailed, ProtocolError, OSError)


def is_local(exc: BaseException) -> bool:
    """A connect failure of ours (out of file descriptors, memory or ports; a DNS lookup), not the backend's."""
    if not isinstance(exc, ConnectFailed):
        return False
    return isinstance(exc.os_error, socket.gaierror) or exc.os_error.errno in _LOCAL_ERRNOS


def map_error(exc: BaseException, backend: str, phase: Failure, *, got_headers: bool) -> UpstreamError:
    """Translate a transport exception into the router's hierarchy; the only place that does so. `phase`: where
    it happened (FIRST_BYTE, IDLE), the failure a timeout there is."""
    if isinstance(exc, ConnectTimeout):
        err = UpstreamTimeout(f"connecting to backend {backend} timed out", failure=CONNECT)
        err.retryable = True  # the request never left: another backend may take it
        return err
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout.silent(backend, phase)
    if isinstance(exc, ConnectFailed):
        reason = exc.os_error.strerror or exc.os_error
        if is_local(exc):
            return UpstreamLocalError(f"the router could not connect to backend {backend}: {reason}")
        return UpstreamConnectError(f"cannot connect to backend {backend}: {reason}")
    if isinstance(exc, ConnectionError) or (got_headers and isinstance(exc, ProtocolError)):
        err = UpstreamDisconnected(f"backend {backend} closed the connection")
        # Nothing was received, so nothing reached the client: as safe to retry as a refusal.
        err.retryable = not got_headers
        return err
    return UpstreamError(f"backend {backend} failed: {type(exc).__name__}")


class Endpoint:
    """One backend URL: where to connect, what to put in the request line and Host, its idle connections."""

    __slots__ = ("host", "port", "ssl", "prefix", "head", "idle", "max_idle")

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None, max_idle: int) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl_context if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.head = f"Host: {parts.netloc}\r\n"
        self.idle: collections.deque[Connection] = collections.deque()  # oldest on the left
        self.max_idle = max_idle

    def take(self, now: float) -> Connection | None:
        idle = self.idle
        while idle:
            conn = idle.pop()  # the newest: the one least likely to have been closed by the backend
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    def put(self, conn: Connection) -> None:
        idle = self.idle
        now = time.monotonic()
        # The oldest idle connection goes once it expired or the backend closed it, one per put: under steady
        # traffic stale descriptors do not pile up behind the newest connections that take() hands out.
        if idle and (idle[0].closed or now - idle[0].idle_since >= KEEPALIVE_S):
            idle.popleft().close()
        if len(idle) < self.max_idle:
            conn.idle_since = now
            idle.append(conn)
        else:
            conn.close()

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None) -> bytes:
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.head}"
        if body is not None:
            head += f"Content-Length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            if "\n" in value or "\r" in value:
                continue  # a value that would split the request is not forwarded
            head += f"{name}: {value}\r\n"
        # surrogateescape: header bytes that were not UTF-8 go out as they came in.
        data = (head + "\r\n").encode("utf-8", "surrogateescape")
        return data + body if body else data


class Client:
    """Keep-alive connections per backend; at most `max_connections` requests open to all backends together, and
    a proxied request (open()) also at most `limits.per_backend` to its backend.

    `keep_alive=False` opens a fresh connection for every request (health probes: a backend that stopped
    accepting must fail its probe even while an old connection to it still works). `limits`: the per-backend
    places (built before the client, so the metrics can show their waits); without, max_connections each."""

    def __init__(self, connect_timeout: float, max_connections: int, max_idle_per_backend: int,
                 keep_alive: bool = True, limits: Limits | None = None) -> None:
        self.limits = limits if limits is not None else Limits([], max_connections)
        self.connect_timeout = connect_timeout
        self.keep_alive = keep_alive
        self.max_idle = max_idle_per_backend if keep_alive else 0
        self._endpoints: dict[str, Endpoint] = {}
        self._slots = Gate(max_connections)
        self._ssl: ssl.SSLContext | None = None
        self._loop = asyncio.get_running_loop()

    def endpoint(self, url: str) -> Endpoint:
        ep = self._endpoints.get(url)
        if ep is None:
            if url.startswith("https:") and self._ssl is None:
                self._ssl = ssl.create_default_context()
            ep = self._endpoints[url] = Endpoint(url, self._ssl, self.max_idle)
        return ep

    async def open(self, url: str, path: str, body: bytes, headers: dict[str, str],
                   placed: Callable[[float | None], None]) -> Reply:
        """POST one proxied request: take `url`'s place under the per-backend limit, then one under the total,
        send, and wait for the status line and headers. `placed(waited)` runs once the backend's place is held
        (`waited`: the seconds it waited for it, None when one was free). A transport failure comes out as an
        UpstreamError; on any failure both places are given back."""
        limits = self.limits
        placed(await limits.take(url))
        try:
            resp = await self.request("POST", url, path, body, headers)
        except BaseException as exc:
            limits.give(url)
            if isinstance(exc, TRANSPORT_ERRORS):
                raise map_error(exc, url, FIRST_BYTE, got_headers=False) from None
            raise
        return Reply(self, url, resp)

    async def request(self, method: str, url: str, path: str, body: bytes | None,
                      headers: dict[str, str] | None) -> Response:
        """Send one request (under the total limit only) and wait for its status line and headers. Raises
        ConnectFailed, ConnectTimeout, Closed, ProtocolError (each mapped by map_error)."""
        ep = self.endpoint(url)
        data = ep.request(method, path, body, headers)
        if not self._slots.try_take():
            await self._slots.take()
        try:
            conn = ep.take(time.monotonic())
            while True:
                fresh = conn is None
                if conn is None:
                    conn = await self._connect(ep)
                resp = Response(conn, self._done)
                conn.send(data, resp)
                try:
                    await resp.wait_head()
                    return resp
                except Closed:
                    conn.close()
                    if fresh or conn.got_bytes:
                        raise
                    # A kept-alive connection the backend closed as we sent: it never saw the request.
                    conn = None
                except BaseException:
                    conn.close()
                    raise
        except BaseException:
            self._slots.give()
            raise

    def _done(self, conn: Connection | None) -> None:
        """A response was released (with its connection when that can serve another request) or closed."""
        self._slots.give()
        if conn is not None:
            if self.keep_alive and conn.endpoint is not None:
                conn.endpoint.put(conn)
            else:
                conn.close()

    async def _connect(self, ep: Endpoint) -> Connection:
        loop = self._loop
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: Connection(loop), ep.host, ep.port, ssl=ep.ssl)
        except TimeoutError:
            raise ConnectTimeout(f"connect to {ep.host}:{ep.port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(exc) from None
        conn.endpoint = ep
        return conn

    def close(self) -> None:
        """Close the idle connections; responses still open close with their exchanges."""
        for ep in self._endpoints.values():
            for conn in ep.idle:
                conn.close()
            ep.idle.clear()


def make_client(settings: Settings, limits: Limits) -> Client:
    return Client(settings.connect_timeout, settings.max_connections, settings.max_connections_per_backend,
                  limits=limits)


class Reply:
    """A backend's answer to one proxied request, as the exchange sees it: status, Content-Type, body reads whose
    transport failures come out as UpstreamError, and end(), which ends the answer's hold on the backend once."""

    __slots__ = ("_resp", "_client", "url", "status", "ctype")

    def __init__(self, client: Client, url: str, resp: Response) -> None:
        self._resp = resp
        self._client: Client | None = client  # None once ended
        self.url = url
        self.status = resp.status
        self.ctype = resp.ctype  # the Content-Type field as sent (None: absent)

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower case."""
        return self._resp.content_type

    async def read_chunk(self, phase: Failure) -> bytes:
        """Every body byte received since the last read, waiting for some; b"" at the end. `phase` (FIRST_BYTE,
        IDLE) names a timeout."""
        try:
            return await self._resp.read_chunk()
        except TRANSPORT_ERRORS as exc:
            raise map_error(exc, self.url, phase, got_headers=True) from None

    async def read_body(self) -> bytes:
        """The whole (non-streamed) body."""
        try:
            return await self._resp.read()
        except TRANSPORT_ERRORS as exc:
            raise map_error(exc, self.url, FIRST_BYTE, got_headers=True) from None

    def time_out(self) -> None:
        """The backend was silent too long (router.watchdog): a read with no bytes left raises idle_timeout."""
        self._resp.set_exception(TimeoutError())

    def end(self) -> None:
        """Done with the answer, whatever happened: a complete one gives its connection back for reuse, any other
        closes it (an unfinished answer's backend, SGLang, then aborts the request); then the backend's place
        under the per-backend limit is given back (the total's goes with the connection). Once."""
        client, self._client = self._client, None
        if client is None:
            return
        resp = self._resp
        try:
            if resp.at_eof():
                resp.release()
            else:
                resp.close()
        finally:
            client.limits.give(self.url)


async def get(client: Client, backend: str, path: str, headers: dict[str, str] | None) -> tuple[int, bytes]:
    """A GET on the side of the hot path (health, loads, models): status and whole body. Raises what
    Client.request raises; the caller bounds the time."""
    resp = await client.request("GET", backend, path, None, headers)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


class Gate:
    """A counting semaphore whose uncontended take is one counter step (asyncio.Semaphore.locked() walks its
    waiters on every call). A freed place goes straight to the oldest waiter, so nobody overtakes it."""

    __slots__ = ("free", "_waiters")

    def __init__(self, places: int) -> None:
        self.free = places
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_take(self) -> bool:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give()  # handed a place just as we were cancelled: pass it on
            raise

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class Limits:
    """The per-backend connection limit: at most `per_backend` requests open to each backend at once; the others
    wait here, counted, instead of unseen inside the client's connection pool. (The total over all backends,
    max_connections, is the Client's own gate: a request takes its backend's place here first, then that.)"""

    def __init__(self, urls: list[str], per_backend: int) -> None:
        self.per_backend = per_backend
        # A URL not added gets its places on first use (a client of its own, in tests and tools, names none).
        self.slots: collections.defaultdict[str, Gate] = collections.defaultdict(self._gate)
        self.waiting: collections.defaultdict[str, int] = collections.defaultdict(int)
        for url in urls:
            self.add(url)

    def _gate(self) -> Gate:
        return Gate(self.per_backend)

    def add(self, url: str) -> None:
        """A backend that joined at run time (router.discovery); its slots outlive a leave, so leases of a
        draining backend still release into them."""
        self.slots.setdefault(url, Gate(self.per_backend))
        self.waiting.setdefault(url, 0)

    async def take(self, url: str) -> float | None:
        """One of `url`'s places; returns the seconds waited for it (None when one was free)."""
        gate = self.slots[url]
        if gate.try_take():
            return None
        t = time.monotonic()
        self.waiting[url] += 1
        try:
            await gate.take()
        finally:
            self.waiting[url] -= 1
        return time.monotonic() - t

    def give(self, url: str) -> None:
        self.slots[url].give()
