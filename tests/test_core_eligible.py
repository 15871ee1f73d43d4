"""The caller's own filter (plugins.Eligible: a gateway's subset hint, a per-backend cap): the one decision is made
among the endpoints it allows, before the policy and the pinned pool, never changed after."""
from __future__ import annotations

import random

import pytest

from router.core.plugins import Eligible
from router.core.scheduler import Scheduler
from router.policies import LeastInflight, Spillover
from router.policy import BELOW, FAILOVER, ONLY, PINNED, BackendLoad

pytestmark = pytest.mark.timeout(30)

VIEW = [BackendLoad("s1", "speculative", 0, True), BackendLoad("s2", "speculative", 5, True),
        BackendLoad("b1", "baseline", 1, True), BackendLoad("b2", "baseline", 9, True)]


def decide(policy, only, pinned=None):
    sched = Scheduler(policy)
    got = sched.decide(sched.snapshot(VIEW, pinned), random.Random(0), only)
    return None if got is None else got.decision


def test_the_policy_chooses_only_among_the_eligible_endpoints():
    assert decide(LeastInflight(), None).url == "s1"  # the least loaded of all
    assert decide(LeastInflight(), Eligible(frozenset({"s2", "b2"}))).url == "s2"
    # with one pool left there was no choice between pools to explain; with both, spillover's own reason
    assert decide(Spillover(4), Eligible(frozenset({"s1"}))).reason == ONLY
    assert decide(Spillover(4), Eligible(frozenset({"s1", "b1"}))).reason == BELOW
    assert decide(Spillover(4), Eligible(frozenset({"s2", "b1"}))).url == "b1"  # s2 holds 5, above 4
    assert decide(Spillover(4), Eligible(frozenset({"b1", "b2"}))).url == "b1"


def test_a_pinned_request_fails_over_to_an_eligible_endpoint_of_the_other_pool():
    d = decide(LeastInflight(), Eligible(frozenset({"b1"})), pinned="baseline")
    assert (d.url, d.reason) == ("b1", PINNED)
    d = decide(LeastInflight(), Eligible(frozenset({"b2"})), pinned="speculative")
    assert (d.url, d.reason) == ("b2", FAILOVER)


def test_nothing_eligible_is_no_decision():
    assert decide(LeastInflight(), Eligible(frozenset())) is None
    assert decide(LeastInflight(), Eligible(frozenset({"nowhere"}))) is None
