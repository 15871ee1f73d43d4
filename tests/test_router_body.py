"""The client's body through the router (router.body): the exact bytes a raw backend receives, the stream keys
as JSON means them, the error messages and limits. Expected bytes are written out by hand; each test's docstring
names the mutmut mutants it kills."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from router.body import parse_head, with_usage
from tests.fixtures_rawbackend import json_answer

CHAT = "/v1/chat/completions"
USAGE = b'"stream_options":{"include_usage":true},'


async def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + CHAT, data=body,
                                                    headers={"Content-Type": "application/json",
                                                             **(headers or {})}) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


def last_chat(be):
    """The last chat request the backend saw: a health probe may land after it, so not simply the last request."""
    chats = [r for r in be.requests if r.path == CHAT]
    assert chats, "the backend saw no chat request"
    return chats[-1]


@pytest.fixture
async def pair(raw_backend_factory, router_factory):
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [], max_body_bytes=64, client_timeout=0.5)
    return be, router


@pytest.mark.parametrize(("sent", "forwarded"), [
    # streamed without stream_options: usage asked for right after the brace, every other byte as sent
    (b'{"stream":true}', b'{' + USAGE + b'"stream":true}'),
    (b' {"stream": true }', b' {' + USAGE + b'"stream": true }'),
    (b'{"stream":true,"o":{"a":1}}', b'{' + USAGE + b'"stream":true,"o":{"a":1}}'),  # the first brace
    # only JSON true streams: no rewrite for anything else
    (b'{"stream":1}', b'{"stream":1}'),
    (b'{"stream":"true"}', b'{"stream":"true"}'),
    (b'{"stream":false}', b'{"stream":false}'),
    (b'{}', b'{}'),
    # the client asked for usage itself: untouched; anything but true is not asking
    (b'{"stream":true,"stream_options":{"include_usage":true}}',
     b'{"stream":true,"stream_options":{"include_usage":true}}'),
    (b'{"stream":true,"stream_options":{"include_usage":1}}',
     b'{"stream": true, "stream_options": {"include_usage": true}}'),
    (b'{"stream":true,"stream_options":{"x":2}}',
     b'{"stream": true, "stream_options": {"x": 2, "include_usage": true}}'),
    (b'{"stream":true,"stream_options":null}', b'{"stream": true, "stream_options": {"include_usage": true}}'),
    # what msgspec refuses but Python's json takes: NaN, a UTF-8 byte-order mark
    (b'{"stream":true,"t":NaN}', b'{' + USAGE + b'"stream":true,"t":NaN}'),
    (b'\xef\xbb\xbf{"stream":false}', b'\xef\xbb\xbf{"stream":false}'),
    (b'{"stream":true,"stream_options":{"include_usage":true},"t":NaN}',
     b'{"stream":true,"stream_options":{"include_usage":true},"t":NaN}'),  # json's reading of stream_options
    # non-ASCII UTF-8 passes as sent
    ('{"stream":true,"c":"h\u00e9"}'.encode(), b'{' + USAGE + '"stream":true,"c":"h\u00e9"}'.encode()),
])
async def test_forwarded_bytes_and_stream_keys(pair, sent, forwarded):
    """mutmut: Head.streamed (`is True`), Head.wants_usage (`isinstance(opts, dict)`, `is True`), with_usage's
    insertion point (`index(b"{") + 1`) and inserted text, its merge of other stream_options, the json fallback
    of parse_head (NaN, BOM) and the stream keys it reads there (`obj.get("stream")`...)."""
    be, router = pair
    status, ctype, _ = await post(router.url, sent)
    assert status == 200
    assert last_chat(be).body == forwarded
    assert ctype.startswith("text/event-stream")  # the raw backend streams either way


def _in(codec: str, text: str, bom: bytes = b"") -> bytes:
    return bom + text.encode(codec)


_ASKED = '{"stream_options":{"include_usage":true},"stream":true,"c":"h\u00e9 \U0001f600"}'


@pytest.mark.parametrize(("sent", "forwarded"), [
    # RFC 8259 8.1 wants UTF-8 between systems, but SGLang's FastAPI reads a body with json.loads(bytes), which
    # takes UTF-16 and UTF-32 too (either byte order, with or without a byte-order mark). The usage request is
    # spliced in the body's own encoding, byte-order mark and all: the backend reads what the client meant.
    (_in("utf-16-le", '{"stream":true,"c":"h\u00e9 \U0001f600"}'), _in("utf-16-le", _ASKED)),
    (_in("utf-16-be", '{"stream":true,"c":"h\u00e9 \U0001f600"}'), _in("utf-16-be", _ASKED)),
    (_in("utf-16-le", '{"stream":true,"c":"h\u00e9 \U0001f600"}', b"\xff\xfe"),
     _in("utf-16-le", _ASKED, b"\xff\xfe")),
    (_in("utf-16-be", '{"stream":true,"c":"h\u00e9 \U0001f600"}', b"\xfe\xff"),
     _in("utf-16-be", _ASKED, b"\xfe\xff")),
    (_in("utf-32-le", '{"stream":true,"c":"h\u00e9 \U0001f600"}'), _in("utf-32-le", _ASKED)),
    (_in("utf-32-be", '{"stream":true,"c":"h\u00e9 \U0001f600"}', b"\x00\x00\xfe\xff"),
     _in("utf-32-be", _ASKED, b"\x00\x00\xfe\xff")),
    # a UTF-8 byte-order mark: spliced after the brace, the mark kept
    (b'\xef\xbb\xbf{"stream":true}', b'\xef\xbb\xbf{' + USAGE + b'"stream":true}'),
    # stream_options without include_usage (re-serialised): back in the client's encoding too
    (_in("utf-16-le", '{"stream":true,"stream_options":{}}', b"\xff\xfe"),
     _in("utf-16-le", '{"stream": true, "stream_options": {"include_usage": true}}', b"\xff\xfe")),
    (_in("utf-16-be", '{"stream":true,"stream_options":{"x":1}}'),
     _in("utf-16-be", '{"stream": true, "stream_options": {"x": 1, "include_usage": true}}')),
    # the first brace, in code units too
    (_in("utf-16-le", '{"stream":true,"o":{"a":1}}'),
     _in("utf-16-le", '{"stream_options":{"include_usage":true},"stream":true,"o":{"a":1}}')),
    # a lone surrogate (json.loads takes it): kept as it came
    ('{"stream":true,"c":"\ud800"}'.encode("utf-16-le", "surrogatepass"),
     '{"stream_options":{"include_usage":true},"stream":true,"c":"\ud800"}'.encode("utf-16-le", "surrogatepass")),
    # not streamed: untouched, whatever the encoding
    (_in("utf-16-le", '{"stream":false}'), _in("utf-16-le", '{"stream":false}')),
], ids=["utf16le", "utf16be", "utf16le-bom", "utf16be-bom", "utf32le", "utf32be-bom", "utf8-bom",
        "utf16le-bom-options", "utf16be-options", "utf16le-nested", "utf16le-lone-surrogate", "utf16le-not-streamed"])
async def test_json_in_utf16_or_utf32_keeps_its_encoding(raw_backend_factory, router_factory, sent, forwarded):
    """A streamed body in UTF-16 or UTF-32 used to get ASCII bytes spliced between its code units (a body no
    backend could read). Fails on with_usage before the fix (`body.index(b"{") + 1` on any encoding).
    mutmut: _wide_codec's byte order, with_usage's text path (`rindex`, the surrogatepass handler on both
    sides), the byte-order mark of the re-serialised body (`or True`, "XXXX")."""
    be = await raw_backend_factory({})
    router = await router_factory([be.url], [])
    status, _, _ = await post(router.url, sent)
    assert status == 200
    assert last_chat(be).body == forwarded
    json.loads(last_chat(be).body)  # what SGLang's FastAPI does with it: no error


@pytest.mark.parametrize(("sent", "message"), [
    (b"", "request body is empty; send a JSON object"),
    (b"[1]", "request body must be a JSON object"),
    (b'"x"', "request body must be a JSON object"),
    (b"\xef\xbb\xbf[1]", "request body must be a JSON object"),  # json's verdict after msgspec's refusal
    (b"{", "request body is not valid JSON"),
    (b'{"a":"\xff"}', "request body is not valid JSON"),  # not UTF-8 inside a string msgspec skips
])
async def test_bad_bodies_get_their_message(pair, sent, message):
    """mutmut: each BadRequest message and code in parse_head, the `not body` check, the UnicodeDecodeError
    and ValueError catches (a 500 instead of a 400)."""
    be, router = pair
    status, _, raw = await post(router.url, sent)
    assert status == 400
    assert json.loads(raw) == {"error": {"message": message, "type": "invalid_request_error",
                                         "code": "invalid_json"}}
    assert be.chat_hits() == 0


async def test_the_size_limit_is_inclusive_and_says_the_sizes(pair):
    """64 bytes pass with a 64-byte limit, 65 do not; the message names both numbers (Content-Length known)
    or only the limit (chunked). mutmut: `content_length > limit` -> `>=`, the two PayloadTooLarge messages."""
    be, router = pair
    at_limit = b'{"pad":"' + b"x" * 54 + b'"}'
    assert len(at_limit) == 64
    assert (await post(router.url, at_limit))[0] == 200
    status, _, raw = await post(router.url, at_limit[:-1] + b' }')
    assert status == 413
    assert json.loads(raw)["error"]["message"] == "request body of 65 bytes is over the 64-byte limit"

    async def chunks():
        yield at_limit
        yield b" "

    async with aiohttp.ClientSession() as s, s.post(router.url + CHAT, data=chunks(),
                                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        assert (await r.json())["error"]["message"] == "request body is over the 64-byte limit"
    assert be.chat_hits() == 1


async def test_a_stalled_upload_is_408_with_the_deadline_named(pair):
    """mutmut: the asyncio.timeout around request.read() (`within` -> None), the RequestTimeout message."""
    be, router = pair
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40\r\n\r\n{\"stream\":")
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            raw = await reader.readexactly(length)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(raw)["error"]["message"] == "request body not received within 0.5 s"
    assert be.chat_hits() == 0


async def test_a_non_streamed_body_goes_out_byte_for_byte(raw_backend_factory, router_factory):
    """A non-streamed body goes out byte for byte, whatever its spacing (no re-serialisation)."""
    be = await raw_backend_factory({CHAT: json_answer(200, {"ok": 1})})
    router = await router_factory([be.url], [])
    sent = b'{ "model" : "m",\n "stream" : false , "x": [1,2 ,3] }'
    status, _, raw = await post(router.url, sent)
    assert (status, json.loads(raw)) == (200, {"ok": 1})
    assert last_chat(be).body == sent


_WIDE = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
# Strings whose code units sit next to the splice or straddle it in UTF-16: astral characters (surrogate pairs),
# lone surrogates of both halves, braces and quotes inside strings, a byte-order mark inside a string.
_AWKWARD = ("a", "\U0001F600", "\ud800", "\udc00", "}{", '"', "\ufeff", "\u2028", "\x00")


@pytest.mark.parametrize("codec", ("utf-8", *_WIDE))
@pytest.mark.parametrize("mark", (False, True))
@pytest.mark.parametrize("first", ("stream", "k"))
def test_with_usage_is_one_splice_in_the_bodys_own_code_units(codec, mark, first):
    """For every encoding SGLang's json.loads accepts, with and without a byte-order mark, with the awkward string
    first or last: the body forwarded is the client's bytes with exactly one insertion, the usage request in the
    body's own encoding right after the opening brace, and it parses to the client's object plus include_usage.
    Fails before 1ee53f8 (ASCII bytes spliced between UTF-16/UTF-32 code units: the 16 wide cases of 20)."""
    for text in _AWKWARD:
        obj = {"stream": True, "k": text} if first == "stream" else {"k": text, "stream": True}
        src = json.dumps(obj, ensure_ascii=False)
        body = (("\ufeff" if mark else "") + src).encode(codec, "surrogatepass")
        out = with_usage(body, parse_head(body))
        insert = '"stream_options":{"include_usage":true},'.encode(codec)
        at = len((("\ufeff" if mark else "") + "{").encode(codec))
        assert out == body[:at] + insert + body[at:], (codec, mark, text)
        got = json.loads(out)
        assert json.dumps(got, sort_keys=True) == json.dumps({**obj, "stream_options": {"include_usage": True}},
                                                             sort_keys=True)
