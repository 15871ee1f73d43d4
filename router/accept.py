"""The router's listening socket and an acceptor that takes connections in batches (uvloop takes one per loop turn)."""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("router")

# uvloop (libuv) accepts one connection per event-loop iteration. With 1,000+ streams an iteration takes
# tens of milliseconds, so new clients queued in the kernel for tens of seconds (measured: 900 waiting).
BATCH = 512
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A bound, listening, non-blocking TCP socket (port 0 picks a free port); OSError when it cannot."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Acceptor:
    """Accepts up to BATCH pending connections each time the socket is readable and hands them to `factory`."""

    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        self.sock = sock
        self.factory = factory
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task] = set()
        self._watching = False
        self._closed = False

    def start(self) -> None:
        if not self._closed and not self._watching:
            self.loop.add_reader(self.sock.fileno(), self.accept_ready)
            self._watching = True

    def _pause(self, seconds: float) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self._watching = False
        self.loop.call_later(seconds, self.start)

    def accept_ready(self) -> int:
        taken = 0
        for _ in range(BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                # Out of descriptors: back off instead of spinning on a socket that stays readable.
                log.warning("cannot accept connections: %s", exc.strerror or exc)
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause(0.5)
                break
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            taken += 1
        return taken

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, sock=conn)
        except OSError:
            conn.close()

    def close(self) -> None:
        """Stop accepting (connections already accepted carry on) and close the listening socket."""
        if self._closed:
            return
        self._closed = True
        if self._watching:
            self.loop.remove_reader(self.sock.fileno())
            self._watching = False
        self.sock.close()
