"""One decision's view of the endpoints: taken once, read by every filter, scorer and the picker, never live."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.policy import View
from router.prefix import Prompt

if TYPE_CHECKING:
    from router.core.latency import Targets


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One backend as a decision sees it (router.policy.BackendView): its figures when the snapshot was taken, and
    the live backend the lease is taken on."""

    url: str
    pool: str
    routable: bool  # healthy per the probes and not ejected (router.outlier)
    load_estimate: int  # in flight here, or the backend's own report plus what was sent since
    pending_tokens: int  # uncached prompt tokens of its leases with no first token yet (prefix affinity)
    generation: int  # times it went down: what it held before is not assumed after
    live: object = field(compare=False, repr=False)
    # The tightest TPOT target (seconds) of the targeted requests it runs now (router.core.latency keeps it light
    # enough for them); None: it runs none.
    tpot_bound_s: float | None = None

    @classmethod
    def of(cls, b) -> Endpoint:
        return cls(b.url, b.pool, b.routable, b.load_estimate, getattr(b, "pending_tokens", 0),
                   getattr(b, "generation", 0), b, getattr(b, "tpot_bound_s", None))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The endpoints grouped by pool (`view`), the request's pinned pool and prompt, how many of the prompt's
    blocks each endpoint holds (`depth`, by URL; empty when the prompt has no blocks or prefix routing is off), and
    the request's latency targets (None: it has none, and is routed as one without)."""

    view: View
    pinned: str | None = None
    prompt: Prompt | None = None
    depth: Mapping[str, int] = field(default_factory=dict)
    targets: Targets | None = None

    @classmethod
    def take(cls, backends: Iterable, pinned: str | None = None, prompt: Prompt | None = None,
             match=None, targets: Targets | None = None) -> Snapshot:
        """`match(endpoint, blocks) -> int`: the prefix index's depth for an endpoint (None: prefix routing off)."""
        eps = tuple(b if isinstance(b, Endpoint) else Endpoint.of(b) for b in backends)
        depth: dict[str, int] = {}
        if match is not None and prompt is not None and prompt.hashed:
            depth = {e.url: match(e, prompt.blocks) for e in eps}
        return cls(View.of(eps), pinned, prompt, depth, targets)

    def narrowed(self, endpoints: tuple) -> Snapshot:
        return Snapshot(View.of(endpoints), self.pinned, self.prompt, self.depth, self.targets)
