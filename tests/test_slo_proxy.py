"""Latency targets through the proxy with the OpenAI SDK (`extra_headers`, `service_tier`) in front of simulated
SGLang servers: the backend chosen from what the router learned, the prediction on the answer, the 429 of a
sheddable request, the least miss of a priority one, the 400s, the metrics counted once, and no lease left."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.fixtures_router import set_faults, sim_stats

pytestmark = pytest.mark.timeout(90)

SPEEDUP = 2.0  # slow enough that a token's time (ms) stands well above the event loop's jitter
CHAT = {"model": "m", "messages": [{"role": "user", "content": "write a haiku about latency"}], "max_tokens": 30}


def client(router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def stream_once(c: openai.AsyncOpenAI, headers: dict | None = None, **extra) -> tuple[dict, int]:
    """One streamed chat completion read to its end: the answer's headers and the completion tokens."""
    raw = await c.chat.completions.with_raw_response.create(**{**CHAT, **extra}, stream=True,
                                                            stream_options={"include_usage": True},
                                                            extra_headers=headers or {})
    tokens = 0
    async for chunk in raw.parse():
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return dict(raw.headers), tokens


async def warm(c: openai.AsyncOpenAI, pool: str, loads=(1, 1, 1, 6)) -> None:
    """Streams pinned to `pool` at each load in turn (concurrent ones), so the router measures its TPOT there."""
    for n in loads:
        await asyncio.gather(*(stream_once(c, {"X-Router-Pool": pool}) for _ in range(n)))


async def two(sim_factory, router_factory, **settings):
    spec = await sim_factory("eagle3-good-tp8", speedup=SPEEDUP)
    base = await sim_factory("baseline-tp8", speedup=SPEEDUP)
    router = await router_factory(speculative=[spec.url], baseline=[base.url], **settings)
    return spec, base, router


def slo_total(router, **labels) -> float:
    return router.metric("router_slo_requests_total", **labels)


async def test_a_tight_tpot_target_goes_where_it_is_met_the_prediction_is_on_the_answer_and_counted_once(
        sim_factory, router_factory):
    spec, base, router = await two(sim_factory, router_factory)
    fig = router.state.pools.figures
    async with client(router) as c:
        await warm(c, "speculative")
        await warm(c, "baseline")
        s1, b1 = fig.tpot_at("speculative", 1), fig.tpot_at("baseline", 1)
        assert s1 < b1  # EAGLE-3 at 3 tokens a step, alone: ~0.66 of the baseline's token time
        target_ms = (s1 + b1) / 2 * 1000
        headers, tokens = await stream_once(c, {"x-slo-tpot-ms": f"{target_ms:.3f}", "x-slo-ttft-ms": "5000"})
    assert headers["x-router-backend"] == spec.url and tokens > 1
    assert float(headers["x-router-predicted-tpot-ms"]) == pytest.approx(s1 * 1000, rel=1e-3)
    assert float(headers["x-router-predicted-ttft-ms"]) > 0
    assert router.metric("router_route_decisions_total", pool="speculative", reason="slo_met") == 1
    await router.wait_idle()
    assert sum(slo_total(router, tier="none", result=r) for r in ("met", "missed", "unmeasured")) == 1
    for kind in ("ttft", "tpot"):
        assert sum(router.metric("router_slo_targets_total", tier="none", kind=kind, result=r)
                   for r in ("met", "missed")) == 1
        assert router.metric("router_slo_prediction_ratio_count", kind=kind, pool="speculative") == 1
    assert router.metric("router_slo_prediction_ratio_count", kind="tpot", pool="baseline") == 0
    assert router.state.pools.by_url[spec.url].tpot_bound_s is None


async def test_with_the_speculative_server_busy_the_same_target_goes_to_baseline(sim_factory, router_factory):
    spec, base, router = await two(sim_factory, router_factory)
    fig = router.state.pools.figures
    async with client(router) as c:
        await warm(c, "speculative", (1, 1, 6, 6))
        await warm(c, "baseline", (1, 1, 6))
        long = {**CHAT, "max_tokens": 4000}
        held = [asyncio.create_task(stream_once(c, {"X-Router-Pool": "speculative"}, **long)) for _ in range(8)]
        try:
            await asyncio.wait_for(_until(lambda: router.state.pools.by_url[spec.url].inflight == 8), 10)
            s9, b1 = fig.tpot_at("speculative", 9), fig.tpot_at("baseline", 1)
            assert b1 < s9  # 8 running: EAGLE-3's steps grow 5 ms a request, the baseline's ~1
            target_ms = (s9 + b1) / 2 * 1000
            headers, _ = await stream_once(c, {"x-slo-tpot-ms": f"{target_ms:.3f}"})
            assert headers["x-router-backend"] == base.url
            assert float(headers["x-router-predicted-tpot-ms"]) < target_ms
        finally:
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    await router.wait_idle(10)


async def _until(cond) -> None:
    while not cond():  # noqa: ASYNC110 - the state lives in the router's tasks; bounded by wait_for
        await asyncio.sleep(0.02)


async def test_flex_that_nothing_can_meet_is_a_429_with_retry_after_and_takes_no_lease(sim_factory,
                                                                                      router_factory):
    spec, base, router = await two(sim_factory, router_factory)
    async with client(router) as c:
        with pytest.raises(openai.RateLimitError) as err:
            await c.chat.completions.create(**CHAT, service_tier="flex", extra_headers={"x-slo-tpot-ms": "0.001"})
    resp = err.value.response
    assert 1 <= int(resp.headers["retry-after"]) <= 60
    assert err.value.body["code"] == "latency_targets_unmet" and err.value.body["type"] == "rate_limit_error"
    assert float(resp.headers["x-router-predicted-tpot-ms"]) > 0.001
    assert slo_total(router, tier="flex", result="shed") == 1
    assert router.metric("router_requests_total", pool="none", backend="none", code="429") == 1
    assert router.inflight() == {spec.url: 0, base.url: 0}
    assert (await sim_stats(spec.url))["requests_total"] == 0 == (await sim_stats(base.url))["requests_total"]


async def test_priority_that_nothing_can_meet_goes_where_it_misses_least(sim_factory, router_factory):
    spec, base, router = await two(sim_factory, router_factory)
    async with client(router) as c:
        raw = await c.chat.completions.with_raw_response.create(
            **CHAT, service_tier="priority", extra_headers={"x-slo-tpot-ms": "0.001"})
        assert raw.parse().choices[0].message.content
        # headers alone, no tier: not sheddable either
        raw2 = await c.chat.completions.with_raw_response.create(**CHAT, extra_headers={"x-slo-ttft-ms": "0.001"})
    assert "x-router-predicted-ttft-ms" in raw.headers and "x-router-predicted-ttft-ms" in raw2.headers
    decided = sum(router.metric("router_route_decisions_total", pool=p, reason="slo_least_miss")
                  for p in ("speculative", "baseline"))
    assert decided == 2
    await router.wait_idle()
    # not streamed: the TTFT is not measured, the TPOT not either; counted once as unmeasured
    assert slo_total(router, tier="priority", result="unmeasured") == 1
    assert slo_total(router, tier="none", result="unmeasured") == 1


async def test_a_request_without_targets_is_answered_as_before(sim_factory, router_factory):
    spec, base, router = await two(sim_factory, router_factory)
    async with client(router) as c:
        raw = await c.chat.completions.with_raw_response.create(**CHAT, service_tier="default")
        raw2 = await c.chat.completions.with_raw_response.create(**CHAT)
    for r in (raw, raw2):
        assert r.headers["x-router-pool"] == "speculative"  # spillover, idle
        assert "x-router-predicted-tpot-ms" not in r.headers
    assert router.metric("router_route_decisions_total", pool="speculative", reason="below_threshold") == 2
    assert sum(v for m in router.registry.collect() if m.name == "router_slo_requests" for v in
               (s.value for s in m.samples)) == 0


@pytest.mark.parametrize(("headers", "tier", "param"), [
    ({"x-slo-tpot-ms": "0"}, None, "x-slo-tpot-ms"),
    ({"x-slo-ttft-ms": "fast"}, None, "x-slo-ttft-ms"),
    ({"x-slo-ttft-ms": "-3"}, "priority", "x-slo-ttft-ms"),
    ({}, "scale", "service_tier"),
])
async def test_bad_target_values_and_unknown_tiers_are_openai_400s_that_reach_no_backend(
        sim_factory, router_factory, headers, tier, param):
    spec, base, router = await two(sim_factory, router_factory)
    extra = {} if tier is None else {"service_tier": tier}
    async with client(router) as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(**CHAT, **extra, extra_headers=headers)
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert router.inflight() == {spec.url: 0, base.url: 0}
    assert (await sim_stats(spec.url))["requests_total"] == 0 == (await sim_stats(base.url))["requests_total"]


async def test_configured_tiers_replace_the_default_mapping(sim_factory, router_factory):
    spec, base, router = await two(sim_factory, router_factory,
                                   slo_tiers={"gold": {"ttft_ms": 60000, "tpot_ms": 1000}})
    async with client(router) as c:
        raw = await c.chat.completions.with_raw_response.create(**CHAT, extra_body={"service_tier": "gold"})
        assert raw.headers["x-router-pool"] in ("speculative", "baseline")
        assert "x-router-predicted-tpot-ms" in raw.headers
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(**CHAT, service_tier="priority")  # not configured here
    await router.wait_idle()
    assert router.metric("router_route_decisions_total", pool=raw.headers["x-router-pool"], reason="slo_met") == 1


async def test_a_retried_targeted_request_holds_its_target_on_the_backend_that_answers(sim_factory, router_factory):
    spec, base, router = await two(sim_factory, router_factory)
    await set_faults(spec.url, error_rate=1.0, error_status=503)
    bounds = []
    pools = router.state.pools
    retry = pools.acquire_retry

    def recording(failed, placement=None):
        got = retry(failed, placement)
        bounds.append(failed.tpot_bound_s)  # the failed attempt's lease still holds the target here
        return got

    pools.acquire_retry = recording
    async with client(router) as c:
        raw = await c.chat.completions.with_raw_response.create(
            **CHAT, extra_headers={"x-slo-tpot-ms": "5000", "X-Router-Pool": "speculative"})
        assert raw.headers["x-router-backend"] == base.url and "x-router-predicted-tpot-ms" in raw.headers
    assert bounds == [5.0]
    await router.wait_idle()
    assert all(b.tpot_bound_s is None for b in pools.backends)
