"""Big refits left to learn() and run a step at a time (router.learner, SpeedModel.fit_steps): same models, no long stall."""
from __future__ import annotations

import asyncio
import copy
import math
import random

import pytest

from router.adaptive import Adaptive
from router.app import STATE
from router.learner import LEARN_STEP, Learner
from router.observe import LoadFigures, Observation
from router.pools import Pools
from router.speedmodel import SpeedModel
from router.tuning import DEFAULT

S1, B1 = "http://s1:1", "http://b1:1"


def feed(m: SpeedModel, k: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    for _ in range(k):
        n = rng.choice([1, 2, 3, 5, 10, 13, 19, 30, 40, 70]) * rng.uniform(0.9, 1.1)
        m.update(n, (0.01 + 0.0005 * n) * math.exp(rng.gauss(0, 0.1)))


def fitted(m: SpeedModel) -> tuple:
    return (m.theta, m.scale, m.shape, m.counts, m.spread)


def test_a_stepped_refit_is_the_refit():
    m = SpeedModel()
    feed(m, 1500)
    assert m.held() > 3 * DEFAULT.fit_step
    other = copy.deepcopy(m)
    steps = list(m.fit_steps(step=100))
    other.fit()
    assert len(steps) > 20 and max(steps) <= m.held()
    assert fitted(m) == fitted(other)


def test_a_deferring_model_leaves_big_refits_due_and_changes_only_when_one_ends():
    lazy, eager = SpeedModel(), SpeedModel()
    lazy.defer = True
    feed(lazy, DEFAULT.sync_fit - 1)
    feed(eager, DEFAULT.sync_fit - 1)
    assert not lazy.due and fitted(lazy) == fitted(eager)  # small refits still run at once
    rng = random.Random(5)
    for _ in range(40):
        n, y = rng.uniform(1, 40), 0.03 * math.exp(rng.gauss(0, 0.1))  # a slower server than the samples so far
        lazy.update(n, y)
        eager.update(n, y)
    assert lazy.due
    before = fitted(lazy)
    job = lazy.fit_steps()
    for _ in range(3):
        next(job)
    assert fitted(lazy) == before and not lazy.due  # under way: nothing moved yet
    for _ in job:
        pass
    assert fitted(lazy) != before
    assert lazy.theta[0] == pytest.approx(eager.theta[0], rel=0.05)


def test_a_rescale_during_a_refit_drops_it_and_leaves_another_due():
    m = SpeedModel()
    m.defer = True
    feed(m, 400)
    job = m.fit_steps()
    next(job)
    m.rescale(2.0)
    scaled = fitted(m)
    for _ in job:
        pass
    assert fitted(m) == scaled and m.due  # the old scale's refit is not applied
    m.fit()
    assert m.theta[0] == pytest.approx(2 * 0.01, rel=0.1)


def observations(k: int, seed: int = 2):
    rng = random.Random(seed)
    for i in range(k):
        pool, url, a = ("speculative", S1, 0.012) if i % 3 == 0 else ("baseline", B1, 0.02)
        n = rng.randint(1, 30)
        d = (a + 0.0006 * n) * 100 * math.exp(rng.gauss(0, 0.1))
        yield Observation(pool, url, n, n, d, d / 20, 100, 50, True)


def test_adaptive_publishes_a_deferred_refit_when_learn_has_run_it():
    eager, lazy = Adaptive(explore=0.0), Adaptive(explore=0.0, defer_fits=True)
    steps = left = 0
    for o in observations(600):
        for pol in (eager, lazy):
            pol.observe(o)
            pol.observe_loads(S1, "speculative", LoadFigures(8, 0, None, 2.5, 48))
        left += bool(lazy.speeds.pending)  # a refit left to learn()
        while lazy.learn(LEARN_STEP):
            steps += 1
        assert not lazy.speeds.pending
    assert left >= 10 and steps > left  # run in several steps each
    assert lazy.speeds.published == eager.speeds.published and lazy.speeds.spreads == eager.speeds.spreads


def test_pools_without_a_learner_run_the_refits_at_once():
    pol = Adaptive(explore=0.0, defer_fits=True)
    pools = Pools([S1], [B1], policy=pol)
    for o in observations(400):
        pools.report_done(pools.by_url[o.url], o)
    assert not pol.speeds.pending


async def test_the_learner_runs_refits_in_steps_while_the_loop_serves_others():
    pol = Adaptive(explore=0.0, defer_fits=True)
    pools = Pools([S1], [B1], policy=pol)
    learner = Learner(pools)
    ticks, seen = 0, []
    learn = pol.learn

    def counted(work=None):
        seen.append(ticks)  # how often the other task had run when this step began
        return learn(work)

    pol.learn = counted

    async def other_work():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    learner.start()
    other = asyncio.create_task(other_work())
    try:
        assert pools.learner is not None
        for o in observations(800):
            pools.report_done(pools.by_url[o.url], o)
        assert pol.speeds.pending and not seen  # left for the learner, not run inside report_done
        for _ in range(10_000):
            if not pol.speeds.pending:
                break
            await asyncio.sleep(0)
        else:
            pytest.fail("the learner left refits pending after 10,000 turns of the loop")
        assert len(seen) >= 4  # in steps ...
        assert all(b > a for a, b in zip(seen, seen[1:], strict=False))  # ... with the loop turning between them
        assert pol.pool_model("baseline").samples > DEFAULT.sync_fit
    finally:
        other.cancel()
        await learner.stop()
    assert pools.learner is None


async def test_a_serving_router_runs_the_learner(router_factory, sim_factory):
    base = await sim_factory("baseline-tp8")
    spec = await sim_factory("eagle3-tp8")
    router = await router_factory([spec.url], [base.url], policy="adaptive")
    pools = router.app[STATE].pools
    assert pools.learner is not None and pools.policy.defer_fits


# ---------------------------------------------------------------- one model for a pool of one instance

def test_a_pool_fed_by_one_instance_shares_its_model_and_splits_at_a_second():
    pol = Adaptive(explore=0.0)
    alone = SpeedModel()  # what the pool's own model would hold: every sample of the pool, in order
    s2 = "http://s2:1"
    for i, o in enumerate(observations(900)):
        if o.pool != "speculative":
            continue
        if i > 600:
            o = Observation(o.pool, s2, o.inflight_at_start, o.inflight_at_end, o.duration_s * 1.3, o.ttft_s,
                            o.completion_tokens, o.chunks, True)
        pol.observe(o)
        alone.update(o.inflight_at_start, o.duration_s / o.completion_tokens)
        if i == 600:
            assert pol.speeds.models["speculative"] is pol.speeds.models[S1]  # one object, refitted once per refit
            assert pol.speeds.published["speculative"] == pol.speeds.published[S1]
    assert pol.speeds.models["speculative"] is not pol.speeds.models[S1]
    assert fitted(pol.speeds.models["speculative"]) == fitted(alone)
    assert pol.speeds.models[S1].samples == 201 and pol.speeds.models[s2].samples == 99


def test_a_second_instances_load_figures_split_the_pool_without_touching_the_first():
    pol = Adaptive(explore=0.0)
    s2 = "http://s2:1"
    for o in observations(60):
        pol.observe(o)
    pol.observe_loads(S1, "speculative", LoadFigures(4, 0, None, None, 48))
    assert pol.speeds.models["speculative"] is pol.speeds.models[S1]
    pol.observe_loads(s2, "speculative", LoadFigures(4, 0, None, None, 16))
    assert pol.speeds.models[S1].max_running == 48
    assert pol.speeds.models["speculative"] is not pol.speeds.models[S1] and pol.speeds.models["speculative"].max_running == 16
    assert pol.speeds.models[s2].max_running == 16
