"""The decision core's interfaces: one snapshot per decision, a filter, a scorer, the picker, and nothing that
changes a decision after the picker made it."""
from __future__ import annotations

import random

import pytest

from router.affinity import Affinity
from router.core.plugins import Picker, PinnedPool, PoolScores, Scored, Scores
from router.core.scheduler import Scheduler
from router.core.snapshot import Endpoint, Snapshot
from router.policies import LeastInflight
from router.policy import AFFINITY, BELOW, FAILOVER, NO_MATCH, PINNED, BackendLoad, Decision, Fixed, View
from router.prefix import TEXT, Prompt

pytestmark = pytest.mark.timeout(30)


class Live:
    """A backend whose figures change under the decision's feet (a policy must not see it)."""

    def __init__(self, url, pool, load):
        self.url, self.pool, self.load, self.reads = url, pool, load, 0

    @property
    def routable(self):
        return True

    @property
    def load_estimate(self):
        self.reads += 1
        return self.load


def test_one_snapshot_per_decision_reads_each_backend_once():
    a, b = Live("a", "baseline", 3), Live("b", "baseline", 1)
    snap = Snapshot.take([a, b])
    assert (a.reads, b.reads) == (1, 1)
    a.load = 0  # after the snapshot: the decision does not see it
    assert LeastInflight().decide(snap.view, random.Random(0)).url == "b"
    assert all(isinstance(e, Endpoint) for e in snap.view.backends)


def test_the_pinned_filter_narrows_to_the_pinned_pool_then_fails_over():
    view = [BackendLoad("s", "speculative", 0, True), BackendLoad("b", "baseline", 9, True)]
    narrowed = PinnedPool().filter(Snapshot.take(view, "baseline"))
    assert [e.url for e in narrowed.view.backends] == ["b"]
    down = [BackendLoad("s", "speculative", 0, True), BackendLoad("b", "baseline", 9, False)]
    assert [e.url for e in PinnedPool().filter(Snapshot.take(down, "baseline")).view.backends] == ["s"]
    sched = Scheduler(LeastInflight())
    assert sched.decide(sched.snapshot(view, "baseline"), random.Random(0)).decision.reason == PINNED
    assert sched.decide(sched.snapshot(down, "baseline"), random.Random(0)).decision.reason == FAILOVER


def long_prompt(seed: int, nbytes: int = 52_000) -> Prompt:
    from router.prefix import chain

    rng = random.Random(seed)
    return Prompt(TEXT, nbytes, chain(bytes(rng.getrandbits(8) for _ in range(nbytes))))


def test_the_prefix_scorer_prices_load_against_the_prefill_saved_and_touches_nothing():
    aff = Affinity()
    p = long_prompt(1)
    aff.index.of("a", 0, 1000).insert(p.blocks)
    snap = Scheduler(LeastInflight(), aff).snapshot([BackendLoad("a", "baseline", 2, True),
                                                     BackendLoad("b", "baseline", 0, True)], None, p)
    assert snap.depth["a"] > 0 == snap.depth["b"]
    before = aff.index.size("a"), aff.index.size("b")
    scores = aff.score(snap, Decision(snap.view.backends[1], BELOW))
    cost = {s.endpoint.url: s.cost_s for s in scores.home.cands}
    assert cost["a"] < cost["b"]  # two requests' wait is less than prefilling 13k tokens
    assert scores.away is None and (aff.index.size("a"), aff.index.size("b")) == before


def ep(url, pool="baseline"):
    return Endpoint(url, pool, True, 0, 0, 0, url)


def test_the_picker_takes_the_cheapest_then_the_deeper_then_random():
    cands = (Scored(ep("a"), 1.0, 0), Scored(ep("b"), 0.5, 0), Scored(ep("c"), 0.5, 3))
    ps = PoolScores("baseline", cands, 0.0, 1e-4)
    assert Picker.best(ps, random.Random(0))[0].url == "c"
    ties = PoolScores("baseline", (Scored(ep("a"), 0.5, 0), Scored(ep("b"), 0.5, 0)), 0.0, 1e-4)
    assert {Picker.best(ties, random.Random(i))[0].url for i in range(20)} == {"a", "b"}
    assert Picker.best(ties, random.Random(0))[3] == NO_MATCH


def test_the_other_pool_wins_only_in_the_one_scoring():
    """Moving pools is a term of the picker's one comparison: the other pool's total against the proposed pool's
    total with the re-prefill of what the other holds."""
    p = long_prompt(2)
    home = PoolScores("baseline", (Scored(ep("b"), 0.1, 0),), 5.0, 1e-4)
    away = PoolScores("speculative", (Scored(ep("s", "speculative"), 0.1, 10),), 1.0, 1e-4)
    proposal = Decision(ep("b"), BELOW)
    scores = Scores(p, 13_000, NO_MATCH, home, away, True, 2048, 4.0)
    got = Picker().pick(proposal, scores, random.Random(0))
    assert (got.decision.url, got.decision.reason) == ("s", AFFINITY)
    unknown = Scores(p, 13_000, NO_MATCH, home, away, False, 2048, 4.0)
    assert Picker().pick(proposal, unknown, random.Random(0)).decision.url == "b"


class Recorder(Fixed):
    """A pool policy that proposes the first backend and records what it was given."""

    name = "recorder"

    def __init__(self):
        self.views: list[View] = []

    def decide(self, view, rng):
        self.views.append(view)
        return Decision(view.backends[0], BELOW)


def test_no_plug_in_sees_or_changes_the_decision_after_the_picker():
    pol = Recorder()
    sched = Scheduler(pol, Affinity())
    backends = [BackendLoad("b1", "baseline", 0, True), BackendLoad("b2", "baseline", 0, True)]
    got = sched.decide(sched.snapshot(backends, None, long_prompt(3)), random.Random(0))
    assert len(pol.views) == 1  # the policy is asked once, before the scorer and the picker
    assert got.decision.backend in backends  # the live backend, for the lease
    with pytest.raises(AttributeError):
        got.decision.reason = "rewritten"  # frozen: the picker's decision is final


def test_the_core_and_the_policies_import_no_io_metrics_or_prometheus():
    import subprocess
    import sys

    code = ("import sys\n"
            "import router.core.scheduler, router.affinity, router.adaptive, router.policies\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'prometheus_client', 'asyncio')"
            " or m in ('router.metrics', 'router.exporter', 'router.pools')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True)
    assert out.stdout.strip() == "[]"
