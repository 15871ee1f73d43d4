"""The client's request body: read once within a deadline and a size limit, parsed, and the usage rewrite."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from router.errors import BadRequest, PayloadTooLarge, RequestTimeout


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
