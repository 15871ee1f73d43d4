"""The decision core at its edges (router.core, router.affinity, router.policies): exact ties, zero costs, the
re-prefill term's arithmetic, defaults. Each test names, in its docstring, what it pins; these are the cases the
mutation run (scripts/mutation.sh, docs/TESTING.md "Decision core") found no other test judging."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from router.affinity import Affinity
from router.core.figures import Figures
from router.core.plugins import Picker, Placement, PoolScores, Scored, Scores
from router.core.scheduler import Scheduler
from router.core.snapshot import Endpoint, Snapshot
from router.observe import LoadFigures, Observation
from router.policies import LeastInflight
from router.policy import (
    AFFINITY,
    BELOW,
    FAILOVER,
    LOAD_OVERRIDE,
    NO_MATCH,
    ONLY,
    PINNED,
    POOL_KEPT,
    POOL_MOVED,
    SINGLE,
    BackendLoad,
    Decision,
    View,
)
from router.prefix import IMAGE, TEXT, Prompt, chain
from tests.fixtures_policy import policy_of

pytestmark = pytest.mark.timeout(30)

BLOCK = 2048  # bytes per block in the hand-made Scores below
BPT = 4.0  # bytes per token there: 512 tokens per block


def ep(url: str, pool: str = "baseline") -> Endpoint:
    return Endpoint(url, pool, True, 0, 0, 0, url)


def long_prompt(seed: int, nbytes: int = 52_000) -> Prompt:
    rng = random.Random(seed)
    return Prompt(TEXT, nbytes, chain(bytes(rng.getrandbits(8) for _ in range(nbytes))))


PROMPT = long_prompt(7)


def pools(home: list[tuple[str, float, int]], away: list[tuple[str, float, int]] | None, *,
          home_decode: float = 0.0, away_decode: float = 0.0, prefill: float = 1e-4) -> tuple:
    """A proposal on the baseline pool's first candidate and its Scores: (url, cost_s, depth) per candidate."""
    h = PoolScores("baseline", tuple(Scored(ep(u), c, d) for u, c, d in home), home_decode, prefill)
    a = None if away is None else PoolScores(
        "speculative", tuple(Scored(ep(u, "speculative"), c, d) for u, c, d in away), away_decode, prefill)
    return Decision(h.cands[0].endpoint, BELOW), h, a


def pick(home, away=None, *, ptok: int = 13_000, known: bool = True, seed: int = 0, **kw):
    proposal, h, a = pools(home, away, **kw)
    return Picker().pick(proposal, Scores(PROMPT, ptok, NO_MATCH, h, a, known, BLOCK, BPT), random.Random(seed))


# ---- the picker


def test_expected_cached_tokens_are_the_held_blocks_in_tokens_capped_by_the_prompt():
    """Scores.tokens: blocks x bytes per block / bytes per token (3 blocks of 2048 bytes at 4 bytes a token are
    1536 tokens), never more than the prompt's own estimate."""
    got = pick([("a", 0.1, 3), ("b", 0.2, 0)])
    assert (got.decision.url, got.placement.expected_cached, got.placement.depth) == ("a", 1536, 3)
    assert pick([("a", 0.1, 3), ("b", 0.2, 0)], ptok=1000).placement.expected_cached == 1000


def test_a_prompt_with_nothing_to_match_still_carries_its_token_estimate():
    """A prompt shorter than a block: no prices, the proposal unchanged, but the placement keeps the router's
    estimate of its prompt tokens (what the prefix metrics count)."""
    aff = Affinity()
    sched = Scheduler(_First(), aff)
    short = Prompt(TEXT, 400, [])
    got = sched.decide(sched.snapshot([BackendLoad("a", "baseline", 0, True)], None, short), random.Random(0))
    assert (got.decision.url, got.placement.reason, got.placement.prompt_tokens) == ("a", NO_MATCH, 100)
    assert got.placement.expected_cached == 0


def test_the_deeper_of_two_exactly_tied_instances_wins_whatever_the_draw():
    """Two candidates tied on cost: the one holding more of the prompt, for every seed (no coin toss)."""
    ps = PoolScores("baseline", (Scored(ep("a"), 0.5, 1), Scored(ep("b"), 0.5, 4)), 0.0, 1e-4)
    assert {Picker.best(ps, random.Random(i))[0].url for i in range(30)} == {"b"}
    assert {Picker.best(ps, random.Random(i))[3] for i in range(30)} == {AFFINITY}


def test_idle_instances_holding_the_whole_prompt_cost_nothing_and_are_still_chosen():
    """A cost of exactly 0 s (no load, the prompt held whole) is a valid price: the tie margin is relative, so
    it must still include the cheapest itself."""
    ps = PoolScores("baseline", (Scored(ep("a"), 0.0, 5), Scored(ep("b"), 0.0, 5)), 0.0, 1e-4)
    assert {Picker.best(ps, random.Random(i))[0].url for i in range(30)} == {"a", "b"}
    one = PoolScores("baseline", (Scored(ep("a"), 0.0, 5), Scored(ep("b"), 0.3, 0)), 0.0, 1e-4)
    assert Picker.best(one, random.Random(0))[:2] == (one.cands[0].endpoint, 0.0)


def test_ties_in_the_other_pool_are_drawn_at_random_too():
    """When the other pool wins, its instance is drawn among its equals like the proposed pool's."""
    urls = {pick([("b", 0.1, 0)], [("s1", 0.1, 8), ("s2", 0.1, 8)], home_decode=5.0, away_decode=1.0,
                 seed=i).decision.url for i in range(30)}
    assert urls == {"s1", "s2"}


def test_the_other_pool_is_not_taken_on_speed_alone_when_it_holds_no_more_of_the_prompt():
    """Equal depths on both sides: the pool policy chose the pool; a faster other pool is no reason to move."""
    got = pick([("b", 0.1, 2)], [("s", 0.1, 2)], home_decode=5.0, away_decode=1.0)
    assert (got.decision.url, got.decision.reason, got.placement.reason) == ("b", BELOW, SINGLE)


@pytest.mark.parametrize("home_cost, away_cost, expect, reason", [
    # here = 1.0 + 1.0 + 0.001 x (2048 - 512) = 3.536 s; there = away_cost + 1.0
    (1.0, 2.5, "s", POOL_KEPT),  # 3.5 < 3.536: only the re-prefill of 1536 tokens makes the move pay
    (1.0, 2.6, "b", POOL_MOVED),  # 3.6 > 3.536: the re-prefill does not cover the difference
    (1.0, 2.54, "b", POOL_MOVED),  # 3.54: just above, with 512 more tokens (the home's own) it would move
])
def test_moving_pools_pays_the_re_prefill_of_exactly_what_the_other_holds_beyond_the_home(
        home_cost, away_cost, expect, reason):
    """The home total carries prefill_s x (tokens the other holds - tokens the home holds): 4 blocks against 1
    at 512 tokens a block is 1536 tokens re-prefilled."""
    got = pick([("b", home_cost, 1)], [("s", away_cost, 4)], home_decode=1.0, away_decode=1.0, prefill=1e-3)
    assert (got.decision.url, got.placement.reason) == (expect, reason)


def test_a_prompt_held_whole_on_both_sides_re_prefills_nothing():
    """The home already holds more tokens than the prompt has: the re-prefill term is 0, not negative and not one
    token's worth; the other pool, 0.5 s slower in total, stays behind."""
    got = pick([("b", 1.0, 1)], [("s", 1.5, 2)], ptok=100, home_decode=1.0, away_decode=1.0, prefill=1.0)
    assert (got.decision.url, got.placement.reason) == ("b", POOL_MOVED)


def test_an_exact_tie_between_the_pools_keeps_the_proposed_pool():
    """Totals equal to the bit (1.0 + 0.5 + 0 on each side, no re-prefill): the pool policy's choice stands."""
    got = pick([("b", 1.0, 1)], [("s", 1.0, 2)], ptok=100, home_decode=0.5, away_decode=0.5, prefill=1.0)
    assert (got.decision.url, got.placement.reason) == ("b", POOL_MOVED)


class _First:
    """A pool policy that proposes the first backend it sees."""

    name = "first"

    def decide(self, view, rng):
        return Decision(view.backends[0], BELOW)


def test_load_override_when_the_holder_is_dearer():
    """Both reasons of an in-pool choice, by price: the holder wins while cheaper, else the load does."""
    assert pick([("a", 0.1, 3), ("b", 0.2, 0)]).placement.reason == AFFINITY
    assert pick([("a", 0.3, 3), ("b", 0.2, 0)]).placement.reason == LOAD_OVERRIDE


# ---- the scheduler


def test_the_scorer_runs_only_with_prefix_routing_on_and_a_prompt():
    """Prefix routing on but no prompt (a body that was not parsed), or off with one: the pool policy's decision,
    no placement; both: a placement."""
    backends = [BackendLoad("a", "baseline", 0, True), BackendLoad("b", "baseline", 0, True)]
    on, off = Scheduler(_First(), Affinity()), Scheduler(_First())
    for sched, prompt in ((on, None), (off, PROMPT)):
        got = sched.decide(sched.snapshot(backends, None, prompt), random.Random(0))
        assert (got.decision.backend, got.decision.reason, got.placement) == (backends[0], ONLY, None)
    assert on.decide(on.snapshot(backends, None, PROMPT), random.Random(0)).placement is not None


def test_a_snapshot_built_on_plain_backends_decides_on_those_backends():
    """A Snapshot made directly from a View (no Endpoint wrappers, nothing `live`): the decision names the backend
    it was given, not nothing."""
    backends = [BackendLoad("a", "baseline", 3, True), BackendLoad("b", "baseline", 1, True)]
    got = Scheduler(LeastInflight()).decide(Snapshot(View.of(backends)), random.Random(0))
    assert got.decision.backend is backends[1]


# ---- the learned figures (one exchange at a time, exact arithmetic: each sample moves a figure 5% of the way)


def obs(*, ok=True, ttft=1.0, duration=5.0, tokens=101, prompt=10_000, cached=None, inflight=3, pool="baseline"):
    return Observation(pool, "u", inflight, inflight, duration, ttft, tokens, tokens, ok, None, prompt, cached)


def placement(*, expected_cached=0, pending_ahead=0, prompt=PROMPT) -> Placement:
    return Placement(NO_MATCH, prompt, expected_cached, 13_000, 0, pending_ahead)


def test_output_tokens_follow_finished_answers_only():
    f = Figures()
    f.observe(obs(tokens=56))  # no placement needed: 256 + 5% of (56 - 256)
    assert f.output_tokens == pytest.approx(246.0)
    for bad in (obs(tokens=1000, ok=False), obs(tokens=None, ttft=None), obs(tokens=0)):
        f.observe(bad, placement())
    assert f.output_tokens == pytest.approx(246.0)


@pytest.mark.parametrize("cached, expected_cached, pending, inflight, ttft, want", [
    # prefill = 1e-4 + 5% of (sample - 1e-4); sample = (ttft - 0.01 s x requests ahead) / uncached tokens
    (2_000, 0, 0, 3, 1.0, 1e-4 + 0.05 * (0.98 / 8_000 - 1e-4)),  # reported cached tokens, 2 requests ahead
    (None, 4_000, 0, 1, 1.2, 1e-4 + 0.05 * (1.2 / 6_000 - 1e-4)),  # none reported: what the index expected
    (2_000, 0, 12_000, 1, 2.0, 1e-4 + 0.05 * (2.0 / 20_000 - 1e-4)),  # prefill in flight ahead of it counts
    (None, 50_000, 0, 0, 0.5, 1e-4 + 0.05 * (0.5 / 1 - 1e-4)),  # held more than the prompt: one token prefilled
    (0, 0, 0, 200, 1.0, 0.95e-4),  # the queue explains more than the whole TTFT: the sample is 0, not negative
])
def test_the_prefill_rate_is_the_ttft_beyond_the_queue_per_uncached_token(
        cached, expected_cached, pending, inflight, ttft, want):
    f = Figures()
    f.observe(obs(cached=cached, inflight=inflight, ttft=ttft), placement(expected_cached=expected_cached,
                                                                         pending_ahead=pending))
    c = f.costs("baseline")
    assert (c.ttft_s_per_token, c.samples) == (pytest.approx(want), 1)


def test_the_prefill_rate_never_reaches_zero():
    f = Figures()
    for _ in range(400):  # every answer explained by its queue: the rate decays toward 0 but stops at 1e-7
        f.observe(obs(cached=0, inflight=200), placement())
    assert f.costs("baseline").ttft_s_per_token == 1e-7


def test_no_prompt_count_or_no_first_token_teaches_no_prefill_and_an_error_teaches_nothing():
    f = Figures()
    f.observe(obs(prompt=None), placement())
    f.observe(obs(prompt=0), placement())
    f.observe(obs(ttft=None, tokens=None), placement())
    f.observe(obs(ok=False), placement())
    c = f.costs("baseline")
    once = 0.02 + 0.05 * (0.04 - 0.02)  # the two with a first token still time the decode: 4 s, 100 tokens
    assert (c.ttft_s_per_token, c.samples, c.tpot_s, c.tpot_samples) == (1e-4, 0, pytest.approx(once + 0.05 * (0.04 - once)), 2)


def test_decode_speed_is_learned_per_token_after_the_first():
    f = Figures()
    f.observe(obs(ttft=1.0, duration=5.0, tokens=101), placement())  # 4 s over 100 tokens after the first
    c = f.costs("baseline")
    assert (c.tpot_s, c.tpot_samples) == (pytest.approx(0.02 + 0.05 * (0.04 - 0.02)), 1)
    f.observe(obs(tokens=1), placement())  # one token: no decode to time
    assert c.tpot_samples == 1
    assert not f.known("baseline", "speculative") and not f.known("speculative", "baseline")
    f.observe(obs(pool="speculative", tokens=2, duration=1.5), placement())
    assert f.known("baseline", "speculative") and f.known("speculative", "baseline")
    assert not Figures().known("baseline", "baseline")


@pytest.mark.parametrize("nbytes, prompt_tokens, rounds, want", [
    (52_000, 10_000, 1, 4.0 + 0.05 * (5.2 - 4.0)),
    (52_000, 100, 1, 16.0),  # 520 bytes a token is no tokenizer: capped
    (52_000, 10**9, 40, 1.0),  # nor is a thousandth of a byte: floored
])
def test_bytes_per_token_follow_the_reported_prompt_tokens_within_bounds(nbytes, prompt_tokens, rounds, want):
    f = Figures()
    p = Prompt(TEXT, nbytes, PROMPT.blocks)
    for _ in range(rounds):
        f.observe(obs(prompt=prompt_tokens), placement(prompt=p))
    assert f.bytes_per_token == pytest.approx(want)


def test_bytes_per_token_need_a_hashed_prompt_with_bytes():
    f = Figures()
    f.observe(obs(prompt=100), placement(prompt=Prompt(TEXT, 4000, [])))
    f.observe(obs(prompt=100), placement(prompt=Prompt(TEXT, 0, PROMPT.blocks)))
    assert f.bytes_per_token == 4.0


def test_reported_limits_and_capacity():
    """max_running as reported, else the setting; a KV capacity change is news once."""
    f = Figures(max_running=8)
    assert f.limit("u") == 8 and Figures().limit("u") is None
    assert f.observe_loads("u", LoadFigures(0, 0, max_running=32, max_total_tokens=100_000)) is True
    assert (f.limit("u"), f.kv["u"]) == (32, 100_000)
    assert f.observe_loads("u", LoadFigures(0, 0, max_total_tokens=100_000)) is False
    assert f.observe_loads("u", LoadFigures(0, 0)) is False
    assert (f.limit("u"), f.kv["u"]) == (32, 100_000)
    assert f.observe_loads("u", LoadFigures(0, 0, max_total_tokens=50_000)) is True


def test_the_figures_state_is_rounded_and_names_its_terms():
    f = Figures()
    f.observe(obs(tokens=57), placement(prompt=Prompt(TEXT, 52_345, PROMPT.blocks)))
    f.observe(obs(tokens=57, prompt=None), placement())
    c = f.costs("baseline")
    assert f.state() == {"bytes_per_token": round(f.bytes_per_token, 3), "output_tokens": round(f.output_tokens, 1),
                         "pools": {"baseline": {"prefill_s_per_token": c.ttft_s_per_token, "wait_s_per_request": 0.01,
                                                "tpot_s": c.tpot_s, "samples": 1}}}
    # 4 + 5% of (5.2345 - 4) = 4.061725; 256 -> 246.05 -> 236.5975
    assert (f.state()["bytes_per_token"], f.state()["output_tokens"]) == (4.062, 236.6)
    f.observe(obs(), placement())  # 236.5975 + 5% of (101 - 236.5975) = 229.817625
    assert (f.state()["pools"]["baseline"]["samples"], f.state()["output_tokens"]) == (2, 229.8)


# ---- the snapshot


def test_a_backend_without_prefix_figures_counts_none_queued_and_generation_zero():
    """A backend view with only the policy's four fields (url, pool, routable, load_estimate)."""
    bare = SimpleNamespace(url="a", pool="baseline", routable=True, load_estimate=2)
    e = Snapshot.take([bare]).view.backends[0]
    assert (e.pending_tokens, e.generation, e.live) == (0, 0, bare)


def test_a_snapshot_of_endpoints_keeps_their_live_backends():
    """Endpoints taken again (a snapshot of a snapshot) are not wrapped twice: the decision still names the live
    backend the lease is taken on."""
    backends = [BackendLoad("a", "baseline", 3, True), BackendLoad("b", "baseline", 1, True)]
    again = Snapshot.take(Snapshot.take(backends).view.backends)
    assert [e.live for e in again.view.backends] == backends
    got = Scheduler(LeastInflight()).decide(again, random.Random(0))
    assert got.decision.backend is backends[1]


def test_no_depths_without_prefix_routing_or_blocks():
    backends = [BackendLoad("a", "baseline", 0, True)]
    assert Snapshot.take(backends).depth == {}
    assert Snapshot.take(backends, None, Prompt(TEXT, 400, []), lambda e, blocks: 9).depth == {}
    assert Snapshot.take(backends, None, PROMPT, lambda e, blocks: 9).depth == {"a": 9}


def test_a_pinned_request_keeps_its_prompt_and_prefix_depths_through_the_filter():
    """The pinned filter narrows the endpoints only: within the pinned pool the instance holding the prompt
    still wins over a less loaded one, and the placement is made."""
    aff = Affinity()
    aff.index.of("b1", 0, 1000).insert(PROMPT.blocks)
    backends = [BackendLoad("s", "speculative", 0, True), BackendLoad("b1", "baseline", 2, True),
                BackendLoad("b2", "baseline", 0, True)]
    sched = Scheduler(LeastInflight(), aff)
    got = sched.decide(sched.snapshot(backends, "baseline", PROMPT), random.Random(0))
    assert (got.decision.url, got.decision.reason, got.placement.reason) == ("b1", PINNED, AFFINITY)
    assert got.placement.depth > 0


# ---- the prefix scorer's prices (defaults: 1024-byte blocks, 4 bytes a token: 256 tokens a block; priors: 1e-4 s
# a prompt token, 0.01 s a request ahead, 0.02 s an output token x 256 of them)


def held_by(aff: Affinity, url: str, blocks: int, generation: int = 0) -> None:
    aff.index.of(url, generation, 1000).insert(PROMPT.blocks[:blocks])


def scores(aff: Affinity, backends: list, proposal: int = 0, reason: str = BELOW, prompt: Prompt = PROMPT):
    snap = Snapshot.take(backends, None, prompt, aff.match)
    return aff.score(snap, Decision(snap.view.backends[proposal], reason))


def costs(ps) -> dict[str, float]:
    return {s.endpoint.url: s.cost_s for s in ps.cands}


def test_each_candidate_is_priced_by_its_queue_then_the_prefill_it_lacks():
    aff = Affinity()
    held_by(aff, "a", 50)  # all 50 blocks: 12,800 of the prompt's 13,000 tokens
    got = scores(aff, [BackendLoad("a", "baseline", 2, True), BackendLoad("b", "baseline", 0, True, 1000)])
    assert got.home.pool == "baseline" and got.away is None
    assert costs(got.home) == {
        "a": pytest.approx(0.01 * 2 + 1e-4 * 200),  # two requests ahead, 200 tokens to prefill
        # 1000 tokens queued, the whole prompt to prefill and the copy of a's 12,800 priced again
        "b": pytest.approx(1e-4 * 1000 + 1e-4 * (13_000 + 12_800))}
    assert (got.home.decode_s, got.home.prefill_s) == (pytest.approx(256 * 0.02), 1e-4)


def test_a_prompt_held_whole_costs_only_its_queue():
    aff = Affinity()
    held_by(aff, "a", 50)
    short = Prompt(TEXT, 10_000, PROMPT.blocks)  # 2,500 tokens, every block held
    got = scores(aff, [BackendLoad("a", "baseline", 3, True), BackendLoad("b", "baseline", 0, True)], prompt=short)
    assert costs(got.home) == {"a": pytest.approx(0.03), "b": pytest.approx(1e-4 * 2 * 2_500)}


@pytest.mark.parametrize("load, limit, want", [
    (1, 2, 0.01),  # below the running limit: the request's share of the decode steps
    (2, 2, 0.02 + 1 * 5.12 / 2),  # at the limit: it waits for one slot; a slot frees every 5.12 s / 2
    (5, 2, 0.05 + 4 * 5.12 / 2),  # 4 slots to wait for
    (10**6, 2, 3600.0),  # the load term is capped
])
def test_beyond_the_running_limit_a_request_waits_for_slots(load, limit, want):
    aff = Affinity()
    aff.figures.observe_loads("a", LoadFigures(0, 0, max_running=limit))  # as reported, per backend
    short = Prompt(TEXT, 10_000, PROMPT.blocks)
    held_by(aff, "a", 50)
    got = scores(aff, [BackendLoad("a", "baseline", load, True), BackendLoad("b", "baseline", 0, True)], prompt=short)
    assert costs(got.home)["a"] == pytest.approx(want)


def test_a_snapshot_without_depths_prices_every_candidate_as_holding_nothing():
    """A Snapshot made directly, of backend views with only the policy's fields: no depths, nothing queued."""
    aff = Affinity()
    held_by(aff, "a", 50)
    backends = [SimpleNamespace(url=u, pool="baseline", routable=True, load_estimate=0) for u in "ab"]
    got = aff.score(Snapshot(View.of(backends), None, PROMPT), Decision(backends[0], BELOW))
    assert costs(got.home) == {"a": pytest.approx(1.3), "b": pytest.approx(1.3)}


def test_the_proposed_pool_is_home_and_the_other_pool_away():
    aff = Affinity()
    backends = [BackendLoad("s1", "speculative", 0, True), BackendLoad("s2", "speculative", 1, True),
                BackendLoad("b1", "baseline", 0, True), BackendLoad("b2", "baseline", 0, False)]
    got = scores(aff, backends)
    assert (got.home.pool, set(costs(got.home)), got.away.pool, set(costs(got.away))) == (
        "speculative", {"s1", "s2"}, "baseline", {"b1"})
    assert (got.prompt_tokens, got.tokens(10)) == (13_000, 2560)  # the scorer's block and token sizes


@pytest.mark.parametrize("cross_pool, reason", [(False, BELOW), (True, PINNED), (True, FAILOVER)])
def test_no_other_pool_when_cross_pool_is_off_or_the_pool_was_not_a_choice(cross_pool, reason):
    aff = Affinity(cross_pool=cross_pool)
    backends = [BackendLoad("s1", "speculative", 0, True), BackendLoad("b1", "baseline", 0, True)]
    assert scores(aff, backends, reason=reason).away is None


def test_the_pools_are_known_only_when_both_decode_speeds_are_measured():
    aff = Affinity()
    aff.figures.observe(obs(pool="speculative"), placement())
    backends = [BackendLoad("s1", "speculative", 0, True), BackendLoad("b1", "baseline", 0, True)]
    assert not scores(aff, backends).known
    aff.figures.observe(obs(pool="baseline"), placement())
    assert scores(aff, backends).known


def test_a_prompt_that_is_not_text_has_no_token_estimate():
    aff = Affinity()
    image = Prompt(IMAGE, 400, [])
    got = scores(aff, [BackendLoad("a", "baseline", 0, True)], prompt=image)
    assert (got.prompt, got.prompt_tokens, got.reason, got.home) == (image, 0, IMAGE, None)


# ---- what a send leaves behind, and the index's upkeep


def test_the_first_send_brings_what_the_picker_did_not_find_cached_a_retry_what_the_index_does_not_hold():
    aff = Affinity()
    held_by(aff, "c", 10)  # 2,560 tokens
    pl = Placement(AFFINITY, PROMPT, 2560, 13_000, 10)
    first = BackendLoad("a", "baseline", 0, True, 700, generation=3)
    assert aff.sent(first, pl) == 13_000 - 2560 and (pl.sends, pl.pending_ahead) == (1, 700)
    assert aff.index.peek("a", 3).depth(PROMPT.blocks) == 50  # under the backend's generation
    assert aff.sent(BackendLoad("c", "baseline", 0, True, 5), pl) == 13_000 - 2560  # a retry: looked up
    assert (pl.sends, pl.pending_ahead) == (2, 5)
    assert aff.sent(BackendLoad("d", "baseline", 0, True), pl) == 13_000
    assert pl.sends == 3
    whole = Placement(AFFINITY, PROMPT, 13_000, 13_000, 50)
    assert aff.sent(BackendLoad("e", "baseline", 0, True), whole) == 0


def test_a_send_of_a_prompt_without_blocks_brings_nothing_and_touches_no_index():
    aff = Affinity()
    assert aff.sent(BackendLoad("a", "baseline", 0, True), Placement(NO_MATCH, Prompt(TEXT, 400, []), 0, 100)) == 0
    assert aff.index.size("a") == 0


def test_sends_count_the_backend_instance_it_reached():
    """A backend view without prefix figures (no generation, no pending tokens) is generation 0 with none queued."""
    aff = Affinity()
    bare = SimpleNamespace(url="a", pool="baseline", routable=True, load_estimate=0)
    pl = Placement(NO_MATCH, PROMPT, 0, 13_000)
    assert aff.sent(bare, pl) == 13_000 and pl.pending_ahead == 0
    assert aff.index.peek("a", 0).depth(PROMPT.blocks) == 50


@pytest.mark.parametrize("cached_blocks, depth_after", [
    (48, 48),  # two blocks fewer than the index said: forget beyond what it holds
    (49, 50),  # one fewer: within a block's rounding, kept
    (50, 50),
])
def test_fewer_cached_tokens_than_expected_truncate_the_index_to_what_it_holds(cached_blocks, depth_after):
    aff = Affinity()
    held_by(aff, "u", 50)
    pl = Placement(AFFINITY, PROMPT, 12_800, 13_000, 50)
    aff.observe(obs(cached=cached_blocks * 256), pl)
    assert aff.index.peek("u").depth(PROMPT.blocks) == depth_after


def test_truncation_follows_the_generation_and_needs_a_finished_answer_and_an_index():
    aff = Affinity()
    held_by(aff, "u", 50, generation=2)
    pl = Placement(AFFINITY, PROMPT, 12_800, 13_000, 50)
    aff.observe(obs(cached=0, ok=False), pl)
    aff.observe(obs(cached=0), pl)  # generation 0's index: none
    aff.observe(obs(cached=0), None)
    assert aff.index.peek("u", 2).depth(PROMPT.blocks) == 50
    aff.observe(obs(cached=0), pl, generation=2)
    assert aff.index.peek("u", 2).depth(PROMPT.blocks) == 0


def test_a_capacity_change_resizes_that_backends_index():
    aff = Affinity()
    held_by(aff, "u", 50)
    aff.observe_loads("u", LoadFigures(0, 0, max_total_tokens=4096), False)
    assert aff.index.by_url["u"].capacity == 1000
    aff.observe_loads("u", LoadFigures(0, 0, max_total_tokens=4096), True)
    assert aff.index.by_url["u"].capacity == 16  # 4096 tokens x 4 bytes / 1024-byte blocks


def test_a_forgotten_backend_needs_a_new_hit_before_zero_polls_count_again():
    """After a forget (the cache was lost), a hit rate of 0 is what a fresh cache says: no second forget until it
    has had hits again."""
    aff = Affinity()
    held_by(aff, "u", 50)
    aff.observe_loads("u", LoadFigures(0, 0, cache_hit_rate=0.5), False)
    aff.forget("u")
    held_by(aff, "u", 50)
    for _ in range(5):
        aff.observe_loads("u", LoadFigures(0, 0, cache_hit_rate=0.0), False)
    assert aff.index.size("u") > 0 and aff.forgotten == 1


def test_forgotten_counts_backends_whose_index_was_dropped():
    aff = Affinity()
    assert aff.state() == {"block_bytes": 1024, "bytes_per_token": 4.0, "output_tokens": 256.0, "cross_pool": True,
                           "forgotten": 0, "pools": {}}
    aff.forget("nobody")
    held_by(aff, "a", 5)
    held_by(aff, "b", 5)
    aff.forget("a")
    aff.forget("b")
    aff.forget("a")
    assert aff.state()["forgotten"] == 2


def test_the_scorers_sizes_and_shared_figures():
    f = Figures()
    assert Affinity(figures=f).figures is f and Affinity().figures is not f
    small = Affinity(capacity_tokens=4096)
    assert (small.index.of("u").capacity, small.capacity_of("v"), small.tokens(10)) == (16, 16, 2560)
    assert Affinity(capacity_tokens=100).capacity_of("u") == 2  # never fewer than two blocks


# ---- the policies' builder


SPEC_CURVE = ((1, 77.5), (2, 125.1), (5, 183.2), (10, 239.6), (30, 299.5))
BASE_CURVE = ((1, 92.6), (2, 159.7), (5, 292.5), (10, 457.2), (30, 711.0))


def test_the_builder_passes_every_setting_to_the_policy_it_builds():
    from router.curves import fit_token_time

    ad = policy_of("adaptive", objective="throughput", adaptive_forgetting=0.9, adaptive_explore=0.1,
                   adaptive_deadband=0.05, max_running_requests=7, curves=(SPEC_CURVE, BASE_CURVE))
    assert (ad.objective, ad.forgetting, ad.explore, ad.deadband, ad.max_running, ad.defer_fits) == (
        "throughput", 0.9, 0.1, 0.05, 7, True)
    assert ad.priors == {"speculative": fit_token_time([list(p) for p in SPEC_CURVE]),
                         "baseline": fit_token_time([list(p) for p in BASE_CURVE])}
    assert policy_of("adaptive").priors == {}
    one = policy_of("adaptive", speculative_curve=[list(p) for p in SPEC_CURVE])
    assert set(one.priors) == {"speculative"}
    g = policy_of("global", threshold=6, hysteresis=2)
    assert (g.threshold, g.hysteresis, g.speculating) == (6, 2, True)
    assert policy_of("spillover", threshold=6).threshold == 6
    b = policy_of("balanced", curves=(SPEC_CURVE, BASE_CURVE))
    assert (b.spec_curve[0], b.base_curve[0]) == ((1.0, 77.5), (1.0, 92.6))


def test_the_builders_refusals_say_what_is_missing():
    from router.policies import make_policy

    with pytest.raises(ValueError) as e:
        make_policy(SimpleNamespace(policy="balanced", curves=lambda: None))
    assert str(e.value) == "the balanced policy needs both throughput curves"
    with pytest.raises(ValueError) as e:
        make_policy(SimpleNamespace(policy="fastest"))
    assert str(e.value) == "unknown policy 'fastest'"


def test_a_policy_with_one_pool_configured_says_failover_only_when_the_other_is_configured():
    """router.policy.sole_pool's rule, asked of the policy itself (the scheduler then says only_pool): balanced
    with only one pool configured gives its own reason; with the other pool configured but down, failover."""
    from router.policies import Balanced
    from router.policy import FASTER

    bal = Balanced((SPEC_CURVE, BASE_CURVE))
    alone = View.of([BackendLoad("s", "speculative", 0, True)])
    assert (bal.decide(alone, random.Random(0)).url, bal.decide(alone, random.Random(0)).reason) == ("s", FASTER)
    down = View.of([BackendLoad("s", "speculative", 0, True), BackendLoad("b", "baseline", 0, False)])
    assert (bal.decide(down, random.Random(0)).url, bal.decide(down, random.Random(0)).reason) == ("s", FAILOVER)
    base = View.of([BackendLoad("b", "baseline", 0, True)])
    assert (bal.decide(base, random.Random(0)).url, bal.decide(base, random.Random(0)).reason) == ("b", FASTER)
    base_down = View.of([BackendLoad("s", "speculative", 0, False), BackendLoad("b", "baseline", 0, True)])
    assert bal.decide(base_down, random.Random(0)).reason == FAILOVER


def test_a_policy_that_learns_nothing_leaves_the_learner_no_work():
    """router.learner calls learn() until it returns False: a fixed policy must say so at once, or the learner
    would spin."""
    for name in ("spillover", "global", "least-inflight", "round-robin", "balanced"):
        pol = policy_of(name, curves=(SPEC_CURVE, BASE_CURVE))
        assert (pol.learn(), pol.learn(64), pol.state(View.of([]))) == (False, False, None), name
