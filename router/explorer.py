"""The adaptive policy's exploration: a pool judged slow gets no traffic and so no samples; these rules send it
some, where that costs little, so its model can be corrected."""
from __future__ import annotations

import math
import random

from router.estimator import SpeedEstimator
from router.policy import BackendView

Score = tuple[float, float]


class Explorer:
    """`explore`: the share of decisions that may go to the other pool at random (only where that costs little,
    or where that pool has had no sample for 1/explore decisions)."""

    def __init__(self, est: SpeedEstimator, explore: float = 0.03, objective: str = "latency") -> None:
        self.est = est
        self.t = est.t
        self.explore = explore
        self.objective = objective
        self.decisions = 0
        self.last_seen: dict[str, int] = {}  # pool -> decision count at its latest sample
        self.last_sent: dict[str, int] = {}  # pool -> decision count when it was last picked
        # Explore a pool that has had no sample for this many decisions even where it costs more: a pool once
        # judged slow gets no traffic and so no samples; without this it would stay misjudged after a change.
        self.stale_after = int(1 / explore) if explore > 0 else 0

    def seen(self, pool: str) -> None:
        """A sample of `pool` was folded."""
        self.last_seen[pool] = self.decisions

    def sent(self, pool: str) -> None:
        self.last_sent[pool] = self.decisions

    def explores(self, pick: BackendView, alt: BackendView, pick_sc: Score, alt_sc: Score,
                 rng: random.Random) -> bool:
        """Does this decision go to `alt` instead of the rule's `pick`? At light load, with the chance that alt is
        the faster while it is plausible and has few samples there; else at random, where cheap or stale."""
        t, est = self.t, self.est
        top, low = max(pick_sc, alt_sc)[0], min(pick_sc, alt_sc)[0]
        cheap = low >= t.explore_floor * top
        n_alt = alt.load_estimate + 1
        g = 1 if self.objective == "latency" else 0
        if (cheap and alt_sc[g] >= t.explore_floor * pick_sc[g] and n_alt <= t.explore_load
                and alt.pool not in est.priors
                and est.model(alt.pool, alt.pool).band_samples(n_alt) < self.low_load_samples(alt)
                and self.plausible(alt, alt_sc[0], pick, pick_sc[0])
                and rng.random() < self.chance(alt, alt_sc[0], pick, pick_sc[0])):
            return True
        unfed = self.decisions - self.last_sent.get(alt.pool, 0) > t.fresh
        if unfed and rng.random() < self.explore:
            stale = self.decisions - self.last_seen.get(alt.pool, 0) > self.stale_after
            if cheap or stale:
                return True
        return False

    def low_load_samples(self, b: BackendView) -> float:
        """How many samples at a light load b's pool needs before exploration there ends on the count alone: more
        for a pool whose requests scatter more (the samples that know its mean as well)."""
        t = self.t
        return min(t.max_low_load_samples, t.low_load_samples * max(1.0, (self.est.spread(b) / t.prior_spread) ** 2))

    def plausible(self, alt: BackendView, alt_speed: float, pick: BackendView, pick_speed: float) -> bool:
        """Could `alt` still be the faster for this request, given how unsure both models are there? A difference
        larger than the two models' uncertainty is acted on: exploring it again costs its whole size."""
        return alt_speed * (1 + self.est.unsure(alt)) >= pick_speed * (1 - self.est.unsure(pick))

    def chance(self, alt: BackendView, alt_speed: float, pick: BackendView, pick_speed: float) -> float:
        """The share of light-load decisions `alt` is explored at while it is plausible: the chance it is the faster
        for this request (Thompson sampling between two), at most low_load_explore. Its log speed's gap to the
        pick's, over the two models' uncertainty there (plausible's interval read as 1.96 standard errors of a
        normal). A flat share sent a slower server too much of a one-client load when both servers scattered."""
        width = math.hypot(self.est.unsure(alt), self.est.unsure(pick)) / 1.96
        cap = self.t.low_load_explore
        if alt_speed >= pick_speed or not math.isfinite(width):
            return cap
        if width <= 0:
            return 0.0
        return min(cap, 0.5 * math.erfc(math.log(pick_speed / alt_speed) / (width * math.sqrt(2))))
