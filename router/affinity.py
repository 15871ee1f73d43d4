"""Prefix affinity as a scorer (router.core): it owns the prefix index of the prompts sent to each instance, prices
each candidate's expected time to first token (load plus the prefill of what the instance does not hold), and
gives the picker the terms that keep a conversation in the pool holding its prefix unless moving gains more than
the re-prefill costs. It never changes a decision: the picker (router.core.plugins.Picker) makes it once."""
from __future__ import annotations

from typing import TYPE_CHECKING

from router.core.figures import Figures
from router.core.plugins import Placement, PoolScores, Scored, Scores
from router.core.snapshot import Endpoint, Snapshot
from router.policy import (
    AFFINITY,
    FAILOVER,
    LOAD_OVERRIDE,
    NO_MATCH,
    PINNED,
    POOL_KEPT,
    POOL_MOVED,
    SINGLE,
    Decision,
    healthy,
    other,
)
from router.prefix import BLOCK_BYTES, IMAGE, NO_TEXT, TEXT, TOKEN_IDS, PrefixIndex, Prompt

if TYPE_CHECKING:
    from router.observe import LoadFigures, Observation

REASONS = (AFFINITY, LOAD_OVERRIDE, NO_MATCH, SINGLE, POOL_KEPT, POOL_MOVED, NO_TEXT, IMAGE, TOKEN_IDS)
LOST_POLLS = 3  # polls in a row with cache_hit_rate 0, after it was above 0, that mean the cache was lost


class Affinity:
    """The prefix index and the cost model over it; the learned figures it prices with are `figures` (one object,
    router.core.figures). `cross_pool` off: only the instances of the proposed pool are priced. No I/O."""

    def __init__(self, *, block_bytes: int = BLOCK_BYTES, capacity_tokens: int = 1_000_000,
                 cross_pool: bool = True, max_running: int | None = None, figures: Figures | None = None) -> None:
        self.block_bytes = block_bytes
        self.capacity_tokens = capacity_tokens
        self.cross_pool = cross_pool
        self.figures = figures if figures is not None else Figures(max_running)
        self.index = PrefixIndex(self._blocks(capacity_tokens))
        self.hit_seen: dict[str, bool] = {}
        self.zero_polls: dict[str, int] = {}
        self.forgotten = 0

    @property
    def bytes_per_token(self) -> float:
        return self.figures.bytes_per_token

    def _blocks(self, tokens: int) -> int:
        return max(2, int(tokens * self.figures.bytes_per_token / self.block_bytes))

    def tokens(self, blocks: int) -> int:
        return int(blocks * self.block_bytes / self.figures.bytes_per_token)

    # ---- the scoring
    def match(self, e: Endpoint, blocks: list[int]) -> int:
        """How many of the prompt's leading blocks `e` holds (the snapshot's prefix match)."""
        idx = self.index.peek(e.url, e.generation)
        return idx.depth(blocks) if idx is not None and blocks else 0

    def pool_scores(self, snap: Snapshot, cands: list, ptok: int) -> PoolScores:
        """Each candidate's expected TTFT (the candidates share one pool)."""
        fig = self.figures
        depths = [snap.depth.get(b.url, 0) for b in cands]
        k = self.block_bytes / fig.bytes_per_token  # tokens per block
        held = min(ptok, int(max(depths) * k))
        c = fig.costs(cands[0].pool)
        p = c.ttft_s_per_token
        scored = []
        for b, d in zip(cands, depths, strict=True):
            # Expected TTFT: the prefill queued there (the uncached prompt tokens of this router's requests with
            # no first token yet, counted by their leases, router.pools) and a small cost per request it runs,
            # a queue for a slot beyond max_running (Figures.queued_s), then the prefill of what it does not
            # hold. Plus a copy of what another instance holds priced twice: prefilled now, and stored in place
            # of as many cached tokens of other conversations there (a full cache evicts them: their next turn
            # re-prefills).
            have = int(d * k)
            scored.append(Scored(b, fig.queued_s(b) + p * (max(0, ptok - have) + max(0, held - have)), d))
        return PoolScores(cands[0].pool, tuple(scored), fig.output_tokens * c.tpot_s, c.ttft_s_per_token)

    def score(self, snap: Snapshot, proposal: Decision) -> Scores:
        """The prices of the proposed pool's instances and, when the request may move, of the other pool's."""
        prompt = snap.prompt
        ptok = int(prompt.nbytes / self.figures.bytes_per_token)
        if not prompt.hashed:
            # Shorter than a block: nothing to match, but its size still estimates its prefill (router.adaptive).
            return Scores(prompt, ptok if prompt.kind == TEXT else 0, prompt.kind if prompt.kind != TEXT else NO_MATCH)
        pool = proposal.pool
        home = self.pool_scores(snap, healthy(snap.view.pool(pool)) or [proposal.backend], ptok)
        away = None
        if self.cross_pool and proposal.reason not in (PINNED, FAILOVER):
            cands = healthy(snap.view.pool(other(pool)))
            if cands:
                away = self.pool_scores(snap, cands, ptok)
        return Scores(prompt, ptok, NO_MATCH, home, away, self.figures.known(pool, other(pool)),
                      self.block_bytes, self.figures.bytes_per_token)

    def sent(self, b, placement: Placement) -> int:
        """The request goes to `b` (a retry included): it will hold the prompt's blocks. Returns the uncached
        tokens it brings there, for its lease to count until released."""
        if not placement.prompt.hashed:
            return 0
        idx = self.index.of(b.url, getattr(b, "generation", 0), self.capacity_of(b.url))
        # the decision's own backend: what the picker found it holds; a retry's: looked up
        held = placement.expected_cached if not placement.sends else min(
            placement.prompt_tokens, self.tokens(idx.depth(placement.prompt.blocks)))
        placement.sends += 1
        uncached = max(0, placement.prompt_tokens - held)
        placement.pending_ahead = getattr(b, "pending_tokens", 0)
        idx.insert(placement.prompt.blocks)
        return uncached

    # ---- the index's upkeep (Pools.report_done / report_loads, after the figures)
    def observe(self, obs: Observation, placement: Placement | None, generation: int = 0) -> None:
        if placement is None or not obs.ok:
            return
        if obs.cached_tokens is not None and placement.prompt.hashed:
            idx = self.index.peek(obs.url, generation)
            held = int(obs.cached_tokens * self.figures.bytes_per_token / self.block_bytes)
            if idx is not None and held < placement.depth - 1:
                # It held less than the index said (evicted, restarted): forget what it no longer has.
                idx.truncate(placement.prompt.blocks, held)

    def observe_loads(self, url: str, figs: LoadFigures, resized: bool) -> None:
        """`resized`: the backend's KV capacity changed (Figures.observe_loads)."""
        if resized:
            idx = self.index.by_url.get(url)
            if idx is not None:
                idx.resize(self._blocks(figs.max_total_tokens))
        rate = figs.cache_hit_rate
        if rate is None:
            return
        if rate > 0:
            self.hit_seen[url] = True
            self.zero_polls[url] = 0
        elif self.hit_seen.get(url):
            n = self.zero_polls[url] = self.zero_polls.get(url, 0) + 1
            if n >= LOST_POLLS:
                self.forget(url)  # it had hits, now none on every poll: its cache was lost (a restart)

    def capacity_of(self, url: str) -> int:
        return self._blocks(self.figures.kv.get(url, self.capacity_tokens))

    def forget(self, url: str) -> None:
        if url in self.index.by_url:
            self.forgotten += 1
        self.index.forget(url)
        self.hit_seen.pop(url, None)
        self.zero_polls.pop(url, None)

    def state(self) -> dict:
        fig = self.figures.state()
        return {"block_bytes": self.block_bytes, "bytes_per_token": fig["bytes_per_token"],
                "output_tokens": fig["output_tokens"], "cross_pool": self.cross_pool,
                "forgotten": self.forgotten, "pools": fig["pools"]}


__all__ = ["REASONS", "Affinity", "Placement", "Prompt"]
