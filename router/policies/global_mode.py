"""The Global pool policy (router.policy.Policy)."""
from __future__ import annotations

import random

from router.policy import ABOVE, BASELINE, BELOW, SPECULATIVE, Decision, Fixed, View, in_pool


class Global(Fixed):
    """One mode for the whole deployment: speculate while the total in flight is below `threshold`."""

    name = "global"

    def __init__(self, threshold: int, hysteresis: int = 0, speculating: bool = True) -> None:
        self.threshold = threshold
        self.hysteresis = hysteresis
        self.speculating = speculating

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        total = sum(b.load_estimate for b in view.backends)
        if self.speculating:
            self.speculating = total < self.threshold
        else:
            # Hysteresis: once above, come back only when clearly below, so the mode does not flap.
            self.speculating = total < self.threshold - self.hysteresis
        if self.speculating:
            return in_pool(view, SPECULATIVE, BELOW, rng)
        return in_pool(view, BASELINE, ABOVE, rng)
