"""The pool policy interface (one small object per policy, router/policies/ and router.adaptive), the reasons a
decision gives (metric label values), and the helpers the policies share; a snapshot in, a proposal out; no I/O."""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.observe import LoadFigures, Observation


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
GAIN = "marginal_gain"
EXPLORE = "explore"
ONLY = "only_pool"  # only one pool is configured: there was no choice between pools to explain
POOL_CHOICE = frozenset((BELOW, ABOVE, FAILOVER, FASTER, GAIN))  # reasons that explain a choice between pools

# Why the prefix scorer's instance (or pool) was chosen (router_prefix_decisions_total's reason label); the
# prompt kinds with nothing to match are router.prefix's.
AFFINITY = "prefix_affinity"  # an instance holding more of the prompt than the least loaded one won
LOAD_OVERRIDE = "load_override"  # one held more of it, but its load cost more than the prefill it saves
NO_MATCH = "no_match"  # no instance holds any of it: by load
SINGLE = "single"  # one routable instance: nothing to choose
POOL_KEPT = "pool_kept"  # the policy's pool lost to the pool holding the prefix: the re-prefill outweighed the gain
POOL_MOVED = "pool_moved"  # the policy's pool won although the other held the prefix: the gain beat the re-prefill


class BackendView(Protocol):
    """What a policy reads of a backend: a decision's snapshot of it (router.core.snapshot.Endpoint), the live
    router.pools.Backend (state()), or a BackendLoad (tests)."""

    url: str
    pool: str

    @property
    def routable(self) -> bool: ...  # healthy per the probes and not ejected (router.outlier)

    @property
    def load_estimate(self) -> int: ...


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """A fixed backend snapshot, for tables and models: `inflight` is the load the policy sees."""

    url: str
    pool: str
    inflight: int
    healthy: bool
    pending_tokens: int = 0  # router.pools.Backend's: uncached prompt tokens of its leases (prefix affinity)
    generation: int = 0

    @property
    def routable(self) -> bool:
        return self.healthy

    @property
    def load_estimate(self) -> int:
        return self.inflight


@dataclass(frozen=True, slots=True)
class View:
    """The backends a policy chooses from, grouped by pool once."""

    backends: tuple[BackendView, ...]
    speculative: tuple[BackendView, ...]
    baseline: tuple[BackendView, ...]

    @classmethod
    def of(cls, backends: Iterable[BackendView]) -> View:
        bs = tuple(backends)
        return cls(bs, tuple(b for b in bs if b.pool == SPECULATIVE), tuple(b for b in bs if b.pool == BASELINE))

    def pool(self, name: str) -> tuple[BackendView, ...]:
        return self.speculative if name == SPECULATIVE else self.baseline


@dataclass(frozen=True, slots=True)
class Decision:
    backend: BackendView
    reason: str

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def pool(self) -> str:
        return self.backend.pool


class Policy(Protocol):
    """One routing policy. decide() is called with no await around it, so counts are exact; a policy may keep
    state between calls (a mode, a cursor, a learned model) but does no I/O. What it learns comes in through
    observe() (each finished exchange) and observe_loads() (each /v1/loads answer); what observe() leaves to do
    (a refit too big to hold the event loop for) learn() does, a step at a time (router.learner); state() is what
    it shows of itself (/router/state, and the router_adaptive_* gauges read its "pools" section), None when
    nothing."""

    name: str

    def decide(self, view: View, rng: random.Random) -> Decision | None: ...

    def observe(self, obs: Observation) -> None: ...

    def observe_loads(self, url: str, pool: str, figs: LoadFigures) -> None: ...

    def learn(self, work: int | None = None) -> bool: ...

    def state(self, view: View) -> dict | None: ...


class Fixed:
    """The learning hooks of a policy that learns nothing: observations are dropped, there is no state to show."""

    def observe(self, obs: Observation) -> None:
        return None

    def observe_loads(self, url: str, pool: str, figs: LoadFigures) -> None:
        return None

    def learn(self, work: int | None = None) -> bool:
        return False

    def state(self, view: View) -> dict | None:
        return None


def other(pool: str) -> str:
    return BASELINE if pool == SPECULATIVE else SPECULATIVE


def healthy(backends: Sequence[BackendView]) -> list[BackendView]:
    return [b for b in backends if b.routable]


def least(cands: Sequence[BackendView], rng: random.Random) -> BackendView:
    if len(cands) == 1:
        return cands[0]
    low = min(b.load_estimate for b in cands)
    # Random among equals: a fixed tie-break would pile every idle moment onto the first backend.
    return rng.choice([b for b in cands if b.load_estimate == low])


def in_pool(view: View, pool: str, reason: str, rng: random.Random) -> Decision | None:
    """Least loaded within `pool`; if it has no healthy backend, the other pool serves (failover)."""
    cands = healthy(view.pool(pool))
    if cands:
        return Decision(least(cands, rng), reason)
    cands = healthy(view.pool(other(pool)))
    if cands:
        return Decision(least(cands, rng), FAILOVER)
    return None


def sole_pool(view: View, spec_up: bool, rng: random.Random, reason: str) -> Decision | None:
    """When at most one pool can serve: failover if the other is configured but down, else `reason`
    (it is the only choice)."""
    pool = SPECULATIVE if spec_up else BASELINE
    return in_pool(view, pool, FAILOVER if view.pool(other(pool)) else reason, rng)


def decide(policy: Policy, view: View, pinned: str | None, rng: random.Random) -> Decision | None:
    """Choose a backend for a new request (router.core.scheduler, no prefix); None when no backend at all is
    healthy. A pinned pool (the X-Router-Pool header) wins over every policy."""
    from router.core.scheduler import Scheduler

    sched = Scheduler(policy)
    got = sched.decide(sched.snapshot(view.backends, pinned), rng)
    return None if got is None else got.decision


def retry_target(view: View, failed_url: str, failed_pool: str, rng: random.Random) -> BackendView | None:
    """Another backend for a retry: the same pool if it has another healthy one, else the other pool."""
    for pool in (failed_pool, other(failed_pool)):
        cands = [b for b in view.pool(pool) if b.routable and b.url != failed_url]
        if cands:
            return least(cands, rng)
    return None
