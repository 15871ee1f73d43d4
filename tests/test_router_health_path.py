"""`health_path`: the active probe's path, for engines without SGLang's /health (llama-cpp-python's server)."""
from __future__ import annotations

import aiohttp
import pytest

from router.settings import ConfigError, load_settings
from tests.fixtures_rawbackend import json_answer
from tests.fixtures_router import CHAT_BODY, poll

pytestmark = pytest.mark.timeout(30)

# What llama-cpp-python's server looks like to a probe: no /health at all, but its FastAPI schema answers.
NO_HEALTH = {"/health": json_answer(404, {"detail": "Not Found"}),
             "/openapi.json": json_answer(200, {"openapi": "3.1.0"})}


async def test_default_probe_marks_an_engine_without_health_down(raw_backend_factory, router_factory):
    engine = await raw_backend_factory(NO_HEALTH)
    router = await router_factory([engine.url], [])
    assert await poll(lambda: engine.hits["/health"] >= 2, 5)
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/ready") as r:
            assert r.status == 503
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 503
    assert engine.chat_hits() == 0 and engine.hits["/openapi.json"] == 0


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


@pytest.mark.parametrize("bad", ["health", "/health?x=1", "/a b", ""])
def test_health_path_must_be_a_plain_path(bad):
    with pytest.raises(ConfigError, match="health_path"):
        load_settings(None, {"speculative": "http://127.0.0.1:1", "health_path": bad}, environ={})
