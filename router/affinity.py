"""Prefix affinity: applied to every policy's decision at the pools' decision point, it picks the instance by
expected time to first token (load plus the prefill of what the instance does not hold) and keeps a
conversation in the pool that holds its prefix unless moving gains more than the re-prefill costs."""
from __future__ import annotations

import random
from dataclasses import dataclass

from router.observe import LoadFigures, Observation
from router.policy import FAILOVER, PINNED, BackendView, Decision, View, healthy
from router.prefix import BLOCK_BYTES, IMAGE, NO_TEXT, TEXT, TOKEN_IDS, PrefixIndex, Prompt

# Why the instance (or pool) was chosen, a closed set (router_prefix_decisions_total's reason label).
AFFINITY = "prefix_affinity"  # an instance holding more of the prompt than the least loaded one won
LOAD_OVERRIDE = "load_override"  # one held more of it, but its load cost more than the prefill it saves
NO_MATCH = "no_match"  # no instance holds any of it: by load
SINGLE = "single"  # one routable instance: nothing to choose
POOL_KEPT = "pool_kept"  # the policy would have switched pools; the re-prefill outweighed the gain
POOL_MOVED = "pool_moved"  # it switched pools although the other held the prefix: the gain beat the re-prefill
REASONS = (AFFINITY, LOAD_OVERRIDE, NO_MATCH, SINGLE, POOL_KEPT, POOL_MOVED, NO_TEXT, IMAGE, TOKEN_IDS)

# Cold-start figures, replaced by what the backends' own answers measure (named assumptions, docs/ROUTER.md):
PRIOR_BYTES_PER_TOKEN = 4.0  # English through a BPE tokenizer, JSON quoting included
PRIOR_PREFILL_S_PER_TOKEN = 1e-4  # 10k prompt tokens/s
PRIOR_WAIT_S_PER_REQUEST = 0.01  # TTFT added by each request already on the instance beyond its prefill (decode
# steps it shares): a named assumption, not learned (learning it from the residual let the prefill term absorb
# every second of queueing and load fall out of the rule: docs/ROUTER.md "Affinity")
PRIOR_TPOT_S = 0.02  # seconds per output token
PRIOR_OUTPUT_TOKENS = 256.0
EWMA = 0.05  # weight of each new sample (about the last 20 count)
LOST_POLLS = 3  # polls in a row with cache_hit_rate 0, after it was above 0, that mean the cache was lost
MAX_LOAD_TERM_S = 3600.0


@dataclass(slots=True)
class PoolCosts:
    """What one pool's answers measured, each an EWMA from a prior."""

    prefill_s: float = PRIOR_PREFILL_S_PER_TOKEN  # seconds per uncached prompt token
    wait_s: float = PRIOR_WAIT_S_PER_REQUEST  # seconds of TTFT per request in flight ahead
    tpot_s: float = PRIOR_TPOT_S
    samples: int = 0
    tpot_samples: int = 0


@dataclass(slots=True)
class Placement:
    """What the affinity decided for one request: the reason, and the tokens it expects cached there."""

    reason: str
    prompt: Prompt
    expected_cached: int = 0  # tokens
    prompt_tokens: int = 0  # the router's estimate from the prompt's bytes
    depth: int = 0  # blocks the chosen backend holds
    pending_ahead: int = 0
    sends: int = 0  # backends it was sent to: 1, or more after a retry  # uncached tokens already in flight on the last of them when it was sent


def _ewma(old: float, new: float) -> float:
    return old + EWMA * (new - old)


class Affinity:
    """The prefix index and the cost model over it. `cross_pool` off: only the instance inside the policy's
    pool is chosen. No I/O, no await: called between the policy's decision and the lease."""

    def __init__(self, *, block_bytes: int = BLOCK_BYTES, capacity_tokens: int = 1_000_000,
                 cross_pool: bool = True, max_running: int | None = None) -> None:
        self.block_bytes = block_bytes
        self.capacity_tokens = capacity_tokens
        self.cross_pool = cross_pool
        self.max_running_default = max_running
        self.bytes_per_token = PRIOR_BYTES_PER_TOKEN
        self.output_tokens = PRIOR_OUTPUT_TOKENS
        self.index = PrefixIndex(self._blocks(capacity_tokens))
        self.pools: dict[str, PoolCosts] = {}
        self.kv: dict[str, int] = {}  # max_total_num_tokens each backend reported
        self.max_running: dict[str, int] = {}
        self.hit_seen: dict[str, bool] = {}
        self.zero_polls: dict[str, int] = {}
        self.forgotten = 0

    def _blocks(self, tokens: int) -> int:
        return max(2, int(tokens * self.bytes_per_token / self.block_bytes))

    def costs(self, pool: str) -> PoolCosts:
        c = self.pools.get(pool)
        if c is None:
            c = self.pools[pool] = PoolCosts()
        return c

    # ---- the decision
    def tokens(self, blocks: int) -> int:
        return int(blocks * self.block_bytes / self.bytes_per_token)

    def duplicate(self, pool: str, prompt_tokens: int, held: int, depth: int) -> float:
        """The second price of copying `held` tokens another instance has onto one holding `depth` blocks."""
        return self.costs(pool).prefill_s * max(0, min(held, prompt_tokens) - self.tokens(depth))

    def best(self, cands: list[BackendView], prompt: Prompt, ptok: int, rng: random.Random
             ) -> tuple[BackendView, float, int, str]:
        """The instance of `cands` with the least expected TTFT, its TTFT, its depth and the reason."""
        blocks = prompt.blocks
        depths = []
        for b in cands:
            idx = self.index.peek(b.url, getattr(b, "generation", 0))
            depths.append(idx.depth(blocks) if idx is not None and blocks else 0)
        k = self.block_bytes / self.bytes_per_token  # tokens per block
        held = min(ptok, int(max(depths) * k))
        c = self.costs(cands[0].pool)  # candidates share one pool
        p, w, slot_s = c.prefill_s, c.wait_s, c.tpot_s * self.output_tokens
        limits, default_limit = self.max_running, self.max_running_default
        scored = []
        for b, d in zip(cands, depths, strict=True):
            # Expected TTFT: the prefill queued there (the uncached prompt tokens of this router's requests with
            # no first token yet, counted by their leases, router.pools) and a small cost per request it runs,
            # a queue for a slot beyond max_running (a slot frees every request time / limit), then the prefill
            # of what it does not hold. Plus a copy of what another instance holds priced twice: prefilled now,
            # and stored in place of as many cached tokens of other conversations there (a full cache evicts
            # them: their next turn re-prefills). One pass: the hot path's share of a decision.
            load = b.load_estimate
            wait = w * load + p * getattr(b, "pending_tokens", 0)
            limit = limits.get(b.url, default_limit)
            if limit is not None and load >= limit:
                wait += (load - limit + 1) * slot_s / limit
            have = int(d * k)
            scored.append((min(wait, MAX_LOAD_TERM_S) + p * (max(0, ptok - have) + max(0, held - have)), d, b))
        low = min(s[0] for s in scored)
        ties = [s for s in scored if s[0] <= low * (1 + 1e-9)]
        if len(ties) > 1:  # equal now: the one holding more keeps it for the next turn too
            most = max(s[1] for s in ties)
            ties = [s for s in ties if s[1] == most]
        t, d, b = ties[0] if len(ties) == 1 else rng.choice(ties)
        if len(cands) == 1:
            return b, t, d, SINGLE
        deepest = max(s[1] for s in scored)
        if deepest == 0:
            return b, t, d, NO_MATCH
        return b, t, d, AFFINITY if d == deepest else LOAD_OVERRIDE

    def place(self, d: Decision, view: View, prompt: Prompt, rng: random.Random) -> tuple[Decision, Placement]:
        """Adjust the policy's decision `d` for this prompt (see the module line)."""
        ptok = int(prompt.nbytes / self.bytes_per_token)
        if not prompt.hashed:
            # Shorter than a block: nothing to match, but its size still estimates its prefill (router.adaptive).
            return d, Placement(prompt.kind if prompt.kind != TEXT else NO_MATCH, prompt,
                                prompt_tokens=ptok if prompt.kind == TEXT else 0)
        pool = d.pool
        cands = healthy(view.pool(pool)) or [d.backend]
        b, t, depth, reason = self.best(cands, prompt, ptok, rng)
        out = Decision(b, d.reason)
        if self.cross_pool and d.reason not in (PINNED, FAILOVER):
            other = healthy(view.pool("baseline" if pool == "speculative" else "speculative"))
            if other:
                ob, ot, odepth, oreason = self.best(other, prompt, ptok, rng)
                if odepth > depth:
                    # The policy left the pool that holds more of the prompt: stay unless the switch gains
                    # more (decode at the chosen pool's measured speed) than the prefill it throws away.
                    here = (t + self.output_tokens * self.costs(pool).tpot_s
                            + self.duplicate(pool, ptok, self.tokens(odepth), depth))
                    there = ot + self.output_tokens * self.costs(ob.pool).tpot_s
                    if there < here and self._known(pool, ob.pool):
                        out, depth, reason = Decision(ob, AFFINITY), odepth, POOL_KEPT
                    else:
                        reason = POOL_MOVED
        cached = min(ptok, self.tokens(depth))
        return out, Placement(reason, prompt, cached, ptok, depth)

    def _known(self, a: str, b: str) -> bool:
        # Both pools' decode speeds measured: before that, the policy's choice of pool stands.
        return self.costs(a).tpot_samples > 0 and self.costs(b).tpot_samples > 0

    def sent(self, b: BackendView, placement: Placement) -> int:
        """The request goes to `b` (a retry included): it will hold the prompt's blocks. Returns the uncached
        tokens it brings there, for its lease to count until released."""
        if not placement.prompt.hashed:
            return 0
        idx = self.index.of(b.url, getattr(b, "generation", 0), self.capacity_of(b.url))
        # the decision's own backend: what place() found it holds; a retry's: looked up
        held = placement.expected_cached if not placement.sends else min(
            placement.prompt_tokens, self.tokens(idx.depth(placement.prompt.blocks)))
        placement.sends += 1
        uncached = max(0, placement.prompt_tokens - held)
        placement.pending_ahead = getattr(b, "pending_tokens", 0)
        idx.insert(placement.prompt.blocks)
        return uncached

    # ---- learning (report_done / report_loads)
    def observe(self, obs: Observation, placement: Placement | None, generation: int = 0) -> None:
        tokens = obs.tokens()
        if tokens and obs.ok:
            self.output_tokens = _ewma(self.output_tokens, float(tokens))
        if placement is None or not obs.ok:
            return
        p = obs.prompt_tokens
        if p and placement.prompt.nbytes and placement.prompt.hashed:
            self.bytes_per_token = min(16.0, max(1.0, _ewma(self.bytes_per_token, placement.prompt.nbytes / p)))
        c = self.costs(obs.pool)
        cached = obs.cached_tokens if obs.cached_tokens is not None else placement.expected_cached
        if obs.cached_tokens is not None and placement.prompt.hashed:
            idx = self.index.peek(obs.url, generation)
            held = int(obs.cached_tokens * self.bytes_per_token / self.block_bytes)
            if idx is not None and held < placement.depth - 1:
                # It held less than the index said (evicted, restarted): forget what it no longer has.
                idx.truncate(placement.prompt.blocks, held)
        if obs.ttft_s is not None and p:
            # TTFT = prefill_s x (its uncached tokens + the uncached tokens in flight ahead of it) + wait_s x the
            # requests ahead: one learned rate, so queueing raises the price of load and of a re-prefill alike.
            uncached = max(1, p - cached) + placement.pending_ahead
            ahead = max(0, obs.inflight_at_start - 1)
            wait = c.wait_s * ahead
            c.prefill_s = max(1e-7, _ewma(c.prefill_s, max(0.0, obs.ttft_s - wait) / uncached))
            c.samples += 1
        if obs.ttft_s is not None and tokens and tokens > 1:
            c.tpot_s = _ewma(c.tpot_s, (obs.duration_s - obs.ttft_s) / (tokens - 1))
            c.tpot_samples += 1

    def observe_loads(self, url: str, figs: LoadFigures) -> None:
        if figs.max_running:
            self.max_running[url] = figs.max_running
        if figs.max_total_tokens and self.kv.get(url) != figs.max_total_tokens:
            self.kv[url] = figs.max_total_tokens
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
        return self._blocks(self.kv.get(url, self.capacity_tokens))

    def forget(self, url: str) -> None:
        if url in self.index.by_url:
            self.forgotten += 1
        self.index.forget(url)
        self.hit_seen.pop(url, None)
        self.zero_polls.pop(url, None)

    def state(self) -> dict:
        return {"block_bytes": self.block_bytes, "bytes_per_token": round(self.bytes_per_token, 3),
                "output_tokens": round(self.output_tokens, 1), "cross_pool": self.cross_pool,
                "forgotten": self.forgotten,
                "pools": {p: {"prefill_s_per_token": c.prefill_s, "wait_s_per_request": c.wait_s,
                              "tpot_s": c.tpot_s, "samples": c.samples} for p, c in self.pools.items()}}
