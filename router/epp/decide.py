"""The endpoint picker's one decision seam: a parsed request in, the ordered endpoints (with the lease that holds
the first) or the reason to answer at once out. Every call to Pools and Lease of the picker is in this module."""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from router.body import Head, parse_head
from router.core.latency import Shed
from router.core.plugins import Eligible, Placement
from router.errors import BadRequest, Failure, NoHealthyBackend, RouterError, TargetsUnmet
from router.headers import pinned_pool
from router.health import no_backend
from router.metrics import Metrics
from router.observe import OK, Attempt, finished
from router.policy import Decision
from router.pools import Backend, Lease, Pools
from router.prefix import prompt_of
from router.settings import DEFAULT_SLO_TIERS
from router.slo import targets_of, tier_label
from router.streaming import Usage

# Seconds a shed request is told to wait (Retry-After): a place frees whenever any request on a full backend ends.
RETRY_AFTER_S = 1


def endpoint_of(url: str) -> str:
    """A backend URL as the protocol names an endpoint: `ip:port`."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Request:
    """What the picker reads of one request: its body (None: a request without one), the pin header's value
    and the data plane's subset hint (None: no hint; a list, maybe empty, restricts the choice)."""

    body: bytes | None
    pinned: str | None = None
    subset: list[str] | None = None
    slo_ttft: str | None = None  # the x-slo-ttft-ms / x-slo-tpot-ms headers' values (router.slo)
    slo_tpot: str | None = None


class Pick:
    """One request's picked endpoints and the lease on the first; end() ends the lease exactly once."""

    __slots__ = ("pools", "lease", "endpoints", "placement", "head", "inflight_at_start", "t0", "ttft", "chunks",
                 "data_events", "usage", "_ended", "targets", "forecast", "metrics")

    def __init__(self, pools: Pools, lease: Lease, endpoints: list[str], placement=None,
                 head: Head | None = None, targets=None, forecast=None, metrics: Metrics | None = None) -> None:
        self.pools = pools
        # Latency targets (router.core.latency.Targets) and the picked endpoint's prediction (Forecast): None
        # without targets; counted at the end in `metrics`.
        self.targets = targets
        self.forecast = forecast
        self.metrics = metrics
        self.head = head  # the body's stream keys (None: no body, or read and let go by the server)
        self.lease = lease
        self.endpoints = endpoints
        self.placement = placement  # router.core.plugins.Placement, None when prefix routing is off
        self.inflight_at_start = lease.backend.inflight
        self.t0 = time.monotonic()
        self.ttft: float | None = None
        self.chunks = 0
        self.data_events = 0
        self.usage = Usage()
        self._ended = False

    @property
    def pool(self) -> str:
        return self.lease.backend.pool

    @property
    def url(self) -> str:
        return self.lease.backend.url

    @property
    def ended(self) -> bool:
        return self._ended

    def served(self, endpoint: str) -> None:
        """The data plane says which endpoint answered: a fallback's answer moves the lease there."""
        if self._ended or endpoint == self.endpoints[0]:
            return
        b = _by_endpoint(self.pools).get(endpoint)
        if b is None or b is self.lease.backend:
            return
        # Nothing was observed on the first backend: its lease ends without an observation (as a retry's).
        tpot = self.lease.tpot_target
        self.lease.finish(None)
        self.lease = b.lease().hold_target(tpot)
        self.inflight_at_start = b.inflight

    def answered(self, status: int, failure: Failure | None = None) -> None:
        """The response's status: a 5xx counts towards the backend's ejection (outlier detection), as in serve.
        `failure`: the data plane answered itself because the attempt failed (refused, timed out, reset)."""
        if not self._ended:
            self.pools.report_attempt(self.lease.backend, Attempt(failure) if failure else Attempt(OK, status))

    def sent(self) -> None:
        """The request went to the backend without a stream to watch: it runs from now."""
        if not self._ended:
            self.lease.start()

    def answering(self) -> None:
        """The answer's headers came and no first token will be seen (the picker does not read the body): the
        request runs from now and the prefill it queued is over."""
        if not self._ended:
            self.lease.prefilled()

    def chunk(self, data_events: int) -> None:
        """A streamed chunk came; the first one is the first token."""
        if self._ended:
            return
        if self.ttft is None:
            self.ttft = time.monotonic() - self.t0
            self.lease.prefilled()
        self.chunks += 1
        self.data_events += data_events

    def end(self, ok: bool) -> None:
        """The backend's part is over (answered, failed, or the stream was reset): the lease ends with what was
        observed (Lease.finish: reported, then released), once."""
        if self._ended:
            return
        self._ended = True
        lease = self.lease
        obs = finished(lease, self.usage, inflight_at_start=self.inflight_at_start, t0=self.t0, ttft=self.ttft,
                       chunks=self.chunks, ok=ok, data_events=self.data_events)
        lease.finish(obs, self.pools, self.placement)
        if self.targets is not None and self.forecast is not None and self.metrics is not None:
            self.metrics.slo_done(tier_label(self.targets), self.targets, self.forecast, obs)


def _by_endpoint(pools: Pools) -> dict[str, Backend]:
    return {endpoint_of(b.url): b for b in pools.backends}


class Overloaded(RouterError):
    """Every backend the request may go to holds max_connections_per_backend requests. serve would queue it in
    the router; the data plane has no such queue (it would pile the request onto a full backend), so the picker
    sheds it: 429 with Retry-After, the client's cue to come back."""

    status, type, code = 429, "rate_limit_error", "backends_at_capacity"
    retry_after_s = RETRY_AFTER_S


class Decider:
    """Decisions over the router's pools; `endpoints`: how many to name (the first holds the lease);
    `max_per_backend`: requests one backend may hold (serve's max_connections_per_backend; above on every
    candidate, the request is shed); `metrics`: where decisions are counted (router_route_decisions_total)."""

    def __init__(self, pools: Pools, *, block_bytes: int, endpoints: int = 1, max_per_backend: int | None = None,
                 metrics: Metrics | None = None, slo_tiers=None) -> None:
        self.pools = pools
        self.slo_tiers = DEFAULT_SLO_TIERS if slo_tiers is None else slo_tiers  # service_tier -> SloTier
        self.block_bytes = block_bytes
        self.endpoints = endpoints
        self.max_per_backend = max_per_backend
        self.metrics = metrics

    def _has_room(self, b: Backend, leased: bool = False) -> bool:
        """`b` may take one more request (`leased`: the request's own lease on it is taken already)."""
        return self.max_per_backend is None or b.inflight - leased < self.max_per_backend

    def decide(self, req: Request) -> Pick | RouterError:
        """The pick with its lease taken, or the error to answer with (400 unparsable or a bad latency target, 503
        nothing ready, 429 every candidate full or the targets of a sheddable request unmet)."""
        try:
            pinned = pinned_pool(req.pinned)
            prompt = head = None
            if req.body is not None:
                head = parse_head(req.body)
            targets = targets_of(req.slo_ttft, req.slo_tpot, None if head is None else head.service_tier,
                                 self.slo_tiers)
            if head is not None and (self.pools.affinity is not None or targets is not None):
                prompt = prompt_of(head.messages, head.prompt, self.block_bytes)
        except BadRequest as err:
            return err
        pools = self.pools
        allowed = None
        if req.subset is not None:
            by_ep = _by_endpoint(pools)
            allowed = [by_ep[e] for e in dict.fromkeys(req.subset) if e in by_ep and by_ep[e].routable]
            if not allowed:
                return NoHealthyBackend(f"no ready endpoint in the subset hint ({len(req.subset)} named)")
        only = None
        cap = self.max_per_backend
        cands = allowed if allowed is not None else pools.backends
        # The hint and the cap narrow the endpoints before the one decision (router.core), never after it. With no
        # hint and no backend at the cap there is nothing to narrow: one pass, no set built (O(backends) work
        # per decision that showed at 256 backends: docs/BENCH.md).
        if allowed is not None or (cap is not None and any(b.inflight >= cap for b in cands)):
            room = [b for b in cands if b.routable and self._has_room(b)]
            if not room:
                if not any(b.routable for b in pools.backends):
                    return no_backend(pools.backends)
                return Overloaded(f"every backend holds {self.max_per_backend} requests "
                                  "(max_connections_per_backend); retry later")
            only = Eligible(frozenset(b.url for b in room))
        got = pools.place(pinned, prompt, only) if targets is None else pools.choose(pinned, prompt, only, targets)
        if got is None:
            return no_backend(pools.backends)
        if isinstance(got, Shed):
            assert targets is not None
            if self.metrics is not None:
                self.metrics.slo_shed(tier_label(targets))
            return TargetsUnmet(f"no endpoint can meet the latency targets now (predicted TTFT "
                                f"{got.forecast.ttft_s * 1000:.0f} ms, TPOT {got.forecast.tpot_s * 1000:.1f} ms at "
                                f"best); retry after {got.retry_after_s} s", retry_after_s=got.retry_after_s)
        lease, decision, placement, forecast = got if len(got) == 4 else (*got, None)
        self._count(decision, placement)
        first = lease.backend
        endpoints = [endpoint_of(first.url)]
        if self.endpoints > 1:
            # Fallbacks: the other routable backends with room (within the hint), same pool first, least loaded
            # first (nsmallest: sorted's order, without sorting them all).
            rest = heapq.nsmallest(self.endpoints - 1, (b for b in cands if b is not first and b.routable
                                                        and self._has_room(b)),
                                   key=lambda b: (b.pool != first.pool, b.load_estimate))
            endpoints += [endpoint_of(b.url) for b in rest]
        return Pick(pools, lease, endpoints, placement, head, targets, forecast, self.metrics)

    def _count(self, decision: Decision, placement: Placement | None) -> None:
        """The decision's metrics, as serve counts them (router.exchange.proxy)."""
        if self.metrics is not None:
            self.metrics.decided(decision, placement)
