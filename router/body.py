"""The client's request body: read once within a deadline and a size limit, its two stream keys, the usage rewrite."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from aiohttp import web

from router.errors import BadRequest, PayloadTooLarge, RequestTimeout


class Head(msgspec.Struct):
    """The only keys the router reads from a request body (UNSET when absent; the prompt's keys stay raw bytes). Decoding into it checks that the
    whole body is JSON without building Python objects for the rest (a 4 MB body: about 4x faster than json)."""

    stream: Any = msgspec.UNSET
    stream_options: Any = msgspec.UNSET
    # The prompt's own bytes, not parsed (router.prefix hashes them): views into the body, no copy.
    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    prompt: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    service_tier: Any = msgspec.UNSET  # OpenAI's latency tier (router.slo maps it to targets)

    @property
    def streamed(self) -> bool:
        return self.stream is True

    @property
    def wants_usage(self) -> bool:
        opts = self.stream_options
        return isinstance(opts, dict) and opts.get("include_usage") is True


_HEAD = msgspec.json.Decoder(Head)


def parse_head(body: bytes) -> Head:
    if not body:
        raise BadRequest("request body is empty; send a JSON object", code="invalid_json")
    try:
        # msgspec does not check the UTF-8 of strings it skips; isascii() is the cheap common case.
        if body.isascii() or body.decode("utf-8"):
            return _HEAD.decode(body)
    except msgspec.ValidationError:  # JSON, but not an object
        raise BadRequest("request body must be a JSON object", code="invalid_json") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        pass
    # What msgspec refuses, Python's json may still take (NaN, a byte-order mark, UTF-16): keep its verdict.
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return Head(obj.get("stream", msgspec.UNSET), obj.get("stream_options", msgspec.UNSET),
                service_tier=obj.get("service_tier", msgspec.UNSET))


async def read_body(request: web.Request, limit: int, within: float | None = None) -> tuple[bytes, Head]:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the {limit}-byte limit")
    try:
        if request.content.is_eof():
            body = await request.read()  # all here already (the common case): nothing to wait for, no timer
        else:
            # Bounded: a client that stops sending its body must not hold a handler for ever.
            async with asyncio.timeout(within):
                body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit") from None
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {within:g} s") from None
    return body, parse_head(body)


def _wide_codec(body: bytes) -> str | None:
    """The codec of a UTF-16 or UTF-32 JSON body with its byte order spelled out (None for UTF-8, BOM or not).

    RFC 8259 asks for UTF-8 between systems, but SGLang's FastAPI reads a body with json.loads(bytes), which takes
    these too (json.detect_encoding). With an explicit byte order a byte-order mark decodes to U+FEFF and encodes
    back as it came."""
    codec = json.detect_encoding(body)
    if codec.startswith("utf-8"):
        return None
    if codec in ("utf-16", "utf-32"):  # only these carry a mark: it tells the byte order
        return codec + ("-le" if body.startswith(b"\xff\xfe") else "-be")
    return codec


def with_usage(body: bytes, head: Head) -> bytes:
    """Ask the backend for the usage chunk, changing the client's bytes as little as possible."""
    codec = _wide_codec(body)
    if head.stream_options is msgspec.UNSET:
        # Insert right after the opening brace: every byte the client sent stays as sent.
        if codec is None:
            i = body.index(b"{") + 1
            return body[:i] + b'"stream_options":{"include_usage":true},' + body[i:]
        # UTF-16/32: the same insertion between code units, in the body's own encoding.
        text = body.decode(codec, "surrogatepass")
        i = text.index("{") + 1
        return (text[:i] + '"stream_options":{"include_usage":true},' + text[i:]).encode(codec, "surrogatepass")
    obj = json.loads(body)  # rare: the client sent stream_options without include_usage
    opts = obj["stream_options"] if isinstance(obj["stream_options"], dict) else {}
    out = json.dumps({**obj, "stream_options": {**opts, "include_usage": True}})
    if codec is None:
        return out.encode()
    mark = "\ufeff" if body.startswith("\ufeff".encode(codec)) else ""
    return (mark + out).encode(codec)  # json.dumps wrote ASCII only: nothing to pass through
