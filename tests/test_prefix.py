"""Table tests of the prefix index (router.prefix) and the affinity's costs inside and across pools (router.affinity)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import msgspec
import pytest

from router import prefix
from router.affinity import (
    AFFINITY,
    LOAD_OVERRIDE,
    NO_MATCH,
    POOL_KEPT,
    POOL_MOVED,
    SINGLE,
    Affinity,
    Placement,
)
from router.body import parse_head
from router.core.scheduler import Scheduler, decide
from router.observe import LoadFigures, Observation
from router.policy import ABOVE, BELOW, BackendLoad, Decision, Fixed, View
from router.pools import Pools
from tests.fixtures_policy import policy_of

pytestmark = pytest.mark.timeout(30)


def conversation(turns: int, words: int = 400) -> list[dict]:
    msgs = [{"role": "system", "content": "You are helpful. " * 30}]
    for t in range(turns):
        msgs.append({"role": "user", "content": " ".join(f"w{t}_{i}" for i in range(words))})
        msgs.append({"role": "assistant", "content": f"answer {t} " * 50})
    return msgs


def body(msgs, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": msgs, **extra}).encode()


def prompt_for(msgs, **extra) -> prefix.Prompt:
    head = parse_head(body(msgs, **extra))
    return prefix.prompt_of(head.messages, head.prompt)


# ---- hashing
def test_chain_equal_prefixes_give_equal_entries_and_a_change_breaks_the_rest():
    a = b"x" * 5000
    b = b"x" * 3000 + b"y" + b"x" * 1999
    ca, cb = prefix.chain(a, 1024), prefix.chain(b, 1024)
    assert len(ca) == 4 and len(cb) == 4  # full blocks only: the 904-byte tail is not hashed
    assert ca[:2] == cb[:2] and ca[2] != cb[2] and ca[3] != cb[3]  # chained: a change taints every later block
    assert prefix.chain(b"x" * 1023, 1024) == []
    assert len(prefix.chain(b"x" * 100_000, 1024, limit=10)) == 10


def test_the_next_turn_of_a_conversation_extends_the_previous_turns_chain():
    t1, t2 = prompt_for(conversation(2)), prompt_for(conversation(3), stream=True, max_tokens=9)
    assert t1.kind == prefix.TEXT and t1.hashed
    assert len(t2.blocks) > len(t1.blocks)
    # the last block of turn 1 holds its tail, which turn 2 continues differently: all but it are shared
    assert t2.blocks[:len(t1.blocks) - 1] == t1.blocks[:-1]


@pytest.mark.parametrize("doc, kind", [
    ({"messages": [{"role": "user", "content": "hello there"}]}, prefix.TEXT),
    ({"prompt": "a completion prompt"}, prefix.TEXT),
    ({"prompt": [1, 2, 3, 4]}, prefix.TOKEN_IDS),
    ({"prompt": [[1, 2], [3]]}, prefix.TOKEN_IDS),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]},
     prefix.IMAGE),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                          "function": {"name": "f"}}]},
                   {"role": "tool", "content": "", "tool_call_id": "1"}]}, prefix.NO_TEXT),
    ({"model": "m"}, prefix.NO_TEXT),
])
def test_prompt_kinds(doc, kind):
    head = parse_head(json.dumps(doc).encode())
    assert prefix.prompt_of(head.messages, head.prompt).kind == kind


def test_only_text_is_hashed():
    head = parse_head(json.dumps({"prompt": list(range(5000))}).encode())
    p = prefix.prompt_of(head.messages, head.prompt)
    assert p.kind == prefix.TOKEN_IDS and p.blocks == [] and not p.hashed


def test_an_enormous_prompt_hashes_at_most_max_blocks():
    raw = msgspec.Raw(b'"' + b"a" * (prefix.MAX_BLOCKS * 1024 * 3) + b'"')
    p = prefix.prompt_of(msgspec.UNSET, raw)
    assert len(p.blocks) == prefix.MAX_BLOCKS


# ---- bounds, LRU, forgetting
def test_depth_is_the_leading_blocks_held():
    idx = prefix.BackendIndex(1000)
    c = list(range(1, 41))
    assert idx.depth(c) == 0
    idx.insert(c[:25])
    for n in (1, 7, 24, 25, 26, 40):
        assert idx.depth(c[:n]) == min(n, 25)
    assert idx.depth([99, *c[1:]]) == 0  # another first block: nothing shared


def test_the_index_never_holds_more_than_its_capacity():
    idx = prefix.BackendIndex(100)
    rng = random.Random(1)
    for _ in range(200):
        idx.insert([rng.getrandbits(62) for _ in range(rng.randint(1, 80))])
        assert len(idx) <= 100
    idx.insert(list(range(10_000)))  # one prompt longer than the capacity keeps its first half-capacity
    assert len(idx) <= 100 and idx.depth(list(range(10_000))) == 50


def test_lru_keeps_what_was_used_recently_and_drops_the_oldest():
    idx = prefix.BackendIndex(40)  # two generations of 20
    old, hot = list(range(100, 110)), list(range(200, 210))
    idx.insert(old)
    idx.insert(hot)  # 20: a full young generation becomes the old one
    for i in range(3):
        idx.insert(hot)  # used again: young again
        idx.insert(list(range(1000 + 10 * i, 1010 + 10 * i)))
    assert idx.depth(hot) == 10
    assert idx.depth(old) == 0


def test_resize_shrinks_to_the_new_bound():
    idx = prefix.BackendIndex(1000)
    idx.insert(list(range(400)))
    idx.resize(100)
    assert len(idx) <= 100 and idx.capacity == 100


def test_a_new_generation_of_a_backend_starts_empty():
    index = prefix.PrefixIndex(100)
    index.of("u", 0).insert([1, 2, 3])
    assert index.peek("u", 0).depth([1, 2, 3]) == 3
    assert index.peek("u", 1) is None  # it went down since: nothing assumed
    assert len(index.of("u", 1)) == 0
    index.forget("u")
    assert index.size("u") == 0 and index.peek("u", 1) is None


# ---- in-pool cost
def B(url, load, pool="baseline"):
    return BackendLoad(url, pool, load, True)


class Propose(Fixed):
    """A pool policy that proposes one decision, whatever the loads."""

    name = "propose"

    def __init__(self, d: Decision | None) -> None:
        self.d = d

    def decide(self, view, rng):
        return Decision(next(e for e in view.backends if e.url == self.d.url), self.d.reason)


def place(aff: Affinity, d: Decision | None, view: View, p: prefix.Prompt, pinned: str | None = None
          ) -> tuple[Decision, Placement]:
    """One decision through the scheduler: `d` as the pool policy's proposal, then the prefix scorer and the picker."""
    sched = Scheduler(Propose(d), aff)
    got = sched.decide(sched.snapshot(view.backends, pinned, p), random.Random(0))
    return got.decision, got.placement


def learn(aff: Affinity, obs: Observation, pl: Placement) -> None:
    """What Pools.report_done does with a finished exchange: the figures, then the index."""
    aff.figures.observe(obs, pl)
    aff.observe(obs, pl)


def placed(aff: Affinity, view: View, d: Decision, p: prefix.Prompt) -> tuple[Decision, Placement]:
    got = place(aff, d, view, p)
    aff.sent(got[0].backend, got[1])
    return got


def long_prompt(seed: int, nbytes: int = 52_000) -> prefix.Prompt:
    rng = random.Random(seed)
    raw = bytes(rng.getrandbits(8) for _ in range(nbytes))
    return prefix.Prompt(prefix.TEXT, nbytes, prefix.chain(raw))


@pytest.mark.parametrize("loads, expect_url, reason", [
    ((3, 3, 3), "a", AFFINITY),  # equal loads: the instance with the prefix
    ((8, 3, 3), "a", AFFINITY),  # 5 more requests cost less than re-prefilling 13k tokens
    ((400, 3, 3), None, LOAD_OVERRIDE),  # far busier: load wins
])
def test_in_pool_choice_weighs_load_against_the_prefill_saved(loads, expect_url, reason):
    aff = Affinity()
    p = long_prompt(1)
    aff.index.of("a", 0, 1000).insert(p.blocks)
    bs = [B(u, n) for u, n in zip("abc", loads, strict=True)]
    view = View.of(bs)
    d, pl = place(aff, Decision(bs[2], BELOW), view, p)
    assert pl.reason == reason
    if expect_url:
        assert d.url == expect_url and pl.expected_cached > 0
    else:
        assert d.url in ("b", "c") and pl.expected_cached == 0


def test_how_much_load_a_prefix_holds_grows_with_its_length():
    """The rule smg's fixed thresholds cannot express: a short shared prefix gives way to a small imbalance,
    a long one holds against a larger one."""
    aff = Affinity()
    short, longer = long_prompt(2, 8_000), long_prompt(3, 80_000)
    for p in (short, longer):
        aff.index.of("a", 0, 10_000).insert(p.blocks)
    # 48 requests more (0.48 s at the 10 ms prior) against ~1.8k held tokens, priced twice (re-prefilled, and
    # evicting as much elsewhere): 0.36 s; the 20k-token prefix: 4 s
    view = View.of([B("a", 50), B("b", 2)])
    assert place(aff, Decision(view.backends[1], BELOW), view, short)[0].url == "b"
    assert place(aff, Decision(view.backends[1], BELOW), view, longer)[0].url == "a"


def test_no_match_and_single_and_no_text():
    aff = Affinity()
    view = View.of([B("a", 5), B("b", 1)])
    d, pl = place(aff, Decision(view.backends[0], BELOW), view, long_prompt(4))
    assert (d.url, pl.reason) == ("b", NO_MATCH)
    one = View.of([B("a", 5)])
    assert place(aff, Decision(one.backends[0], BELOW), one, long_prompt(4))[1].reason == SINGLE
    for kind in (prefix.NO_TEXT, prefix.IMAGE, prefix.TOKEN_IDS):
        d, pl = place(aff, Decision(view.backends[0], BELOW), view, prefix.Prompt(kind, 10, []))
        assert d.url == "a" and pl.reason == kind  # the policy's choice, unchanged


@dataclass
class Busy:
    """A backend view with the uncached prompt tokens its leases hold (router.pools.Backend.pending_tokens)."""

    url: str
    load_estimate: int
    pending_tokens: int
    pool: str = "baseline"
    routable: bool = True


@pytest.mark.parametrize("pending_a, pending_b, expect_url, reason", [
    (0, 0, "a", AFFINITY),  # nothing queued anywhere: the instance holding the prompt
    (6_000, 0, "a", AFFINITY),  # half a prompt of prefill queued there costs less than re-prefilling all of it
    # more queued there than the prompt itself, but less than twice: a copy elsewhere is prefilled now and
    # evicts as much of other conversations there, so it stays
    (20_000, 0, "a", AFFINITY),
    (40_000, 0, "b", LOAD_OVERRIDE),  # three long prompts still prefilling there: the idle one, re-prefill and all
    (40_000, 30_000, "a", AFFINITY),  # both queued alike: the prefix decides again
])
def test_prefill_queued_ahead_counts_in_the_unit_of_the_prefill_saved(pending_a, pending_b, expect_url, reason):
    """The same two request counts, different prefill queued behind them: the rule weighs work, not counts."""
    aff = Affinity()
    p = long_prompt(11)  # 52 kB: ~13k tokens, all held by "a"
    aff.index.of("a", 0, 1000).insert(p.blocks)
    view = View.of([Busy("a", 3, pending_a), Busy("b", 3, pending_b)])
    d, pl = place(aff, Decision(view.backends[1], BELOW), view, p)
    assert (d.url, pl.reason) == (expect_url, reason)


def test_leases_count_the_uncached_tokens_they_bring_until_released():
    ps = pools_with_affinity(2)
    lease, d, pl = ps.place(None, prompt_for(conversation(3)))
    b = ps.by_url[d.url]
    assert b.pending_tokens == pl.prompt_tokens > 0  # nothing cached yet: all of it is to prefill
    lease2, d2, pl2 = ps.place(None, prompt_for(conversation(4)))  # the next turn, mostly held by b now
    other = ps.by_url[d2.url]
    held = pl2.prompt_tokens - pl2.expected_cached if d2.url == d.url else pl2.prompt_tokens
    assert other.pending_tokens == (pl.prompt_tokens if other is b else 0) + held
    for le in (lease, lease2, lease):  # a second release of the same lease changes nothing
        le.release()
    assert all(x.pending_tokens == 0 for x in ps.backends)


def test_ttft_learning_keeps_load_in_the_rule_under_queueing():
    """A TTFT made long by queueing is prefill work ahead, not a slower prefill of the prompt alone: the learned
    rate rises for both terms together, and an instance with a long queue still loses the conversation."""
    aff = Affinity()
    p = long_prompt(12)
    ptok = int(p.nbytes / aff.bytes_per_token)
    for _ in range(200):  # every answer waited behind 3 prompts' worth of prefill: 4 prompts in 4 s
        pl = Placement(NO_MATCH, p, 0, ptok, 0, pending_ahead=3 * ptok)
        learn(aff, Observation("baseline", "u", 4, 4, 10.0, 4.0, 100, 100, True, 4.0, ptok, 0), pl)
    assert aff.figures.costs("baseline").ttft_s_per_token == pytest.approx(4.0 / (4 * ptok), rel=0.05)
    aff.index.of("a", 0, 1000).insert(p.blocks)
    view = View.of([Busy("a", 4, 3 * ptok), Busy("b", 1, 0)])
    d, pl = place(aff, Decision(view.backends[1], BELOW), view, p)
    assert (d.url, pl.reason) == ("b", LOAD_OVERRIDE)


def test_a_queue_beyond_max_running_costs_whole_requests():
    aff = Affinity(max_running=4)
    p = long_prompt(5)
    aff.index.of("a", 0, 1000).insert(p.blocks)
    view = View.of([B("a", 40), B("b", 2)])
    assert place(aff, Decision(view.backends[1], BELOW), view, p)[1].reason == LOAD_OVERRIDE


# ---- across pools
def S(url, load):
    return BackendLoad(url, "speculative", load, True)


def warm(aff: Affinity, tpot: dict[str, float]) -> None:
    for pool, t in tpot.items():
        for _ in range(100):
            learn(aff, Observation(pool, "x", 1, 1, 0.1 + 256 * t, 0.1, 257, 257, True, 1.0, 4000, 0),
                        Placement(NO_MATCH, prefix.NONE))


@pytest.mark.parametrize("spec_tpot, base_tpot, expect_pool, reason", [
    (0.0185, 0.018, "speculative", POOL_KEPT),  # 0.13 s faster decode: less than a 13k-token re-prefill (0.33 s)
    (0.200, 0.018, "baseline", POOL_MOVED),  # speculation 10x slower now: move, re-prefill and all
])
def test_a_switch_pays_for_the_prefix_it_throws_away(spec_tpot, base_tpot, expect_pool, reason):
    aff = Affinity()
    warm(aff, {"speculative": spec_tpot, "baseline": base_tpot})
    p = long_prompt(6)
    aff.index.of("s1", 0, 1000).insert(p.blocks)
    view = View.of([S("s1", 4), B("b1", 4)])
    d, pl = place(aff, Decision(view.backends[1], ABOVE), view, p)
    assert (d.pool, pl.reason) == (expect_pool, reason)


def test_pinning_and_cross_pool_off_never_switch_pools():
    aff = Affinity()
    warm(aff, {"speculative": 0.02, "baseline": 0.02})
    p = long_prompt(7)
    aff.index.of("s1", 0, 1000).insert(p.blocks)
    view = View.of([S("s1", 4), B("b1", 4)])
    assert place(aff, None, view, p, pinned="baseline")[0].pool == "baseline"
    off = Affinity(cross_pool=False)
    off.index.of("s1", 0, 1000).insert(p.blocks)
    assert place(off, Decision(view.backends[1], ABOVE), view, p)[0].pool == "baseline"


def test_cold_start_leaves_the_policys_pool():
    aff = Affinity()  # no decode speed measured yet for either pool
    p = long_prompt(8)
    aff.index.of("s1", 0, 1000).insert(p.blocks)
    view = View.of([S("s1", 4), B("b1", 4)])
    d, pl = place(aff, Decision(view.backends[1], ABOVE), view, p)
    assert (d.pool, pl.reason) == ("baseline", POOL_MOVED)


# ---- learning and forgetting through the pools
def pools_with_affinity(n=2, **kw) -> Pools:
    ps = Pools([], [f"http://b{i}" for i in range(n)], policy=policy_of("least-inflight"), rng=random.Random(0),
               affinity=Affinity(**kw))
    for b in ps.backends:
        b.healthy = True
    return ps


def test_turns_stay_on_one_instance_and_a_leaving_backend_is_forgotten():
    ps = pools_with_affinity(3)
    first = ps.place(None, prompt_for(conversation(3)))
    lease, d, pl = first
    lease.release()
    for turns in (4, 5, 6):
        lease2, d2, pl2 = ps.place(None, prompt_for(conversation(turns)))
        assert d2.url == d.url and pl2.reason == AFFINITY and pl2.expected_cached > 0
        lease2.release()
    assert ps.affinity.index.size(d.url) > 0
    ps.remove_backend(d.url)
    assert ps.affinity.index.size(d.url) == 0


def test_a_backend_that_went_down_is_forgotten():
    ps = pools_with_affinity(2)
    lease, d, _ = ps.place(None, prompt_for(conversation(3)))
    lease.release()
    b = ps.by_url[d.url]
    for _ in range(3):
        b.probe_failed(3)
    b.probe_ok(1)
    b.probe_ok(1)
    _, d2, pl = ps.place(None, prompt_for(conversation(4)))
    assert pl.reason == NO_MATCH


def test_cache_hit_rate_falling_to_zero_forgets_the_backend():
    ps = pools_with_affinity(2)
    lease, d, _ = ps.place(None, prompt_for(conversation(3)))
    lease.release()
    b = ps.by_url[d.url]
    ps.report_loads(b, LoadFigures(1, 0, max_total_tokens=500_000, cache_hit_rate=0.6))
    for _ in range(2):
        ps.report_loads(b, LoadFigures(1, 0, cache_hit_rate=0.0))
    assert ps.affinity.index.size(b.url) > 0  # one or two polls without a hit: a fresh conversation, not a loss
    ps.report_loads(b, LoadFigures(1, 0, cache_hit_rate=0.0))
    assert ps.affinity.index.size(b.url) == 0


def test_capacity_follows_max_total_num_tokens():
    ps = pools_with_affinity(1)
    b = ps.backends[0]
    ps.report_loads(b, LoadFigures(0, 0, max_total_tokens=4096))
    cap = ps.affinity.capacity_of(b.url)
    assert cap == int(4096 * 4.0 / 1024)
    for t in range(3, 30):
        ps.place(None, prompt_for(conversation(t)))[0].release()
        assert ps.affinity.index.size(b.url) <= cap


def test_reported_cached_tokens_below_expected_truncate_the_index():
    ps = pools_with_affinity(2)
    p3 = prompt_for(conversation(3))
    ps.place(None, p3)[0].release()
    lease, d, pl = ps.place(None, prompt_for(conversation(4)))
    assert pl.depth > 2
    obs = Observation("baseline", d.url, 1, 1, 1.0, 0.2, 50, 50, True, 1.0, prompt_tokens=4000, cached_tokens=0)
    ps.report_done(lease.backend, obs, pl)
    lease.release()
    assert ps.affinity.index.peek(d.url).depth(pl.prompt.blocks) == 0


def test_bytes_per_token_is_learned_from_usage():
    aff = Affinity()
    p = long_prompt(9, 20_000)
    for _ in range(200):
        learn(aff, Observation("baseline", "u", 1, 1, 1.0, 0.1, 10, 10, True, 1.0, 4000, None),
                    Placement(NO_MATCH, p))
    assert aff.bytes_per_token == pytest.approx(5.0, rel=0.01)


def test_decide_then_place_keeps_the_policys_reasons_for_the_pool():
    ps = pools_with_affinity(2)
    d = decide(ps.policy, ps.view, None, ps.rng)
    assert d is not None
    lease, d2, pl = ps.place(None, prompt_for(conversation(2)))
    assert d2.reason == d.reason
    lease.release()
