"""Latency targets in the decision core (router.core.latency) and their parsing (router.slo), without sockets: the
predictions from known figures, the choice, shedding, the filter that keeps targeted endpoints light, and the
leases' bookkeeping of targets."""
from __future__ import annotations

import math
import random

import msgspec
import pytest

from router.adaptive import Adaptive
from router.affinity import Affinity
from router.core.figures import PRIOR_TPOT_S, Figures
from router.core.latency import (
    RETRY_AFTER_MAX_S,
    SLO_LEAST_MISS,
    SLO_MET,
    Latency,
    Shed,
    Targets,
)
from router.core.scheduler import Scheduler
from router.core.snapshot import Snapshot
from router.errors import BadRequest
from router.observe import Observation
from router.policies import LeastInflight, Spillover
from router.policy import PINNED, BackendLoad
from router.pools import Pools
from router.prefix import TEXT, Prompt, chain
from router.settings import DEFAULT_SLO_TIERS, SloTier
from router.slo import NO_TIER, targets_of, tier_label

pytestmark = pytest.mark.timeout(30)


def stream(pool: str, n: float, tpot: float, tokens: int = 101, ttft: float = 0.05) -> Observation:
    """A finished stream that ran beside n requests in all at `tpot` seconds per token after its first."""
    return Observation(pool, pool[0], 1, 1, ttft + tpot * (tokens - 1), ttft, tokens, tokens, True, n)


def text_prompt(nbytes: int, seed: int = 0) -> Prompt:
    rng = random.Random(seed)
    return Prompt(TEXT, nbytes, chain(bytes(rng.getrandbits(8) for _ in range(nbytes))))


def snap(backends, targets=None, prompt=None, pinned=None, depth=None) -> Snapshot:
    s = Snapshot.take(backends, pinned, prompt, None, targets)
    return Snapshot(s.view, s.pinned, s.prompt, depth or {}, s.targets)


# ---- prediction from known figures
def test_tpot_line_is_the_least_squares_line_of_what_ran_and_the_prior_until_measured():
    fig = Figures()
    assert fig.tpot_at("speculative", 5) == PRIOR_TPOT_S
    for _ in range(10):  # t(n) = 0.005 + 0.005 n, exactly
        fig.observe(stream("speculative", 1.0, 0.010))
        fig.observe(stream("speculative", 5.0, 0.030))
    assert fig.tpot_at("speculative", 3) == pytest.approx(0.020, rel=1e-9)
    assert fig.tpot_at("speculative", 9) == pytest.approx(0.050, rel=1e-9)
    assert fig.tpot_at("baseline", 3) == PRIOR_TPOT_S  # per pool
    one = Figures()
    for _ in range(3):  # one load seen: its level, whatever the load asked about
        one.observe(stream("baseline", 2.0, 0.012))
    assert one.tpot_at("baseline", 40) == pytest.approx(0.012)
    falling = Figures()
    for _ in range(5):  # faster when busier is noise, not a law: no negative slope
        falling.observe(stream("baseline", 1.0, 0.02))
        falling.observe(stream("baseline", 8.0, 0.01))
    assert falling.tpot_at("baseline", 20) == pytest.approx(0.015, rel=0.01)


def test_one_measured_stream_replaces_the_prior():
    """The prior is in real seconds (20 ms); a cold router's first measured stream is nearer whatever the servers
    (on simulators 20x fast, ten times nearer). It held until the third stream: the forgetting kept the weight of
    two below 2."""
    fig = Figures()
    fig.observe(stream("speculative", 1, 0.002))
    assert fig.tpot_at("speculative", 4) == pytest.approx(0.002, rel=1e-9)
    fig.observe(stream("speculative", 1, 0.004))
    assert fig.tpot_at("speculative", 4) == pytest.approx((0.98 * 0.002 + 0.004) / 1.98, rel=1e-9)
    assert fig.tpot_at("baseline", 4) == PRIOR_TPOT_S


def test_ttft_is_the_prefix_scorers_queue_plus_this_prompts_uncached_prefill():
    fig = Figures()
    c = fig.costs("baseline")
    c.ttft_s_per_token, c.wait_s = 1e-4, 0.01
    lat = Latency(fig, block_bytes=1024)
    prompt = text_prompt(4000)  # 1000 tokens at 4 bytes a token
    b = BackendLoad("b", "baseline", 2, True, pending_tokens=1000)
    s = snap([b], Targets(ttft_s=1.0), prompt)
    e = s.view.backends[0]
    # 2 requests' wait + the 1000 tokens queued there + its own 1000
    assert lat.ttft(s, e, lat.prompt_tokens(s)) == pytest.approx(0.02 + 0.1 + 0.1)
    held = snap([b], Targets(ttft_s=1.0), prompt, depth={"b": 2})  # 2 blocks = 512 tokens held
    assert lat.ttft(held, held.view.backends[0], 1000) == pytest.approx(0.02 + 0.1 + 488e-4)
    fig.running_limits["b"] = 2  # at its running limit: a slot frees every request time / limit
    full = snap([BackendLoad("b", "baseline", 3, True)], Targets(ttft_s=1.0))
    slot = c.tpot_s * fig.output_tokens
    assert lat.ttft(full, full.view.backends[0], 0) == pytest.approx(0.03 + 2 * slot / 2)


def test_tpot_is_the_decode_time_per_token_whatever_the_policy_not_the_speed_models_whole_duration():
    """The adaptive policy's speed model learns seconds per token of the whole duration, time to first token
    included (router.estimator.sample: what closed-loop throughput needs); a request's TPOT is its decode alone.
    With long prompts (a second of prefill before 100 tokens at 5 ms) the two differ twofold and more."""
    fig = Figures()
    pol = Adaptive()
    pol.share_figures(fig)
    for _ in range(40):  # decode 0.004 + 0.001 n seconds a token, each after a 1 s prefill
        for n in (1.0, 5.0):
            obs = stream("speculative", n, 0.004 + 0.001 * n, ttft=1.0)
            fig.observe(obs)
            pol.observe(obs)
    pol.learn()
    lat = Latency(fig)
    s = snap([BackendLoad("s", "speculative", 2, True), BackendLoad("b", "baseline", 2, True)], Targets(tpot_s=1))
    spec, base = s.view.backends
    assert pol.speeds.key(spec) is not None  # the speed model is measured: the old prediction read it
    assert lat.tpot(spec, pol) == pytest.approx(0.004 + 0.001 * 3, rel=1e-6)  # the decode line at load + 1
    assert lat.tpot(spec, LeastInflight()) == lat.tpot(spec, pol)  # the same whatever the policy
    assert lat.tpot(base, pol) == PRIOR_TPOT_S  # baseline not measured yet: the figures' prior


# ---- the choice
def two_pools(spec_load=0, base_load=0):
    """Figures where the speculative pool is faster alone and slower busy (EAGLE-3's curve against a baseline)."""
    fig = Figures()
    for _ in range(10):
        fig.observe(stream("speculative", 1.0, 0.008))
        fig.observe(stream("speculative", 9.0, 0.024))  # 0.006 + 0.002 n
        fig.observe(stream("baseline", 1.0, 0.012))
        fig.observe(stream("baseline", 9.0, 0.016))  # 0.0115 + 0.0005 n
    backends = [BackendLoad("s", "speculative", spec_load, True), BackendLoad("b", "baseline", base_load, True)]
    return fig, backends


def test_a_tight_tpot_target_goes_to_the_speculative_pool_at_low_load_and_to_baseline_when_it_is_busy():
    fig, idle = two_pools()
    lat = Latency(fig)
    got = lat.choose(snap(idle, Targets(ttft_s=5.0, tpot_s=0.011)), Spillover(3), random.Random(0), None)
    assert (got.decision.url, got.decision.reason) == ("s", SLO_MET)
    assert got.forecast.tpot_s == pytest.approx(0.008) and got.forecast.headroom == pytest.approx(3 / 11)
    _, busy = two_pools(spec_load=5)  # 0.018 s there with one more: only baseline meets 0.015
    got = lat.choose(snap(busy, Targets(tpot_s=0.015)), Spillover(3), random.Random(0), None)
    assert (got.decision.url, got.decision.reason) == ("b", SLO_MET)
    assert got.forecast.tpot_s == pytest.approx(0.012)


def test_of_those_meeting_the_most_headroom_wins_the_least_of_the_two_kinds():
    fig, backends = two_pools()
    fig.costs("speculative").ttft_s_per_token = 1e-4
    backends[0] = BackendLoad("s", "speculative", 0, True, pending_tokens=15_000)  # 1.5 s of prefill queued
    lat = Latency(fig)
    s = snap(backends, Targets(ttft_s=2.0, tpot_s=0.02))
    spec = lat.forecast(s, s.view.backends[0], Spillover(3), 0)
    # s: TTFT 1.5 s (headroom 0.25), TPOT 0.008 (0.6) -> 0.25; b: TTFT 0 (1.0), TPOT 0.012 (0.4) -> 0.4
    assert spec.headroom == pytest.approx(0.25) and spec.met
    got = lat.choose(s, Spillover(3), random.Random(0), None)
    assert got.decision.url == "b" and got.forecast.headroom == pytest.approx(0.4)


def test_none_meeting_priority_misses_least_and_flex_is_shed_with_a_bounded_retry_after():
    fig, backends = two_pools(spec_load=5, base_load=9)
    lat = Latency(fig)
    pri = lat.choose(snap(backends, Targets(tpot_s=0.005, tier="priority")), Spillover(3), random.Random(0), None)
    # s at 6 running: 0.018 (miss -2.6); b at 10: 0.0165 (miss -2.3): b misses least
    assert (pri.decision.url, pri.decision.reason) == ("b", SLO_LEAST_MISS) and not pri.forecast.met
    flex = lat.choose(snap(backends, Targets(tpot_s=0.005, tier="flex", sheddable=True)), Spillover(3),
                      random.Random(0), None)
    assert isinstance(flex, Shed) and flex.forecast.url == "b"
    # the least over the endpoints of its TTFT plus one running request's end there (tpot x output / load)
    expect = min(0.05 + fig.output_tokens * 0.018 / 5, 0.09 + fig.output_tokens * 0.0165 / 9)
    assert flex.retry_after_s == max(1, math.ceil(expect))
    fig.costs("baseline").wait_s = fig.costs("speculative").wait_s = 100.0  # a queue of 500+ s: capped
    late = lat.choose(snap(backends, Targets(ttft_s=1.0, sheddable=True)), Spillover(3), random.Random(0), None)
    assert late.retry_after_s == RETRY_AFTER_MAX_S


def test_pinned_requests_with_targets_stay_in_their_pool_and_nothing_routable_is_none():
    fig, backends = two_pools()
    sched = Scheduler(Spillover(3), latency=Latency(fig))
    got = sched.decide(sched.snapshot(backends, "baseline", None, Targets(tpot_s=0.011)), random.Random(0))
    assert (got.decision.url, got.decision.reason) == ("b", PINNED)
    down = [BackendLoad("s", "speculative", 0, False), BackendLoad("b", "baseline", 0, False)]
    assert sched.decide(sched.snapshot(down, None, None, Targets(tpot_s=1.0)), random.Random(0)) is None


def test_requests_without_targets_are_decided_as_without_the_predictor():
    fig, backends = two_pools()
    with_lat = Scheduler(Spillover(3), latency=Latency(fig))
    without = Scheduler(Spillover(3))
    for loads in [(0, 0), (3, 0), (5, 9), (2, 2)]:
        bs = [BackendLoad("s", "speculative", loads[0], True), BackendLoad("b", "baseline", loads[1], True)]
        a = with_lat.decide(with_lat.snapshot(bs), random.Random(1))
        b = without.decide(without.snapshot(bs), random.Random(1))
        assert (a.decision.url, a.decision.reason, a.forecast) == (b.decision.url, b.decision.reason, None)
        none = with_lat.decide(with_lat.snapshot(bs, None, None, Targets()), random.Random(1))  # targets of nothing
        assert (none.decision.url, none.decision.reason, none.forecast) == (b.decision.url, b.decision.reason, None)


def test_targeted_requests_prefer_an_endpoint_they_do_not_push_past_anothers_target():
    fig, _ = two_pools()
    # both meet a loose 0.05 target; s runs a request with a 0.009 target that one more would break
    s = BackendLoad("s", "speculative", 0, True)
    from router.core.snapshot import Endpoint
    eps = [Endpoint("s", "speculative", True, 0, 0, 0, s, 0.0075), Endpoint("b", "baseline", True, 0, 0, 0, None)]
    got = Latency(fig).choose(snap(eps, Targets(tpot_s=0.05)), Spillover(3), random.Random(0), None)
    assert got.decision.url == "b"


# ---- the pools: leases hold targets, requests without targets keep off
def pools(policy=None, affinity=None):
    ps = Pools(["s"], ["b"], policy=policy or Spillover(3), rng=random.Random(0), affinity=affinity)
    for b in ps.backends:
        b.healthy = True
    for _ in range(10):
        for o in (stream("speculative", 1.0, 0.008), stream("speculative", 9.0, 0.024),
                  stream("baseline", 1.0, 0.012), stream("baseline", 9.0, 0.016)):
            ps.figures.observe(o)
    return ps


def test_a_lease_holds_its_tpot_target_on_the_backend_until_released_and_a_retry_carries_it():
    ps = pools()
    s = ps.by_url["s"]
    lease, d, _, f = ps.choose(targets=Targets(tpot_s=0.011))
    assert d.url == "s" and f.tpot_s == pytest.approx(0.008) and lease.tpot_target == 0.011
    second, *_ = ps.choose(targets=Targets(tpot_s=0.0105))
    assert second.backend is s and s.tpot_bound_s == 0.0105
    retry = ps.acquire_retry(s, None).hold_target(second.tpot_target)
    second.finish(None)
    assert retry.backend.url == "b" and retry.backend.tpot_bound_s == 0.0105 and s.tpot_bound_s == 0.011
    retry.release()
    lease.release()
    lease.release()  # once
    assert s.tpot_bound_s is None and ps.by_url["b"].tpot_bound_s is None and s._bounds == {}
    assert s.inflight == 0 == ps.by_url["b"].inflight


def test_requests_without_targets_keep_off_a_backend_they_would_push_past_its_targets():
    ps = pools()
    held, d, *_ = ps.choose(targets=Targets(tpot_s=0.0095))  # s alone: 0.008; b: 0.012
    assert d.url == "s"
    # spillover would send this one to s too (below its threshold); one more there: 0.010 > 0.0095
    lease, d2, _ = ps.place()
    assert d2.url == "b"
    lease.release()
    held.release()
    again, d3, _ = ps.place()  # no targeted request left: routed as before
    assert d3.url == "s"
    again.release()


def test_a_target_missed_anyway_holds_no_backend_off():
    ps = pools()
    missed, d, _, f = ps.choose(targets=Targets(tpot_s=0.000001))  # priority, least miss: nowhere can meet it
    assert not f.met and missed.tpot_target is None and ps.by_url[d.url].tpot_bound_s is None
    lease, d2, _ = ps.place()
    assert d2.url == "s"  # spillover, as without it
    lease.release()
    missed.release()


def test_keeping_off_leaves_nothing_then_routed_as_today():
    ps = pools()
    ps.by_url["b"].healthy = False
    held, d, *_ = ps.choose(targets=Targets(tpot_s=0.0095))
    lease, d2, _ = ps.place()
    assert (d.url, d2.url) == ("s", "s")
    lease.release()
    held.release()


def test_shed_takes_no_lease_and_prefix_placement_is_recorded_for_a_targeted_request():
    ps = pools(affinity=Affinity())
    assert isinstance(ps.choose(targets=Targets(tpot_s=0.001, sheddable=True)), Shed)
    assert all(b.inflight == 0 for b in ps.backends)
    prompt = text_prompt(8000)
    lease, d, placement, f = ps.choose(prompt=prompt, targets=Targets(tpot_s=0.011))
    assert d.url == "s" and placement is not None and placement.prompt_tokens == 2000
    assert ps.affinity.index.peek("s", 0).depth(prompt.blocks) == len(prompt.blocks)  # sent: indexed there
    assert lease.backend.pending_tokens == 2000
    lease.release()


# ---- parsing (router.slo)
TIERS = {**DEFAULT_SLO_TIERS, "gold": SloTier(ttft_ms=300, tpot_ms=12)}


def test_headers_and_tiers_give_targets_headers_override_the_tiers_numbers():
    assert targets_of(None, None, msgspec.UNSET, TIERS) is None
    assert targets_of(None, None, "default", TIERS) is None  # a tier without targets: routed as today
    assert targets_of(None, None, None, TIERS) is None
    assert targets_of("250", None, msgspec.UNSET, TIERS) == Targets(0.25, None, None, False)
    assert targets_of(None, " 7.5 ", "flex", TIERS) == Targets(30.0, 0.0075, "flex", True)
    assert targets_of(None, None, "gold", TIERS) == Targets(0.3, 0.012, "gold", False)
    assert targets_of(None, "20", "default", TIERS) == Targets(None, 0.02, "default", False)
    assert tier_label(Targets(1.0)) == NO_TIER and tier_label(Targets(1.0, tier="gold")) == "gold"


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan", "inf", "", "1e400"])
def test_a_bad_target_header_is_a_400_naming_it(value):
    for args in ((value, None), (None, value)):
        with pytest.raises(BadRequest) as err:
            targets_of(*args, msgspec.UNSET, TIERS)
        body = err.value.body()["error"]
        assert err.value.status == 400 and body["type"] == "invalid_request_error"
        assert body["param"] in ("x-slo-ttft-ms", "x-slo-tpot-ms") and body["code"] == "invalid_latency_target"


@pytest.mark.parametrize("tier", ["scale", "PRIORITY", 3, ["flex"]])
def test_an_unknown_tier_is_a_400_on_service_tier(tier):
    with pytest.raises(BadRequest) as err:
        targets_of(None, None, tier, TIERS)
    body = err.value.body()["error"]
    assert body["param"] == "service_tier" and body["code"] == "invalid_service_tier"
    assert body["type"] == "invalid_request_error"


def test_tiers_come_from_yaml_env_or_flag_and_a_bad_one_is_one_line(tmp_path):
    from router.settings import ConfigError, load_settings

    path = tmp_path / "router.yaml"
    path.write_text("speculative: [http://127.0.0.1:1]\nslo_tiers:\n  gold: {ttft_ms: 300, tpot_ms: 12}\n"
                    "  bronze: {sheddable: true}\n")
    s = load_settings(str(path), environ={})
    assert s.slo_tiers == {"gold": SloTier(ttft_ms=300, tpot_ms=12), "bronze": SloTier(sheddable=True)}
    env = load_settings(None, {"speculative": "http://127.0.0.1:1"},
                        environ={"ROUTER_SLO_TIERS": '{"gold": {"tpot_ms": 9}}'})
    assert env.slo_tiers == {"gold": SloTier(tpot_ms=9)}
    assert load_settings(None, {"speculative": "http://127.0.0.1:1"}, environ={}).slo_tiers == DEFAULT_SLO_TIERS
    for bad in ('{"gold": {"tpot_ms": 0}}', '{"gold": {"latency": 3}}', "{gold", '{"gold": {"ttft_ms": "NaN"}}'):
        with pytest.raises(ConfigError) as err:
            load_settings(None, {"speculative": "http://127.0.0.1:1", "slo_tiers": bad}, environ={})
        assert "slo_tiers" in str(err.value) and "\n" not in str(err.value)
