"""Request handlers: read the body once, decide, lease, forward upstream, stream the bytes back."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.errors import (
    BadRequest,
    ExpectationFailed,
    MethodNotAllowed,
    NoHealthyBackend,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
    ShuttingDown,
    Unauthorized,
    UpstreamError,
    error_response,
    sse_error_event,
)
from router.observe import (
    CONNECT_TIMEOUT,
    DISCONNECTED,
    FIRST_BYTE_TIMEOUT,
    IDLE_TIMEOUT,
    LOCAL,
    OK,
    REFUSED,
    Attempt,
    Observation,
)
from router.policy import POOLS, RETRY
from router.pools import Backend, Lease
from router.state import STATE, RouterState
from router.upstream import FIRST_BYTE, IDLE, map_error

log = logging.getLogger("router.proxy")

POOL_HEADER = "X-Router-Pool"
BACKEND_HEADER = "X-Router-Backend"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RETRY_STATUSES = frozenset((502, 503))
# Transport error kinds (router.errors) as attempt outcomes (router.observe).
_ATTEMPT_KIND = {"connect": REFUSED, "connect_timeout": CONNECT_TIMEOUT, "first_byte_timeout": FIRST_BYTE_TIMEOUT,
                 "idle_timeout": IDLE_TIMEOUT, "disconnect": DISCONNECTED, "local": LOCAL}
# Status label for a client that left before the answer ended (nginx's convention).
CLIENT_CLOSED = "499"


# ---------------------------------------------------------------- request side

async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` as aiohttp does it; anything else is a 417 in our shape.

    aiohttp's default handler echoes the header into its error text and fails with a 500 on non-UTF-8 bytes.
    """
    if request.headers.get("Expect", "").lower() != "100-continue":
        return error_response(ExpectationFailed("only 'Expect: 100-continue' is supported"))
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    return None


async def unrouted(request: web.Request) -> web.StreamResponse:
    """The catch-all route: 405 for a known path with the wrong method, else 404. Nothing is forwarded."""
    allowed = sorted({route.method for resource in request.app.router.resources()
                      if resource.canonical == request.path for route in resource if route.method != "*"})
    if allowed:
        raise MethodNotAllowed(f"method {request.method} not allowed on {request.path[:200]}",
                               allow=",".join(allowed))
    raise NotFound(f"no route for {request.path[:200]!r}; the router serves only /v1/chat/completions, "
                   "/v1/completions, /v1/models, /health, /ready and /metrics")


@web.middleware
async def count_rejections(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Count answers the router gave without any backend (400/401/404/405/413/503) as pool="none"."""
    resp = await handler(request)
    if resp.status >= 400 and BACKEND_HEADER not in resp.headers:
        request.app[STATE].metrics.requests.labels("none", "none", str(resp.status)).inc()
    return resp


@web.middleware
async def auth_middleware(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    st = request.app[STATE]
    if st.api_key is not None and request.path.startswith("/v1/") and request.match_info.http_exception is None:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest: the time taken does not depend on how much of the key matched.
        # surrogatepass: header bytes that are not UTF-8 still encode (one-to-one), so they get a 401, not a 500.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"),
                                                                 st.api_key):
            raise Unauthorized("missing or invalid API key; send Authorization: Bearer KEY")
    return await handler(request)


async def read_json_body(request: web.Request, limit: int, within: float | None = None) -> tuple[bytes, dict]:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the {limit}-byte limit")
    try:
        # Bounded: a client that stops sending its body must not hold a handler for ever.
        async with asyncio.timeout(within):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit") from None
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {within:g} s") from None
    if not body:
        raise BadRequest("request body is empty; send a JSON object", code="invalid_json")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body, obj


def with_usage(body: bytes, obj: dict) -> bytes:
    """Ask the backend for the usage chunk, changing the client's bytes as little as possible."""
    if "stream_options" not in obj:
        # Insert right after the opening brace: every byte the client sent stays as sent.
        i = body.index(b"{") + 1
        return body[:i] + b'"stream_options":{"include_usage":true},' + body[i:]
    opts = obj["stream_options"] if isinstance(obj["stream_options"], dict) else {}
    return json.dumps({**obj, "stream_options": {**opts, "include_usage": True}}).encode()


def pinned_pool(request: web.Request) -> str | None:
    value = request.headers.get(POOL_HEADER)
    if value is None:
        return None
    value = value.strip().lower()
    if value not in POOLS:
        raise BadRequest(f"{POOL_HEADER} must be one of {', '.join(POOLS)}", code="invalid_pool")
    return value


def upstream_headers(request: web.Request, api_key: str | None) -> dict[str, str]:
    # An allowlist: the client's Authorization and anything else it sent stay here.
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json"),
               "Accept": request.headers.get("Accept", "*/*")}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


# ---------------------------------------------------------------- response side

def split_events(buf: bytes) -> tuple[bytes, bytes]:
    """Complete SSE events and the unfinished tail."""
    end = buf.rfind(b"\n\n")
    if end >= 0:
        return buf[:end + 2], buf[end + 2:]
    end = buf.rfind(b"\r\n\r\n")
    if end >= 0:
        return buf[:end + 4], buf[end + 4:]
    return b"", buf


@dataclass
class Usage:
    prompt: int = 0
    completion: int = 0
    seen: bool = False

    def take(self, obj: object) -> None:
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(usage, dict):
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            self.prompt = p if isinstance(p, int) else self.prompt
            self.completion = c if isinstance(c, int) else self.completion
            self.seen = True


def scan_usage(events: bytes, usage: Usage, strip: bool) -> bytes:
    """Record usage from the usage chunk; drop that chunk when the client did not ask for it."""
    if b'"prompt_tokens"' not in events:  # the cheap check: most chunks never get parsed
        return events
    sep = b"\r\n\r\n" if b"\r\n\r\n" in events else b"\n\n"
    kept = []
    for ev in events.split(sep):
        if b'"prompt_tokens"' in ev and ev.startswith(b"data:"):
            try:
                obj = json.loads(ev[5:])
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                usage.take(obj)
                if strip and not obj.get("choices"):
                    continue
        kept.append(ev)
    return sep.join(kept)


class Exchange:
    """One proxied request: owns its lease for its whole life and records its metrics once at the end."""

    def __init__(self, st: RouterState, request: web.Request, lease: Lease) -> None:
        self.st = st
        self.request = request
        self.lease = lease
        self.code = CLIENT_CLOSED
        self.t0 = time.monotonic()
        self.usage = Usage()
        self.upstream: aiohttp.ClientResponse | None = None
        self.task = asyncio.current_task()
        self.inflight_at_start = lease.backend.inflight
        self.ttft: float | None = None
        self.chunks = 0
        self.cut = False  # set when the drain ended before this exchange did
        self.delivered = False  # [DONE] went out: a client leaving after it got the whole answer
        st.exchanges.add(self)

    def cut_now(self) -> None:
        """The drain is over: stop this exchange so it can answer with an explicit error."""
        if not self.cut and self.task is not None and not self.task.done():
            self.cut = True
            self.task.cancel()

    def absorb_cut(self) -> bool:
        """True when the CancelledError being handled is cut_now()'s alone (then it is taken back)."""
        return self.cut and self.task is not None and self.task.uncancel() == 0

    @property
    def pool(self) -> str:
        return self.lease.backend.pool

    def headers(self) -> dict[str, str]:
        return {POOL_HEADER: self.lease.backend.pool, BACKEND_HEADER: self.lease.backend.url}

    def upstream_failed(self, err: UpstreamError) -> None:
        self.st.metrics.upstream_errors.labels(self.lease.backend.url, err.kind).inc()
        self.st.pools.report_attempt(self.lease.backend, Attempt(_ATTEMPT_KIND.get(err.kind, DISCONNECTED)))

    async def open(self, path: str, body: bytes) -> aiohttp.ClientResponse:
        """Send the request and wait for response headers; retry elsewhere only before any byte came back."""
        assert self.st.session is not None
        attempts = 0
        while True:
            b = self.lease.backend
            try:
                resp = await self.st.session.post(b.url + path, data=body,
                                                  headers=upstream_headers(self.request, b.api_key))
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                err = map_error(exc, b.url, FIRST_BYTE, got_headers=False)
                self.upstream_failed(err)
                if not err.retryable or attempts >= self.st.settings.retries or not self._retry():
                    raise err from None
                attempts += 1
                continue
            self.st.pools.report_attempt(b, Attempt(OK, resp.status))
            if resp.status in RETRY_STATUSES and attempts < self.st.settings.retries and self._retry():
                self.st.metrics.upstream_errors.labels(b.url, f"status_{resp.status}").inc()
                resp.close()
                attempts += 1
                continue
            self.upstream = resp
            return resp

    def _retry(self) -> bool:
        new = self.st.pools.acquire_retry(self.lease.backend)
        if new is None:
            return False
        self.lease.release()
        self.lease = new
        self.inflight_at_start = new.backend.inflight
        self.st.metrics.decisions.labels(new.backend.pool, RETRY).inc()
        self.st.metrics.retries.labels(new.backend.pool).inc()
        return True

    async def buffered(self, resp: aiohttp.ClientResponse) -> web.Response:
        body = await resp.read()
        if resp.status == 200 and b'"usage"' in body:
            try:
                self.usage.take(json.loads(body))
            except ValueError:
                pass
        headers = self.headers()
        if "Content-Type" in resp.headers:
            headers["Content-Type"] = resp.headers["Content-Type"]
        return web.Response(status=resp.status, body=body, headers=headers)

    async def stream(self, resp: aiohttp.ClientResponse, first: bytes, strip: bool) -> web.StreamResponse:
        """Forward complete SSE events as they arrive; `first` is the first chunk, read before any byte went out."""
        m = self.st.metrics
        idle = self.st.settings.idle_timeout
        headers = {**self.headers(), "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                   "Cache-Control": "no-cache"}
        out = web.StreamResponse(status=resp.status, headers=headers)
        buf = b""
        last = None
        chunk = first
        try:
            await out.prepare(self.request)
            self.code = str(resp.status)
            while chunk:
                events, buf = split_events(buf + chunk)
                if events:
                    events = scan_usage(events, self.usage, strip)
                if events:
                    now = time.monotonic()
                    self.chunks += 1
                    if last is None:
                        self.ttft = now - self.t0
                        m.ttft_by_pool[self.pool].observe(self.ttft)
                    else:
                        m.itl_by_pool[self.pool].observe(now - last)
                    last = now
                    await out.write(events)
                    self.delivered = events.rstrip().endswith(b"data: [DONE]")
                try:
                    async with asyncio.timeout(idle):
                        chunk = await resp.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # Headers went out already: tell the client in-band, then end the stream cleanly.
                    err = map_error(exc, self.lease.backend.url, IDLE, got_headers=True)
                    self.upstream_failed(err)
                    await out.write(sse_error_event(err))
                    buf = b""
                    break
            if buf:
                await out.write(scan_usage(buf, self.usage, strip))
            await out.write_eof()
        except ConnectionError:
            if not self.delivered:
                self.code = CLIENT_CLOSED  # the client went away while we wrote to it
        except asyncio.CancelledError:
            if not self.absorb_cut():
                if not self.delivered:
                    self.code = CLIENT_CLOSED
                raise
            try:
                # Shutdown, not a backend failure: end the stream the way every other error mid-stream ends.
                await out.write(sse_error_event(ShuttingDown("the router is shutting down; retry the request")))
                await out.write_eof()
            except ConnectionError:
                self.code = CLIENT_CLOSED
        return out

    def finish(self) -> None:
        """Runs exactly once, in `finally`: release the lease, close upstream, record the outcome."""
        self.st.exchanges.discard(self)
        b = self.lease.backend
        ok = self.code.startswith("2") and (self.delivered or self.ttft is None)
        self.st.pools.report_done(b, Observation(
            b.pool, b.url, self.inflight_at_start, b.inflight, time.monotonic() - self.t0, self.ttft,
            self.usage.completion if self.usage.seen else None, self.chunks, ok))
        self.lease.release()
        if self.upstream is not None:
            # close(), not release(): an unfinished response must drop its connection so SGLang aborts.
            if self.upstream.content.at_eof():
                self.upstream.release()
            else:
                self.upstream.close()
        m = self.st.metrics
        b = self.lease.backend
        m.requests.labels(b.pool, b.url, self.code).inc()
        m.duration.labels(b.pool).observe(time.monotonic() - self.t0)
        if self.usage.seen:
            m.prompt_tokens.labels(b.pool).inc(self.usage.prompt)
            m.completion_tokens.labels(b.pool).inc(self.usage.completion)
        if self.code == CLIENT_CLOSED:
            m.disconnects.labels(b.pool).inc()


async def _proxy(request: web.Request, path: str) -> web.StreamResponse:
    st = request.app[STATE]
    pinned = pinned_pool(request)
    body, obj = await read_json_body(request, st.settings.max_body_bytes, st.settings.client_timeout)
    stream = obj.get("stream") is True
    opts = obj.get("stream_options")
    client_wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    if stream and not client_wants_usage:
        body = with_usage(body, obj)
    got = st.pools.acquire(pinned)
    if got is None:
        raise NoHealthyBackend("no healthy backend in either pool")
    lease, decision = got
    st.metrics.decisions.labels(decision.pool, decision.reason).inc()
    ex = Exchange(st, request, lease)
    try:
        try:
            async with asyncio.timeout(st.settings.first_byte_timeout):
                resp = await ex.open(path, body)
                sse = stream and resp.status == 200 and resp.content_type == "text/event-stream"
                if sse:
                    # Wait for the first chunk before answering: until then a failure is a clean 504/502.
                    first = await resp.content.readany()
                else:
                    out = await ex.buffered(resp)
        except TimeoutError as exc:
            err = map_error(exc, ex.lease.backend.url, FIRST_BYTE, got_headers=False)
            ex.upstream_failed(err)
            raise err from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            err = map_error(exc, ex.lease.backend.url, FIRST_BYTE, got_headers=True)
            ex.upstream_failed(err)
            raise err from None
        if sse:
            return await ex.stream(resp, first, strip=not client_wants_usage)
        ex.code = str(out.status)
        return out
    except RouterError as err:
        ex.code = str(err.status)
        return error_response(err, ex.headers())
    except asyncio.CancelledError:
        if not ex.absorb_cut():
            raise
        err = ShuttingDown("the router is shutting down; retry the request")
        ex.code = str(err.status)
        return error_response(err, ex.headers())
    finally:
        ex.finish()


def cut_all(st: RouterState) -> None:
    """Called when the drain time is up: every exchange still open ends with an explicit 503 / SSE error."""
    for ex in list(st.exchanges):
        ex.cut_now()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, COMPLETIONS)


# ---------------------------------------------------------------- router's own endpoints

async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.settings.served_model_name:
        data = [{"id": st.settings.served_model_name, "object": "model", "created": 0, "owned_by": "spec-router"}]
        return web.json_response({"object": "list", "data": data})
    assert st.session is not None
    session = st.session
    backends = [b for b in st.pools.backends if b.healthy]

    async def fetch(b: Backend) -> list:
        try:
            async with asyncio.timeout(st.settings.health_timeout):
                async with session.get(b.url + "/v1/models", headers=b.auth_headers) as resp:
                    if resp.status != 200:
                        return []
                    got = await resp.json(content_type=None)
        except (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError):
            return []
        data = got.get("data") if isinstance(got, dict) else None
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(data, list) else []

    lists = await asyncio.gather(*(fetch(b) for b in backends))
    seen: dict[str, dict] = {}
    for entries in lists:
        for entry in entries:
            seen.setdefault(entry["id"], entry)
    if not seen:
        raise NoHealthyBackend("no healthy backend answered /v1/models")
    return web.json_response({"object": "list", "data": list(seen.values())})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    pools = request.app[STATE].pools
    up = {b.url: b.healthy for b in pools.backends}
    if not pools.any_healthy():
        err = NoHealthyBackend("no backend is healthy yet")
        body = err.body()
        body["backends"] = up
        return web.json_response(body, status=503)
    return web.json_response({"status": "ready", "backends": up})


def metrics_handler(st: RouterState) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        out = web.Response(body=generate_latest(st.metrics.registry))
        out.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return out
    return handler
