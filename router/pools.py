"""Backends, their pools and health state, and the lease that is the only way to change an in-flight count."""
from __future__ import annotations

import random
from collections.abc import Iterable

from router.curves import CurvePoints
from router.metrics import Metrics
from router.observe import REFUSED, Attempt, Observation
from router.policy import POOLS, BackendLoad, Decision, Policy, View, build, decide, retry_target


class Backend:
    """One SGLang instance. Its in-flight count changes only through Lease objects."""

    __slots__ = ("url", "pool", "api_key", "healthy", "ever_probed", "fails", "successes", "_inflight",
                 "reported", "_inflight_at_report")

    def __init__(self, url: str, pool: str, api_key: str | None = None) -> None:
        self.url = url
        self.pool = pool
        self.api_key = api_key
        # Not routable until a probe says so: a loading SGLang answers 503 for minutes.
        self.healthy = False
        self.ever_probed = False
        self.fails = 0
        self.successes = 0
        self._inflight = 0
        self.reported: int | None = None  # running + waiting the backend itself last reported
        self._inflight_at_report = 0

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def auth_headers(self) -> dict[str, str] | None:
        """The pool's own backend key for side requests (probes, load polls, model lists)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None

    def report(self, load: int | None) -> None:
        self.reported = load
        self._inflight_at_report = self._inflight

    @property
    def load_estimate(self) -> int:
        """The backend's own figure (other router replicas included) plus what we sent since it came in."""
        if self.reported is None:
            return self._inflight
        return max(self._inflight, self.reported + self._inflight - self._inflight_at_report)

    def lease(self) -> Lease:
        self._inflight += 1
        return Lease(self)

    def _release(self) -> None:
        # Clamp: a count below zero would make this backend look idle for ever.
        self._inflight = max(0, self._inflight - 1)

    def load(self) -> BackendLoad:
        return BackendLoad(self.url, self.pool, self.load_estimate, self.healthy)

    # Health transitions; the thresholds keep one slow probe on a busy backend from ejecting it.
    def probe_ok(self, success_threshold: int) -> None:
        self.fails = 0
        self.successes += 1
        if not self.ever_probed or self.successes >= success_threshold:
            self.healthy = True
        self.ever_probed = True

    def probe_failed(self, failure_threshold: int) -> None:
        self.successes = 0
        self.fails += 1
        if not self.ever_probed or self.fails >= failure_threshold:
            self.healthy = False
        self.ever_probed = True

    def refused(self) -> None:
        """A refused connection is unambiguous: down at once, until probes bring it back."""
        self.successes = 0
        self.healthy = False
        self.ever_probed = True

    def __repr__(self) -> str:
        return f"Backend({self.url!r}, {self.pool}, inflight={self._inflight}, healthy={self.healthy})"


class Lease:
    """One request's hold on one backend; release() is idempotent so a double release cannot skew counts."""

    __slots__ = ("backend", "_released")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.backend._release()


class Pools:
    """All backends of both pools plus the policy's remembered state; decisions and leases happen together."""

    def __init__(self, speculative: Iterable[str], baseline: Iterable[str], *, policy: str | Policy,
                 threshold: int = 0, hysteresis: int = 0, keys: dict[str, str | None] | None = None,
                 metrics: Metrics | None = None, rng: random.Random | None = None,
                 curves: tuple[CurvePoints, CurvePoints] | None = None) -> None:
        keys = keys or {}
        self.backends: list[Backend] = [Backend(u, "speculative", keys.get("speculative")) for u in speculative]
        self.backends += [Backend(u, "baseline", keys.get("baseline")) for u in baseline]
        self.by_url = {b.url: b for b in self.backends}
        # Built once; policies read the live Backend objects through it, nothing is copied per request.
        self.view = View.of(self.backends)
        self.policy: Policy = (build(policy, threshold=threshold, hysteresis=hysteresis, curves=curves)
                               if isinstance(policy, str) else policy)
        self.threshold = threshold
        self.rng = rng or random.Random()
        if metrics is not None:
            self._bind_metrics(metrics)

    def _bind_metrics(self, metrics: Metrics) -> None:
        # Gauges read the live values at scrape time, so they can never drift from the counts.
        for b in self.backends:
            metrics.inflight.labels(b.pool, b.url).set_function(lambda b=b: b.inflight)
            metrics.backend_up.labels(b.pool, b.url).set_function(lambda b=b: 1.0 if b.healthy else 0.0)
        metrics.threshold.set(self.threshold)
        for pool in POOLS:
            metrics.duration.labels(pool)
            metrics.disconnects.labels(pool)

    def loads(self) -> list[BackendLoad]:
        return [b.load() for b in self.backends]

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def acquire(self, pinned: str | None = None) -> tuple[Lease, Decision] | None:
        """Decide and take the lease with no await in between, so concurrent requests see exact counts."""
        d = decide(self.policy, self.view, pinned, self.rng)
        if d is None:
            return None
        return d.backend.lease(), d

    def acquire_retry(self, failed: Backend) -> Lease | None:
        target = retry_target(self.view, failed.url, failed.pool, self.rng)
        return None if target is None else target.lease()

    # ---- the learning seam: the proxy reports here; outlier detection and learned policies listen.
    def report_attempt(self, backend: Backend, attempt: Attempt) -> None:
        """Called once per upstream attempt, as soon as its outcome is known (headers or a failure)."""
        if attempt.kind == REFUSED:
            backend.refused()

    def report_done(self, backend: Backend, obs: Observation) -> None:
        """Called once per finished exchange, just before its lease is released."""
