"""The one decision: a snapshot, the filters, the pool policy's proposal, the prefix scorer, the picker; for a request
with latency targets, the latency predictor's choice in place of the proposal and the picker."""
from __future__ import annotations

import random
from collections.abc import Iterable

from router.core.latency import Latency, Shed, Targets
from router.core.plugins import Choice, Filter, Picker, Pinned, PinnedPool, Placement, Scorer
from router.core.snapshot import Snapshot
from router.policy import ONLY, POOL_CHOICE, Decision, Policy, View, other
from router.prefix import Prompt


class Scheduler:
    """Runs one decision with no await in it. The pool policy proposes a pool (and an instance, with the reason);
    with prefix routing on and a prompt, the prefix scorer prices the candidates and the picker chooses once.
    `prefix`: the scorer (router.affinity.Affinity), None when prefix routing is off. `latency`: the latency
    predictor (router.core.latency.Latency): a request with targets is placed by it alone (the pool policy and the
    picker are not asked); one without is kept off endpoints that its load would push past the TPOT targets of
    the targeted requests they run (a no-op while none runs). None: targets are ignored."""

    def __init__(self, policy: Policy, prefix: Scorer | None = None, filters: tuple[Filter, ...] = (PinnedPool(),),
                 picker: Picker | None = None, latency: Latency | None = None) -> None:
        self.policy = policy
        self.prefix = prefix
        self.filters = filters
        self.picker = picker or Picker()
        self.latency = latency

    def snapshot(self, backends: Iterable, pinned: str | None = None, prompt: Prompt | None = None,
                 targets: Targets | None = None) -> Snapshot:
        match = None if self.prefix is None else self.prefix.match
        return Snapshot.take(backends, pinned, prompt, match, targets)

    def decide(self, snap: Snapshot, rng: random.Random, only: Filter | None = None) -> Choice | Shed | None:
        """The choice for one request; None when no endpoint is routable; Shed when the request has targets no
        endpoint can meet and may be shed. Its decision names the live backend. `only`: the caller's own filter
        (plugins.Eligible), applied before the scheduler's."""
        for f in (self.filters if only is None else (only, *self.filters)):
            snap = f.filter(snap)
        if self.latency is not None:
            t = snap.targets
            if t is not None and (t.ttft_s is not None or t.tpot_s is not None):
                got = self.latency.choose(snap, self.policy, rng, self.prefix)
                if isinstance(got, Choice):
                    d = got.decision
                    return Choice(Decision(getattr(d.backend, "live", d.backend), d.reason), got.placement,
                                  got.forecast)
                return got
            snap = self.latency.keep_light(snap, self.policy)
        if snap.pinned is not None:
            proposal = Pinned(snap.pinned).decide(snap.view, rng)
        else:
            proposal = self.policy.decide(snap.view, rng)
            if proposal is not None and proposal.reason in POOL_CHOICE and not snap.view.pool(other(proposal.pool)):
                # One configured pool: a "threshold" or "failover" reason would name a choice that was never made.
                proposal = Decision(proposal.backend, ONLY)
        if proposal is None:
            return None
        if self.prefix is None or snap.prompt is None:
            choice = Choice(proposal, None)
        else:
            choice = self.picker.pick(proposal, self.prefix.score(snap, proposal), rng)
        d = choice.decision
        return Choice(Decision(getattr(d.backend, "live", d.backend), d.reason), choice.placement)


__all__ = ["Choice", "Placement", "Scheduler", "Shed", "Targets"]


def decide(policy: Policy, view: View, pinned: str | None, rng: random.Random) -> Decision | None:
    """Choose a backend for a new request without prefix scoring (tests and replays of a bare policy); None when no
    backend at all is healthy. A pinned pool (the X-Router-Pool header) wins over every policy."""
    sched = Scheduler(policy)
    got = sched.decide(sched.snapshot(view.backends, pinned), rng)
    return None if got is None else got.decision
