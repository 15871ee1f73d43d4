"""A tiny fast fake SGLang backend for `bench overhead`: instant answers, paced, fast or idle streams."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from aiohttp import web

from bench.cli import until_signal
from bench.rawhttp import Connection, request_bytes

# Precomputed bytes: the backend's own cost must stay far below the proxy's, so nothing is built per request
# that can be built once.
_CREATED = 1700000000
LOCAL_MODEL_PATH = os.path.dirname(os.path.abspath(__file__))


def _chat_json(model: str) -> bytes:
    return json.dumps({
        "id": "fake-1", "object": "chat.completion", "created": _CREATED, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }, separators=(",", ":")).encode()


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": "fake-1", "object": "chat.completion.chunk", "created": _CREATED, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


class Mode:
    """How streams behave; changed at run time through `POST /_fake/mode` (pace_ms, hold_s)."""

    def __init__(self) -> None:
        self.pace_s = 0.0  # gap between streamed tokens; 0: as fast as the socket takes them
        self.hold_s = 0.0  # > 0: after the first token, hold the stream open this long (an idle stream)


class Backend:
    def __init__(self, model: str) -> None:
        self.model = model
        self.mode = Mode()
        self.requests = 0
        self.open_streams = 0
        self.chat_body = _chat_json(model)
        self.role_event = _event(_chunk(model, {"role": "assistant", "content": ""}))
        self.token_event = _event(_chunk(model, {"content": "tok"}))
        self.finish_event = _event(_chunk(model, {}, "stop"))
        self.done_event = b"data: [DONE]\n\n"

    def usage_event(self, n: int) -> bytes:
        return _event({"id": "fake-1", "object": "chat.completion.chunk", "created": _CREATED, "model": self.model,
                       "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                                "total_tokens": 5 + n}})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response({"object": "error", "message": "bad JSON", "type": "BadRequestError",
                                      "code": 400}, status=400)
        if not body.get("stream"):
            return web.Response(body=self.chat_body, content_type="application/json")
        # sglang-router renames max_tokens to max_completion_tokens on the way.
        n = max(1, int(body.get("max_completion_tokens") or body.get("max_tokens") or 16))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.open_streams += 1
        try:
            await resp.write(self.role_event + self.token_event)
            pace, hold = self.mode.pace_s, self.mode.hold_s
            if hold > 0:
                await self._hold(request, hold)
                return resp
            for i in range(1, n):
                if pace > 0:
                    await asyncio.sleep(pace)
                # aiohttp's write() only waits when the socket buffer is full: one token, one write, as SGLang.
                await resp.write(self.token_event)
                if pace == 0 and i % 64 == 0:
                    await asyncio.sleep(0)  # let other streams in
            tail = self.finish_event + (self.usage_event(n) if usage else b"") + self.done_event
            await resp.write(tail)
            await resp.write_eof()
        finally:
            self.open_streams -= 1
        return resp

    async def _hold(self, request: web.Request, hold: float) -> None:
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            await asyncio.sleep(0.1)

    async def set_mode(self, request: web.Request) -> web.Response:
        data = await request.json()
        self.mode.pace_s = float(data.get("pace_ms", self.mode.pace_s * 1e3)) / 1e3
        self.mode.hold_s = float(data.get("hold_s", self.mode.hold_s))
        return web.json_response({"pace_ms": self.mode.pace_s * 1e3, "hold_s": self.mode.hold_s})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "open_streams": self.open_streams})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": _CREATED, "owned_by": "fake", "root": self.model,
             "max_model_len": 131072}]})

    async def model_info(self, request: web.Request) -> web.Response:
        # A local directory without a tokenizer: sglang-router then loads none, and asks no model hub for one.
        return web.json_response({"model_path": LOCAL_MODEL_PATH, "tokenizer_path": LOCAL_MODEL_PATH, "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": "default"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": LOCAL_MODEL_PATH, "served_model_name": self.model, "tp_size": 1,
                                  "dp_size": 1, "max_total_num_tokens": 1 << 20, "version": "0.5.23",
                                  "internal_states": [{}]})

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"num_running_reqs": self.open_streams, "num_waiting_reqs": 0})


async def set_mode(backend_url: str, **mode: float) -> None:
    """Change a running fake backend's streams (`pace_ms`, `hold_s`) from a client: `POST /_fake/mode`."""
    conn = await Connection.open(backend_url)
    try:
        await asyncio.wait_for(conn.send(request_bytes(backend_url, "/_fake/mode", json.dumps(mode).encode())), 5)
    finally:
        conn.close()


def build_app(model: str = "default") -> web.Application:
    b = Backend(model)
    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/chat/completions", b.chat)
    app.router.add_get("/health", b.health)
    app.router.add_get("/health_generate", b.health)
    app.router.add_get("/v1/models", b.models)
    app.router.add_get("/get_model_info", b.model_info)
    app.router.add_get("/model_info", b.model_info)
    app.router.add_get("/get_server_info", b.server_info)
    app.router.add_get("/server_info", b.server_info)
    app.router.add_get("/v1/loads", b.loads)
    app.router.add_post("/_fake/mode", b.set_mode)
    app.router.add_get("/_fake/stats", b.stats)
    return app


async def serve(host: str, port: int, model: str) -> None:
    runner = web.AppRunner(build_app(model), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on http://{host}:{bound}", flush=True)
    await until_signal()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fastbackend", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="default")
    ns = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(serve(ns.host, ns.port, ns.model))
    else:
        uvloop.run(serve(ns.host, ns.port, ns.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
