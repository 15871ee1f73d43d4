"""The Spillover pool policy (router.policy.Policy)."""
from __future__ import annotations

import random

from router.policy import (
    ABOVE,
    BASELINE,
    BELOW,
    FAILOVER,
    SPECULATIVE,
    Decision,
    Fixed,
    View,
    healthy,
    in_pool,
)


class Spillover(Fixed):
    """Speculate while the speculative pool holds fewer than `threshold` per healthy instance, else baseline."""

    name = "spillover"

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        spec = healthy(view.speculative)
        # Below threshold per healthy instance: sum < threshold * n, so no instance ever exceeds it.
        if spec and sum(b.load_estimate for b in spec) < self.threshold * len(spec):
            return in_pool(view, SPECULATIVE, BELOW, rng)
        if not spec and self.threshold > 0 and view.speculative:
            return in_pool(view, BASELINE, FAILOVER, rng)  # would speculate, but that pool is down
        return in_pool(view, BASELINE, ABOVE, rng)
