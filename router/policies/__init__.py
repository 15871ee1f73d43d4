"""The pool policies, one file each behind router.policy.Policy, and the one place a policy is built from
settings (make_policy)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from router.curves import fit_token_time
from router.policies.balanced import Balanced
from router.policies.global_mode import Global
from router.policies.least_inflight import LeastInflight
from router.policies.round_robin import RoundRobin
from router.policies.spillover import Spillover
from router.policy import Policy

if TYPE_CHECKING:
    from router.settings import Settings

NAMES = ("spillover", "global", "least-inflight", "round-robin", "balanced", "adaptive")


def make_policy(settings: Settings) -> Policy:
    """The routing policy object the settings name, built once (the only builder: the router, the virtual judge
    and the tests' routers all come here)."""
    name = settings.policy
    if name == "spillover":
        return Spillover(settings.threshold)
    if name == "global":
        return Global(settings.threshold, settings.hysteresis)
    if name == "least-inflight":
        return LeastInflight()
    if name == "round-robin":
        return RoundRobin()
    if name == "balanced":
        curves = settings.curves()
        if curves is None:
            raise ValueError("the balanced policy needs both throughput curves")
        return Balanced(curves)
    if name != "adaptive":
        raise ValueError(f"unknown policy {name!r}")
    from router.adaptive import Adaptive

    # Curves, when given, are priors: the model starts from them and then follows what it measures.
    priors = {pool: fit_token_time(points) for pool, points in
              (("speculative", settings.speculative_curve), ("baseline", settings.baseline_curve)) if points}
    return Adaptive(objective=settings.objective, forgetting=settings.adaptive_forgetting,
                    explore=settings.adaptive_explore, deadband=settings.adaptive_deadband,
                    max_running=settings.max_running_requests, priors=priors, defer_fits=True)


__all__ = ["NAMES", "Balanced", "Global", "LeastInflight", "RoundRobin", "Spillover", "make_policy"]
