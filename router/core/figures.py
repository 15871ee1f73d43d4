"""The learned per-backend and per-pool figures every scorer reads: one object, updated in one place (observe /
observe_loads, called once per event by router.pools.Pools), read by the prefix scorer (router.affinity) and the
adaptive policy (router.adaptive). Each figure has this one owner; the adaptive policy's own models measure other
things (a server's token time against its load, its idle prefill forward, a running limit inferred where none is
reported: router.estimator), named apart below."""
from __future__ import annotations

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

    def known(self, a: str, b: str) -> bool:
        """Both pools' decode speeds measured."""
        return self.costs(a).tpot_samples > 0 and self.costs(b).tpot_samples > 0

    def observe(self, obs: Observation, placement=None) -> None:
        """One finished exchange; `placement` (router.affinity.Placement): what the prefix scorer expected of it."""
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
