"""`spec-router epp` behind a real Envoy: the OpenAI SDK through Envoy reaches the backend the picker chose, and
every lease the picker takes ends exactly once."""
from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.fixtures_epp import error_of, need_epp
from tests.fixtures_router import poll, sim_stats

pytestmark = [need_epp, pytest.mark.timeout(60)]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "write a haiku about gateways"}], "max_tokens": 8}


async def _two(sim_factory, epp_factory, **settings):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[spec.url], baseline=[base.url], **settings)
    return spec, base, stack


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_sdk_not_streamed_reaches_the_picked_backend(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(**CHAT)
    reply = raw.parse()
    assert reply.choices[0].message.content
    # spillover, idle: the speculative pool, and the backend that answered is the one the picker named
    assert raw.headers["x-router-pool"] == "speculative"
    assert raw.headers["x-router-backend"] == spec.url
    assert (await sim_stats(spec.url))["completed_total"] == 1
    assert (await sim_stats(base.url))["requests_total"] == 0
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)
