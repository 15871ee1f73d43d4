"""Passive outlier ejection of one backend: a pure state machine over attempt outcomes and the clock (no I/O)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from router.errors import Failure
from router.observe import OK

# Phases are a closed set (metric label values). A backend that fails its health probes is "down" elsewhere;
# this machine only knows whether the requests it was sent are failing.
ACTIVE, EJECTED, TRIAL = "active", "ejected", "trial"

# What one attempt's outcome means for its backend.
SUCCESS, FAILURE, NEUTRAL = "success", "failure", "neutral"


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """consecutive_errors: failures in a row that eject (0: never eject). An ejection lasts base_s, doubling
    with each ejection that follows within max_s of the last return, capped at max_s. Then the backend is on
    trial: at most trial_requests in flight, and that many successes in a row bring it fully back."""

    consecutive_errors: int = 5
    base_s: float = 5.0
    max_s: float = 60.0
    trial_requests: int = 3


@dataclass(frozen=True, slots=True)
class OutlierState:
    phase: str = ACTIVE
    failures: int = 0  # consecutive failures while active
    ejections: int = 0  # ejections in the current streak; sets the next ejection's length
    until: float = 0.0  # end of the current ejection (monotonic seconds)
    trial_ok: int = 0  # successes in a row while on trial
    back_at: float = float("-inf")  # when it last came fully back (a streak ends max_s after it)


def classify(kind: str, status: int | None) -> str:
    """A 5xx or a transport failure of the backend's own is a failure. A 4xx is the request's fault and a
    `local` error (out of file descriptors, DNS) is ours: neither says anything about the backend."""
    if kind == OK:
        if status is None or status >= 500:
            return FAILURE
        return NEUTRAL if status >= 400 else SUCCESS
    return NEUTRAL if kind == Failure.LOCAL else FAILURE


def phase_at(s: OutlierState, now: float) -> str:
    """The phase at `now`: an ejection that has run its time is a trial (no event needed to get there)."""
    if s.phase == EJECTED and now >= s.until:
        return TRIAL
    return s.phase


def admits(s: OutlierState, now: float, inflight: int, cfg: OutlierConfig) -> bool:
    """May a new request go to this backend? On trial only while fewer than trial_requests are in flight."""
    phase = phase_at(s, now)
    if phase == ACTIVE:
        return True
    return phase == TRIAL and inflight < cfg.trial_requests


def ejection_s(ejections: int, cfg: OutlierConfig) -> float:
    """Length of the n-th ejection of a streak (n >= 1)."""
    return min(cfg.max_s, cfg.base_s * 2.0 ** min(ejections - 1, 62))


def _eject(s: OutlierState, now: float, cfg: OutlierConfig) -> OutlierState:
    # A failed trial continues the streak; a backend that stayed fully back for max_s starts a new one.
    streak = s.ejections if s.phase != ACTIVE or now - s.back_at < cfg.max_s else 0
    n = streak + 1
    return OutlierState(EJECTED, 0, n, now + ejection_s(n, cfg), 0, s.back_at)


def step(s: OutlierState, outcome: str, now: float, cfg: OutlierConfig, may_eject: bool) -> OutlierState:
    """The state after one attempt's outcome. `may_eject` is False when no other backend could take the
    traffic: then failures pass through to clients rather than nobody being served."""
    if cfg.consecutive_errors <= 0 or outcome == NEUTRAL:
        return s
    phase = phase_at(s, now)
    if phase == EJECTED:
        return s  # answers to requests sent before the ejection: the trial decides, not these
    if phase == TRIAL:
        if outcome == FAILURE:
            if may_eject:
                return _eject(s, now, cfg)
            return replace(s, phase=ACTIVE, failures=1, trial_ok=0)
        ok = s.trial_ok + 1
        if ok >= cfg.trial_requests:
            return replace(s, phase=ACTIVE, failures=0, trial_ok=0, back_at=now)
        return replace(s, phase=TRIAL, trial_ok=ok)
    if outcome == SUCCESS:
        return s if s.failures == 0 else replace(s, failures=0)
    failures = s.failures + 1
    if failures >= cfg.consecutive_errors and may_eject:
        return _eject(s, now, cfg)
    return replace(s, failures=failures)


def restore(s: OutlierState, now: float) -> OutlierState:
    """Fully back at once, ejection streak kept: used when every other backend is gone."""
    return replace(s, phase=ACTIVE, failures=0, trial_ok=0, until=now, back_at=now)
