"""The learned per-backend and per-pool figures every scorer reads: one object, updated in one place (observe /
observe_loads, called once per event by router.pools.Pools), read by the prefix scorer (router.affinity) and the
adaptive policy (router.adaptive). Each figure has this one owner; the adaptive policy's own models measure other
things (a server's token time against its load, its idle prefill forward, a running limit inferred where none is
reported: router.estimator), named apart below."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.observe import LoadFigures, Observation


# Cold-start figures, replaced by what the backends' own answers measure (named assumptions, docs/ROUTER.md):
PRIOR_BYTES_PER_TOKEN = 4.0  # English through a BPE tokenizer, JSON quoting included
PRIOR_PREFILL_S_PER_TOKEN = 1e-4  # 10k prompt tokens/s
PRIOR_WAIT_S_PER_REQUEST = 0.01  # TTFT added by each request already on the instance beyond its prefill (decode
# steps it shares): a named assumption, not learned (learning it from the residual let the prefill term absorb
# every second of queueing and load fall out of the rule: docs/ROUTER.md "Cache-aware routing (prefix affinity)")
PRIOR_TPOT_S = 0.02  # seconds per output token
PRIOR_OUTPUT_TOKENS = 256.0
EWMA = 0.05  # weight of each new sample (about the last 20 count)
MAX_LOAD_TERM_S = 3600.0  # the queue term's cap: a queue beyond it says nothing more about the prefix
TPOT_FORGET = 0.98  # weight the TPOT line's past keeps at each sample (about the last 50 count)
TPOT_MIN_SPREAD = 0.25  # variance of the loads seen below which the line has no slope: their mean TPOT is used


@dataclass(slots=True)
class PoolCosts:
    """What one pool's answers measured, each an EWMA from a prior."""

    # Seconds of time to first token per uncached prompt token, queueing included (the tokens pending ahead count):
    # not router.speedmodel.PrefillModel, the adaptive policy's fit of the prefill forward alone (idle servers only).
    ttft_s_per_token: float = PRIOR_PREFILL_S_PER_TOKEN
    wait_s: float = PRIOR_WAIT_S_PER_REQUEST  # seconds of TTFT per request in flight ahead
    # Seconds per output token after the first, at whatever load it ran (not the adaptive speed models' per-request
    # token time against the load, whole duration included).
    tpot_s: float = PRIOR_TPOT_S
    samples: int = 0
    tpot_samples: int = 0


@dataclass(slots=True)
class TpotLine:
    """A pool's seconds per output token against the requests running beside (n, the time-weighted mean in flight
    of each stream): a least-squares line over forgetting sums, so it follows drift and costs O(1) per sample. A
    slope below 0 is taken as 0 (one more request running makes no request faster)."""

    w: float = 0.0
    sn: float = 0.0
    snn: float = 0.0
    sy: float = 0.0
    sny: float = 0.0

    def add(self, n: float, y: float) -> None:
        if not (math.isfinite(n) and math.isfinite(y) and y > 0):
            return
        f = TPOT_FORGET
        self.w = self.w * f + 1.0
        self.sn = self.sn * f + n
        self.snn = self.snn * f + n * n
        self.sy = self.sy * f + y
        self.sny = self.sny * f + n * y

    def at(self, n: float, cold: float) -> float:
        """Predicted seconds per token at n running; `cold` until a sample came (the prior is in real seconds: a
        first measured stream is nearer on any server)."""
        if self.w < 1.0:
            return cold
        mn, my = self.sn / self.w, self.sy / self.w
        var = self.snn / self.w - mn * mn
        if var < TPOT_MIN_SPREAD:
            return my
        slope = max(0.0, (self.sny / self.w - mn * my) / var)
        return max(1e-6, my + slope * (n - mn))


def _ewma(old: float, new: float) -> float:
    return old + EWMA * (new - old)


class Figures:
    """Per pool: TTFT seconds per uncached token, wait per request ahead, decode seconds per token; per backend: the
    running limit and KV capacity it reported; overall: output tokens per request and prompt bytes per token.
    `max_running`: the running limit of a backend that reported none (the `max_running` setting; None: unlimited).
    The adaptive policy is given the same setting and takes it in place of any reported limit (router.estimator)."""

    def __init__(self, max_running: int | None = None) -> None:
        self.max_running_default = max_running
        self.bytes_per_token = PRIOR_BYTES_PER_TOKEN
        self.output_tokens = PRIOR_OUTPUT_TOKENS  # per finished request (EWMA): the decode term, /router/state
        self.pools: dict[str, PoolCosts] = {}
        self.running_limits: dict[str, int] = {}  # by URL: the max_running_requests its /v1/loads last reported
        self.kv: dict[str, int] = {}  # max_total_num_tokens each backend reported
        # By pool: seconds per output token against the load it ran at (router.core.latency's TPOT prediction
        # where the policy has no speed model); kept apart from `pools`, which only the prefix scorer's events fill.
        self.tpot_lines: dict[str, TpotLine] = {}

    def costs(self, pool: str) -> PoolCosts:
        c = self.pools.get(pool)
        if c is None:
            c = self.pools[pool] = PoolCosts()
        return c

    def limit(self, url: str) -> int | None:
        return self.running_limits.get(url, self.max_running_default)

    def reported(self, url: str) -> bool:
        """Has url's /v1/loads given its running limit?"""
        return url in self.running_limits

    def queued_s(self, e) -> float:
        """Seconds of TTFT ahead of a new request on endpoint `e` before its own prefill (the prefix scorer's
        load term, router.affinity): a wait per request it runs, the prefill queued there (uncached prompt
        tokens of leases with no first token yet), and a queue for a slot beyond its running limit (a slot frees
        every request time / limit); capped at MAX_LOAD_TERM_S."""
        c = self.costs(e.pool)
        load = e.load_estimate
        wait = c.wait_s * load + c.ttft_s_per_token * getattr(e, "pending_tokens", 0)
        limit = self.limit(e.url)
        if limit is not None and load >= limit:
            wait += (load - limit + 1) * (c.tpot_s * self.output_tokens) / limit
        return min(wait, MAX_LOAD_TERM_S)

    def tpot_at(self, pool: str, n: float) -> float:
        """Seconds per output token a request gets in `pool` with n running (itself included), speculation
        included where the pool speculates (it is measured there); the prior until measured."""
        line = self.tpot_lines.get(pool)
        c = self.pools.get(pool)
        cold = c.tpot_s if c is not None else PRIOR_TPOT_S
        return cold if line is None else line.at(n, cold)

    def known(self, a: str, b: str) -> bool:
        """Both pools' decode speeds measured."""
        return self.costs(a).tpot_samples > 0 and self.costs(b).tpot_samples > 0

    def observe(self, obs: Observation, placement=None) -> None:
        """One finished exchange; `placement` (router.affinity.Placement): what the prefix scorer expected of it."""
        tokens = obs.tokens()
        if tokens and obs.ok:
            self.output_tokens = _ewma(self.output_tokens, float(tokens))
        if obs.ok and obs.ttft_s is not None and tokens and tokens > 1 and obs.duration_s > obs.ttft_s:
            # The mean in flight over its life, not the load it came in with (what a prediction is made at): learning
            # against the latter measured no better (docs/BENCH.md "Latency targets: how good the predictions are").
            n = obs.inflight_mean if obs.inflight_mean is not None else (obs.inflight_at_start + obs.inflight_at_end) / 2
            line = self.tpot_lines.get(obs.pool)
            if line is None:
                line = self.tpot_lines[obs.pool] = TpotLine()
            line.add(max(1.0, n), (obs.duration_s - obs.ttft_s) / (tokens - 1))
        if placement is None or not obs.ok:
            return
        p = obs.prompt_tokens
        if p and placement.prompt.nbytes and placement.prompt.hashed:
            self.bytes_per_token = min(16.0, max(1.0, _ewma(self.bytes_per_token, placement.prompt.nbytes / p)))
        c = self.costs(obs.pool)
        cached = obs.cached_tokens if obs.cached_tokens is not None else placement.expected_cached
        if obs.ttft_s is not None and p:
            # TTFT = ttft_s_per_token x (its uncached tokens + the uncached tokens in flight ahead of it) + wait_s x the
            # requests ahead: one learned rate, so queueing raises the price of load and of a re-prefill alike.
            uncached = max(1, p - cached) + placement.pending_ahead
            ahead = max(0, obs.inflight_at_start - 1)
            wait = c.wait_s * ahead
            c.ttft_s_per_token = max(1e-7, _ewma(c.ttft_s_per_token, max(0.0, obs.ttft_s - wait) / uncached))
            c.samples += 1
        if obs.ttft_s is not None and tokens and tokens > 1:
            c.tpot_s = _ewma(c.tpot_s, (obs.duration_s - obs.ttft_s) / (tokens - 1))
            c.tpot_samples += 1

    def observe_loads(self, url: str, figs: LoadFigures) -> bool:
        """One /v1/loads answer; True when the backend's KV capacity changed (the prefix index resizes)."""
        if figs.max_running:
            self.running_limits[url] = figs.max_running
        if figs.max_total_tokens and self.kv.get(url) != figs.max_total_tokens:
            self.kv[url] = figs.max_total_tokens
            return True
        return False

    def state(self) -> dict:
        return {"bytes_per_token": round(self.bytes_per_token, 3), "output_tokens": round(self.output_tokens, 1),
                "pools": {p: {"prefill_s_per_token": c.ttft_s_per_token, "wait_s_per_request": c.wait_s,
                              "tpot_s": c.tpot_s, "samples": c.samples} for p, c in self.pools.items()}}
