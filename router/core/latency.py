"""Latency targets in the decision (no I/O): each candidate's predicted time to first token (TTFT) and time per
output token (TPOT), the choice of the endpoint that meets a request's targets with the most headroom (or misses
least, or sheds it), and the filter that keeps the endpoints running targeted requests light enough for them."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from router.core.figures import Figures
from router.core.plugins import Choice, Placement
from router.core.snapshot import Endpoint, Snapshot
from router.policy import AFFINITY, FAILOVER, LOAD_OVERRIDE, NO_MATCH, PINNED, SINGLE, Decision
from router.prefix import BLOCK_BYTES, TEXT

# Decision reasons (router_route_decisions_total's label): a request with targets was placed where it meets them
# with the most headroom, or, none meeting them, where it misses least.
SLO_MET = "slo_met"
SLO_LEAST_MISS = "slo_least_miss"
SLO_REASONS = (SLO_MET, SLO_LEAST_MISS)
# Retry-After of a shed request, seconds: the predicted wait, within these bounds.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60


@dataclass(frozen=True, slots=True)
class Targets:
    """A request's latency targets in seconds (None: no target of that kind), the service tier that named them
    (None: headers alone) and whether it may be shed (429) when no endpoint can meet them."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    tier: str | None = None
    sheddable: bool = False


@dataclass(frozen=True, slots=True)
class Forecast:
    """One endpoint's predicted latency for a request. `headroom`: the least over its targets of (target -
    predicted) / target, >= 0 when it meets them all. `crowds`: one more request there would push the predicted
    TPOT over the tightest TPOT target of the targeted requests it runs already."""

    url: str
    ttft_s: float
    tpot_s: float
    headroom: float
    crowds: bool = False

    @property
    def met(self) -> bool:
        return self.headroom >= 0.0


@dataclass(frozen=True, slots=True)
class Shed:
    """No endpoint can meet a sheddable request's targets: answer 429, retry after `retry_after_s`. `forecast`:
    the endpoint that missed least."""

    forecast: Forecast
    retry_after_s: int


class Latency:
    """The predictor and the choice over it. TTFT: the prefix scorer's cost model (router.affinity, through
    Figures.queued_s: the wait per request there, the prefill queued there, a queue for a slot beyond the running
    limit) plus this prompt's prefill of what the endpoint does not hold. TPOT: the pool's learned seconds per
    output token after the first at the load it would then run (load + 1), speculation included: the figures'
    TPOT line (Figures.tpot_at; the prior when cold), whatever the policy.
    `block_bytes`: the prefix index's block size (what a matched depth is in tokens)."""

    def __init__(self, figures: Figures, block_bytes: int = BLOCK_BYTES) -> None:
        self.figures = figures
        self.block_bytes = block_bytes

    # ---- the prediction
    def prompt_tokens(self, snap: Snapshot) -> int:
        prompt = snap.prompt
        if prompt is None or prompt.kind != TEXT:
            return 0
        return int(prompt.nbytes / self.figures.bytes_per_token)

    def held(self, snap: Snapshot, e: Endpoint, ptok: int) -> int:
        """Prompt tokens `e` holds (its matched depth)."""
        return min(ptok, int(snap.depth.get(e.url, 0) * self.block_bytes / self.figures.bytes_per_token))

    def ttft(self, snap: Snapshot, e: Endpoint, ptok: int) -> float:
        c = self.figures.costs(e.pool)
        return self.figures.queued_s(e) + c.ttft_s_per_token * max(0, ptok - self.held(snap, e, ptok))

    def tpot(self, e: Endpoint, policy: object) -> float:
        # The figures' decode-only line whatever the policy: the adaptive speed model's token time holds the time
        # to first token too (router.estimator.sample), several times a long prompt's TPOT. `policy`: unused.
        return self.figures.tpot_at(e.pool, e.load_estimate + 1)

    def forecast(self, snap: Snapshot, e: Endpoint, policy: object, ptok: int) -> Forecast:
        t = snap.targets
        assert t is not None
        ttft, tpot = self.ttft(snap, e, ptok), self.tpot(e, policy)
        room = math.inf
        if t.ttft_s is not None:
            room = min(room, (t.ttft_s - ttft) / t.ttft_s)
        if t.tpot_s is not None:
            room = min(room, (t.tpot_s - tpot) / t.tpot_s)
        crowds = e.tpot_bound_s is not None and tpot > e.tpot_bound_s
        return Forecast(e.url, ttft, tpot, room, crowds)

    # ---- the choice
    def choose(self, snap: Snapshot, policy: object, rng: random.Random, prefix: object | None
               ) -> Choice | Shed | None:
        """The endpoint for a request with targets (snap.targets), among the routable endpoints the filters left:
        of those meeting every target, the one with the most headroom, an endpoint that would push its targeted
        requests over their TPOT target last; none meeting them, the one missing least (headroom closest to 0),
        or Shed for a sheddable request. Ties: the least loaded, then random. None: no endpoint is routable."""
        cands = [e for e in snap.view.backends if e.routable]
        if not cands:
            return None
        ptok = self.prompt_tokens(snap)
        fcs = [self.forecast(snap, e, policy, ptok) for e in cands]
        key = [(f.met, f.met and not f.crowds, f.headroom) for f in fcs]
        top = max(key)
        ties = [i for i, k in enumerate(key) if k[:2] == top[:2] and k[2] >= top[2] - 1e-9 * max(1.0, abs(top[2]))]
        low = min(cands[i].load_estimate for i in ties)
        ties = [i for i in ties if cands[i].load_estimate == low]
        i = ties[0] if len(ties) == 1 else rng.choice(ties)
        e, f = cands[i], fcs[i]
        targets = snap.targets
        assert targets is not None
        if not f.met and targets.sheddable:
            return Shed(f, self.retry_after(cands, fcs, targets))
        if snap.pinned is not None:
            reason = PINNED if e.pool == snap.pinned else FAILOVER
        else:
            reason = SLO_MET if f.met else SLO_LEAST_MISS
        return Choice(Decision(e, reason), self.placement(snap, e, cands, ptok, prefix), f)

    def retry_after(self, cands: list[Endpoint], fcs: list[Forecast], targets: Targets) -> int:
        """Seconds until a retry may be met: the least over the endpoints of its predicted TTFT (the queue there
        to clear) plus, where its TPOT is what misses, the time one request running there takes to end (a place
        frees); within RETRY_AFTER_MIN_S..RETRY_AFTER_MAX_S."""
        best = math.inf
        for e, f in zip(cands, fcs, strict=True):
            wait = f.ttft_s
            if targets.tpot_s is not None and f.tpot_s > targets.tpot_s:
                wait += self.figures.output_tokens * f.tpot_s / max(1, e.load_estimate)
            best = min(best, wait)
        return int(min(max(math.ceil(best), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    def placement(self, snap: Snapshot, e: Endpoint, cands: list[Endpoint], ptok: int,
                  prefix: object | None) -> Placement | None:
        """What the prefix scorer expects of the prompt on `e` (as its picker would record it), for its index
        and the lease's pending prefill; None with prefix routing off or no prompt."""
        prompt = snap.prompt
        if prefix is None or prompt is None:
            return None
        if not prompt.hashed:
            return Placement(prompt.kind if prompt.kind != TEXT else NO_MATCH, prompt, prompt_tokens=ptok)
        depth = snap.depth.get(e.url, 0)
        deepest = max(snap.depth.get(c.url, 0) for c in cands)
        if len(cands) == 1:
            reason = SINGLE
        elif deepest == 0:
            reason = NO_MATCH
        else:
            reason = AFFINITY if depth == deepest else LOAD_OVERRIDE
        return Placement(reason, prompt, self.held(snap, e, ptok), ptok, depth)

    # ---- requests without targets
    def keep_light(self, snap: Snapshot, policy: object) -> Snapshot:
        """A request without targets leaves out the endpoints where one more request would push the predicted TPOT
        over the tightest TPOT target of the targeted requests running there; when that leaves no routable
        endpoint, or no endpoint runs a targeted request, the snapshot as it was (routed as today)."""
        eps = snap.view.backends
        if all(e.tpot_bound_s is None for e in eps):
            return snap
        keep = tuple(e for e in eps if e.tpot_bound_s is None or self.tpot(e, policy) <= e.tpot_bound_s)
        if len(keep) == len(eps) or not any(e.routable for e in keep):
            return snap
        return snap.narrowed(keep)


__all__ = ["SLO_LEAST_MISS", "SLO_MET", "SLO_REASONS", "Forecast", "Latency", "Shed", "Targets"]
