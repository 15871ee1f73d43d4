"""The Balanced pool policy (router.policy.Policy)."""
from __future__ import annotations

import random

from router.curves import CurvePoints, request_speed
from router.policy import FASTER, Decision, Fixed, View, healthy, least, sole_pool


class Balanced(Fixed):
    """Send the request to the pool whose least-loaded instance would serve it faster (ties: speculative),
    on two measured curves of ONE instance each. Greedily equalising per-request speed follows the best
    split as load grows, which no fixed threshold can."""

    name = "balanced"

    def __init__(self, curves: tuple[CurvePoints, CurvePoints]) -> None:
        self.spec_curve, self.base_curve = curves

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        spec, base = healthy(view.speculative), healthy(view.baseline)
        if not spec or not base:
            return sole_pool(view, bool(spec), rng, FASTER)
        bs, bb = least(spec, rng), least(base, rng)
        if request_speed(self.spec_curve, bs.load_estimate) >= request_speed(self.base_curve, bb.load_estimate):
            return Decision(bs, FASTER)
        return Decision(bb, FASTER)
