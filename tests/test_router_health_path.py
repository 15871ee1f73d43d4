"""The probe's path: `/health`, the `/v1/models` fallback for engines without it (llama-cpp-python's server, any
OpenAI-compatible server), an explicit `health_path`, and the log lines that say why a backend is not up."""
from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from router.settings import ConfigError, load_settings
from tests.fixtures_rawbackend import CHAT_EVENTS, _head, json_answer
from tests.fixtures_router import CHAT_BODY, poll

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]

# What llama-cpp-python's server looks like to a probe: no /health at all, but /v1/models and its FastAPI
# schema answer.
NO_HEALTH = {"/health": json_answer(404, {"detail": "Not Found"}),
             "/openapi.json": json_answer(200, {"openapi": "3.1.0"})}


def health_records(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.health"]


@pytest.mark.parametrize("status", [404, 405])
async def test_default_probe_falls_back_to_models_once_and_routes(raw_backend_factory, router_factory, caplog,
                                                                   status):
    """A missing /health is not "down": the first probe already asks /v1/models, later ones only that,
    and the switch is logged once at INFO."""
    caplog.set_level(logging.INFO, logger="router.health")
    engine = await raw_backend_factory({"/health": json_answer(status, {"detail": "Not Found"})})
    router = await router_factory([engine.url], [])
    assert router.state.pools.any_healthy()  # after the first round
    assert await poll(lambda: engine.hits["/v1/models"] >= 3, 5)
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 200
            assert r.headers["X-Router-Backend"] == engine.url
        async with s.get(router.url + "/ready") as r:
            assert r.status == 200
            assert (await r.json())["probes"][engine.url] == {"pool": "speculative", "state": "up",
                                                              "last_probe": "GET /v1/models -> 200"}
    assert engine.hits["/health"] == 1 and engine.chat_hits() == 1
    assert health_records(caplog) == [
        ("INFO", f"backend {engine.url} (speculative) answers GET /health with {status}: probing GET /v1/models "
                 "instead (set health_path to choose the path)"),
        ("INFO", f"backend {engine.url} (speculative) is now up")]


async def test_on_the_fallback_a_backend_serving_our_requests_is_not_probed(raw_backend_factory, router_factory):
    """llama-cpp-python's /v1/models waits for its model lock and (interrupt_requests, its default) cuts a running
    stream short: while the router has a request on such a backend, no probe is sent to it."""
    async def slow_stream(c) -> None:
        await c.write(_head(200, "text/event-stream", chunked=True))
        await asyncio.sleep(1.2)  # six probe intervals
        await c.write_chunked(CHAT_EVENTS)
        await c.write(b"0\r\n\r\n")

    engine = await raw_backend_factory({"/health": json_answer(404, {}), "/v1/chat/completions": slow_stream})
    router = await router_factory([engine.url], [])
    async with aiohttp.ClientSession() as s:
        before = engine.hits["/v1/models"]
        async with s.post(router.url + "/v1/chat/completions", json={**CHAT_BODY, "stream": True}) as r:
            assert r.status == 200
            body = await r.read()
        after = engine.hits["/v1/models"]
    assert b"hi" in body
    assert after - before <= 1  # at most one probe that was already under way
    assert await poll(lambda: engine.hits["/v1/models"] >= after + 2, 5)  # probing resumes when it is free
    assert router.state.pools.backends[0].healthy


async def test_an_explicit_health_path_is_never_replaced(raw_backend_factory, router_factory, caplog):
    """`health_path: /health` set on purpose: a 404 there is down, and the 503 and the log say so."""
    engine = await raw_backend_factory(NO_HEALTH)
    router = await router_factory([engine.url], [], health_path="/health")
    assert await poll(lambda: engine.hits["/health"] >= 3, 5)
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/ready") as r:
            assert r.status == 503
            assert (await r.json())["probes"][engine.url]["last_probe"] == "GET /health -> 404"
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 503
            assert (await r.json())["error"]["message"] == (
                f"no healthy backend: {engine.url} (speculative): down, GET /health -> 404")
    assert engine.chat_hits() == 0 and engine.hits["/v1/models"] == 0 and engine.hits["/openapi.json"] == 0
    # Said once although every probe failed the same way.
    assert health_records(caplog) == [
        ("WARNING", f"backend {engine.url} (speculative) is not up: GET /health -> 404")]


async def test_health_path_probes_the_configured_path_and_routes(raw_backend_factory, router_factory):
    engine = await raw_backend_factory(NO_HEALTH)
    router = await router_factory([engine.url], [], health_path="/openapi.json")
    assert await poll(lambda: router.state.pools.any_healthy(), 5)
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 200
            assert r.headers["X-Router-Backend"] == engine.url
    assert engine.hits["/openapi.json"] >= 1 and engine.hits["/health"] == 0
    assert engine.chat_hits() == 1


async def test_no_health_and_no_models_is_down_and_health_is_tried_again(raw_backend_factory, router_factory,
                                                                          caplog):
    """Both paths missing: down, both results named; each probe asks /health first again (no sticking to a
    fallback that never worked), and when /health appears the backend comes up through it."""
    caplog.set_level(logging.INFO, logger="router.health")
    engine = await raw_backend_factory({"/health": json_answer(404, {}), "/v1/models": json_answer(404, {})})
    router = await router_factory([engine.url], [])
    assert await poll(lambda: engine.hits["/health"] >= 3, 5)
    b = router.state.pools.backends[0]
    assert not b.healthy and b.last_probe == "GET /health -> 404, GET /v1/models -> 404"
    assert engine.hits["/v1/models"] >= engine.hits["/health"] - 1
    engine.routes["/health"] = json_answer(200, {})
    assert await poll(lambda: b.healthy, 5)
    assert b.last_probe == "GET /health -> 200"
    assert health_records(caplog) == [
        ("WARNING", f"backend {engine.url} (speculative) is not up: GET /health -> 404, GET /v1/models -> 404"),
        ("INFO", f"backend {engine.url} (speculative) is now up")]


async def test_a_backend_that_stays_down_is_logged_again_only_when_its_result_changes(raw_backend_factory,
                                                                                     router_factory, caplog):
    caplog.set_level(logging.INFO, logger="router.health")
    be = await raw_backend_factory({"/health": json_answer(503, {})})
    await be.stop_listening()
    router = await router_factory([], [be.url])
    b = router.state.pools.backends[0]
    assert await poll(lambda: b.last_probe == "connection refused", 5)
    await asyncio.sleep(0.5)  # more refused probes (interval 0.2 s): nothing new to say
    await be.start(be.port)
    assert await poll(lambda: b.last_probe == "GET /health -> 503", 5)
    be.routes["/health"] = json_answer(200, {})
    assert await poll(lambda: b.healthy, 5)
    be.routes["/health"] = json_answer(500, {})
    assert await poll(lambda: not b.healthy, 5)
    assert health_records(caplog) == [
        ("WARNING", f"backend {be.url} (baseline) is not up: connection refused"),
        ("WARNING", f"backend {be.url} (baseline) is still down: GET /health -> 503"),
        ("INFO", f"backend {be.url} (baseline) is now up"),
        ("WARNING", f"backend {be.url} (baseline) is now down: GET /health -> 500")]


@pytest.mark.parametrize("bad", ["health", "/health?x=1", "/a b", ""])
def test_health_path_must_be_a_plain_path(bad):
    with pytest.raises(ConfigError, match="health_path"):
        load_settings(None, {"speculative": "http://127.0.0.1:1", "health_path": bad}, environ={})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cli_in_front_of_nothing_says_why_within_the_first_interval():
    """The router's own process with default settings: stderr names the backend and "connection refused"
    well before the second probe (the default interval is 5 s)."""
    url = f"http://127.0.0.1:{_closed_port()}"
    with subprocess.Popen([sys.executable, "-m", "router", "serve", "--baseline", url, "--port", "0"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.readline().startswith("listening on http://127.0.0.1:")
            started = time.monotonic()
            line = proc.stderr.readline()  # the first probe runs at start-up
            waited = time.monotonic() - started
        finally:
            proc.terminate()
            proc.wait(10)
    assert line.rstrip().endswith(f"WARNING router.health: backend {url} (baseline) is not up: connection refused")
    assert waited < 5.0
