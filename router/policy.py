"""Pure routing decisions: a load snapshot plus settings in, a chosen backend and a reason out; no I/O."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

SPECULATIVE = "speculative"
BASELINE = "baseline"
POOLS: tuple[str, str] = (SPECULATIVE, BASELINE)

# Reasons are a closed set: they become metric label values.
BELOW = "below_threshold"
ABOVE = "above_threshold"
FAILOVER = "failover"
PINNED = "pinned"
LEAST = "least_inflight"
ROUND_ROBIN = "round_robin"
RETRY = "retry"
FASTER = "faster_pool"
REASONS: tuple[str, ...] = (BELOW, ABOVE, FAILOVER, PINNED, LEAST, ROUND_ROBIN, RETRY, FASTER)

# A measured closed-loop curve of ONE instance: (concurrency, output tok/s) points, concurrency increasing.
CurvePoints = tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """One backend as the policy sees it at decision time."""

    url: str
    pool: str
    inflight: int
    healthy: bool


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What a policy remembers between decisions: the global policy's mode and the round-robin cursor."""

    speculating: bool = True
    cursor: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    url: str
    pool: str
    reason: str
    state: PolicyState


def other(pool: str) -> str:
    return BASELINE if pool == SPECULATIVE else SPECULATIVE


def _healthy(loads: Sequence[BackendLoad], pool: str | None = None) -> list[BackendLoad]:
    return [b for b in loads if b.healthy and (pool is None or b.pool == pool)]


def _least(cands: Sequence[BackendLoad], rng: random.Random) -> BackendLoad:
    low = min(b.inflight for b in cands)
    # Random among equals: a fixed tie-break would pile every idle moment onto the first backend.
    return rng.choice([b for b in cands if b.inflight == low])


def _in_pool(loads: Sequence[BackendLoad], pool: str, reason: str, state: PolicyState,
             rng: random.Random) -> Decision | None:
    """Least in-flight within `pool`; if it has no healthy backend, the other pool serves (failover)."""
    cands = _healthy(loads, pool)
    if cands:
        b = _least(cands, rng)
        return Decision(b.url, pool, reason, state)
    cands = _healthy(loads, other(pool))
    if cands:
        b = _least(cands, rng)
        return Decision(b.url, b.pool, FAILOVER, state)
    return None


def spillover(loads: Sequence[BackendLoad], threshold: int, state: PolicyState,
              rng: random.Random) -> Decision | None:
    spec = _healthy(loads, SPECULATIVE)
    # Below threshold per healthy instance: sum < threshold * n, so no instance ever exceeds it.
    if spec and sum(b.inflight for b in spec) < threshold * len(spec):
        return _in_pool(loads, SPECULATIVE, BELOW, state, rng)
    if not spec and threshold > 0 and any(b.pool == SPECULATIVE for b in loads):
        return _in_pool(loads, BASELINE, FAILOVER, state, rng)  # would speculate, but that pool is down
    return _in_pool(loads, BASELINE, ABOVE, state, rng)


def global_threshold(loads: Sequence[BackendLoad], threshold: int, hysteresis: int, state: PolicyState,
                     rng: random.Random) -> Decision | None:
    total = sum(b.inflight for b in loads)
    if state.speculating:
        speculating = total < threshold
    else:
        # Hysteresis: once above, come back only when clearly below, so the mode does not flap.
        speculating = total < threshold - hysteresis
    new = PolicyState(speculating=speculating, cursor=state.cursor)
    if speculating:
        return _in_pool(loads, SPECULATIVE, BELOW, new, rng)
    return _in_pool(loads, BASELINE, ABOVE, new, rng)


def curve_throughput(points: CurvePoints, c: float) -> float:
    """Output tok/s of one instance at `c` in flight: linear between points, 0 at 0, flat beyond the last."""
    if c <= 0:
        return 0.0
    x0, y0 = 0.0, 0.0
    for x1, y1 in points:
        if c <= x1:
            return y0 + (y1 - y0) * (c - x0) / (x1 - x0)
        x0, y0 = x1, y1
    return y0


def request_speed(points: CurvePoints, inflight: int) -> float:
    """Tok/s a new request would get on an instance already holding `inflight`: X(n+1)/(n+1); beyond the
    curve's last point this falls as 1/n, which is how a saturated server's queue behaves."""
    return curve_throughput(points, inflight + 1) / (inflight + 1)


def balanced(loads: Sequence[BackendLoad], curves: tuple[CurvePoints, CurvePoints], state: PolicyState,
             rng: random.Random) -> Decision | None:
    """Send the request to the pool whose least-loaded instance would serve it faster (ties: speculative).
    Greedily equalising per-request speed follows the best split as load grows, which no fixed threshold can."""
    spec, base = _healthy(loads, SPECULATIVE), _healthy(loads, BASELINE)
    if not spec or not base:
        pool = SPECULATIVE if spec else BASELINE
        down = other(pool)
        # Only one pool can serve: failover if the other is configured but down, else it is the only choice.
        reason = FAILOVER if any(b.pool == down for b in loads) else FASTER
        return _in_pool(loads, pool, reason, state, rng)
    bs, bb = _least(spec, rng), _least(base, rng)
    if request_speed(curves[0], bs.inflight) >= request_speed(curves[1], bb.inflight):
        return Decision(bs.url, SPECULATIVE, FASTER, state)
    return Decision(bb.url, BASELINE, FASTER, state)


def least_inflight(loads: Sequence[BackendLoad], state: PolicyState, rng: random.Random) -> Decision | None:
    cands = _healthy(loads)
    if not cands:
        return None
    b = _least(cands, rng)
    return Decision(b.url, b.pool, LEAST, state)


def round_robin(loads: Sequence[BackendLoad], state: PolicyState) -> Decision | None:
    cands = _healthy(loads)
    if not cands:
        return None
    b = cands[state.cursor % len(cands)]
    return Decision(b.url, b.pool, ROUND_ROBIN, PolicyState(state.speculating, state.cursor + 1))


def decide(loads: Sequence[BackendLoad], *, policy: str, threshold: int, hysteresis: int = 0,
           state: PolicyState = PolicyState(), pinned: str | None = None,
           rng: random.Random | None = None,
           curves: tuple[CurvePoints, CurvePoints] | None = None) -> Decision | None:
    """Choose a backend for a new request; None when no backend at all is healthy.
    `curves` (speculative, baseline) are the per-instance throughput curves the balanced policy needs."""
    rng = rng or random.Random()
    if pinned is not None:
        return _in_pool(loads, pinned, PINNED, state, rng)
    if policy == "spillover":
        return spillover(loads, threshold, state, rng)
    if policy == "global":
        return global_threshold(loads, threshold, hysteresis, state, rng)
    if policy == "least-inflight":
        return least_inflight(loads, state, rng)
    if policy == "round-robin":
        return round_robin(loads, state)
    if policy == "balanced":
        if curves is None:
            raise ValueError("the balanced policy needs both throughput curves")
        return balanced(loads, curves, state, rng)
    raise ValueError(f"unknown policy {policy!r}")


def retry_target(loads: Sequence[BackendLoad], failed_url: str, failed_pool: str,
                 rng: random.Random | None = None) -> BackendLoad | None:
    """Another backend for a retry: the same pool if it has another healthy one, else the other pool."""
    rng = rng or random.Random()
    rest = [b for b in loads if b.url != failed_url]
    for pool in (failed_pool, other(failed_pool)):
        cands = _healthy(rest, pool)
        if cands:
            return _least(cands, rng)
    return None
