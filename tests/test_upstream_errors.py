"""Each upstream failure kind as a client sees it through the router: status and the whole OpenAI-style error
document (message, type, code), or the in-band SSE error event once a stream has started.

The expected documents are written out by hand, so a changed word, a lost backend URL, a wrong phase or a kind
mapped to another class fails here. Plus the request bytes the client module writes (header sanitising, bytes
that were not UTF-8) and the counting of its per-backend places. Each docstring names the mutmut mutants of
router/upstream.py it kills (`bash scripts/mutation.sh router/upstream.py`).
"""
from __future__ import annotations

import asyncio
import json
import socket
import ssl

import aiohttp
import pytest

from router import upstream
from router.errors import UpstreamError
from tests.fixtures_rawbackend import (
    Conn,
    hang,
    headers_then,
    sse,
    sse_body,
)
from tests.fixtures_router import poll

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**BODY, "stream": True}
# One probe round only, long enough not to fail on a busy machine; no retry, so each answer is one attempt's.
SETTINGS = {"health_interval": 60.0, "health_timeout": 10.0, "first_byte_timeout": 5.0, "connect_timeout": 5.0,
            "retries": 0}


async def post(url: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.post(url + CHAT, json=body) as r:
        return r.status, await r.read()


def no_wait(waited: float | None) -> None:
    """Client.open's `placed`: nothing to record."""


def document(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


def sse_error(message: str, type_: str, code: str) -> bytes:
    """The router's in-band error: one event with the document (json.dumps' default separators), then [DONE]."""
    return (b"data: " + json.dumps(document(message, type_, code)).encode() + b"\n\ndata: [DONE]\n\n")


def malformed_body(stream: bool):
    """200 headers, then a chunk-size line that is not hexadecimal: a protocol error after the headers."""
    async def act(c: Conn) -> None:
        ctype = "text/event-stream" if stream else "application/json"
        await c.write(f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        await asyncio.sleep(0.05)
        await c.write(b"zz\r\nnot a chunk\r\n")
        await asyncio.sleep(0.5)
    return act


async def garbage_status_line(c: Conn) -> None:
    await c.write(b"SPDY/9 what\r\n\r\n")
    await asyncio.sleep(0.5)


def errors_counted(router, url: str) -> dict[str, float]:
    kinds = ("connect", "connect_timeout", "first_byte_timeout", "idle_timeout", "disconnect", "error", "local")
    return {k: v for k in kinds if (v := router.metric("router_upstream_errors_total", backend=url, kind=k))}


# ---------------------------------------------------------------- before any byte reached the client

async def test_refused_connection_is_502_backend_unreachable_with_the_os_reason(raw_backend_factory,
                                                                               router_factory):
    """mutmut: map_error 26 (reason None), 27 (`strerror and os_error`: the "[Errno 111]" prefix), 33, 35, 36
    (message None / missing), send 13 (exc None), send 14 (backend None in the message)."""
    b = await raw_backend_factory({})
    router = await router_factory([b.url], [], **SETTINGS)
    await b.stop_listening()
    status, raw = await post(router.url, BODY)
    assert status == 502
    assert json.loads(raw) == document(
        f"cannot connect to backend {b.url}: Connect call failed ('127.0.0.1', {b.port})",
        "upstream_error", "backend_unreachable")
    assert errors_counted(router, b.url) == {"connect": 1}


async def test_connect_timeout_is_504_with_its_own_message(raw_backend_factory, router_factory):
    """mutmut: map_error 1-9 (the error None, message None or missing, kind None / missing / misspelt)."""
    b = await raw_backend_factory({})
    router = await router_factory([b.url], [], **{**SETTINGS, "connect_timeout": 0.3})
    await b.blackhole()
    status, raw = await post(router.url, BODY)
    assert status == 504
    assert json.loads(raw) == document(f"connecting to backend {b.url} timed out", "timeout_error",
                                       "upstream_timeout")
    assert errors_counted(router, b.url) == {"connect_timeout": 1}


@pytest.mark.parametrize("stream", [False, True])
async def test_no_headers_in_time_is_504_no_first_byte(raw_backend_factory, router_factory, stream):
    """mutmut: map_error 12-17 and 20 (`what` None, its condition inverted / forced, its words), 22, 23, 25
    (kind None, message missing, kind missing)."""
    b = await raw_backend_factory({CHAT: hang()})
    router = await router_factory([b.url], [], **{**SETTINGS, "first_byte_timeout": 0.5})
    status, raw = await post(router.url, STREAM if stream else BODY)
    assert status == 504
    assert json.loads(raw) == document(f"backend {b.url} sent no first byte in time", "timeout_error",
                                       "upstream_timeout")
    assert errors_counted(router, b.url) == {"first_byte_timeout": 1}


@pytest.mark.parametrize("stream", [False, True])
async def test_closed_after_headers_is_502_closed_the_connection(raw_backend_factory, router_factory, stream):
    """mutmut: map_error 39-43 (the error None, message None / missing), read_chunk 1 and 2 / read_body 1 and 2
    (exc or backend None)."""
    b = await raw_backend_factory({CHAT: headers_then("close", stream=stream)})
    router = await router_factory([b.url], [], **SETTINGS)
    status, raw = await post(router.url, STREAM if stream else BODY)
    assert status == 502
    assert json.loads(raw) == document(f"backend {b.url} closed the connection", "upstream_error",
                                       "backend_disconnected")
    assert errors_counted(router, b.url) == {"disconnect": 1}


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_body_after_headers_counts_as_a_disconnect(raw_backend_factory, router_factory, stream):
    """A protocol error after the headers is the backend dropping the exchange (502 backend_disconnected), not
    a generic failure. mutmut: map_error 37 (`or` -> `and`), read_chunk 4 and 9 / read_body 4 and 9 (got_headers
    None / False: a generic bad_gateway)."""
    b = await raw_backend_factory({CHAT: malformed_body(stream)})
    router = await router_factory([b.url], [], **SETTINGS)
    status, raw = await post(router.url, STREAM if stream else BODY)
    assert status == 502
    assert json.loads(raw) == document(f"backend {b.url} closed the connection", "upstream_error",
                                       "backend_disconnected")
    assert errors_counted(router, b.url) == {"disconnect": 1}


async def test_garbage_status_line_is_a_generic_502_naming_the_error(raw_backend_factory, router_factory):
    """A protocol error before the headers is neither a disconnect nor retryable. mutmut: map_error 38
    (`got_headers or ...`: a retryable disconnect), 46, 48-50 (message None / missing, `type(None)`),
    send 21 (got_headers True)."""
    b = await raw_backend_factory({CHAT: garbage_status_line})
    router = await router_factory([b.url], [], **SETTINGS)
    status, raw = await post(router.url, BODY)
    assert status == 502
    assert json.loads(raw) == document(f"backend {b.url} failed: ProtocolError", "upstream_error", "bad_gateway")
    assert errors_counted(router, b.url) == {"error": 1}


async def test_our_own_dns_failure_is_503_router_local_error(raw_backend_factory, router_factory, monkeypatch):
    """The router could not even look the backend up (after a first probe found it): its own trouble, a 503
    naming the resolver's reason. mutmut: map_error 28-32 (is_local(None), message None / missing), is_local 1,
    3, 4."""
    b = await raw_backend_factory({})
    url = f"http://localhost:{b.port}"
    router = await router_factory([url], [], **SETTINGS)

    async def no_dns(*args, **kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_dns)
    status, raw = await post(router.url, BODY)
    assert status == 503
    assert json.loads(raw) == document(
        f"the router could not connect to backend {url}: Temporary failure in name resolution",
        "service_unavailable", "router_local_error")
    assert errors_counted(router, url) == {"local": 1}
    assert b.chat_hits() == 0


# ---------------------------------------------------------------- after the stream started: in-band errors

FIRST = {"id": "r", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}


def first_then(rest):
    """200 stream headers and one whole event, then `rest(conn)`."""
    async def act(c: Conn) -> None:
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.write_chunked(sse_body(FIRST))
        await rest(c)
    return act


async def _stall(c: Conn) -> None:
    await asyncio.Event().wait()


async def _bad_chunk(c: Conn) -> None:
    await asyncio.sleep(0.05)
    await c.write(b"zz\r\n")
    await asyncio.sleep(0.5)


async def test_silence_mid_stream_is_an_in_band_next_chunk_timeout(raw_backend_factory, router_factory):
    """mutmut: map_error 18 and 19 ("next chunk" misspelt), read_chunk 3 (phase None: kind "None_timeout" and
    "first byte" in the message)."""
    b = await raw_backend_factory({CHAT: first_then(_stall)})
    router = await router_factory([b.url], [], **{**SETTINGS, "idle_timeout": 0.5})
    status, raw = await post(router.url, STREAM)
    assert status == 200
    assert raw == sse_body(FIRST) + sse_error(f"backend {b.url} sent no next chunk in time", "timeout_error",
                                              "upstream_timeout")
    assert errors_counted(router, b.url) == {"idle_timeout": 1}


async def test_malformed_chunk_mid_stream_is_an_in_band_disconnect(raw_backend_factory, router_factory):
    """mutmut: read_chunk 4 and 9 after the first chunk (got_headers None / False: a generic "failed" error)."""
    b = await raw_backend_factory({CHAT: first_then(_bad_chunk)})
    router = await router_factory([b.url], [], **SETTINGS)
    status, raw = await post(router.url, STREAM)
    assert status == 200
    assert raw == sse_body(FIRST) + sse_error(f"backend {b.url} closed the connection", "upstream_error",
                                              "backend_disconnected")
    assert errors_counted(router, b.url) == {"disconnect": 1}


# ---------------------------------------------------------------- the request bytes the client writes

async def test_header_values_that_would_split_the_request_are_dropped_alone(raw_backend_factory):
    """A value with a lone LF or a lone CR is not forwarded; the headers after it still are. mutmut:
    Endpoint.request 6 (`or` -> `and`), 7 and 9 (the LF / CR test misspelt), 8 and 10 (`not in`), 11 (`break`)."""
    b = await raw_backend_factory({"/x": sse(b"data: 1\n\n")})
    client = upstream.Client(5.0, 10, 10)
    try:
        resp = await client.open(b.url, "/x", b"{}", {
            "Lf-Only": "a\nInjected: 1", "Kept-1": "one", "Cr-Only": "a\rInjected: 2", "Kept-2": "two"}, no_wait)
        assert resp.status == 200
        resp.end()
    finally:
        client.close()
    (req,) = b.requests
    assert {k: v for k, v in req.headers.items() if k not in ("host", "content-length")} == {
        "kept-1": "one", "kept-2": "two"}


async def test_header_bytes_that_were_not_utf8_are_forwarded_as_they_came(raw_backend_factory, router_factory):
    """A client's Accept header with a Latin-1 byte (not UTF-8) reaches the backend as the same byte instead of
    failing the request. mutmut: Endpoint.request 18 (strict encoding), 23 and 24 (the error handler's name)."""
    b = await raw_backend_factory({})
    router = await router_factory([b.url], [], **SETTINGS)
    body = json.dumps(BODY).encode()
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Accept: text/caf\xe9\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        async with asyncio.timeout(20):
            answer = await reader.read()
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 ")
    (req,) = [r for r in b.requests if r.path == CHAT]
    assert req.headers["accept"] == "text/caf\xe9"  # the fixture reads header bytes as Latin-1


# ---------------------------------------------------------------- places: Gate and Limits

@pytest.mark.parametrize("complete", [True, False])
async def test_a_reply_ends_once_and_gives_each_place_back_once(raw_backend_factory, complete):
    """Client.open takes the backend's place and one of the total; Reply.end gives both back (the connection
    kept for reuse when the answer was read to its end, else closed), and a second end gives nothing more.
    mutmut: Reply.end's `_client = ""` (a second end fails), its `if client is None` inverted."""
    b = await raw_backend_factory({"/x": sse(b"data: 1\n\n")})
    limits = upstream.Limits([b.url], 2)
    client = upstream.Client(5.0, 3, 10, limits=limits)
    try:
        reply = await client.open(b.url, "/x", b"{}", {}, no_wait)
        assert (limits.slots[b.url].free, client._slots.free) == (1, 2)
        if complete:
            assert await reply.read_body() == b"data: 1\n\n"
        reply.end()
        reply.end()
        assert (limits.slots[b.url].free, client._slots.free) == (2, 3)
        assert len(client.endpoint(b.url).idle) == 0  # the fixture answers with Connection: close
    finally:
        client.close()


async def test_a_waiter_cancelled_before_its_turn_takes_no_place():
    """mutmut: Gate.take 3 (`and` -> `or`: a cancelled waiter gives back a place it never had, so two
    requests could then be open where one is allowed)."""
    gate = upstream.Gate(1)
    assert gate.try_take()
    waiter = asyncio.ensure_future(gate.take())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.free == 0 and not gate.try_take()
    gate.give()
    assert gate.free == 1 and gate.try_take() and not gate.try_take()


def test_every_place_given_back_can_be_taken_again():
    """mutmut: Gate.give 3 (`free = 1`: places given back while others are free are lost), 4 and 5."""
    gate = upstream.Gate(3)
    assert [gate.try_take() for _ in range(4)] == [True, True, True, False]
    for _ in range(3):
        gate.give()
    assert gate.free == 3
    assert [gate.try_take() for _ in range(4)] == [True, True, True, False]


async def test_nobody_waits_for_a_place_before_traffic_and_a_wait_is_shown_then_gone(raw_backend_factory,
                                                                                      router_factory):
    """router_upstream_waiting_requests starts at 0 (not absent), shows the two requests waiting for the
    backend's only place, and returns to 0; each wait is recorded, within the time it took. mutmut:
    Limits.__init__ 8 (`fromkeys(urls, 1)`) and 5 (None); exchange.py's take_slot 4 (`waited is None`) and
    6-8 (the wait observed as None, on no metric or pool), numbered as in the run at f899a00."""
    release = asyncio.Event()

    async def slow(c: Conn) -> None:
        await release.wait()
        await sse(sse_body(FIRST, "[DONE]"))(c)

    b = await raw_backend_factory({CHAT: slow})
    router = await router_factory([b.url], [], **{**SETTINGS, "max_connections_per_backend": 1})
    labels = {"pool": "speculative", "backend": b.url}
    assert router.registry.get_sample_value("router_upstream_waiting_requests", labels) == 0
    t0 = asyncio.get_running_loop().time()
    posts = [asyncio.ensure_future(post(router.url, STREAM)) for _ in range(3)]
    try:
        assert await poll(lambda: router.metric("router_upstream_waiting_requests", **labels) == 2, 10)
        assert b.chat_hits() == 1
    finally:
        release.set()
    assert [s for s, _ in await asyncio.gather(*posts)] == [200, 200, 200]
    took = asyncio.get_running_loop().time() - t0
    assert router.registry.get_sample_value("router_upstream_waiting_requests", labels) == 0
    assert b.chat_hits() == 3
    assert router.metric("router_upstream_wait_seconds_count", pool="speculative") == 2
    # the two waits overlap: together at most twice the time it all took
    assert 0 <= router.metric("router_upstream_wait_seconds_sum", pool="speculative") <= 2 * took


# ---------------------------------------------------------------- where to connect: plain or TLS, which port

@pytest.mark.parametrize(("url", "host", "port", "prefix", "head", "tls"), [
    ("http://b.example/v1/", "b.example", 80, "/v1", "Host: b.example\r\n", False),
    ("https://b.example", "b.example", 443, "", "Host: b.example\r\n", True),
    ("https://b.example:8443/v1/X/", "b.example", 8443, "/v1/X", "Host: b.example:8443\r\n", True),
    ("http://10.0.0.7:30000", "10.0.0.7", 30000, "", "Host: 10.0.0.7:30000\r\n", False),
])
def test_an_endpoint_knows_where_to_connect_and_what_to_send(url, host, port, prefix, head, tls):
    """The default port per scheme, TLS only for https, the path prefix without its trailing slash, the Host
    line as the URL spells it. mutmut: Endpoint.__init__ 3-4 and 6-25 (host, port, ssl, prefix, head)."""
    ctx = ssl.create_default_context()
    ep = upstream.Endpoint(url, ctx, 3)
    assert (ep.host, ep.port, ep.prefix, ep.head, ep.max_idle) == (host, port, prefix, head, 3)
    assert ep.ssl is (ctx if tls else None)


async def test_the_client_makes_one_verifying_tls_context_for_https_backends_only():
    """mutmut: Client.__init__ 11 (`_ssl = ""`: never made), Client.endpoint 4-9 and 12 (the https test, the
    context made again or never, not passed on)."""
    client = upstream.Client(1.0, 10, 2)
    a, b, plain = (client.endpoint(u) for u in ("https://a.example", "https://b.example:8443", "http://c.example"))
    assert isinstance(a.ssl, ssl.SSLContext) and a.ssl is b.ssl and plain.ssl is None
    assert a.ssl.verify_mode == ssl.CERT_REQUIRED and a.ssl.check_hostname
    assert client.endpoint("https://a.example") is a and client.endpoint("http://c.example") is plain


async def test_an_https_backend_gets_a_tls_handshake_not_plain_http():
    """The first byte a backend at an https URL receives is a TLS handshake record (0x16), never the request
    line; a backend that then hangs up is a connect failure. mutmut: Client._connect 7 and 11 (ssl=None / no
    ssl argument: the request goes out in clear text)."""
    first: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first.append(await reader.read(1))
        writer.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = upstream.Client(5.0, 10, 2)
    try:
        with pytest.raises(UpstreamError) as info:
            async with asyncio.timeout(10):
                await client.open(url, "/v1/x", b"{}", {}, no_wait)
    finally:
        client.close()
        server.close()
        await server.wait_closed()
    assert first == [b"\x16"]
    assert info.value.kind == "connect" and str(info.value).startswith(f"cannot connect to backend {url}: ")
