"""Table tests of the pure routing policies and of leases and pools (no sockets)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from router.policy import (
    ABOVE,
    BELOW,
    FAILOVER,
    LEAST,
    PINNED,
    ROUND_ROBIN,
    BackendLoad,
    PolicyState,
    decide,
    retry_target,
)
from router.pools import Backend, Pools

S1, S2, B1, B2 = "http://s1:1", "http://s2:1", "http://b1:1", "http://b2:1"


def snap(s1=0, b1=0, *, s2=None, b2=None, s1_up=True, b1_up=True, s2_up=True, b2_up=True):
    loads = [BackendLoad(S1, "speculative", s1, s1_up)]
    if s2 is not None:
        loads.append(BackendLoad(S2, "speculative", s2, s2_up))
    loads.append(BackendLoad(B1, "baseline", b1, b1_up))
    if b2 is not None:
        loads.append(BackendLoad(B2, "baseline", b2, b2_up))
    return loads


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
    d = decide(snap(*split), policy="global", threshold=threshold, hysteresis=hyst,
               state=PolicyState(speculating=before))
    assert d.pool == pool
    assert d.state.speculating is after


def test_global_does_not_flap_at_the_boundary():
    state = PolicyState()
    pools = []
    for total in (3, 4, 3, 4, 3, 2, 1, 2, 3, 4):
        d = decide(snap(total, 0), policy="global", threshold=4, hysteresis=2, state=state)
        state = d.state
        pools.append(d.pool[0])
    assert "".join(pools) == "sbbbbbsssb"


def test_least_inflight_spans_both_pools_and_breaks_ties_at_random():
    assert decide(snap(5, 2, s2=3, b2=4), policy="least-inflight", threshold=0).url == B1
    rng = random.Random(7)
    picks = Counter(decide(snap(1, 1), policy="least-inflight", threshold=0, rng=rng).url for _ in range(400))
    assert set(picks) == {S1, B1}
    assert min(picks.values()) > 100
    assert decide(snap(1, 1), policy="least-inflight", threshold=0).reason == LEAST


def test_round_robin_cycles_healthy_backends():
    state = PolicyState()
    urls = []
    for _ in range(6):
        d = decide(snap(0, 0, s2=0, s2_up=False, b2=9), policy="round-robin", threshold=0, state=state)
        assert d.reason == ROUND_ROBIN
        state = d.state
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
    assert retry_target(snap(0, 0, s2=5), S1, "speculative").url == S2
    assert retry_target(snap(0, 0), S1, "speculative").url == B1
    assert retry_target(snap(0, 0, b1_up=False), S1, "speculative") is None


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
    b.refused()
    assert not b.healthy


def test_pool_acquire_is_exact_under_many_decisions():
    pools = Pools([S1], [B1], policy="spillover", threshold=3)
    for b in pools.backends:
        b.probe_ok(1)
    leases = [pools.acquire()[0] for _ in range(10)]
    assert Counter(lease.backend.url for lease in leases) == {S1: 3, B1: 7}
    for lease in leases:
        lease.release()
    assert [b.inflight for b in pools.backends] == [0, 0]


def test_pool_leases_under_random_endings_return_to_zero():
    rng = random.Random(3)
    pools = Pools([S1, S2], [B1, B2], policy="least-inflight", threshold=0, rng=rng)
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
