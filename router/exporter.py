"""Binds the router_* metrics (declared in router.metrics) to the live core objects: backends, pools, connection
limits and the policy's state(). The core modules (pools, policy, exchange's lease) import no Prometheus."""
from __future__ import annotations

from router.affinity import REASONS
from router.metrics import Metrics
from router.policy import POOLS
from router.pools import EJECT_REASONS, IN_ROTATION, STATES, Backend, PoolEvents, Pools
from router.upstream import Limits


class PoolGauges(PoolEvents):
    """The pools' listener: per-backend gauges read live values at scrape time (they cannot drift from the
    counts); a backend gone for good loses its gauges (they would report its last value for ever), counters
    keep their history."""

    def __init__(self, metrics: Metrics, limits: Limits | None, affinity=None) -> None:
        self.m = metrics
        self.limits = limits
        self.affinity = affinity

    def joined(self, b: Backend) -> None:
        m = self.m
        m.inflight.labels(b.pool, b.url).set_function(lambda b=b: b.inflight)
        m.backend_up.labels(b.pool, b.url).set_function(lambda b=b: 1.0 if b.state() in IN_ROTATION else 0.0)
        for state in STATES:
            m.backend_state.labels(b.pool, b.url, state).set_function(
                lambda b=b, state=state: 1.0 if b.state() == state else 0.0)
        for reason in EJECT_REASONS:
            m.ejections.labels(b.pool, b.url, reason)
        if self.affinity is not None:
            aff = self.affinity
            m.prefix_blocks.labels(b.pool, b.url).set_function(lambda u=b.url: aff.index.size(u))

    def limited(self, b: Backend) -> None:
        """`b` has its place in the connection limits (router.upstream.Limits): show the requests waiting there."""
        if self.limits is not None:
            limits = self.limits
            self.m.upstream_waiting.labels(b.pool, b.url).set_function(lambda u=b.url: limits.waiting[u])

    def left(self, b: Backend) -> None:
        m = self.m
        for gauge in (m.inflight, m.backend_up, m.reported_load, m.upstream_waiting, m.prefix_blocks):
            try:
                gauge.remove(b.pool, b.url)
            except KeyError:
                pass
        for state in STATES:
            try:
                m.backend_state.remove(b.pool, b.url, state)
            except KeyError:
                pass

    def ejected(self, b: Backend, reason: str) -> None:
        self.m.ejections.labels(b.pool, b.url, reason).inc()


def bind(metrics: Metrics, pools: Pools, limits: Limits | None = None) -> PoolGauges:
    """Bind every gauge that reads the pools (and, given, the connection limits); from then on the pools report
    joins, leaves and ejections to the returned listener."""
    events = PoolGauges(metrics, limits, pools.affinity)
    for b in pools.backends:
        events.joined(b)
        events.limited(b)
    metrics.threshold.set(pools.threshold)
    for pool in POOLS:
        metrics.backends.labels(pool).set_function(lambda pool=pool: sum(b.pool == pool for b in pools.backends))
        metrics.duration.labels(pool)
        metrics.disconnects.labels(pool)
        # The cache shares' series exist from the start (at 0), so their panels show 0 rather than no data.
        for c in (metrics.prefix_prompt_tokens, metrics.prefix_expected_cached, metrics.cached_tokens,
                  metrics.cache_reported_prompt_tokens):
            c.labels(pool)
        if pools.affinity is not None:
            for reason in REASONS:
                metrics.prefix_decisions.labels(pool, reason)
    # Read at scrape time through the pools, so a policy swapped in or members changed are followed.
    metrics.policy_gauges.read = lambda: pools.policy.state(pools.view)
    pools.events = events
    return events
