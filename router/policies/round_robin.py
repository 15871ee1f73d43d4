"""The RoundRobin pool policy (router.policy.Policy)."""
from __future__ import annotations

import random

from router.policy import ROUND_ROBIN, Decision, Fixed, View, healthy


class RoundRobin(Fixed):
    """Every healthy backend in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self.cursor = 0

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        cands = healthy(view.backends)
        if not cands:
            return None
        b = cands[self.cursor % len(cands)]
        self.cursor += 1
        return Decision(b, ROUND_ROBIN)
