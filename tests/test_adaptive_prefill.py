"""adaptive's prefill model (router.speedmodel.PrefillModel): what a request's prefill forward costs its server's
batch, per uncached prompt token where prompt lengths vary, learned through observe() and shown by state()."""
from __future__ import annotations

import random

import pytest

from router.adaptive import Adaptive
from router.observe import Observation
from router.policy import BackendLoad, View
from router.speedmodel import PrefillModel

S1, B1 = "http://s1:1", "http://b1:1"
SPEC = (0.02, 0.001746)  # seconds per token per request at n running: alpha + beta * n
BASE = (0.0097, 0.00115)
TOKENS = 200


def view(s, b):
    return View.of([BackendLoad(S1, "speculative", s, True), BackendLoad(B1, "baseline", b, True)])


def alone(pool, url, ab, ttft, prompt=3000, cached=None, expected=None):
    """A request that found its server idle, its duration what the model already says there."""
    duration = (ab[0] + ab[1]) * TOKENS
    return Observation(pool, url, 1, 1, duration, ttft, TOKENS, TOKENS // 16, True, prompt_tokens=prompt,
                       cached_tokens=cached, expected_cached_tokens=expected)


def test_prefill_per_token_is_fitted_when_prompt_lengths_vary():
    m = PrefillModel()
    rng = random.Random(2)
    for _ in range(60):
        u = rng.randint(200, 4000)
        m.update(u, 0.012 + 2.5e-5 * u)
        m.note(u)
    assert m.per_token() == pytest.approx(2.5e-5, rel=1e-6)
    assert m.seconds(1000) == pytest.approx(0.012 + 0.025, rel=1e-6)
    assert m.seconds(0) == pytest.approx(0.012, rel=1e-6)


def test_prefill_of_one_prompt_length_is_its_mean_and_no_slope():
    m = PrefillModel()
    assert m.seconds() == 0.0  # nothing measured: no stall assumed
    for t in (0.08, 0.09, 0.10):
        m.update(3000, t)
    assert m.per_token() is None  # fixed and per-token parts cannot be told apart
    assert m.seconds() == pytest.approx(0.09, rel=0.01)
    m.update(float("nan"), 0.1)
    m.update(3000, -1.0)
    assert m.samples == 3


def test_the_prefill_a_server_costs_its_batch_is_learned_from_requests_that_found_it_idle():
    pol = Adaptive(priors={"speculative": SPEC, "baseline": BASE}, explore=0.0)
    v = view(7, 21)
    assert pol.stall(v.speculative[0]) == 0.0  # nothing measured
    pol.observe(alone("speculative", S1, SPEC, 1.0))
    pol.observe(alone("baseline", B1, BASE, 0.05))
    busy = Observation("speculative", S1, 4, 4, 1.0, 0.9, TOKENS, 12, True, prompt_tokens=3000)
    pol.observe(busy)  # not alone: its first token waited for others' steps, not a measure of the forward
    assert pol.prefill["speculative"].samples == 1
    assert pol.stall(v.speculative[0]) == pytest.approx(1.0) and pol.stall(v.baseline[0]) == pytest.approx(0.05)
    st = pol.state(v)
    assert st["pools"]["speculative"]["prefill_s"] == pytest.approx(1.0)
    assert st["pools"]["speculative"]["prefill_samples"] == 1 and st["tokens_per_request"] == TOKENS
    assert [b["stall_s"] for b in st["backends"]] == [pytest.approx(1.0), pytest.approx(0.05)]


def test_uncached_tokens_come_from_the_usage_else_from_the_prefix_index():
    pol = Adaptive(explore=0.0)
    pol.observe(alone("baseline", B1, BASE, 0.1, prompt=3000, cached=2000, expected=0))
    assert pol.prefill["baseline"].uncached == pytest.approx(1000)
    pol = Adaptive(explore=0.0)
    pol.observe(alone("baseline", B1, BASE, 0.1, prompt=3000, cached=None, expected=2500))
    assert pol.prefill["baseline"].uncached == pytest.approx(500)
    pol = Adaptive(explore=0.0)
    pol.observe(alone("baseline", B1, BASE, 0.1, prompt=3000))
    assert pol.prefill["baseline"].uncached == pytest.approx(3000)


def test_pools_pass_the_index_expectation_to_the_policy_only_when_the_backend_reported_no_cached_tokens():
    from router.affinity import Placement
    from router.pools import Pools
    from router.prefix import prompt_of

    pol = Adaptive(explore=0.0)
    pools = Pools([S1], [B1], policy=pol)
    placement = Placement("prefix_affinity", prompt_of([{"role": "user", "content": "x"}], None), expected_cached=2500)
    pools.report_done(pools.by_url[B1], alone("baseline", B1, BASE, 0.1, prompt=3000), placement)
    assert pol.prefill["baseline"].uncached == pytest.approx(500)
    pools.report_done(pools.by_url[S1], alone("speculative", S1, SPEC, 0.1, prompt=3000, cached=0), placement)
    assert pol.prefill["speculative"].uncached == pytest.approx(3000)  # the backend's own figure wins
