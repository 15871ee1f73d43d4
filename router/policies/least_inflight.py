"""The LeastInflight pool policy (router.policy.Policy)."""
from __future__ import annotations

import random

from router.policy import LEAST, Decision, Fixed, View, healthy, least


class LeastInflight(Fixed):
    """The least loaded healthy backend of either pool."""

    name = "least-inflight"

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        cands = healthy(view.backends)
        return Decision(least(cands, rng), LEAST) if cands else None
