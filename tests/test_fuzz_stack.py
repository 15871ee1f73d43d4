"""Fuzzing support: a router before a recording backend on a background thread, and a raw-socket HTTP client."""
from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from router.app import build_app, start
from router.settings import load_settings
from router.state import STATE

# What the router may ever send to a backend; anything else reaching the recorder is a leak.
ALLOWED_UPSTREAM = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                    ("GET", "/health"), ("GET", "/v1/loads")}
CLIENT_KEY = "client-key-7f3a"
BACKEND_KEY = "backend-key-91c2"


def fuzz_seed() -> int:
    """FUZZ_SEED=N replays a run; without it each run draws a new seed (printed in pytest's header)."""
    value = os.environ.get("FUZZ_SEED", "").strip()
    return int(value) if value else random.SystemRandom().randrange(2**32)


# One seed per test session, shared by every property so the header line replays all of them.
FUZZ_SEED = fuzz_seed()


def examples(default: int) -> int:
    """CI runs `default` examples per property; FUZZ_EXAMPLES=N runs the long version."""
    return int(os.environ.get("FUZZ_EXAMPLES", default))


@dataclass
class Recorded:
    method: str
    path: str  # path and query exactly as received
    headers: dict[str, str]
    body: bytes


class _ErrorLogs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {self.format(record)}")

    def router_records(self) -> list[str]:
        """Errors logged by the router itself (aiohttp's own parser logs each malformed request)."""
        return [r for r in self.records if r.startswith("router")]


@dataclass
class FuzzStack:
    router_url: str = ""
    backend_url: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    recorded: list[Recorded] = field(default_factory=list)
    errors: _ErrorLogs = field(default_factory=_ErrorLogs)
    loop: asyncio.AbstractEventLoop | None = None
    app: web.Application | None = None
    sent: int = 0
    statuses: dict[int | None, int] = field(default_factory=dict)

    def __repr__(self) -> str:  # hypothesis prints the fixture with every failing example: keep it short
        return f"FuzzStack({self.router_url}, {self.sent} requests sent)"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))

    def inflight(self) -> dict[str, int]:
        assert self.app is not None
        return {b.url: b.inflight for b in self.app[STATE].pools.backends}

    def leaks(self) -> list[Recorded]:
        return [r for r in self.recorded if (r.method, r.path) not in ALLOWED_UPSTREAM
                or CLIENT_KEY in repr(r.headers)]

    def count(self, status: int | None) -> None:
        self.sent += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def _recording_backend(stack: FuzzStack) -> web.AppRunner:
    async def record(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        stack.recorded.append(Recorded(request.method, request.path_qs, dict(request.headers), body))
        if request.path == "/health":
            return web.Response()
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
        if b'"stream":true' in body.replace(b" ", b""):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
                             b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
                             b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"id": "x", "choices": [{"index": 0, "message": {"content": "x"}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def run_stack(**settings) -> tuple[FuzzStack, callable]:
    """Start backend + router on a private event loop in a thread; returns the stack and a stop function."""
    stack = FuzzStack()
    ready = threading.Event()
    stop_evt: dict = {}
    logging.getLogger().addHandler(stack.errors)
    failure: list[BaseException] = []

    async def main() -> None:
        backend = await _recording_backend(stack)
        stack.backend_url = f"http://127.0.0.1:{backend.addresses[0][1]}"
        values = {"host": "127.0.0.1", "port": 0, "speculative": stack.backend_url, "health_interval": 0.2,
                  "health_timeout": 1.0, "health_failure_threshold": 2, "health_success_threshold": 1,
                  "drain_timeout": 0.5, "speculative_api_key": BACKEND_KEY, **settings}
        s = load_settings(None, values, environ={})
        stack.app = build_app(s, CollectorRegistry())
        runner, stack.router_url = await start(stack.app, s.host, s.port)
        stack.port = int(stack.router_url.rsplit(":", 1)[1])
        async with asyncio.timeout(5):
            await stack.app[STATE].health.first_round.wait()
        stop = asyncio.Event()
        stop_evt["e"] = stop
        stack.loop = asyncio.get_running_loop()
        ready.set()
        await stop.wait()
        await runner.cleanup()
        await backend.cleanup()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced to the test thread below
            failure.append(exc)
            ready.set()

    t = threading.Thread(target=thread_main, name="fuzz-stack", daemon=True)
    t.start()
    if not ready.wait(15) or failure:
        raise RuntimeError(f"fuzz stack did not start: {failure!r}")

    def stop() -> None:
        assert stack.loop is not None
        stack.loop.call_soon_threadsafe(stop_evt["e"].set)
        t.join(10)
        logging.getLogger().removeHandler(stack.errors)
        if failure:
            raise failure[0]

    return stack, stop


def raw_request(stack: FuzzStack, data: bytes, timeout: float = 5.0, chunks: list[tuple[bytes, float]] = ()) \
        -> tuple[int | None, bytes]:
    """Send raw bytes (then each (piece, delay) of `chunks`), read until the server closes; returns the
    status (None when the server closed without answering) and the whole response."""
    with socket.create_connection((stack.host, stack.port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            for piece, delay in chunks:
                time.sleep(delay)
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413, 400) and close before reading everything
        got = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"router sent no complete answer within {timeout}s: {got[:200]!r}") from None
            if not part:
                break
            got += part
    status = None
    if got.startswith(b"HTTP/1."):
        try:
            status = int(got.split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = None
    stack.count(status)
    return status, got


def build_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes | None,
                  content_length: bool = True) -> bytes:
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [k + b": " + v for k, v in headers]
    if body is not None and content_length:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def test_the_fuzz_stack_forwards_a_valid_request_with_the_backend_key_only():
    stack, stop = run_stack(api_key=CLIENT_KEY)
    try:
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        status, got = raw_request(stack, build_request(
            b"POST", b"/v1/chat/completions",
            [(b"Content-Type", b"application/json"), (b"Authorization", b"Bearer " + CLIENT_KEY.encode())], body))
        assert status == 200, got[:300]
        gen = [r for r in stack.recorded if r.path == "/v1/chat/completions"]
        assert len(gen) == 1 and gen[0].body == body
        assert gen[0].headers["Authorization"] == f"Bearer {BACKEND_KEY}"
        assert stack.leaks() == [] and stack.errors.router_records() == []
    finally:
        stop()
