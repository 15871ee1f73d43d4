"""SSE framing and the usage scan (router.streaming) over HTTP: CRLF-delimited streams split across reads, an
in-band error next to the usage chunk, odd usage figures. Expected bytes are built by hand from the events;
each test's docstring names the mutmut mutants it kills."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.fixtures_rawbackend import json_answer, sse

CHAT = "/v1/chat/completions"
STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
WITH_USAGE = {**STREAM, "stream_options": {"include_usage": True}}


def ev(obj: dict | str) -> bytes:
    return b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj, separators=(",", ":")).encode())


def content(text: str) -> dict:
    return {"id": "r", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE_ONLY = {"id": "r", "object": "chat.completion.chunk", "choices": [],
              "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}}


async def post(url: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("final_blank_line", [True, False])
@pytest.mark.parametrize("piece", [1, 7, None])
async def test_crlf_delimited_stream_split_across_reads(raw_backend_factory, router_factory, piece,
                                                        final_blank_line):
    """Events separated by CRLF CRLF (allowed by the SSE spec), written 1 or 7 bytes at a time or all at once
    (then several events share one read, the usage chunk among them): every byte
    reaches the client when it asked for usage; otherwise exactly the usage-only event goes, and the figures
    are counted either way. mutmut: split_events' CRLF branch (`rfind`, `>= 0`, `+ 4`, the separator) and
    scan_usage's separator choice."""
    events = [ev(content("Hel")), ev(content("lo")), ev(USAGE_ONLY), ev("[DONE]")]
    body = b"\r\n\r\n".join(events) + (b"\r\n\r\n" if final_blank_line else b"")
    be = await raw_backend_factory({CHAT: sse(body, piece=piece)})
    router = await router_factory([be.url], [])
    assert await post(router.url, WITH_USAGE) == (200, body)
    stripped = b"\r\n\r\n".join([events[0], events[1], events[3]]) + (b"\r\n\r\n" if final_blank_line else b"")
    assert await post(router.url, STREAM) == (200, stripped)
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 22
    assert router.metric("router_completion_tokens_total", pool="speculative") == 8


async def test_an_error_event_in_the_same_read_as_the_usage_chunk_is_kept(raw_backend_factory, router_factory):
    """An in-band error (no choices, no usage) arriving in one read with the usage chunk: only the usage chunk
    is stripped. mutmut: scan_usage's `b'"prompt_tokens"' in ev and ev.startswith(b"data:")` -> `or` (every
    event of the read parsed, the error taken for a usage chunk and dropped)."""
    error = ev({"error": {"message": "backend overloaded", "code": 503}})
    body = b"\n\n".join([ev(content("x")), error, ev(USAGE_ONLY), ev("[DONE]")]) + b"\n\n"
    be = await raw_backend_factory({CHAT: sse(body)})  # one piece: a single read
    router = await router_factory([be.url], [])
    status, got = await post(router.url, STREAM)
    assert (status, got) == (200, b"\n\n".join([ev(content("x")), error, ev("[DONE]")]) + b"\n\n")


async def test_usage_figures_that_are_not_integers_are_not_counted(raw_backend_factory, router_factory):
    """A usage chunk whose figures are not integers counts nothing for them; a later good one counts.
    mutmut: Usage.take's `isinstance(p, int)` / `isinstance(c, int)` checks and the `isinstance(usage, dict)`."""
    odd = {**USAGE_ONLY, "usage": {"prompt_tokens": 11.5, "completion_tokens": 4.5}}
    not_a_dict = {**USAGE_ONLY, "usage": [11, 4], "prompt_tokens": 1}
    body = b"\n\n".join([ev(content("x")), ev(odd), ev(not_a_dict), ev("[DONE]")]) + b"\n\n"
    be = await raw_backend_factory({CHAT: sse(body, piece=7)})
    router = await router_factory([be.url], [])
    status, got = await post(router.url, WITH_USAGE)
    assert (status, got) == (200, body)
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 0
    assert router.metric("router_completion_tokens_total", pool="speculative") == 0


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
async def test_each_event_is_forwarded_before_the_next_one_exists(raw_backend_factory, router_factory, sep):
    """The backend sends one event and then waits until the client has it: the router must not hold complete
    events back. mutmut: split_events' separator strings (an unknown separator buffers the whole answer)."""
    first, rest = ev(content("first")) + sep, ev(content("second")) + sep + ev("[DONE]") + sep
    client_has_first = asyncio.Event()

    async def act(c):
        await c.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                      b"Connection: close\r\n\r\n")
        await c.write_chunked(first)
        await client_has_first.wait()
        await c.write_chunked(rest)
        await c.write(b"0\r\n\r\n")

    be = await raw_backend_factory({CHAT: act})
    router = await router_factory([be.url], [])
    got = b""
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json=WITH_USAGE) as r:
        async with asyncio.timeout(10):
            while first not in got:
                piece = await r.content.readany()
                assert piece, "the stream ended before its first event arrived"
                got += piece
            client_has_first.set()
            got += await r.content.read()
    assert got == first + rest


async def test_a_non_streamed_answer_that_only_looks_like_json_passes_through(raw_backend_factory,
                                                                             router_factory):
    """A 200 whose body mentions "usage" but is not JSON: passed through as sent, nothing counted. mutmut:
    Usage.take's `view is not None` check (the router would fail with a 500)."""
    broken = b'{"usage": {"prompt_tokens": 3'
    be = await raw_backend_factory({CHAT: json_answer(200, broken)})
    router = await router_factory([be.url], [])
    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, json={"model": "m"}) as r:
        assert (r.status, await r.read()) == (200, broken)
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 0


async def test_a_usage_event_without_the_space_after_data(raw_backend_factory, router_factory):
    """`data:{...}` (no space; the SSE spec allows it) is still the usage chunk: stripped and counted.
    mutmut: scan_usage's `ev[5:]` -> `ev[6:]`."""
    usage = b"data:" + json.dumps(USAGE_ONLY, separators=(",", ":")).encode()
    body = b"\n\n".join([ev(content("x")), usage, ev("[DONE]")]) + b"\n\n"
    be = await raw_backend_factory({CHAT: sse(body)})
    router = await router_factory([be.url], [])
    assert await post(router.url, STREAM) == (200, b"\n\n".join([ev(content("x")), ev("[DONE]")]) + b"\n\n")
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 11
