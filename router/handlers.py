"""The router's own endpoints and middlewares: auth, Expect, rejections, /v1/models, /health, /ready, /metrics."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import upstream
from router.errors import (
    ExpectationFailed,
    MethodNotAllowed,
    NoHealthyBackend,
    NotFound,
    Unauthorized,
    error_response,
    translate,
)
from router.headers import BACKEND_HEADER
from router.health import report, summary
from router.pools import IN_ROTATION, Backend
from router.state import STATE, RouterState


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
                   "/v1/completions, /v1/models, /health, /ready, /metrics and /router/state")


@web.middleware
async def edge(request: web.Request,
               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The one middleware of the API app (one frame per request, not three): the API key, errors as OpenAI
    JSON (router.errors.translate), and answers the router gave without any backend (400/401/404/405/413/503)
    counted as pool="none"."""
    try:
        authorize(request)
        resp = await handler(request)
    except Exception as exc:
        resp = translate(request, exc)
    if resp.status >= 400 and BACKEND_HEADER not in resp.headers:
        request.app[STATE].metrics.requests.labels("none", "none", str(resp.status)).inc()
    return resp


def authorize(request: web.Request) -> None:
    st = request.app[STATE]
    # /router/ (the learned state) shows backend URLs and loads: as private as the API itself.
    if (st.api_key is not None and request.path.startswith(("/v1/", "/router/"))
            and request.match_info.http_exception is None):
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest: the time taken does not depend on how much of the key matched.
        # surrogatepass: header bytes that are not UTF-8 still encode (one-to-one), so they get a 401, not a 500.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"),
                                                                 st.api_key):
            raise Unauthorized("missing or invalid API key; send Authorization: Bearer KEY")


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.settings.served_model_name:
        data = [{"id": st.settings.served_model_name, "object": "model", "created": 0, "owned_by": "spec-router"}]
        return web.json_response({"object": "list", "data": data})
    assert st.client is not None
    client = st.client
    backends = [b for b in st.pools.backends if b.healthy]

    async def fetch(b: Backend) -> list:
        try:
            async with asyncio.timeout(st.settings.health_timeout):
                status, body = await upstream.get(client, b.url, "/v1/models", b.auth_headers)
            if status != 200:
                return []
            got = json.loads(body)
        except (*upstream.TRANSPORT_ERRORS, ValueError):
            return []
        data = got.get("data") if isinstance(got, dict) else None
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(data, list) else []

    lists = await asyncio.gather(*(fetch(b) for b in backends))
    seen: dict[str, dict] = {}
    for entries in lists:
        for entry in entries:
            seen.setdefault(entry["id"], entry)
    if not seen:
        if not backends:  # none is up: say why, as every other 503 of this kind does
            raise NoHealthyBackend(f"no healthy backend: {summary(st.pools.backends)}", probes=report(st.pools.backends))
        raise NoHealthyBackend("no healthy backend answered /v1/models")
    return web.json_response({"object": "list", "data": list(seen.values())})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 once a backend passed its probes; both answers name every backend's state and last probe result.
    `backends` says whether each is in rotation now (up, or on trial after an ejection), read from the same
    state as `probes`: a backend whose probes pass but that outlier detection ejected is `false`, "ejected"."""
    pools = request.app[STATE].pools
    probes = report(pools.backends, time.monotonic())
    up = {url: p["state"] in IN_ROTATION for url, p in probes.items()}
    if not pools.any_healthy():
        err = NoHealthyBackend(f"no backend is healthy yet: {summary(pools.backends)}")
        body = err.body()
        body["backends"] = up
        body["probes"] = probes
        return web.json_response(body, status=503)
    return web.json_response({"status": "ready", "backends": up, "probes": probes})


def metrics_handler(st: RouterState) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        out = web.Response(body=generate_latest(st.metrics.registry))
        out.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return out
    return handler
