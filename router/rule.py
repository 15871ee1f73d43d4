"""The adaptive policy's decision rule: the best backend of each pool by its published model, then which pool."""
from __future__ import annotations

import math
import random

from router.estimator import SpeedEstimator
from router.policy import BASELINE, SPECULATIVE, BackendView

OBJECTIVES = ("throughput", "latency")
Score = tuple[float, float]


class DecisionRule:
    """objective "throughput": the backend whose throughput gains most from one more request (equal marginal
    gains across pools is the system optimum); "latency": the backend where this request would be fastest (the
    balanced policy's rule), and at light load within a tie the one that gains more throughput."""

    def __init__(self, est: SpeedEstimator, objective: str = "latency") -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}")
        self.est = est
        self.t = est.t
        self.objective = objective

    def score(self, b: BackendView) -> Score:
        p, n = self.est.params(b), b.load_estimate
        speed, gain = p.request_speed(n), p.marginal_gain(n)
        if self.objective == "latency":
            return speed, gain
        # Once every candidate queues, marginal gains are all 0: the per-request speed splits the queue.
        return gain, speed

    def best(self, cands: list[BackendView], rng: random.Random) -> tuple[Score, BackendView]:
        if len(cands) == 1:
            return self.score(cands[0]), cands[0]
        scored = [(self.score(b), b) for b in cands]
        top = max(sc for sc, _ in scored)
        # Random among equals, as least-inflight does: equal instances at equal loads share the work.
        return top, rng.choice([b for sc, b in scored if sc == top])

    def speculative_first(self, s_score: Score, s_b: BackendView, b_score: Score, b_b: BackendView) -> bool:
        """Which pool's best backend wins, in the first of five cases that applies."""
        est, t = self.est, self.t
        busy = max(s_b.load_estimate, b_b.load_estimate)
        if s_score == b_score:
            # A tie (in practice: nothing learned yet) goes to the less measured pool, then to speculative.
            return est.samples(SPECULATIVE) <= est.samples(BASELINE)
        if (est.finished < t.young_samples and busy >= t.low_load
                and s_b.load_estimate != b_b.load_estimate and not est.priors):
            # Busy, on models this young: the less loaded backend (Tuning.young_samples).
            return s_b.load_estimate < b_b.load_estimate
        if self.objective != "latency":
            return s_score > b_score
        close = abs(s_score[0] - b_score[0]) <= self.tie(s_b, b_b) * max(s_score[0], b_score[0])
        if s_score[1] != b_score[1] and busy < t.low_load and close:
            # Light load, a tie of speeds: the one that gains more throughput.
            return s_score[1] > b_score[1]
        if close and (steady := self.steadier(s_b, b_b)) is not None:
            return steady is s_b
        return s_score > b_score

    def tie(self, s_b: BackendView, b_b: BackendView) -> float:
        """How close two per-request speeds are a tie: near_tie, widened by the models' uncertainty there."""
        t = self.t
        return min(t.max_tie, t.near_tie + t.tie_z * math.hypot(self.est.stderr(s_b), self.est.stderr(b_b)))

    def steadier(self, s_b: BackendView, b_b: BackendView) -> BackendView | None:
        """The backend a busy tie goes to: the one whose requests scatter less, when the two spreads are told apart,
        it would not queue the request and the other is busy; None when neither."""
        t = self.t
        s_spread, b_spread = self.est.spread(s_b), self.est.spread(b_b)
        if abs(s_spread - b_spread) <= t.spread_band + t.spread_apart * max(s_spread, b_spread):
            return None
        steady, scatter = (s_b, b_b) if s_spread < b_spread else (b_b, s_b)
        # Not when the steadier would queue the request: its time there is then mostly the wait, whose scatter no
        # spread measures (a queued request's sample is its decode alone). Nor when the scattering server is
        # lightly loaded: its light bands then hold few samples, the tie is wide, and losing every such tie
        # would keep them few.
        return None if self.est.queues(steady) or scatter.load_estimate < t.low_load else steady
