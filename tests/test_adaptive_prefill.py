"""adaptive's prefill model (router.speedmodel.PrefillModel): what a request's prefill forward costs its server's
batch, per uncached prompt token where prompt lengths vary, learned through observe() and shown by state()."""
from __future__ import annotations

import random

import pytest

from router.adaptive import Adaptive
from router.core.figures import EWMA, PRIOR_OUTPUT_TOKENS
from router.observe import Observation
from router.policy import BackendLoad, View
from router.speedmodel import PrefillModel
from router.tuning import DEFAULT, Tuning

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
    assert pol.speeds.stall(v.speculative[0]) == 0.0  # nothing measured
    pol.observe(alone("speculative", S1, SPEC, 1.0))
    pol.observe(alone("baseline", B1, BASE, 0.05))
    busy = Observation("speculative", S1, 4, 4, 1.0, 0.9, TOKENS, 12, True, prompt_tokens=3000)
    pol.observe(busy)  # not alone: its first token waited for others' steps, not a measure of the forward
    assert pol.speeds.prefill["speculative"].samples == 1
    assert pol.speeds.stall(v.speculative[0]) == pytest.approx(1.0) and pol.speeds.stall(v.baseline[0]) == pytest.approx(0.05)
    st = pol.state(v)
    assert st["pools"]["speculative"]["prefill_s"] == pytest.approx(1.0)
    assert st["pools"]["speculative"]["prefill_samples"] == 1
    # Its speed samples are in the models unmoved and kept for the rebuild once the covariate is measured. Output
    # tokens per request: the one figure the prefix scorer prices with too (router.core.figures), three samples in.
    assert st["samples_unmoved"] == 3
    assert st["tokens_per_request"] == round(TOKENS + (PRIOR_OUTPUT_TOKENS - TOKENS) * (1 - EWMA) ** 3, 1)
    assert [b["stall_s"] for b in st["backends"]] == [pytest.approx(1.0), pytest.approx(0.05)]


def test_uncached_tokens_come_from_the_usage_else_from_the_prefix_index():
    pol = Adaptive(explore=0.0)
    pol.observe(alone("baseline", B1, BASE, 0.1, prompt=3000, cached=2000, expected=0))
    assert pol.speeds.prefill["baseline"].uncached == pytest.approx(1000)
    pol = Adaptive(explore=0.0)
    pol.observe(alone("baseline", B1, BASE, 0.1, prompt=3000, cached=None, expected=2500))
    assert pol.speeds.prefill["baseline"].uncached == pytest.approx(500)
    pol = Adaptive(explore=0.0)
    pol.observe(alone("baseline", B1, BASE, 0.1, prompt=3000))
    assert pol.speeds.prefill["baseline"].uncached == pytest.approx(3000)


def test_pools_pass_the_index_expectation_to_the_policy_only_when_the_backend_reported_no_cached_tokens():
    from router.affinity import Placement
    from router.pools import Pools
    from router.prefix import prompt_of

    pol = Adaptive(explore=0.0)
    pools = Pools([S1], [B1], policy=pol)
    placement = Placement("prefix_affinity", prompt_of([{"role": "user", "content": "x"}], None), expected_cached=2500)
    pools.report_done(pools.by_url[B1], alone("baseline", B1, BASE, 0.1, prompt=3000), placement)
    assert pol.speeds.prefill["baseline"].uncached == pytest.approx(500)
    pools.report_done(pools.by_url[S1], alone("speculative", S1, SPEC, 0.1, prompt=3000, cached=0), placement)
    assert pol.speeds.prefill["speculative"].uncached == pytest.approx(3000)  # the backend's own figure wins


def test_a_sample_is_moved_by_what_its_prompt_cost_beyond_the_typical_at_most_its_first_token():
    """sample()'s shift: seconds taken off (or added to) a duration holding the request's prefill; at most its
    time to first token, at most half a duration not streamed, and after a wait in a one-place queue at most the
    first token's time past the wait. mutmut: the shift dropped, either cap dropped or swapped."""
    from router.adaptive import sample

    o = Observation("baseline", B1, 1, 1, 2.4, 0.6, 24, 24, True)
    assert sample(o, None, 0.3) == (1.0, pytest.approx(2.1 / 24))
    assert sample(o, None, 5.0) == (1.0, pytest.approx(1.8 / 24))  # its prefill took at most its first token
    assert sample(o, None, -0.4) == (1.0, pytest.approx(2.8 / 24))  # a short prompt: as if it were typical
    unstreamed = Observation("baseline", B1, 1, 1, 2.4, None, 24, 1, True)
    assert sample(unstreamed, None, 5.0) == (1.0, pytest.approx(1.2 / 24))
    waited = Observation("baseline", B1, 2, 2, 3.0, 1.0, 24, 24, True, waited_s=0.5)
    assert sample(waited, 1, 0.2) == (1.0, pytest.approx(2.3 / 24))
    assert sample(waited, 1, 2.0) == (1.0, pytest.approx(2.0 / 24))
    assert sample(Observation("baseline", B1, 1, 1, 2.4, 0.6, 24, 24, True), None) == (1.0, pytest.approx(0.1))


def test_the_estimated_prompt_size_counts_when_the_usage_gave_none():
    from router.adaptive import uncached_tokens

    def obs(**kw):
        return Observation("baseline", B1, 1, 1, 1.0, 0.1, None, 5, True, data_events=6, **kw)

    assert uncached_tokens(obs()) is None
    assert uncached_tokens(obs(estimated_prompt_tokens=300)) == 300
    assert uncached_tokens(obs(estimated_prompt_tokens=300, expected_cached_tokens=100)) == 200
    assert uncached_tokens(obs(prompt_tokens=500, estimated_prompt_tokens=300, cached_tokens=450)) == 50


def learn_pair(monkeypatch, covariate: bool) -> dict:
    """Two servers alike (24 tokens decoded at 0.04 s each after a prefill of 0.05 s + 12.5 ms a prompt token,
    the llama.cpp pair's: bench/results/adaptive/engine-scatter.txt), no usage, each first served ten prompts of
    every size, then by luck the speculative one only long prompts and the baseline only short ones."""
    pol = Adaptive(explore=0.0, tuning=DEFAULT if covariate else Tuning(covariate_samples=10**9))
    rng = random.Random(5)

    def serve(pool, url, u):
        ttft = 0.05 + 0.0125 * u
        dur = (ttft + 24 * 0.04) * rng.lognormvariate(0, 0.04)
        pol.observe(Observation(pool, url, 1, 1, dur, ttft, None, 24, True, data_events=25,
                                estimated_prompt_tokens=u))

    for _ in range(10):
        serve("speculative", S1, rng.randint(24, 216))
        serve("baseline", B1, rng.randint(24, 216))
    for _ in range(20):
        serve("speculative", S1, rng.randint(160, 216))
        serve("baseline", B1, rng.randint(24, 60))
    return pol.state(view(0, 0))["pools"]


def test_which_prompts_a_server_happened_to_draw_does_not_decide_which_looks_faster(monkeypatch):
    """The prompt as a covariate (Adaptive.prompt_shift): both servers' samples are moved to the typical prompt by
    the prefill model's per-token seconds, so the two alike are learned alike (within 5%) though one drew 3-5x
    longer prompts; unmoved, that luck made the speculative one half as fast. A server with no prefill model of
    its own yet is moved by every server's together. mutmut: the shift not passed to sample(), the mix not
    updated, the per-token slope or the EVERY fallback dropped."""
    moved = learn_pair(monkeypatch, covariate=True)
    assert moved["speculative"]["tok_s_alone"] == pytest.approx(moved["baseline"]["tok_s_alone"], rel=0.05)
    assert moved["baseline"]["prefill_s_per_ktok"] == pytest.approx(12.5, rel=0.05)
    pol = Adaptive(explore=0.0)
    for u in range(24, 224, 20):
        pol.observe(Observation("speculative", S1, 1, 1, 4.0, 0.05 + 0.0125 * u, None, 24, True, data_events=25,
                                estimated_prompt_tokens=u))
    assert "baseline" not in pol.speeds.prefill and pol.speeds.prompt_mix > 0
    assert pol.speeds.prompt_shift(B1, "baseline", 300) == pytest.approx(0.0125 * (300 - pol.speeds.prompt_mix), rel=1e-3)
    unmoved = learn_pair(monkeypatch, covariate=False)
    assert unmoved["speculative"]["tok_s_alone"] < 0.75 * unmoved["baseline"]["tok_s_alone"]


def test_the_first_samples_are_folded_unmoved_and_the_models_rebuilt_moved_once_the_covariate_is_measured():
    """Until the prefill model of every server holds Tuning.covariate_samples idle requests, samples enter the models
    unmoved (decisions route on them) and are kept; then the models are rebuilt from them moved to the typical
    prompt, keeping a queue limit and an accept-length rescale learned meanwhile, and the tokens per request. A
    server never found idle measures no prefill: after Tuning.max_early samples they stay unmoved.
    mutmut: no rebuild, the rebuild dropping the limit or the rescale, the log not ending at max_early."""
    from router.observe import LoadFigures

    pol = Adaptive(explore=0.0)
    rng = random.Random(3)
    pol.observe_loads(B1, "baseline", LoadFigures(0, 0, max_running=7))
    for i in range(DEFAULT.covariate_samples - 1):
        pool, url = ("speculative", S1) if i % 2 == 0 else ("baseline", B1)
        u = rng.randint(160, 216) if pool == "speculative" else rng.randint(24, 60)  # the luck of the draw
        ttft = 0.05 + 0.0125 * u
        pol.observe(Observation(pool, url, 1, 1, ttft + 0.96, ttft, None, 24, True, data_events=25,
                                estimated_prompt_tokens=u))
        for _ in range(DEFAULT.anchor_polls if i == 2 else 0):
            pol.observe_loads(S1, "speculative", LoadFigures(16, 0, accept_length=3.0))
    for _ in range(DEFAULT.accept_polls):  # tokens per step 3 -> 1.5: the speculative model 2x slower, at once
        pol.observe_loads(S1, "speculative", LoadFigures(16, 0, accept_length=1.5))
    st = pol.state(view(0, 0))
    assert st["samples_unmoved"] == DEFAULT.covariate_samples - 1
    assert st["pools"]["speculative"]["samples"] + st["pools"]["baseline"]["samples"] == DEFAULT.covariate_samples - 1
    # Unmoved, the speculative server's long prompts put it well below the baseline's speed alone.
    assert st["pools"]["speculative"]["tok_s_alone"] < 0.5 * st["pools"]["baseline"]["tok_s_alone"]
    tokens = pol.figures.output_tokens
    pol.observe(Observation("baseline", B1, 1, 1, 0.05 + 0.0125 * 100 + 0.96, 0.05 + 0.0125 * 100, None, 24, True,
                            data_events=25, estimated_prompt_tokens=100))
    st = pol.state(view(0, 0))
    assert st["samples_unmoved"] == 0 and pol.speeds.early is None
    assert st["pools"]["speculative"]["samples"] + st["pools"]["baseline"]["samples"] == DEFAULT.covariate_samples
    # The rebuild replays the models' samples, not the figures store: each output-token count went in once.
    assert st["tokens_per_request"] == round(tokens + EWMA * (24 - tokens), 1)
    assert st["pools"]["baseline"]["max_running"] == 7
    # Every sample moved to the typical prompt: 0.05 s + 12.5 ms a token of the mix, and 24 tokens at 0.04 s; the
    # speculative model then 2x slower (the rescale the samples it held took, taken again on the rebuild).
    typical = 24 / (0.05 + 0.0125 * pol.speeds.prompt_mix + 0.96)
    assert st["pools"]["baseline"]["tok_s_alone"] == pytest.approx(typical, rel=0.03)
    assert st["pools"]["speculative"]["tok_s_alone"] == pytest.approx(typical / 2, rel=0.03)

    busy = Adaptive(explore=0.0)
    for i in range(DEFAULT.max_early):
        busy.observe(Observation("baseline", B1, 4, 4, 2.0, 0.5, None, 24, True, data_events=25,
                                 estimated_prompt_tokens=50 + i))
    assert busy.state(view(0, 0))["samples_unmoved"] == 0 and busy.speeds.early is None
    assert busy.speeds.models["baseline"].samples == DEFAULT.max_early


def test_what_the_rebuild_would_replay_is_bounded():
    """Accept-length rescales while no request finishes each add to what the rebuild would replay: beyond
    max_early_log the log ends (the models stay as they are), so it cannot grow with time."""
    from router.observe import LoadFigures

    pol = Adaptive(explore=0.0)
    longest = 0
    for cycle in range(DEFAULT.max_early_log + 2):
        for _ in range(DEFAULT.anchor_polls + DEFAULT.accept_polls):
            pol.observe_loads(S1, "speculative", LoadFigures(16, 0, accept_length=3.0 if cycle % 2 else 1.5))
            longest = max(longest, len(pol.speeds.early or ()))
    assert pol.speeds.models[S1].epoch > DEFAULT.max_early_log  # every cycle rescaled
    assert pol.speeds.early is None and longest == DEFAULT.max_early_log
