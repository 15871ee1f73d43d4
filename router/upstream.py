"""The HTTP client session to backends, and the one place where transport exceptions become router errors."""
from __future__ import annotations

import asyncio
import errno

import aiohttp

from router.errors import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamLocalError,
    UpstreamTimeout,
)
from router.settings import Settings

# Phases of an upstream exchange; a timeout's kind names the phase it hit.
CONNECT, FIRST_BYTE, IDLE = "connect", "first_byte", "idle"
# Connect errors that come from this host's own limits, whatever the backend's state.
_LOCAL_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL))


def is_local(exc: BaseException) -> bool:
    """A connect failure of ours (out of file descriptors, memory or ports; a DNS lookup), not the backend's."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return True
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.errno in _LOCAL_ERRNOS
    return False


def make_session(settings: Settings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=settings.max_connections, limit_per_host=0,
                                     enable_cleanup_closed=False, ttl_dns_cache=300)
    # Only connect is bounded here; first-byte and idle deadlines are per request (asyncio.timeout).
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout,
                                    sock_connect=settings.connect_timeout)
    # auto_decompress off: bodies pass through as the backend sent them.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("Accept-Encoding",), raise_for_status=False)


def map_error(exc: BaseException, backend: str, phase: str, *, got_headers: bool) -> UpstreamError:
    """Translate a transport exception into the router's hierarchy; the only place that does so."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        err = UpstreamTimeout(f"connecting to backend {backend} timed out", backend=backend, kind="connect_timeout")
        err.retryable = True  # the request never left: another backend may take it
        return err
    if isinstance(exc, TimeoutError):
        what = "first byte" if phase != IDLE else "next chunk"
        return UpstreamTimeout(f"backend {backend} sent no {what} in time", backend=backend, kind=f"{phase}_timeout")
    if is_local(exc):
        reason = exc.os_error.strerror if isinstance(exc, aiohttp.ClientConnectorError) else None
        return UpstreamLocalError(f"the router could not connect to backend {backend}: {reason or exc}",
                                  backend=backend)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"cannot connect to backend {backend}: {exc.os_error.strerror or exc}",
                                    backend=backend)
    if isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | ConnectionError):
        err = UpstreamDisconnected(f"backend {backend} closed the connection", backend=backend)
        # Nothing was received, so nothing reached the client: as safe to retry as a refusal.
        err.retryable = not got_headers
        return err
    return UpstreamError(f"backend {backend} failed: {type(exc).__name__}", backend=backend)


def is_transport_error(exc: BaseException) -> bool:
    return isinstance(exc, TRANSPORT_ERRORS) and not isinstance(exc, asyncio.CancelledError)


# What aiohttp's client raises for a transport failure. On the hot path only the functions below catch it,
# so every failure reaches the proxy as one UpstreamError shape.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, ConnectionError, TimeoutError)


async def send(session: aiohttp.ClientSession, backend: str, path: str, body: bytes,
               headers: dict[str, str]) -> aiohttp.ClientResponse:
    """POST to a backend and wait for its response headers."""
    try:
        return await session.post(backend + path, data=body, headers=headers)
    except TRANSPORT_ERRORS as exc:
        raise map_error(exc, backend, FIRST_BYTE, got_headers=False) from None


async def read_chunk(resp: aiohttp.ClientResponse, backend: str, phase: str) -> bytes:
    """The next bytes of a response body (b"" at its end)."""
    try:
        return await resp.content.readany()
    except TRANSPORT_ERRORS as exc:
        raise map_error(exc, backend, phase, got_headers=True) from None


async def read_body(resp: aiohttp.ClientResponse, backend: str) -> bytes:
    """A whole (non-streamed) response body."""
    try:
        return await resp.read()
    except TRANSPORT_ERRORS as exc:
        raise map_error(exc, backend, FIRST_BYTE, got_headers=True) from None


class Limits:
    """At most `per_backend` requests open to each backend at once; the others wait here, counted, instead of
    unseen inside aiohttp's connection pool."""

    def __init__(self, urls: list[str], per_backend: int) -> None:
        self.slots = {u: asyncio.Semaphore(per_backend) for u in urls}
        self.waiting = dict.fromkeys(urls, 0)
        self.per_backend = per_backend

    def add(self, url: str) -> None:
        """A backend that joined at run time (router.discovery); its slots outlive a leave, so leases of a
        draining backend still release into them."""
        self.slots.setdefault(url, asyncio.Semaphore(self.per_backend))
        self.waiting.setdefault(url, 0)
