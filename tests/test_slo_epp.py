"""Latency targets in the endpoint picker: through a real Envoy with the OpenAI SDK (the 429 of a sheddable request
with Retry-After, the prediction on the answer, the 400s), and its decision seam (router.epp.decide.Decider)."""
from __future__ import annotations

import json
import random

import openai
import pytest
from prometheus_client import CollectorRegistry

from router.core.latency import Targets
from router.epp.decide import Decider, Pick, Request
from router.errors import BadRequest, TargetsUnmet
from router.metrics import Metrics
from router.observe import Observation
from router.policies import Spillover
from router.pools import Pools
from router.settings import DEFAULT_SLO_TIERS
from tests.fixtures_epp import need_epp
from tests.fixtures_router import poll, sim_stats

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "write a haiku about gateways"}], "max_tokens": 8}
BODY = json.dumps(CHAT).encode()


def decider() -> tuple[Decider, Pools, CollectorRegistry]:
    ps = Pools(["http://s:1"], ["http://b:1"], policy=Spillover(3), rng=random.Random(0))
    for b in ps.backends:
        b.healthy = True
    reg = CollectorRegistry()
    return Decider(ps, block_bytes=1024, metrics=Metrics(reg)), ps, reg


def test_the_pickers_seam_sheds_a_flex_request_it_cannot_meet_and_takes_no_lease():
    d, ps, reg = decider()
    flex = json.dumps({**CHAT, "service_tier": "flex"}).encode()
    got = d.decide(Request(flex, slo_tpot="0.001"))
    assert isinstance(got, TargetsUnmet) and got.status == 429 and 1 <= got.retry_after_s <= 60
    assert all(b.inflight == 0 for b in ps.backends)
    assert reg.get_sample_value("router_slo_requests_total", {"tier": "flex", "result": "shed"}) == 1


def test_the_pickers_seam_places_a_targeted_request_with_its_prediction_and_counts_it_once():
    d, ps, reg = decider()
    pick = d.decide(Request(BODY, slo_ttft="60000", slo_tpot="1000"))
    assert isinstance(pick, Pick) and pick.targets == Targets(60.0, 1.0, None, False)
    assert pick.forecast.met and pick.lease.backend.tpot_bound_s == 1.0
    pick.chunk(1)
    for _ in range(5):
        pick.chunk(1)
    pick.end(True)
    pick.end(True)  # once
    assert all(b.inflight == 0 and b.tpot_bound_s is None for b in ps.backends)
    # no usage came: the stream's data events are its tokens
    assert reg.get_sample_value("router_slo_requests_total", {"tier": "none", "result": "met"}) == 1
    assert reg.get_sample_value("router_slo_prediction_ratio_count", {"kind": "ttft", "pool": pick.pool}) == 1


def test_the_pickers_seam_answers_bad_targets_with_400s():
    d, ps, _ = decider()
    assert isinstance(d.decide(Request(BODY, slo_tpot="-1")), BadRequest)
    bad_tier = d.decide(Request(json.dumps({**CHAT, "service_tier": "turbo"}).encode()))
    assert isinstance(bad_tier, BadRequest) and bad_tier.param == "service_tier"
    assert isinstance(d.decide(Request(None, slo_ttft="x")), BadRequest)  # no body: the headers still count
    assert all(b.inflight == 0 for b in ps.backends)
    assert d.slo_tiers is DEFAULT_SLO_TIERS


def test_a_served_fallback_carries_the_target_to_the_backend_that_answered():
    d, ps, _ = decider()
    pick = d.decide(Request(BODY, slo_tpot="1000"))
    other = next(b for b in ps.backends if b is not pick.lease.backend)
    pick.served(other.url.removeprefix("http://"))
    assert pick.lease.backend is other and other.tpot_bound_s == 1.0
    assert all(b.tpot_bound_s is None for b in ps.backends if b is not other)
    pick.lease.finish(Observation(other.pool, other.url, 1, 1, 0.1, None, None, 0, False))
    assert all(b.inflight == 0 and b.tpot_bound_s is None for b in ps.backends)


@need_epp
async def test_through_envoy_flex_unmet_is_a_429_with_retry_after_and_priority_gets_its_prediction(
        sim_factory, epp_factory):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[spec.url], baseline=[base.url])
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        with pytest.raises(openai.RateLimitError) as err:
            await c.chat.completions.create(**CHAT, service_tier="flex", extra_headers={"x-slo-tpot-ms": "0.001"})
        assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
        assert err.value.body["code"] == "latency_targets_unmet"
        raw = await c.chat.completions.with_raw_response.create(**CHAT, service_tier="priority")
        assert raw.parse().choices[0].message.content
        assert float(raw.headers["x-router-predicted-tpot-ms"]) > 0
        assert float(raw.headers["x-router-predicted-ttft-ms"]) >= 0
        with pytest.raises(openai.BadRequestError) as bad:
            await c.chat.completions.create(**CHAT, extra_headers={"x-slo-ttft-ms": "soon"})
        assert bad.value.body["param"] == "x-slo-ttft-ms"
    total = (await sim_stats(spec.url))["requests_total"] + (await sim_stats(base.url))["requests_total"]
    assert total == 1  # only the priority request reached a backend
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)
