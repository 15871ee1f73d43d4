"""Router shutdown and stream endings: whatever is still open when the drain ends gets an explicit error."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
from aiohttp import web

from bench import procs
from tests.fixtures_router import CHAT_BODY, poll, sim_stats, wait_stat

CHAT = "/v1/chat/completions"
LONG = {**CHAT_BODY, "stream": True, "max_tokens": 2000, "ignore_eos": True}


def sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


async def test_sigterm_ends_open_streams_and_waiting_requests_explicitly(sim_factory):
    """Regression: streams still open at the drain deadline used to be cut (no error event, no [DONE])."""
    streaming = await sim_factory("eagle3-tp8", speedup=1.0, faults={"stall_after_chunks": 2})
    waiting = await sim_factory("baseline-tp8", speedup=1.0, faults={"hang": True})
    router = await asyncio.to_thread(
        procs.start_router, [streaming.url], [waiting.url], "spillover", 100,
        extra=["--drain-timeout", "0.5", "--health-interval", "0.2", "--first-byte-timeout", "60",
               "--idle-timeout", "60"])
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(100):  # both backends probed (bounded)
                async with s.get(router.url + "/ready") as r:
                    if r.status == 200 and all((await r.json())["backends"].values()):
                        break
                await asyncio.sleep(0.05)
            streams = [await s.post(router.url + CHAT, json=LONG, headers={"X-Router-Pool": "speculative"})
                       for _ in range(3)]
            for r in streams:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
            pending = [asyncio.create_task(s.post(router.url + CHAT, json=LONG, headers={"X-Router-Pool": "baseline"}))
                       for _ in range(2)]
            # Until the two pending requests are parked in the hanging backend (bounded).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while (await sim_stats(waiting.url))["faults_injected"].get("hang", 0) < 2:
                assert loop.time() < deadline, await sim_stats(waiting.url)
                await asyncio.sleep(0.05)
            os.kill(router.pid, signal.SIGTERM)
            for r in streams:
                events = sse_events(await r.read())
                assert json.loads(events[-2][6:])["error"]["code"] == "router_shutting_down"
                assert events[-1] == b"data: [DONE]"
            for t in pending:
                r = await t
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "router_shutting_down"
        assert await asyncio.to_thread(router.proc.wait, 10) == 0
        assert "Traceback" not in router.stderr_tail()
        # The router closed its upstream requests: the engine aborted the three streams.
        assert await wait_stat(streaming.url, "aborted_total", 3) == 3
        assert (await sim_stats(streaming.url))["running"] == 0
        assert (await sim_stats(waiting.url))["faults_injected"]["hang"] == 2
    finally:
        router.stop()


async def test_shutdown_with_zero_drain_does_not_wait_for_ever(sim_factory, router_factory):
    """drain_timeout 0 meant 'no limit' to aiohttp: a stalled stream kept the router from stopping."""
    spec = await sim_factory("eagle3-tp8", speedup=1.0, faults={"stall_after_chunks": 1})
    router = await router_factory([spec.url], [], drain_timeout=0, idle_timeout=60)
    async with aiohttp.ClientSession() as s:
        r = await s.post(router.url + CHAT, json=LONG)
        await r.content.readuntil(b"\n\n")
        async with asyncio.timeout(5):
            await router.close()
            events = sse_events(await r.read())
    assert events[-1] == b"data: [DONE]"
    assert router.inflight() == {spec.url: 0}


async def test_client_leaving_right_after_done_is_counted_as_served(router_factory):
    """Regression: a client that closed after reading [DONE] (before the upstream's EOF) was counted as 499."""
    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(30)  # the body ends much later: the router is still streaming when the client goes
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", backend)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        router = await router_factory([url], [])
        async with aiohttp.ClientSession() as s:
            r = await s.post(router.url + CHAT, json={**CHAT_BODY, "stream": True})
            got = b""
            while b"[DONE]" not in got:
                got += await r.content.readany()
            r.close()
        assert await router.wait_idle() == {url: 0}
        assert await poll(lambda: router.metric("router_requests_total", pool="speculative", backend=url,
                                                code="200") == 1, 5)
        assert router.metric("router_requests_total", pool="speculative", backend=url, code="499") == 0
        assert router.metric("router_client_disconnects_total", pool="speculative") == 0
    finally:
        await runner.cleanup()


async def test_the_acceptor_takes_every_pending_connection_in_one_turn():
    """Regression: uvloop accepted one connection per loop turn; under 1,000+ streams new clients waited
    tens of seconds in the kernel's queue. One readiness event must drain the whole queue."""
    import select
    import socket

    from router.accept import Acceptor, listen_socket

    made: list[asyncio.Protocol] = []

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):
            made.append(self)
            transport.close()

    sock = listen_socket("127.0.0.1", 0, backlog=256)
    acceptor = Acceptor(sock, Proto)
    clients = []
    try:
        for _ in range(100):
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(sock.getsockname())
            except BlockingIOError:
                pass
            clients.append(c)
        # Until the kernel has completed every handshake (a connected socket is writable); nothing is accepted.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(select.select([], clients, [], 0)[1]) < len(clients) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        assert acceptor.accept_ready() == 100
        assert acceptor.accept_ready() == 0
        for _ in range(50):
            if len(made) == 100:
                break
            await asyncio.sleep(0.02)
        assert len(made) == 100
    finally:
        acceptor.close()
        for c in clients:
            c.close()
