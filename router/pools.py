"""Backends, their pools and health state, and the lease that is the only way to change an in-flight count."""
from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from router import outlier
from router.affinity import Affinity
from router.core.figures import Figures
from router.core.latency import Latency, Shed, Targets
from router.core.plugins import Filter, Placement
from router.core.scheduler import Scheduler
from router.observe import ATTEMPT_KINDS, LOCAL, OK, Attempt, LoadFigures, Observation
from router.outlier import OutlierConfig, OutlierState
from router.policy import BackendLoad, Decision, Policy, View, retry_target
from router.prefix import BLOCK_BYTES, Prompt

log = logging.getLogger("router.pools")

# Backend states as the router reports them (router_backend_state): "down" is the health probes' verdict,
# the others are router.outlier's phases of a backend the probes call healthy.
UP, DOWN = "up", "down"
STATES: tuple[str, ...] = (UP, DOWN, outlier.EJECTED, outlier.TRIAL)
IN_ROTATION = (UP, outlier.TRIAL)  # router_backend_up reads 1 in these
# Why a backend was ejected (a label): an HTTP 5xx, or the transport failure kind of the last attempt.
EJECT_REASONS: tuple[str, ...] = ("5xx", *(k for k in ATTEMPT_KINDS if k not in (OK, LOCAL)))


clock = time.monotonic  # the in-flight integral's clock (a test sets its own)


class PoolEvents:
    """What the pools tell an observer about their members (router.exporter binds the metrics here); no-ops."""

    def joined(self, b: Backend) -> None:
        """A backend added at run time (the configured ones are there at construction)."""

    def left(self, b: Backend) -> None:
        """A backend gone for good (removed, its last lease released)."""

    def ejected(self, b: Backend, reason: str) -> None:
        """Passive ejection; `reason` is one of EJECT_REASONS."""


class Backend:
    """One SGLang instance. Its in-flight count changes only through Lease objects."""

    __slots__ = ("url", "pool", "api_key", "healthy", "ever_probed", "fails", "successes", "last_probe", "probe",
                 "_inflight", "_pending", "reported", "_inflight_at_report", "outlier", "outlier_cfg", "on_drained", "_area", "_area_at", "generation",
                 "started", "last_release", "_bounds")

    def __init__(self, url: str, pool: str, api_key: str | None = None,
                 outlier_cfg: OutlierConfig | None = None) -> None:
        self.url = url
        self.pool = pool
        self.api_key = api_key
        # Not routable until a probe says so: a loading SGLang answers 503 for minutes.
        self.healthy = False
        self.ever_probed = False
        self.fails = 0
        self.successes = 0
        self.last_probe = "not probed yet"  # the last health probe's result in words (/ready, 503 bodies, logs)
        self.probe: object = None  # router.health's own per-backend bookkeeping (path in use, what it logged)
        self._inflight = 0
        # Leases out whose request is known to run, or may: streams from their first token on, and requests not
        # streamed (no byte shows when they start) from their sending (Lease.start).
        self.started = 0
        self.last_release = -math.inf  # clock() at the latest release: when a place last freed
        # Uncached prompt tokens of the leases out that have no first token yet (router.affinity): the prefill
        # queued ahead of a new request.
        self._pending = 0
        # Request-seconds in flight up to _area_at (the integral of the in-flight count over time): what a lease
        # reads to know the mean load its request ran under, which its start and end counts alone misstate
        # whenever the load ramps up or drains during it.
        self._area = 0.0
        self._area_at = clock()
        self.reported: int | None = None  # running + waiting the backend itself last reported
        self._inflight_at_report = 0
        self.outlier = OutlierState()  # passive ejection, driven by Pools.report_attempt
        self.outlier_cfg = outlier_cfg or OutlierConfig()
        # Set by Pools.remove_backend while leases are still out: called when the last one is released.
        self.on_drained: Callable[[Backend], None] | None = None
        # Counts the times it went down: what it held before (its prefix cache) is not assumed after.
        self.generation = 0
        # TPOT targets (seconds) of its leases with one -> how many: the tightest is what a request without targets
        # must not push it past (router.core.latency). At most one entry per lease out: bounded.
        self._bounds: dict[float, int] = {}

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def pending_tokens(self) -> int:
        return self._pending

    @property
    def tpot_bound_s(self) -> float | None:
        """The tightest TPOT target of the requests it runs now (None: none has one)."""
        return min(self._bounds) if self._bounds else None

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

    def area(self, now: float) -> float:
        """Request-seconds in flight from the backend's start until `now`."""
        return self._area + self._inflight * (now - self._area_at)

    def _tick(self, now: float) -> None:
        self._area = self.area(now)
        self._area_at = now

    def lease(self, tokens: int = 0) -> Lease:
        """`tokens`: the uncached prompt tokens it brings (prefix affinity), counted until its first token or its
        release."""
        now = clock()
        self._tick(now)
        self._inflight += 1
        self._pending += tokens
        return Lease(self, now, tokens)

    def _release(self, tokens: int = 0) -> None:
        now = clock()
        self._tick(now)
        self.last_release = now
        self._inflight -= 1
        self._pending = max(0, self._pending - tokens)
        if self._inflight < 0:
            # Leases release once, so this is an accounting bug: say so (tests fail on this line's log record),
            # then keep the backend routable rather than idle-looking for ever.
            log.error("in-flight count of backend %s went below 0: a lease was released twice", self.url)
            self._inflight = 0
        if self._inflight == 0 and self.on_drained is not None:
            self.on_drained(self)

    @property
    def routable(self) -> bool:
        """May a new request go here: healthy per the probes, and not ejected (on trial: below its trial cap).
        The one property policies read."""
        return self.healthy and (self.outlier.phase == outlier.ACTIVE or
                                 outlier.admits(self.outlier, time.monotonic(), self._inflight, self.outlier_cfg))

    def state(self, now: float | None = None) -> str:
        """One of STATES: down (probes), ejected, trial, or up."""
        if not self.healthy:
            return DOWN
        phase = outlier.phase_at(self.outlier, time.monotonic() if now is None else now)
        return UP if phase == outlier.ACTIVE else phase

    def load(self) -> BackendLoad:
        return BackendLoad(self.url, self.pool, self.load_estimate, self.routable)

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
            if self.healthy:
                self.generation += 1
            self.healthy = False
        self.ever_probed = True

    def __repr__(self) -> str:
        return (f"Backend({self.url!r}, {self.pool}, inflight={self._inflight}, healthy={self.healthy}, "
                f"{self.outlier.phase})")


class Lease:
    """One request's hold on one backend. It ends once, by finish() (or release(), which is finish without an
    observation); a second end does nothing, so counts cannot skew."""

    __slots__ = ("backend", "_released", "_t0", "_area0", "_tokens", "beside", "waited", "_tpot")

    def __init__(self, backend: Backend, now: float, tokens: int = 0) -> None:
        self.backend = backend
        self._released = False
        self._tokens = tokens
        self._tpot: float | None = None  # its request's TPOT target (seconds), counted on the backend until released
        self._t0, self._area0 = now, backend.area(now)
        # The backend's other started leases when this one started (None: not yet): for a stream, at its first
        # token, how many ran beside it then (router.queuelimit).
        self.beside: int | None = None
        # Seconds from the lease to the backend's latest release before it started (None: none in between): with
        # one place on the backend, the release that let it start.
        self.waited: float | None = None

    def mean_inflight(self) -> float:
        """The backend's mean in-flight count (this request included) since the lease was taken."""
        now = clock()
        if now <= self._t0:
            return float(self.backend.inflight)
        return (self.backend.area(now) - self._area0) / (now - self._t0)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def tpot_target(self) -> float | None:
        return self._tpot

    def hold_target(self, tpot_s: float | None) -> Lease:
        """Its request has this TPOT target: the backend counts it until the release (once; None: none)."""
        if tpot_s is not None and self._tpot is None and not self._released:
            self._tpot = tpot_s
            bounds = self.backend._bounds
            bounds[tpot_s] = bounds.get(tpot_s, 0) + 1
        return self

    def prefilled(self) -> None:
        """The first token came: its uncached tokens are no longer prefill queued on the backend (once)."""
        self.start()
        if self._tokens and not self._released:
            self.backend._pending = max(0, self.backend._pending - self._tokens)
            self._tokens = 0

    def start(self) -> None:
        """Its request runs on the backend now: a stream's first token, or a request not streamed being sent (once)."""
        if self.beside is None and not self._released:
            self.beside = self.backend.started
            self.backend.started += 1
            freed = self.backend.last_release
            self.waited = freed - self._t0 if freed > self._t0 else None

    def finish(self, obs: Observation | None, pools: Pools | None = None,
               placement: Placement | None = None) -> bool:
        """End the lease with what was observed, whatever happened: the pools hear `obs` (Pools.report_done, with
        the placement) while the lease still counts, then it is released, even if reporting failed. `obs` None:
        nothing finished here (an attempt given up for a retry; its failure went through report_attempt).
        Returns False, and does nothing, when the lease had ended already."""
        if self._released:
            return False
        try:
            if obs is not None and pools is not None:
                pools.report_done(self.backend, obs, placement)
        finally:
            self.release()
        return True

    def release(self) -> None:
        """End the lease without an observation (finish(None)); once."""
        if not self._released:
            self._released = True
            if self.beside is not None:
                self.backend.started -= 1
            if self._tpot is not None:
                bounds = self.backend._bounds
                left = bounds.get(self._tpot, 0) - 1
                if left > 0:
                    bounds[self._tpot] = left
                else:
                    bounds.pop(self._tpot, None)
            self.backend._release(self._tokens)


class Pools:
    """All backends of both pools plus the policy's remembered state; decisions and leases happen together."""

    def __init__(self, speculative: Iterable[str], baseline: Iterable[str], *, policy: Policy,
                 threshold: int = 0, keys: dict[str, str | None] | None = None,
                 rng: random.Random | None = None,
                 outlier_cfg: OutlierConfig | None = None, affinity: Affinity | None = None) -> None:
        keys = keys or {}
        self._keys = keys
        # Removed backends whose leases are still out (router.discovery): kept only until the last release.
        self.draining: dict[str, Backend] = {}
        self.outlier_cfg = outlier_cfg or OutlierConfig()
        self.backends: list[Backend] = [Backend(u, "speculative", keys.get("speculative"), self.outlier_cfg)
                                        for u in speculative]
        self.backends += [Backend(u, "baseline", keys.get("baseline"), self.outlier_cfg) for u in baseline]
        self.by_url = {b.url: b for b in self.backends}
        # The live backends grouped by pool (retries, /router/state); a decision reads its own snapshot instead.
        self.view = View.of(self.backends)
        self.threshold = threshold  # shown as router_threshold
        self.rng = rng or random.Random()
        # Prefix affinity (router.affinity): the decision's prefix scorer; None: off.
        self.affinity = affinity
        # The learned per-backend figures (router.core.figures): one store, updated here once per event (report_done,
        # report_loads), read by the prefix scorer and by a policy that shares it (the adaptive policy).
        self.figures = affinity.figures if affinity is not None else Figures()
        # Latency targets (router.core.latency): predicted from the same figures the prefix scorer prices with.
        self.latency = Latency(self.figures, affinity.block_bytes if affinity is not None else BLOCK_BYTES)
        self.scheduler = Scheduler(policy, affinity, latency=self.latency)
        self._share_figures(policy)
        self.events: PoolEvents = PoolEvents()  # router.exporter replaces it to bind the metrics
        # Who runs what the policy's observe() left to learn(): router.learner's wake-up in a serving router;
        # None runs it at once, in report_done (a bench driving the policy directly, tests).
        self.learner: Callable[[], None] | None = None

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.scheduler.policy = policy
        self._share_figures(policy)

    def _share_figures(self, policy: Policy) -> None:
        share = getattr(policy, "share_figures", None)
        if share is not None:
            share(self.figures)

    def loads(self) -> list[BackendLoad]:
        return [b.load() for b in self.backends]

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def acquire(self, pinned: str | None = None) -> tuple[Lease, Decision] | None:
        """Decide and take the lease with no await in between, so concurrent requests see exact counts."""
        got = self.place(pinned)
        return None if got is None else got[:2]

    def place(self, pinned: str | None = None, prompt: Prompt | None = None, only: Filter | None = None,
              targets: Targets | None = None) -> tuple[Lease, Decision, Placement | None] | Shed | None:
        """acquire(), with the prompt weighed by the prefix scorer when prefix routing is on (router.core): one
        snapshot, one decision, then the lease, with no await in between. `only` narrows the endpoints first
        (the endpoint picker's subset hint and per-backend cap). `targets`: the request's latency targets
        (router.core.latency; `choose` also returns the prediction); Shed, and no lease, when none can meet them
        and the request may be shed."""
        got = self.choose(pinned, prompt, only, targets)
        return got if got is None or isinstance(got, Shed) else got[:3]

    def choose(self, pinned: str | None = None, prompt: Prompt | None = None, only: Filter | None = None,
               targets: Targets | None = None):
        """place(), returning (Lease, Decision, Placement | None, Forecast | None) | Shed | None: the forecast is
        the chosen endpoint's predicted latency (requests with targets only)."""
        sched = self.scheduler
        got = sched.decide(sched.snapshot(self.backends, pinned, prompt, targets), self.rng, only)
        if got is None or isinstance(got, Shed):
            return got
        d, placement = got.decision, got.placement
        tokens = 0 if placement is None or self.affinity is None else self.affinity.sent(d.backend, placement)
        lease = d.backend.lease(tokens)
        if targets is not None and got.forecast is not None and got.forecast.met:
            # Only a target it is predicted to meet holds others off: one it misses anyway (an impossible number,
            # a least miss) would reserve the backend for nothing.
            lease.hold_target(targets.tpot_s)
        return lease, d, placement, got.forecast

    def acquire_retry(self, failed: Backend, placement: Placement | None = None) -> Lease | None:
        """A lease on another backend for a retry (the caller holds the request's TPOT target on it,
        Lease.hold_target, as on the first)."""
        target = retry_target(self.view, failed.url, failed.pool, self.rng)
        if target is None:
            return None
        tokens = 0
        if placement is not None and self.affinity is not None:
            tokens = self.affinity.sent(target, placement)
        return target.lease(tokens)

    # ---- the learning seam: the proxy reports here; outlier detection and learned policies listen.
    def report_attempt(self, backend: Backend, attempt: Attempt) -> None:
        """Called once per upstream attempt, as soon as its outcome is known (headers or a failure).
        Only failures count here: good headers are no success yet (a stream can still stall), report_done
        tells that."""
        if outlier.classify(attempt.kind, attempt.status) == outlier.FAILURE:
            self._outcome(backend, outlier.FAILURE, attempt)

    def _outcome(self, backend: Backend, outcome: str, attempt: Attempt | None) -> None:
        s = backend.outlier
        if outcome == outlier.SUCCESS and s.phase == outlier.ACTIVE and s.failures == 0:
            return  # the common case, kept cheap
        now = time.monotonic()
        may_eject = outcome == outlier.FAILURE and self._others_routable(backend, now)
        new = outlier.step(s, outcome, now, self.outlier_cfg, may_eject)
        if new is s:
            return
        backend.outlier = new
        if new.phase != s.phase or outlier.phase_at(s, now) != new.phase:
            self._log_change(backend, s, new, attempt, now)

    def _others_routable(self, backend: Backend, now: float) -> bool:
        # "Routable" here ignores the trial's in-flight cap: a backend on trial can take traffic.
        return any(o is not backend and o.healthy and outlier.phase_at(o.outlier, now) != outlier.EJECTED
                   for o in self.backends)

    def _log_change(self, b: Backend, old: OutlierState, new: OutlierState, attempt: Attempt | None,
                    now: float) -> None:
        what = "none" if attempt is None else f"HTTP {attempt.status}" if attempt.kind == OK else attempt.kind
        if new.phase == outlier.EJECTED:
            reason = "5xx" if attempt is None or attempt.kind == OK else attempt.kind
            self.events.ejected(b, reason)
            if self.affinity is not None:
                self.affinity.forget(b.url)  # back from an ejection it may well have restarted
            after = (f"{self.outlier_cfg.consecutive_errors} consecutive failures" if old.phase == outlier.ACTIVE
                     else "a failed trial request")
            log.warning("backend %s (%s) ejected for %.3g s (ejection %d in a row) after %s, the last: %s",
                        b.url, b.pool, new.until - now, new.ejections, after, what)
        elif new.phase == outlier.TRIAL:
            log.info("backend %s (%s) ejection over: on trial (%d request(s) at a time until %d succeed)",
                     b.url, b.pool, self.outlier_cfg.trial_requests, self.outlier_cfg.trial_requests)
        elif old.phase != outlier.ACTIVE and new.failures:
            log.warning("backend %s (%s) failed a trial request (%s) but no other backend is routable: "
                        "back in rotation, its errors pass through", b.url, b.pool, what)
        else:
            log.info("backend %s (%s) passed its trial: fully back", b.url, b.pool)

    def tick(self, now: float | None = None) -> None:
        """Periodic upkeep (the health loop calls it): log ejections that ran out, and when no backend is
        routable any more, take ejected ones back rather than answer nobody (their errors pass through)."""
        now = time.monotonic() if now is None else now
        for b in self.backends:
            if b.outlier.phase == outlier.EJECTED and now >= b.outlier.until:
                b.outlier = OutlierState(outlier.TRIAL, 0, b.outlier.ejections, b.outlier.until, 0,
                                         b.outlier.back_at)
                log.info("backend %s (%s) ejection over: on trial (%d request(s) at a time until %d succeed)",
                         b.url, b.pool, self.outlier_cfg.trial_requests, self.outlier_cfg.trial_requests)
        if any(b.healthy and b.outlier.phase == outlier.ACTIVE for b in self.backends):
            return
        for b in self.backends:
            if b.healthy and b.outlier.phase != outlier.ACTIVE:
                b.outlier = outlier.restore(b.outlier, now)
                log.warning("backend %s (%s) taken back early: no other backend is routable, its errors pass "
                            "through", b.url, b.pool)

    def report_done(self, backend: Backend, obs: Observation, placement: Placement | None = None) -> None:
        """Called once per finished exchange, just before its lease is released."""
        # A complete answer is the backend's success; anything else (errors, client disconnects) was either
        # reported as a failed attempt already or is not the backend's doing.
        if obs.ok:
            self._outcome(backend, outlier.SUCCESS, None)
        if placement is not None and obs.cached_tokens is None:
            obs = replace(obs, expected_cached_tokens=placement.expected_cached,
                          estimated_prompt_tokens=placement.prompt_tokens or None)
        self.figures.observe(obs, placement)
        self.policy.observe(obs)
        if self.learner is None:
            self.policy.learn(None)
        else:
            self.learner()
        if self.affinity is not None:
            self.affinity.observe(obs, placement, backend.generation)

    def report_loads(self, backend: Backend, figs: LoadFigures) -> None:
        """Called with each /v1/loads answer of a backend (load_signal backend)."""
        resized = self.figures.observe_loads(backend.url, figs)
        self.policy.observe_loads(backend.url, backend.pool, figs)
        if self.affinity is not None:
            self.affinity.observe_loads(backend.url, figs, resized)

    # ---- membership that changes at run time (router.discovery). The lists are replaced, never mutated in
    # place, so a loop that is iterating over the old list (probes, load polls) finishes undisturbed.
    def add_backend(self, url: str, pool: str) -> Backend:
        """A new instance of `pool`; not routable until a health probe passes. A draining one comes back."""
        b = self.by_url.get(url)
        if b is not None:
            return b
        b = self.draining.pop(url, None)
        if b is not None and b.pool == pool:
            b.on_drained = None
        else:
            if b is not None:  # the address moved to the other pool: the old entry's leases just run out
                b.on_drained = None
                self._forget(b)
            b = Backend(url, pool, self._keys.get(pool), self.outlier_cfg)
            self.events.joined(b)
        self._set_members([*self.backends, b])
        return b

    def remove_backend(self, url: str) -> None:
        """Stop routing to `url` now; with leases still out it drains and is dropped at the last release."""
        b = self.by_url.get(url)
        if b is None:
            return
        self._set_members([x for x in self.backends if x is not b])
        if b.inflight == 0:
            self._forget(b)
        else:
            self.draining[url] = b
            b.on_drained = self._drained

    def _set_members(self, backends: list[Backend]) -> None:
        # The policy's view is rebuilt with the list: it groups the live backends by pool once per change.
        self.backends = backends
        self.by_url = {b.url: b for b in backends}
        self.view = View.of(backends)

    def _drained(self, b: Backend) -> None:
        if self.draining.get(b.url) is b:
            del self.draining[b.url]
            b.on_drained = None
            self._forget(b)

    def _forget(self, b: Backend) -> None:
        self.events.left(b)
        if self.affinity is not None:
            self.affinity.forget(b.url)
