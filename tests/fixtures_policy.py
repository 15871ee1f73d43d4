"""Policies as the router builds them (router.policies.make_policy), from a name and a few settings."""
from __future__ import annotations

from router.policies import make_policy
from router.policy import Policy
from router.settings import load_settings


def policy_of(name: str, *, curves=None, **settings) -> Policy:
    """`curves`: (speculative, baseline) points for balanced (or adaptive's priors)."""
    if curves is not None:
        settings |= {"speculative_curve": list(curves[0]), "baseline_curve": list(curves[1])}
    return make_policy(load_settings(None, {"policy": name, "speculative": ["http://s:1"], "baseline": ["http://b:1"],
                                            **settings}, environ={}))
