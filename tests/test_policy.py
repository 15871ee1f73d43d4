"""Table tests of the pure routing policies and of leases and pools; one balanced-policy test through real sockets."""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import aiohttp
import pytest

from router import policies
from router import policy as P
from router.adaptive import Adaptive
from router.curves import curve_throughput, marginal_gain, request_speed
from router.policy import (
    ABOVE,
    BELOW,
    FAILOVER,
    FASTER,
    LEAST,
    PINNED,
    ROUND_ROBIN,
    BackendLoad,
    View,
    retry_target,
)
from router.pools import Backend, Pools
from router.settings import ConfigError
from tests.fixtures_policy import policy_of

S1, S2, B1, B2 = "http://s1:1", "http://s2:1", "http://b1:1", "http://b2:1"


def snap(s1=0, b1=0, *, s2=None, b2=None, s1_up=True, b1_up=True, s2_up=True, b2_up=True):
    loads = [BackendLoad(S1, "speculative", s1, s1_up)]
    if s2 is not None:
        loads.append(BackendLoad(S2, "speculative", s2, s2_up))
    loads.append(BackendLoad(B1, "baseline", b1, b1_up))
    if b2 is not None:
        loads.append(BackendLoad(B2, "baseline", b2, b2_up))
    return View.of(loads)


def decide(view, *, policy="spillover", threshold=0, hysteresis=0, curves=None, pinned=None, rng=None):
    """One decision of a freshly built policy (the factory the router uses)."""
    pol = policy_of(policy, threshold=threshold, hysteresis=hysteresis, curves=curves)
    return P.decide(pol, view, pinned, rng or random.Random())


SPILLOVER_TABLE = [
    # (loads, threshold, pool, url, reason)
    (snap(0, 0), 4, "speculative", S1, BELOW),
    (snap(3, 0), 4, "speculative", S1, BELOW),
    (snap(4, 0), 4, "baseline", B1, ABOVE),
    (snap(9, 5), 4, "baseline", B1, ABOVE),
    (snap(0, 0), 0, "baseline", B1, ABOVE),  # threshold 0: never speculate
    (snap(10**6, 0), 10**9, "speculative", S1, BELOW),  # huge threshold: always speculate
    (snap(0, 0, b1_up=False), 0, "speculative", S1, FAILOVER),
    (snap(2, 0, s1_up=False), 4, "baseline", B1, FAILOVER),
    (snap(2, 0, s1_up=False), 0, "baseline", B1, ABOVE),
    (snap(4, 0, b1_up=False), 4, "speculative", S1, FAILOVER),
    # per healthy instance: 7 in flight over 2 instances is below 4 each; the idler one is chosen
    (snap(4, 0, s2=3), 4, "speculative", S2, BELOW),
    (snap(4, 0, s2=4), 4, "baseline", B1, ABOVE),
    # a down instance does not count towards capacity
    (snap(1, 0, s2=0, s2_up=False), 2, "speculative", S1, BELOW),
    (snap(2, 0, s2=0, s2_up=False), 2, "baseline", B1, ABOVE),
    (snap(0, 3, b2=1), 0, "baseline", B2, ABOVE),
    # threshold 1 is the smallest that would speculate: with that pool down it is a failover (mutmut: `> 1`)
    (snap(0, 0, s1_up=False), 1, "baseline", B1, FAILOVER),
]


@pytest.mark.parametrize(("loads", "threshold", "pool", "url", "reason"), SPILLOVER_TABLE)
def test_spillover(loads, threshold, pool, url, reason):
    d = decide(loads, policy="spillover", threshold=threshold)
    assert (d.pool, d.url, d.reason) == (pool, url, reason)


def test_no_healthy_backend_is_none():
    for policy in ("spillover", "global", "least-inflight", "round-robin"):
        assert decide(snap(s1_up=False, b1_up=False), policy=policy, threshold=3) is None
    assert decide(snap(s1_up=False, b1_up=False), policy="spillover", threshold=3, pinned="baseline") is None


GLOBAL_TABLE = [
    # (total split, threshold, hysteresis, speculating before, pool, speculating after)
    ((2, 1), 4, 0, True, "speculative", True),
    ((2, 2), 4, 0, True, "baseline", False),
    ((2, 1), 4, 0, False, "speculative", True),
    ((2, 1), 4, 2, False, "baseline", False),  # 3 is not below 4 - 2: stay on baseline
    ((1, 0), 4, 2, False, "speculative", True),
    ((3, 0), 4, 2, True, "speculative", True),  # hysteresis does not delay the switch up
    ((0, 0), 0, 0, True, "baseline", False),
]


@pytest.mark.parametrize(("split", "threshold", "hyst", "before", "pool", "after"), GLOBAL_TABLE)
def test_global_with_hysteresis(split, threshold, hyst, before, pool, after):
    pol = policies.Global(threshold, hyst, speculating=before)
    d = pol.decide(snap(*split), random.Random())
    assert (d.pool, d.reason) == (pool, BELOW if pool == "speculative" else ABOVE)
    assert pol.speculating is after


def test_global_and_build_defaults():
    """The defaults of the public constructors: no hysteresis, threshold 32 (mutmut: `hysteresis: int = 1` in
    Global and in build, `threshold: int = 32` -> 33 in build)."""
    back = policies.Global(4, speculating=False)  # above before; 3 in flight is below 4 - 0: speculate again
    assert back.decide(snap(3, 0), random.Random()).pool == "speculative"
    built = policy_of("global", threshold=4)
    assert built.decide(snap(4, 0), random.Random()).pool == "baseline"
    assert built.decide(snap(3, 0), random.Random()).pool == "speculative"
    spill = policy_of("spillover")
    assert spill.decide(snap(31, 0), random.Random()).pool == "speculative"
    assert spill.decide(snap(32, 0), random.Random()).pool == "baseline"


TIES = [
    # (policy, threshold, pinned, loads, tied urls, reason): each decision path meets a tie it must break at
    # random (mutmut: `rng` -> None on that path; in_pool's failover also `other(pool)` -> `other(None)`).
    ("spillover", 4, "speculative", snap(2, 0, s2=2), {S1, S2}, PINNED),
    ("spillover", 4, "speculative", snap(0, 1, s1_up=False, b2=1), {B1, B2}, FAILOVER),
    ("spillover", 4, None, snap(0, 3, s1_up=False, b2=3), {B1, B2}, FAILOVER),
    ("global", 10, None, snap(1, 0, s2=1), {S1, S2}, BELOW),
    ("global", 1, None, snap(1, 2, b2=2), {B1, B2}, ABOVE),
    ("balanced", 0, None, snap(3, 0, s2=3, b1_up=False), {S1, S2}, FAILOVER),
]


@pytest.mark.parametrize(("policy", "threshold", "pinned", "loads", "urls", "reason"), TIES)
def test_ties_are_broken_at_random_on_every_path(policy, threshold, pinned, loads, urls, reason):
    rng = random.Random(5)
    picks = Counter()
    for _ in range(200):
        d = decide(loads, policy=policy, threshold=threshold, curves=SEED, pinned=pinned, rng=rng)
        assert d.reason == reason
        picks[d.url] += 1
    assert set(picks) == urls and min(picks.values()) > 50


def test_retry_target_breaks_ties_at_random():
    """mutmut: `least(cands, rng)` -> `least(cands, None)` in retry_target."""
    rng = random.Random(5)
    picks = Counter(retry_target(snap(0, 2, b2=2), S1, "speculative", rng).url for _ in range(200))
    assert set(picks) == {B1, B2} and min(picks.values()) > 50


def test_global_does_not_flap_at_the_boundary():
    pol = policy_of("global", threshold=4, hysteresis=2)
    pools = []
    for total in (3, 4, 3, 4, 3, 2, 1, 2, 3, 4):
        pools.append(P.decide(pol, snap(total, 0), None, random.Random()).pool[0])
    assert "".join(pools) == "sbbbbbsssb"


def test_least_inflight_spans_both_pools_and_breaks_ties_at_random():
    assert decide(snap(5, 2, s2=3, b2=4), policy="least-inflight", threshold=0).url == B1
    rng = random.Random(7)
    picks = Counter(decide(snap(1, 1), policy="least-inflight", threshold=0, rng=rng).url for _ in range(400))
    assert set(picks) == {S1, B1}
    assert min(picks.values()) > 100
    assert decide(snap(1, 1), policy="least-inflight", threshold=0).reason == LEAST


def test_round_robin_cycles_healthy_backends():
    pol = policy_of("round-robin")
    urls = []
    for _ in range(6):
        d = P.decide(pol, snap(0, 0, s2=0, s2_up=False, b2=9), None, random.Random())
        assert d.reason == ROUND_ROBIN
        urls.append(d.url)
    assert urls == [S1, B1, B2, S1, B1, B2]


@pytest.mark.parametrize(("pin", "loads", "pool", "reason"), [
    ("speculative", snap(99, 0), "speculative", PINNED),
    ("baseline", snap(0, 0), "baseline", PINNED),
    ("baseline", snap(0, 0, b1_up=False), "speculative", FAILOVER),
])
def test_pinned(pin, loads, pool, reason):
    d = decide(loads, policy="spillover", threshold=4, pinned=pin)
    assert (d.pool, d.reason) == (pool, reason)


def test_retry_prefers_same_pool_then_other():
    rng = random.Random()
    assert retry_target(snap(0, 0, s2=5), S1, "speculative", rng).url == S2
    assert retry_target(snap(0, 0), S1, "speculative", rng).url == B1
    assert retry_target(snap(0, 0, b1_up=False), S1, "speculative", rng) is None


def test_one_builder_makes_one_object_per_policy_and_rejects_unknown_names():
    """router.policies.make_policy is the only builder: every policy name, adaptive included."""
    kinds = {name: type(policy_of(name, threshold=3, curves=SEED)) for name in policies.NAMES}
    assert kinds == {"spillover": policies.Spillover, "global": policies.Global, "least-inflight": policies.LeastInflight,
                     "round-robin": policies.RoundRobin, "balanced": policies.Balanced, "adaptive": Adaptive}
    assert all(policy_of(name, curves=SEED).name == name for name in kinds)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        policies.make_policy(SimpleNamespace(policy="fastest"))
    with pytest.raises(ValueError, match="needs both throughput curves"):
        policies.make_policy(SimpleNamespace(policy="balanced", curves=lambda: None))


def test_each_decision_sees_the_leases_taken_before_it():
    # The pools' view holds their own Backend objects, and each decision snapshots them anew: a lease taken after
    # the view was built is seen by the next decision at once.
    pools = Pools([S1], [B1], policy=policy_of("spillover", threshold=1), threshold=1)
    for b in pools.backends:
        b.probe_ok(1)
    assert pools.view.speculative[0] is pools.by_url[S1]
    first, d1 = pools.acquire()
    _, d2 = pools.acquire()
    assert (d1.url, d2.url) == (S1, B1)
    first.release()
    assert pools.acquire()[1].url == S1


def test_lease_releases_once_and_clamps():
    b = Backend(S1, "speculative")
    first, second = b.lease(), b.lease()
    assert b.inflight == 2
    first.release()
    first.release()
    assert b.inflight == 1
    second.release()
    assert b.inflight == 0
    b._release()  # a stray release cannot drive the count below zero
    assert b.inflight == 0


def test_health_thresholds():
    b = Backend(S1, "speculative")
    assert not b.healthy
    b.probe_ok(success_threshold=2)  # first probe decides at once: start routing as soon as it is up
    assert b.healthy
    b.probe_failed(failure_threshold=3)
    b.probe_failed(failure_threshold=3)
    assert b.healthy  # one or two slow probes do not eject a busy backend
    b.probe_failed(failure_threshold=3)
    assert not b.healthy
    b.probe_ok(success_threshold=2)
    assert not b.healthy
    b.probe_ok(success_threshold=2)
    assert b.healthy


def test_pool_acquire_is_exact_under_many_decisions():
    pools = Pools([S1], [B1], policy=policy_of("spillover", threshold=3), threshold=3)
    for b in pools.backends:
        b.probe_ok(1)
    leases = [pools.acquire()[0] for _ in range(10)]
    assert Counter(lease.backend.url for lease in leases) == {S1: 3, B1: 7}
    for lease in leases:
        lease.release()
    assert [b.inflight for b in pools.backends] == [0, 0]


def test_pool_leases_under_random_endings_return_to_zero():
    rng = random.Random(3)
    pools = Pools([S1, S2], [B1, B2], policy=policy_of("least-inflight", threshold=0), threshold=0, rng=rng)
    for b in pools.backends:
        b.probe_ok(1)
    live = []
    for _ in range(5000):
        if live and rng.random() < 0.5:
            lease = live.pop(rng.randrange(len(live)))
            for _ in range(rng.randint(1, 3)):  # double releases are harmless
                lease.release()
        else:
            live.append(pools.acquire()[0])
        assert sum(b.inflight for b in pools.backends) == len(live)
    for lease in live:
        lease.release()
    assert [b.inflight for b in pools.backends] == [0, 0, 0, 0]


# ---------------------------------------------------------------- balanced: curves of ONE instance each

# /work/shared/data/seed_benchmark.csv: eagle3 is slower than baseline even alone.
SEED_SPEC = ((1, 77.5), (2, 125.1), (5, 183.2), (10, 239.6), (30, 299.5), (70, 337.7), (100, 338.8), (250, 340.9))
SEED_BASE = ((1, 92.6), (2, 159.7), (5, 292.5), (10, 457.2), (30, 711.0), (70, 784.2), (100, 761.6), (250, 772.1))
# eagle3-good-tp8's measured curve: faster alone, slower from ~30 in flight.
GOOD_SPEC = ((1, 141.7), (2, 230.3), (5, 340.7), (10, 474.4), (30, 581.9), (70, 606.6), (100, 600.3), (250, 604.2))
SEED, GOOD = (SEED_SPEC, SEED_BASE), (GOOD_SPEC, SEED_BASE)


def test_curve_interpolation_and_request_speed():
    assert marginal_gain(SEED_BASE, 0) == 92.6
    assert marginal_gain(SEED_BASE, 1) == pytest.approx(159.7 - 92.6)
    assert marginal_gain(SEED_BASE, 300) == 0.0  # saturated: one more request only queues
    assert curve_throughput(SEED_SPEC, 0) == 0.0
    assert curve_throughput(SEED_SPEC, 0.5) == pytest.approx(77.5 / 2)
    assert curve_throughput(SEED_SPEC, 3) == pytest.approx(125.1 + (183.2 - 125.1) / 3)
    assert curve_throughput(SEED_SPEC, 10_000) == 340.9  # flat beyond the last point
    assert request_speed(SEED_BASE, 0) == 92.6
    assert request_speed(SEED_BASE, 1) == pytest.approx(159.7 / 2)
    # Saturated: the per-request speed keeps falling as 1/n (the queue), never levels off.
    assert request_speed(SEED_BASE, 999) == pytest.approx(772.1 / 1000)


BALANCED_TABLE = [
    # (curves, loads, pinned, pool, url, reason)
    (SEED, snap(0, 0), None, "baseline", B1, FASTER),  # seed: baseline is faster alone, so it gets the first
    (SEED, snap(0, 1), None, "baseline", B1, FASTER),  # 159.7/2 = 79.9 > 77.5
    (SEED, snap(0, 2), None, "speculative", S1, FASTER),  # 204.0/3 = 68.0 < 77.5
    (GOOD, snap(0, 0), None, "speculative", S1, FASTER),  # good profile: speculative first
    (GOOD, snap(1, 0), None, "speculative", S1, FASTER),  # 2 there: 230.3/2 = 115.2 > 92.6
    (GOOD, snap(2, 0), None, "baseline", B1, FASTER),  # 3 there: 267.1/3 = 89.0 < 92.6
    ((SEED_BASE, SEED_BASE), snap(4, 4), None, "speculative", S1, FASTER),  # a tie goes to speculative
    (GOOD, snap(5, 0, s2=1), None, "speculative", S2, FASTER),  # the least-loaded instance of the pool
    (SEED, snap(0, 5, b2=1), None, "baseline", B2, FASTER),
    (GOOD, snap(0, 0, s1_up=False), None, "baseline", B1, FAILOVER),  # one pool down -> the other
    (SEED, snap(0, 0, b1_up=False), None, "speculative", S1, FAILOVER),
    (GOOD, snap(9, 0, s2=0, s2_up=False), None, "baseline", B1, FASTER),  # a down instance is not least
    (SEED, snap(0, 0), "speculative", "speculative", S1, PINNED),  # the pinned header still wins
    (GOOD, snap(0, 0), "baseline", "baseline", B1, PINNED),
]


@pytest.mark.parametrize(("curves", "loads", "pinned", "pool", "url", "reason"), BALANCED_TABLE)
def test_balanced(curves, loads, pinned, pool, url, reason):
    d = decide(loads, policy="balanced", threshold=0, curves=curves, pinned=pinned, rng=random.Random(1))
    assert (d.pool, d.url, d.reason) == (pool, url, reason)


def test_balanced_with_one_pool_configured_and_none_healthy():
    only = View.of([BackendLoad(B1, "baseline", 7, True)])
    d = decide(only, policy="balanced", threshold=0, curves=SEED)
    assert (d.url, d.reason) == (B1, P.ONLY)  # not a failover, nor a faster pool: there is no other pool
    # the same with only the speculative pool (mutmut: sole_pool's pool choice, `other(pool)`, bool(spec))
    only = View.of([BackendLoad(S1, "speculative", 7, True)])
    d = decide(only, policy="balanced", threshold=0, curves=SEED)
    assert (d.url, d.reason) == (S1, P.ONLY)
    assert decide(snap(0, 0, s1_up=False, b1_up=False), policy="balanced", threshold=0, curves=SEED) is None
    with pytest.raises(ConfigError, match="policy balanced needs speculative_curve and baseline_curve"):
        decide(snap(0, 0), policy="balanced", threshold=0)


@pytest.mark.parametrize("policy", ["spillover", "global"])
def test_one_configured_pool_is_counted_as_only_pool(policy):
    """A baseline-only router is never "above threshold", a speculative-only one over its threshold never
    "failover": there was no choice between pools. Pinning and the backend-level policies keep their reasons."""
    base_only = View.of([BackendLoad(B1, "baseline", 0, True)])
    spec_only = View.of([BackendLoad(S1, "speculative", 9, True)])
    assert (decide(base_only, policy=policy, threshold=4).reason, decide(spec_only, policy=policy, threshold=4).reason,
            decide(spec_only, policy=policy, threshold=40).reason) == (P.ONLY, P.ONLY, P.ONLY)
    assert decide(base_only, policy=policy, threshold=4, pinned="speculative").reason == P.FAILOVER
    assert decide(base_only, policy="least-inflight").reason == P.LEAST


def _greedy(curves, n: int, n_spec: int = 1, n_base: int = 1) -> Counter:
    """Place n requests one at a time with the real policy, counting each decision as a lease."""
    urls = [f"http://s{i}:1" for i in range(n_spec)] + [f"http://b{i}:1" for i in range(n_base)]
    counts = dict.fromkeys(urls, 0)
    for _ in range(n):
        loads = View.of([BackendLoad(u, "speculative" if u.startswith("http://s") else "baseline", k, True)
                         for u, k in counts.items()])
        counts[decide(loads, policy="balanced", threshold=0, curves=curves, rng=random.Random(0)).url] += 1
    return Counter({pool: sum(k for u, k in counts.items() if u.startswith(f"http://{pool[0]}"))
                    for pool in ("speculative", "baseline")})


@pytest.mark.parametrize("curves", [SEED, GOOD])
def test_balanced_split_tends_to_throughput_ratio_at_saturation(curves):
    # Far beyond both curves' last points each request's speed is X_last/(n+1): equal speeds mean the
    # in-flight counts split as the two saturated throughputs do.
    split = _greedy(curves, 5000)
    want = curves[0][-1][1] / curves[1][-1][1]
    assert split["speculative"] / split["baseline"] == pytest.approx(want, rel=0.01)


def test_balanced_split_grows_with_load_on_the_good_profile():
    spec = [_greedy(GOOD, c)["speculative"] for c in (1, 5, 30, 250)]
    assert spec[0] == 1 and spec == sorted(spec) and spec[-1] > 8 * 5  # far beyond one fixed threshold


def test_balanced_spreads_over_instances_of_a_pool():
    split = _greedy(GOOD, 40, n_spec=2, n_base=2)
    assert split == _greedy(GOOD, 20) + _greedy(GOOD, 20)  # two identical halves of the deployment


def test_pools_pass_curves_to_balanced():
    pools = Pools([S1], [B1], policy=policy_of("balanced", threshold=0, curves=SEED), threshold=0)
    for b in pools.backends:
        b.probe_ok(1)
    leases = [pools.acquire()[0] for _ in range(6)]
    assert Counter(lease.backend.url for lease in leases) == {S1: 2, B1: 4}


async def test_balanced_through_real_sockets(sim_factory, router_factory):
    # Streams stall after their first chunk, so all six overlap and each decision sees the previous ones.
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2000,
            "ignore_eos": True}
    spec = await sim_factory("eagle3-tp8", speedup=1.0, faults={"stall_after_chunks": 1})
    base = await sim_factory("baseline-tp8", speedup=1.0, faults={"stall_after_chunks": 1})
    curve = ",".join(f"{c}:{t}" for c, t in SEED_SPEC), ",".join(f"{c}:{t}" for c, t in SEED_BASE)
    router = await router_factory([spec.url], [base.url], policy="balanced", speculative_curve=curve[0],
                                  baseline_curve=curve[1])
    async with aiohttp.ClientSession() as s:
        first = await s.post(router.url + "/v1/chat/completions", json=body)
        rest = [await s.post(router.url + "/v1/chat/completions", json=body) for _ in range(5)]
        resps = [first, *rest]
        try:
            assert all(r.status == 200 for r in resps)
            assert first.headers["X-Router-Pool"] == "baseline"
            assert Counter(r.headers["X-Router-Pool"] for r in resps) == {"speculative": 2, "baseline": 4}
            assert router.metric("router_route_decisions_total", pool="baseline", reason="faster_pool") == 4
        finally:
            for r in resps:
                r.close()
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}
