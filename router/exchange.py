"""One proxied request from decision to last byte: the lease it owns, retries, streaming back, and its metrics."""
from __future__ import annotations

import asyncio
import time

from aiohttp import hdrs, web

from router.body import read_body, with_usage
from router.core.latency import Shed
from router.errors import (
    Failure,
    RouterError,
    ShuttingDown,
    TargetsUnmet,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamTimeout,
    error_response,
    sse_error_event,
    status_kind,
)
from router.headers import (
    BACKEND_HEADER,
    POOL_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    pinned_pool,
    predicted_headers,
)
from router.health import no_backend
from router.observe import OK, Attempt, finished
from router.policy import RETRY
from router.pools import Lease
from router.prefix import prompt_of
from router.slo import targets_of, tier_label
from router.state import STATE, RouterState
from router.streaming import Usage, scan_usage, split_events, usage_view
from router.upstream import FIRST_BYTE, IDLE, Reply
from router.watchdog import FirstByteDeadline, Watchdog

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RETRY_STATUSES = frozenset((502, 503))
# Status label for a client that left before the answer ended (nginx's convention).
CLIENT_CLOSED = "499"


def upstream_headers(request: web.Request, api_key: str | None) -> dict[str, str]:
    # An allowlist: the client's Authorization and anything else it sent stay here.
    headers = {hdrs.CONTENT_TYPE: request.headers.get(hdrs.CONTENT_TYPE, "application/json"),
               hdrs.ACCEPT: request.headers.get(hdrs.ACCEPT, "*/*")}
    if api_key:
        headers[hdrs.AUTHORIZATION] = f"Bearer {api_key}"
    return headers


class Exchange:
    """One proxied request: owns its lease and the backend's answer for its whole life (both end once, in
    end_upstream) and records its metrics once at the end (finish)."""

    __slots__ = ("st", "request", "lease", "code", "t0", "usage", "upstream", "task", "inflight_at_start", "ttft",
                 "chunks", "data_events", "cut", "first", "delivered", "watchdog", "placement", "streamed",
                 "targets", "forecast")

    def __init__(self, st: RouterState, request: web.Request, lease: Lease, placement=None, targets=None,
                 forecast=None) -> None:
        self.st = st
        # The request's latency targets (router.core.latency.Targets) and the chosen backend's predicted latency
        # (Forecast); None for a request without targets.
        self.targets = targets
        self.forecast = forecast
        self.placement = placement  # router.affinity.Placement, None when prefix routing is off
        self.request = request
        self.lease = lease
        self.code = CLIENT_CLOSED
        self.t0 = time.monotonic()
        self.usage = Usage()
        self.upstream: Reply | None = None  # the answer being read; ended with the lease
        task = asyncio.current_task()  # the handler's: an exchange lives inside it
        assert task is not None
        self.task = task
        self.inflight_at_start = lease.backend.inflight
        self.ttft: float | None = None
        self.chunks = 0
        self.data_events = 0  # SSE `data:` events forwarded ([DONE] included): tokens where no usage comes
        self.cut = False  # set when the drain ended before this exchange did
        # self.first: a stream's first chunk, set by proxy() and taken by stream() (nothing reads it before)
        self.delivered = False  # the client took [DONE]: a client leaving after it got the whole answer
        self.watchdog: Watchdog | None = None
        # self.streamed: the client asked for a stream, set by start() (placed() reads it, within start)
        st.exchanges.add(self)  # open until finish()

    def cut_now(self) -> None:
        """The drain is over: stop this exchange so it can answer with an explicit error. Called once (cut_all
        runs once), and only while the exchange is open (finish() takes it out of st.exchanges)."""
        self.cut = True
        self.task.cancel()

    def absorb_cut(self) -> bool:
        """True when the CancelledError being handled is cut_now()'s alone. cut_now()'s cancellation is taken
        back at most once: with a client disconnect pending too, a second call must not take back that one."""
        cut, self.cut = self.cut, False
        if not cut:
            return False
        return self.task.uncancel() == 0

    @property
    def pool(self) -> str:
        return self.lease.backend.pool

    def headers(self) -> dict[str, str]:
        out = {POOL_HEADER: self.lease.backend.pool, BACKEND_HEADER: self.lease.backend.url}
        if self.forecast is not None:
            out.update(predicted_headers(self.forecast))
        return out

    def upstream_failed(self, err: UpstreamError) -> None:
        m = self.st.metrics
        m.child(m.upstream_errors, self.lease.backend.url, err.kind).inc()
        self.st.pools.report_attempt(self.lease.backend, Attempt(err.failure))

    def first_byte_timeout(self) -> UpstreamError:
        """first_byte_timeout ran out (router.watchdog.FirstByteDeadline) on the backend tried last."""
        url = self.lease.backend.url
        err = UpstreamTimeout.silent(url, Failure.FIRST_BYTE_TIMEOUT)
        self.upstream_failed(err)
        return err

    async def start(self, path: str, body: bytes, stream: bool
                    ) -> tuple[Reply, bytes | None, web.Response | None]:
        """Send the request and wait for its first chunk (streams) or whole body; until a byte went to the client,
        a refused connection, a 502/503, or a backend closing the connection is retried on another backend."""
        client = self.st.client
        assert client is not None
        self.streamed = stream
        attempts = 0
        while True:
            b = self.lease.backend
            try:
                resp = await client.open(b.url, path, body, upstream_headers(self.request, b.api_key), self.placed)
            except UpstreamError as err:
                self.upstream_failed(err)
                if not err.retryable or attempts >= self.st.settings.retries or not self._retry():
                    raise
                attempts += 1
                continue
            self.upstream = resp
            self.st.pools.report_attempt(b, Attempt(OK, resp.status))
            if resp.status in RETRY_STATUSES and attempts < self.st.settings.retries and self._retry():
                m = self.st.metrics
                m.child(m.upstream_errors, b.url, status_kind(resp.status)).inc()
                attempts += 1
                continue
            sse = stream and resp.status == 200 and resp.content_type == "text/event-stream"
            try:
                if sse:
                    # Wait for the first chunk before answering: until then a failure is a clean 504/502.
                    first = await resp.read_chunk(FIRST_BYTE)
                    self.lease.prefilled()  # its prompt is prefilled: no longer queued ahead of others
                    return resp, first, None
                return resp, None, await self.buffered(resp)
            except UpstreamError as err:
                self.upstream_failed(err)
                # Headers came, but the client has received nothing yet: as safe to retry as a refusal.
                if (not isinstance(err, UpstreamDisconnected) or attempts >= self.st.settings.retries
                        or not self._retry()):
                    raise
                attempts += 1

    def placed(self, waited: float | None) -> None:
        """The backend's place under max_connections_per_backend is held (router.upstream.Client.open): a wait
        shows in the metrics, and a request not streamed counts as running from now (no byte shows when it
        starts)."""
        if waited is not None:
            m = self.st.metrics
            m.child(m.upstream_wait, self.pool).observe(waited)
        if not self.streamed:
            self.lease.start()

    def _retry(self) -> bool:
        """Another backend takes the request: the failed attempt's answer and lease end (its failure was reported
        as an attempt; nothing finished there)."""
        new = self.st.pools.acquire_retry(self.lease.backend, self.placement)
        if new is None:
            return False
        new.hold_target(self.lease.tpot_target)
        self.end_reply()
        self.lease.finish(None)
        self.lease = new
        self.inflight_at_start = new.backend.inflight
        m = self.st.metrics
        m.child(m.decisions, new.backend.pool, RETRY).inc()
        m.child(m.retries, new.backend.pool).inc()
        return True

    async def buffered(self, resp: Reply) -> web.Response:
        body = await resp.read_body()
        if resp.status == 200 and b'"usage"' in body:
            self.usage.take(usage_view(body))
        headers = self.headers()
        if resp.ctype is not None:
            headers[hdrs.CONTENT_TYPE] = resp.ctype
        return web.Response(status=resp.status, body=body, headers=headers)

    async def stream(self, resp: Reply, strip: bool) -> web.StreamResponse:
        """Forward complete SSE events as they arrive, from `self.first` on (the first chunk, read before any byte
        went out).

        Writes do not wait for the client (up to write_buffer_bytes), so the upstream is read at the backend's
        pace and the lease ends when the backend's answer does; the client then gets the rest within
        write_timeout-bounded stalls.
        """
        m = self.st.metrics
        s = self.st.settings
        cap = s.write_buffer_bytes
        # Only a 200 with a text/event-stream Content-Type is streamed (start()), so both are known here.
        assert resp.ctype is not None
        out = web.StreamResponse(headers={**self.headers(), hdrs.CONTENT_TYPE: resp.ctype,
                                          hdrs.CACHE_CONTROL: "no-cache"})
        buf = b""
        last = None
        chunk, self.first = self.first, None
        done_sent = False
        try:
            writer = await out.prepare(self.request)
            transport = self.request.transport
            assert writer is not None
            assert transport is not None
            self.code = str(out.status)
            self.watchdog = dog = Watchdog(s.idle_timeout, s.write_timeout, transport, writer, resp)
            while chunk:
                events, buf = split_events(buf + chunk)
                if events:
                    events = scan_usage(events, self.usage, strip)
                if events:
                    now = time.monotonic()
                    self.chunks += 1
                    # Events end in a blank line and JSON escapes its newlines: "\ndata:" starts an event.
                    self.data_events += events.count(b"\ndata:") + events.startswith(b"data:")
                    if last is None:
                        self.ttft = now - self.t0
                        m.ttft_by_pool[self.pool].observe(self.ttft)
                    else:
                        m.itl_by_pool[self.pool].observe(now - last)
                    last = now
                    await write(writer, events)
                    done_sent = events.rstrip().endswith(b"data: [DONE]")
                    # The kernel took it all: the client has the whole answer even if it leaves now.
                    self.delivered = done_sent and not transport.get_write_buffer_size()
                    if transport.get_write_buffer_size() > cap:
                        await writer.drain()  # the client is that far behind: let the backend wait too
                del events, chunk  # forwarded: an idle stream holds no bytes while it waits
                try:
                    chunk = await resp.read_chunk(IDLE)
                except UpstreamError as err:
                    # Headers went out already: tell the client in-band, then end the stream cleanly.
                    self.upstream_failed(err)
                    self.end_upstream(done_sent)
                    await write(writer, sse_error_event(err))
                    break  # what is left in buf is dropped
                dog.last_chunk = time.monotonic()
            else:
                if buf:  # the backend's last bytes, without a blank line after them
                    await write(writer, scan_usage(buf, self.usage, strip))
            self.end_upstream(done_sent)
            await out.write_eof()
            await flush(writer, transport)
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

    def end_upstream(self, complete: bool) -> None:
        """The backend's part is over (answered, failed, abandoned or cut): the lease ends with what was observed
        and the answer is given back, once (a later call does nothing)."""
        lease = self.lease
        if lease.released:
            return
        if self.watchdog is not None:
            self.watchdog.upstream_done()
        # A stream is finished only by its [DONE]; a buffered answer (no watchdog) by its whole body.
        ok = self.code.startswith("2") and (complete or self.watchdog is None)
        obs = finished(lease, self.usage, inflight_at_start=self.inflight_at_start, t0=self.t0, ttft=self.ttft,
                       chunks=self.chunks, ok=ok, data_events=self.data_events)
        try:
            lease.finish(obs, self.st.pools, self.placement)
        finally:
            self.end_reply()
        if self.targets is not None and self.forecast is not None:
            self.st.metrics.slo_done(tier_label(self.targets), self.targets, self.forecast, obs)

    def end_reply(self) -> None:
        """The answer's connection back for reuse when complete, else dropped (router.upstream.Reply.end)."""
        reply, self.upstream = self.upstream, None
        if reply is not None:
            reply.end()

    def finish(self) -> None:
        """Runs in `finally`, once (a later call does nothing): end the lease and the answer if still held, record
        the outcome."""
        exchanges = self.st.exchanges
        if self not in exchanges:
            return  # finished already
        exchanges.remove(self)
        if self.watchdog is not None:
            self.watchdog.stop()
        self.end_upstream(self.delivered)
        b = self.lease.backend
        m = self.st.metrics
        m.child(m.requests, b.pool, b.url, self.code).inc()
        m.child(m.duration, b.pool).observe(time.monotonic() - self.t0)
        if self.usage.seen:
            m.child(m.prompt_tokens, b.pool).inc(self.usage.prompt)
            m.child(m.completion_tokens, b.pool).inc(self.usage.completion)
            if self.usage.cached is not None:
                m.child(m.cached_tokens, b.pool).inc(self.usage.cached)
                m.child(m.cache_reported_prompt_tokens, b.pool).inc(self.usage.prompt)
        if self.code == CLIENT_CLOSED:
            m.child(m.disconnects, b.pool).inc()


def write(writer, data: bytes):
    """A stream's writes never wait for the client (up to write_buffer_bytes, stream()), so the upstream is read at
    the backend's pace; the watchdog bounds a client that stops reading."""
    return writer.write(data, drain=False)


async def flush(writer, transport: asyncio.BaseTransport) -> None:
    """Wait until the client has taken every byte (the watchdog bounds each stall)."""
    if transport.is_closing() or not transport.get_write_buffer_size():
        return
    low, high = transport.get_write_buffer_limits()
    transport.set_write_buffer_limits(high=0)  # paused until the buffer is empty
    try:
        await writer.drain()
    finally:
        if not transport.is_closing():
            transport.set_write_buffer_limits(high=high, low=low)


async def proxy(request: web.Request, path: str) -> web.StreamResponse:
    st = request.app[STATE]
    pinned = pinned_pool(request.headers.get(POOL_HEADER))
    body, head = await read_body(request, st.settings.max_body_bytes, st.settings.client_timeout)
    stream = head.streamed
    client_wants_usage = head.wants_usage
    if stream and not client_wants_usage:
        body = with_usage(body, head)
    targets = targets_of(request.headers.get(SLO_TTFT_HEADER), request.headers.get(SLO_TPOT_HEADER),
                         head.service_tier, st.settings.slo_tiers)
    # A request with targets is prefixed too without prefix routing: its prompt's prefill is part of its TTFT.
    prompt = (prompt_of(head.messages, head.prompt, st.settings.prefix_block_bytes)
              if st.pools.affinity or targets is not None else None)
    got = st.pools.place(pinned, prompt) if targets is None else st.pools.choose(pinned, prompt, None, targets)
    if got is None:
        raise no_backend(st.pools.backends)
    if isinstance(got, Shed):
        assert targets is not None
        st.metrics.slo_shed(tier_label(targets))
        return error_response(TargetsUnmet(
            f"no backend can meet the latency targets now (predicted TTFT {got.forecast.ttft_s * 1000:.0f} ms, "
            f"TPOT {got.forecast.tpot_s * 1000:.1f} ms at best); retry after {got.retry_after_s} s",
            retry_after_s=got.retry_after_s), predicted_headers(got.forecast))
    lease, decision, placement, forecast = got if len(got) == 4 else (*got, None)
    st.metrics.decided(decision, placement)
    ex = Exchange(st, request, lease, placement, targets, forecast)
    try:
        with FirstByteDeadline(st.settings.first_byte_timeout, ex.first_byte_timeout):
            resp, first, out = await ex.start(path, body, stream)
        del body  # sent: an open stream holds only what it still has to forward
        if first is not None:
            ex.first, first = first, None
            return await ex.stream(resp, strip=not client_wants_usage)
        assert out is not None
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
    return await proxy(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await proxy(request, COMPLETIONS)
