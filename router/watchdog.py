"""An exchange's deadlines after the connect (router.upstream bounds that): first byte, then one timer per stream
for the backend's idle gap and the client's write stall."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from router.errors import UpstreamError
from router.upstream import Reply


class FirstByteDeadline:
    """first_byte_timeout over a block that may wait for a place, connect, retry and read: when it runs out, the
    block's await is cancelled and the block raises `expired()`'s error instead. One timer handle (cheaper than an
    asyncio.timeout context); a cancellation from elsewhere (a client leaving, the drain) passes through, as
    asyncio.timeout decides it."""

    __slots__ = ("_task", "_cancelling", "_handle", "_expired")

    def __init__(self, timeout: float, expired: Callable[[], UpstreamError]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()  # cancellations already pending when it was armed
        self._expired = expired
        # None once it has fired: that cancellation is the deadline's own.
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(timeout, self._fire)

    def _fire(self) -> None:
        if not self._task.done():
            self._handle = None
            self._task.cancel()

    def __enter__(self) -> FirstByteDeadline:
        return self

    def __exit__(self, et, exc, tb) -> None:
        if self._handle is not None:
            self._handle.cancel()
        elif et is asyncio.CancelledError and self._task.uncancel() <= self._cancelling:
            raise self._expired() from None


class Watchdog:
    """Re-armed lazily, so the per-chunk cost is one float store (`last_chunk`), not a timer per read.

    Idle: no upstream chunk for `idle` seconds -> the answer times out (Reply.time_out: its reader gets an
    idle_timeout). Write stall: bytes wait for the client and it took none of them for `write_timeout`
    seconds -> the client connection is aborted, which aiohttp turns into a client disconnect. A stall is noticed
    between `write_timeout` and 1.5 x `write_timeout` after the client stopped reading.
    """

    __slots__ = ("_loop", "_idle", "_write_timeout", "_tick", "_transport", "_writer", "_resp", "_handle",
                 "last_chunk", "_sent", "_sent_at")

    def __init__(self, idle: float, write_timeout: float, transport: asyncio.Transport,
                 writer, resp: Reply) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = idle
        self._write_timeout = write_timeout
        self._tick = write_timeout / 2
        self._transport = transport
        self._writer = writer
        self._resp: Reply | None = resp
        self.last_chunk = time.monotonic()
        # Bytes the kernel had taken at the last recorded progress, and when (`_sent_at`, set by that record):
        # below any count, so the first check with bytes waiting records.
        self._sent = -math.inf
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(min(idle, self._tick), self._check)

    def upstream_done(self) -> None:
        """The backend's part is over: only the write deadline is left."""
        self._resp = None

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        now = time.monotonic()
        wait = self._tick
        if self._resp is not None:
            quiet = now - self.last_chunk
            if quiet >= self._idle:
                self._resp.time_out()
                self._resp = None
            else:
                wait = min(wait, self._idle - quiet)
        pending = self._transport.get_write_buffer_size() if not self._transport.is_closing() else 0
        if pending:
            sent = self._writer.output_size - pending  # bytes the kernel has taken so far
            if sent > self._sent:  # it only grows; an empty buffer in between means it grew
                self._sent, self._sent_at = sent, now
            elif now - self._sent_at >= self._write_timeout:
                self._transport.abort()
                return
        self._handle = self._loop.call_later(wait, self._check)
