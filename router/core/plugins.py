"""The decision's plug-in interfaces and the shared ones: a filter narrows the snapshot, a scorer prices the
candidates, the picker chooses once. No plug-in sees or changes a decision after the picker made it."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from router.core.snapshot import Endpoint, Snapshot
from router.policy import (
    AFFINITY,
    FAILOVER,
    LOAD_OVERRIDE,
    NO_MATCH,
    PINNED,
    POOL_KEPT,
    POOL_MOVED,
    SINGLE,
    Decision,
    Fixed,
    View,
    in_pool,
    other,
)
from router.prefix import Prompt


class Filter(Protocol):
    """Narrows the endpoints a decision may choose from (never adds one)."""

    def filter(self, snap: Snapshot) -> Snapshot: ...


@dataclass(frozen=True, slots=True)
class Scored:
    """One candidate's price: `cost_s` its expected seconds to first token, `depth` the prompt's blocks it holds."""

    endpoint: Endpoint
    cost_s: float
    depth: int


@dataclass(frozen=True, slots=True)
class PoolScores:
    """A pool's candidates, priced, and the pool's own terms: `decode_s` the decode of a typical answer there,
    `prefill_s` its seconds per prompt token (what re-prefilling a prefix held elsewhere costs)."""

    pool: str
    cands: tuple[Scored, ...]
    decode_s: float
    prefill_s: float


@dataclass(frozen=True, slots=True)
class Scores:
    """What the prefix scorer found for one request. `home`: the pool the pool policy proposed; `away`: the other
    pool, when the request may move (None: pinned, failed over, one pool, or cross-pool off); both None when the
    prompt has no blocks to match (`reason` then says why). `known`: both pools' decode speeds measured."""

    prompt: Prompt
    prompt_tokens: int
    reason: str = NO_MATCH
    home: PoolScores | None = None
    away: PoolScores | None = None
    known: bool = False
    block_bytes: int = 0
    bytes_per_token: float = 1.0

    def tokens(self, blocks: int) -> int:
        return int(blocks * self.block_bytes / self.bytes_per_token)


class Scorer(Protocol):
    """Prices the candidates of a proposal (the pool policy's choice of pool and reason), touching nothing."""

    def score(self, snap: Snapshot, proposal: Decision) -> Scores: ...


@dataclass(slots=True)
class Placement:
    """What the decision expects of the prompt where it went: the prefix reason, the tokens it expects cached."""

    reason: str
    prompt: Prompt
    expected_cached: int = 0  # tokens
    prompt_tokens: int = 0  # the router's estimate from the prompt's bytes
    depth: int = 0  # blocks the chosen backend holds
    pending_ahead: int = 0  # uncached tokens already in flight on the last backend it was sent to
    sends: int = 0  # backends it was sent to: 1, or more after a retry


@dataclass(frozen=True, slots=True)
class Choice:
    """The decision, what the prefix scorer expects of it, and (a request with latency targets) the chosen
    endpoint's predicted latency (router.core.latency.Forecast)."""

    decision: Decision
    placement: Placement | None
    forecast: object | None = None


class Picker:
    """Chooses once, from the proposal and the prices: in each pool the instance of least expected time to first
    token (ties: the one holding more of the prompt, then random); then the proposed pool, unless the other pool
    holds more of the prompt and its total (first token plus decode) is less than the proposed pool's total with
    the re-prefill of what the other holds (both pools' decode measured)."""

    def pick(self, proposal: Decision, scores: Scores, rng: random.Random) -> Choice:
        home = scores.home
        if home is None:
            return Choice(proposal, Placement(scores.reason, scores.prompt, prompt_tokens=scores.prompt_tokens))
        ptok = scores.prompt_tokens
        b, t, depth, reason = self.best(home, rng)
        out = Decision(b, proposal.reason)
        if scores.away is not None:
            ob, ot, odepth, _ = self.best(scores.away, rng)
            if odepth > depth:
                here = t + home.decode_s + home.prefill_s * max(0, min(scores.tokens(odepth), ptok)
                                                               - scores.tokens(depth))
                there = ot + scores.away.decode_s
                if there < here and scores.known:
                    out, depth, reason = Decision(ob, AFFINITY), odepth, POOL_KEPT
                else:
                    reason = POOL_MOVED
        cached = min(ptok, scores.tokens(depth))
        return Choice(out, Placement(reason, scores.prompt, cached, ptok, depth))

    @staticmethod
    def best(ps: PoolScores, rng: random.Random) -> tuple[Endpoint, float, int, str]:
        scored = ps.cands
        low = min(s.cost_s for s in scored)
        ties = [s for s in scored if s.cost_s <= low * (1 + 1e-9)]
        if len(ties) > 1:  # equal now: the one holding more keeps it for the next turn too
            most = max(s.depth for s in ties)
            ties = [s for s in ties if s.depth == most]
        s = ties[0] if len(ties) == 1 else rng.choice(ties)
        if len(scored) == 1:
            return s.endpoint, s.cost_s, s.depth, SINGLE
        deepest = max(x.depth for x in scored)
        if deepest == 0:
            return s.endpoint, s.cost_s, s.depth, NO_MATCH
        return s.endpoint, s.cost_s, s.depth, AFFINITY if s.depth == deepest else LOAD_OVERRIDE


class PinnedPool:
    """The X-Router-Pool header: only the pinned pool's routable endpoints, or while it has none the other pool's
    (failover); the pool policy is not asked."""

    def filter(self, snap: Snapshot) -> Snapshot:
        if snap.pinned is None:
            return snap
        for pool in (snap.pinned, other(snap.pinned)):
            got = tuple(e for e in snap.view.pool(pool) if e.routable)
            if got:
                return snap.narrowed(got)
        return snap.narrowed(())


class Eligible:
    """Only the endpoints a caller allows before the decision (a gateway's subset hint, a per-backend cap): the
    decision is made among them, never changed after it."""

    def __init__(self, urls: frozenset[str]) -> None:
        self.urls = urls

    def filter(self, snap: Snapshot) -> Snapshot:
        return snap.narrowed(tuple(e for e in snap.view.backends if e.url in self.urls))


class Pinned(Fixed):
    """The pinned request's proposal: the least loaded endpoint of the pool it is pinned to, else failover."""

    name = "pinned"

    def __init__(self, pool: str) -> None:
        self.pool = pool

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        return in_pool(view, self.pool, PINNED, rng)


__all__ = ["FAILOVER", "Choice", "Eligible", "Filter", "Picker", "PinnedPool", "Placement", "PoolScores", "Scored", "Scorer",
           "Scores"]
