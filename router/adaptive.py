"""The adaptive policy: learns each pool's (and instance's) speed online and routes on the learned models."""
from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping
from dataclasses import replace

from router.observe import LoadFigures, Observation
from router.policy import (
    BASELINE,
    EXPLORE,
    GAIN,
    SPECULATIVE,
    BackendView,
    Decision,
    View,
    healthy,
    other,
    sole_pool,
)
from router.queuelimit import QueueWitness
from router.speedmodel import NEUTRAL, Params, PrefillModel, SpeedModel, shrink

OBJECTIVES = ("throughput", "latency")
# The measurements behind each constant: docs/BENCH.md, "Adaptive: why its constants are what they are".
MIN_INSTANCE_SAMPLES = 20  # an instance routes on its own model from this many samples; before, on its pool's
MIN_POOL_SAMPLES = 1  # a pool with fewer and no prior borrows the other pool's model
# A young model's per-request scatter is not known yet: its spread is shrunk toward PRIOR_SPREAD by PRIOR_SPREAD_N
# pseudo-samples (one sample has no scatter at all). A load band it holds no sample in is an extrapolation of the
# line, as unsure as UNMEASURED (the line alone was 15-30% off a server's speed alone: docs/BENCH.md).
PRIOR_SPREAD = 0.1
PRIOR_SPREAD_N = 3
UNMEASURED = 0.15
EXPLORE_FLOOR = 0.7  # exploration never picks a backend scoring below this fraction of the best one
# The reported accept length is a window average that jitters by 5-10%: only a move beyond ACCEPT_JUMP, on
# ACCEPT_POLLS polls in a row, from a server running at least ACCEPT_MIN_RUNNING, rescales the model.
ACCEPT_JUMP = 0.2
ACCEPT_POLLS = 2
ACCEPT_MIN_RUNNING = 4
# ... and beyond ACCEPT_Z times what the running mix alone moves it by: the requests' own scatter (the model's
# spread) over the square root of the requests running. A server drawing acceptance per prompt (1 to 5 tokens a
# step) reports an average of 4-8 requests' draws that swings by 20-30% with the mix, and each swing rescaled the
# model as a drift: prefill-long's speculative model stood at 2.7x its token time after a warm-up (the virtual
# judge, docs/BENCH.md) and its light load went to the baseline.
ACCEPT_Z = 3.0
# The figure a jump is judged against (the anchor) is the mean of the first ANCHOR_POLLS figures from a server
# running at least ACCEPT_MIN_RUNNING (no jump is judged before), then follows the figures within the jump by
# 1/ANCHOR_POLLS a poll; their own scatter around it (per request, as the spread) is a jump's floor too. One
# poll as the anchor, taken before the model had samples to measure its spread, rescaled prefill-long's
# speculative model 1.7x fast when the next figures came in 40% higher (1 of 4 virtual seeds, 1.7-1.8x off
# after a judge run: docs/BENCH.md "s32"), and a scattered server's long memory kept it there.
ANCHOR_POLLS = 10
# Light load (up to LOW_LOAD running): until the other pool has LOW_LOAD_SAMPLES there, it gets a share of the
# decisions where that costs little (one pool is otherwise never tried there), and only while it could still be
# the faster (plausible): the chance it is the faster, at most LOW_LOAD_EXPLORE (Adaptive.chance).
LOW_LOAD = 3
# ... and only where it would run at most EXPLORE_LOAD (alone or beside one): the loads 1-2 clients are decided
# at, the furthest from the busier traffic the line is fitted on. At 3 the band borrows from the line and its
# neighbours (speedmodel's shrink); exploring it was 20 of 34 decisions at 2 + 1 running on prefill-long's 4
# clients, a request that adds a quarter less throughput there each time (0.95x; docs/BENCH.md "s33", "s36").
EXPLORE_LOAD = 2
LOW_LOAD_SAMPLES = 5
# ... times (its spread / PRIOR_SPREAD)^2 for a pool whose requests scatter more (the samples that know its mean
# as well), up to MAX_LOW_LOAD_SAMPLES: prefill-long's speculative server (spread ~0.5) judged on 5 draws came
# out 28% slow alone after a warm-up, and one judge repeat sent it 2% of a one-client level (docs/BENCH.md).
MAX_LOW_LOAD_SAMPLES = 32
LOW_LOAD_EXPLORE = 0.5  # at most (what a tie gets); a flat quarter was worse on the TP4 split (docs/BENCH.md "s35")
NEAR_TIE = 0.03  # "latency": per-request speeds this close are a tie the models cannot call
FRESH = 10  # random exploration only of a pool not sent a request in this many decisions
# The near tie widens by TIE_Z standard errors of the two predictions (capped at MAX_TIE).
TIE_Z = 2.0
# Whether a pool could still be the faster is judged at Student's t for the samples it holds there (two-sided 95%,
# by degrees of freedom; TIE_Z from 10 on): a scatter estimated from a few samples is itself unsure, and one
# sample has none. At z = 2, one request of prefill-long's speculative server that drew 1 token a step (2.7x its
# mean token time) ruled the server out at one client for good: 0.75x of all-speculative from a cold start.
T95 = (math.inf, 12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26)
MAX_TIE = 0.15
SPREAD_BAND = 0.01  # the published spread moves only by more than this; busier ties go to the steadier backend
# ... when the two spreads differ by more than SPREAD_BAND plus this share of the larger: a spread measured on
# ~100 samples is itself known to ~12%, and two servers that scatter alike (30% each) are not told apart by it.
SPREAD_APART = 0.25
MIN_INSTANCE_PREFILL = 3  # an instance's own prefill model from this many idle samples; before, its pool's
# The prompt as a covariate: a sample's duration is moved by what its prompt's prefill costs beyond a typical
# prompt's (the prefill model's per-token seconds times its uncached tokens minus the mix's), once the prefill
# model holds COVARIATE_SAMPLES idle samples. On the llama.cpp pair one request's seconds per token scatter by
# 0.36-0.38 (log sd), nearly all of it the prompt (the same prompt twice: 0.04); moved so, 0.18 and 0.26
# (bench/results/adaptive/covariate-replay.txt), and a robust fit of them is no longer 10-12% fast.
COVARIATE_SAMPLES = 8
EVERY = "*"  # the prefill model of every server together (no backend URL or pool is named so)
# The first samples (up to MAX_EARLY of them) are folded unmoved and kept; once the covariate is measured the
# models are rebuilt from them moved. At one client exploration ends on a pool's first 5 samples, and two long
# prompts among them, unmoved for good, put the llama.cpp baseline a third slow alone, below exploration's floor
# (bench/results/adaptive/covariate-replay.py). Held out of the models until then instead, a cold router
# alternated its first 8 requests where prompts cost nothing: convex-10's one client went 30 -> 13 of 30 virtual
# seeds. A server never found idle measures no prefill: its first MAX_EARLY samples then stay unmoved.
MAX_EARLY = 2 * COVARIATE_SAMPLES
MAX_EARLY_LOG = 4 * MAX_EARLY  # what the rebuild replays, at most (accept-length rescales while nothing finishes)
# Busy decisions (LOW_LOAD or more running) go to the less loaded backend until the models hold YOUNG_SAMPLES
# samples in all: a line through a few light-load samples, extrapolated to busier loads, routed a cold router worse
# than load alone. On the virtual judge a cold router's first run came within 5% of the best at convex-10's 8
# clients in 29 of 30 seeds (3 on the young models), on prefill-long in 134 of 180 cells (115)
# (bench/results/judge/virtual.md, virtual-rebuild-only.md).
YOUNG_SAMPLES = MAX_EARLY
PROMPT_MIX_MEMORY = 100  # the typical prompt: an EWMA of every request's uncached tokens over about this many
STATE_LOADS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the loads /router/state shows each model's per-request speed at


def sample(obs: Observation, limit: int | None = None, shift: float = 0.0) -> tuple[float, float] | None:
    """What one finished exchange says of its server: (n running, seconds per token per request), or None
    when it says nothing usable. `limit`: the server's max_running_requests, if known. `shift`: seconds its
    prompt's prefill cost beyond a typical prompt's (Adaptive.prompt_shift), taken off a duration that holds
    its prefill, at most its time to first token (what its prefill can have taken; its wait not included).

    The whole duration counts, time to first token included: what the router maximises is closed-loop
    throughput, X = n * tokens / duration (Little's law), so a server slower to start a request (prefill,
    another request's prefill stalling the batch) is slower for it. Decode time alone made the speculative
    model a few percent optimistic against the curves `balanced` routes on. A wait in the server's queue is
    not the server's speed: the model knows the queue from max_running_requests (Params.running)."""
    tokens = obs.tokens()
    if not obs.ok or tokens is None or tokens < 2 or obs.duration_s <= 0:
        return None
    if obs.ttft_s is not None and obs.ttft_s > obs.duration_s:
        return None
    # Not streamed, nothing says how much of it was prefill: at most half.
    y = (obs.duration_s - min(shift, obs.duration_s / 2 if obs.ttft_s is None else obs.ttft_s)) / tokens
    # The load it ran under: the time-weighted mean when measured (at a level's ramp or drain, start and end
    # counts of 5 and 52, or 51 and 2, stood for a request that ran with ~50 nearly all along).
    mean = obs.inflight_mean
    n = max(1.0, mean if mean is not None else (obs.inflight_at_start + obs.inflight_at_end) / 2)
    if limit is not None and obs.inflight_at_start > limit:
        # It waited in the server's queue first: its duration is queue, then decode in a full batch. Only the
        # decode part, from its first token on, measures the server, and only while the batch stayed full (a
        # request that ran on into a drain is a sample of no one load). Scaling the whole duration by
        # limit / n instead (Little's law, right for the mean request) left the requests that had not waited
        # (every request of a level's first round) `n / limit` too fast: at 100 clients, 71 on the TP8
        # baseline (limit 64), the model put it 17% faster at 64 than it is, the first round queued 11 on it
        # where balanced queues 7, and the level ended 6% later (0.94x).
        if obs.ttft_s is None or obs.inflight_at_end < limit:
            return None
        if limit == 1 and obs.waited_s is not None and obs.waited_s < obs.ttft_s:
            # One place: the release just before its first token let it start (nothing else ran there), so from
            # then on it is the server's whole time for it, its prefill included. Its decode alone left the
            # llama.cpp pair's prompts' prefill out: both engines were learned 5-41% fast alone (s40).
            return 1.0, (obs.duration_s - obs.waited_s - min(shift, obs.ttft_s - obs.waited_s)) / tokens
        return float(limit), (obs.duration_s - obs.ttft_s) / (tokens - 1)
    if limit is not None and n > limit:
        # It ran at once, in a batch of `limit` (the rest waited behind it): the token time at the limit.
        n = float(limit)
    return n, y


def uncached_tokens(obs: Observation) -> int | None:
    """The prompt tokens its server had to prefill: the usage's prompt (else the router's estimate from its
    bytes) less the cached ones (reported, else what the prefix index expected); None when no size is known."""
    prompt = obs.prompt_tokens if obs.prompt_tokens is not None else obs.estimated_prompt_tokens
    if not prompt:
        return None
    cached = obs.cached_tokens if obs.cached_tokens is not None else obs.expected_cached_tokens
    return max(0, prompt - (cached or 0))


class Adaptive:
    """Route on speed models fitted online (router.speedmodel), one per pool and one per instance.

    objective "throughput": the backend whose throughput gains most from one more request (equal marginal
    gains across pools is the system optimum); "latency": the backend where this request would be fastest
    (the balanced policy's rule), and at light load within NEAR_TIE of a tie the one that gains more throughput.
    The models feed on finished exchanges (report_done); with load_signal backend, /v1/loads sets the queue
    limit and rescales them when the accept length moves. Routing uses a published copy of each model that
    moves only when the fit moved by more than `deadband`, so noise cannot flip decisions back and forth."""

    name = "adaptive"

    def __init__(self, *, objective: str = "latency", forgetting: float = 0.99, explore: float = 0.03,
                 deadband: float = 0.01, max_running: int | None = None,
                 priors: Mapping[str, tuple[float, float]] | None = None, defer_fits: bool = False) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}")
        self.objective = objective
        self.forgetting = forgetting
        self.explore = explore
        self.deadband = deadband
        self.max_running = max_running
        self.priors = dict(priors or {})
        # Big refits are left to learn() (SpeedModel.defer): the router runs them in steps between its other work.
        self.defer_fits = defer_fits
        self._new_models()
        self.accept: dict[str, float] = {}  # accept length each backend last reported
        self.anchor: dict[str, float] = {}  # accept length a jump is judged against (ANCHOR_POLLS)
        self.beyond: dict[str, int] = {}  # polls in a row with the accept length beyond the jump
        self.polls: dict[str, int] = {}  # figures folded into each anchor since it was (re)set, up to ANCHOR_POLLS
        self.accept_dev: dict[str, float] = {}  # mean squared relative deviation of the figures from the anchor
        self.prefill: dict[str, PrefillModel] = {}  # by pool name, by backend URL, and EVERY
        self.reported: set[str] = set()  # backends whose /v1/loads gave their max_running_requests
        self.witness: dict[str, QueueWitness] = {}  # the queue limit of the others, inferred (router.queuelimit)
        # Everything that fed the models while the covariate is unmeasured (samples, queue limits, accept-length
        # rescales, instances joining a pool), in order: the models are rebuilt from it, the samples moved, once it
        # is (_rebuild). None once rebuilt or after MAX_EARLY samples.
        self.early: list[tuple] | None = []
        self.prompt_mix = 0.0  # EWMA of every request's uncached prompt tokens: the typical prompt (prompt_shift)
        self.prompts = 0
        self.decisions = 0
        self.last_seen: dict[str, int] = {}  # pool -> decision count at its latest sample
        self.last_sent: dict[str, int] = {}  # pool -> decision count when it was last picked
        # Explore a pool that has had no sample for this many decisions even where it costs more: a pool once
        # judged slow gets no traffic and so no samples; without this it would stay misjudged after a change.
        self.stale_after = int(1 / explore) if explore > 0 else 0

    def _new_models(self) -> None:
        """The speed models and what follows from the samples they hold, empty (at start, and for _rebuild)."""
        self.pending: dict[str, list] = {}  # key -> [its refit under way (None: not begun), load of its last sample]
        self.models: dict[str, SpeedModel] = {}  # by pool name and by backend URL
        # pool -> the one instance that has fed its model so far: the two are then one object (_fed).
        self.sole: dict[str, str] = {}
        self.split: set[str] = set()  # pools fed by more than one instance
        self.published: dict[str, Params] = {}
        self.published_at: dict[str, int] = {}  # the samples its model held when each copy was published
        self.spreads: dict[str, float] = {}  # published per-request spread of each model (log, robust sd)
        self.bounded: dict[str, tuple[Params, int, Params]] = {}  # url -> (params, most seen, them bounded) (provisional)
        self.tokens = 0.0  # EWMA of completion tokens per request (0: none seen yet)
        self.finished = 0  # samples taken

    # ---- models
    def model(self, key: str, pool: str) -> SpeedModel:
        m = self.models.get(key)
        if m is None:
            m = self.models[key] = SpeedModel(self.forgetting, self.priors.get(pool))
            m.max_running = self.max_running
            m.defer = self.defer_fits
            self.published[key] = m.params()
            self.spreads[key] = m.spread
        return m

    def _key(self, b: BackendView) -> str | None:
        """Which model a decision uses for backend b: its own, its pool's, or None (a guess, see params)."""
        m = self.models.get(b.url)
        if m is not None and m.samples >= MIN_INSTANCE_SAMPLES:
            return b.url
        pm = self.model(b.pool, b.pool)
        if pm.samples < MIN_POOL_SAMPLES and b.pool not in self.priors:
            return None
        return b.pool

    def stderr(self, b: BackendView) -> float:
        """Relative standard error of the model's speed for one more request on b: its per-request spread
        (shrunk toward PRIOR_SPREAD while it has few samples) over the square root of the samples it holds at
        that load, busier than LOW_LOAD plus the pseudo-samples that band's estimate is shrunk toward the line by
        (speedmodel.shrink); UNMEASURED at least where it holds none there (the line's extrapolation).

        Busy, counted on the band's own samples alone, a server whose requests scatter by 60% was 8.5% unsure at 4
        running with 61 samples there, while its estimate, mostly the line fitted on all 333, was within 1% of
        the server: the busy tie sat at its 15% cap and 12% more speed per request went to the steadier
        baseline (prefill-long's 8 clients at 3 + 5 where the best keeps 4 + 4). At light load the line is at its
        edge, where bands sat 15-30% off it, so only the band's own samples count there (counted as sure as the
        line, saturating-never's 2 clients went all to the baseline: 0.937x). docs/BENCH.md "s37", "s38"."""
        key = self._key(b)
        if key is None:
            return 0.0
        m = self.models[key]
        k = m.samples
        s = self.spreads.get(key, 0.0)
        held = m.band_samples(b.load_estimate + 1)
        if b.pool in self.priors:
            # Curves from a calibration: measured at every load already, its own samples' scatter only.
            return s / math.sqrt(max(held, 1))
        s = math.sqrt((k * s * s + PRIOR_SPREAD_N * PRIOR_SPREAD ** 2) / (k + PRIOR_SPREAD_N))
        pseudo = shrink(s) if b.load_estimate >= LOW_LOAD else 0.0
        return s / math.sqrt(held + pseudo) if held else max(s, UNMEASURED)

    def spread(self, b: BackendView) -> float:
        """The published per-request scatter of the model a decision uses for b (0 while it has none)."""
        key = self._key(b)
        return 0.0 if key is None else self.spreads.get(key, 0.0)

    def tie(self, s_b: BackendView, b_b: BackendView) -> float:
        """How close two per-request speeds are a tie: NEAR_TIE, widened by the models' uncertainty there."""
        return min(MAX_TIE, NEAR_TIE + TIE_Z * math.hypot(self.stderr(s_b), self.stderr(b_b)))

    def params(self, b: BackendView) -> Params:
        """The published model a decision uses for backend b: its own once it has enough samples."""
        key = self._key(b)
        if key is None:
            # Knowing nothing of this pool, assume it is like the other one (or both neutral while neither is
            # known): the decision is then by load alone until this pool has been measured.
            o = other(b.pool)
            om = self.models.get(o)
            known = om is not None and (om.samples >= MIN_POOL_SAMPLES or o in self.priors)
            src = self.published[o] if known else Params(*NEUTRAL)
            # All of it but the queue limit, shape included: a copy of the line alone was a few percent off the
            # original (the other server alone 2% faster than its line, say) and lost every tie at equal loads,
            # so this pool never got the samples that would end the borrowing (one router sent 15 requests in
            # a row to a speculative server 8x slower than the baseline, which had 2 samples).
            return self.provisional(b, replace(src, max_running=self.model(b.pool, b.pool).max_running))
        return self.provisional(b, self.published[key])

    def provisional(self, b: BackendView, p: Params) -> Params:
        """p, or while b's queue limit is not known (none reported, set or inferred yet) and streams were seen, p
        limited to the most requests b was seen running at once: a request beyond that may wait behind a whole
        other one (a serial server), and the models' line says nothing of that until it has. Counted as batching
        (the line's slope from a GPU-like prior), a cold router sent requests behind a running one on the llama.cpp
        pair while the other engine was idle: 6-10 of its first 40 at two clients (docs/BENCH.md "s40", "s41").
        A server that does run more shows it the first time it is sent one more (exploration, or every backend
        busy), and the figure lifts (router.queuelimit)."""
        if p.max_running is not None or self.max_running is not None or b.url in self.reported or not self.witness:
            return p
        w = self.witness.get(b.url)
        # One not yet seen at all counts as seen running one, once streams are seen on some backend: the first
        # requests' picks at two clients come before both servers have finished one.
        most = 1 if w is None else w.most
        got = self.bounded.get(b.url)
        if got is None or got[0] is not p or got[1] != most:
            got = self.bounded[b.url] = (p, most, replace(p, max_running=most))
        return got[2]

    def _fed(self, url: str, pool: str) -> tuple[str, ...]:
        """The models a sample or a load figure of `url` goes into: its own and its pool's. While one instance alone
        has fed its pool, the two are one object (the same samples in, the same fit out): updated and refitted once,
        not twice (the refits were most of adaptive's CPU per request; docs/BENCH.md, "s34")."""
        first = self.sole.get(pool)
        if first == url:
            return (url,)
        if first is None and pool not in self.split:
            self.model(pool, pool)  # its published copy: a fresh model's, as the instance's is
            self.sole[pool] = url
            self.models[pool] = self.model(url, pool)
            return (url,)
        if first is not None:
            # A second instance: the pool's model goes on from a copy of the first one's.
            m = self.models[pool] = copy.deepcopy(self.models[first])
            del self.sole[pool]
            self.split.add(pool)
            if first in self.pending:  # its refit under way is the first one's: the pool's is due again
                m.due = True
                self.pending[pool] = [None, self.pending[first][1]]
        return (url, pool)

    def _named(self, key: str) -> list[str]:
        """key, and the pools whose model is key's (_fed)."""
        return [key, *(p for p, u in self.sole.items() if u == key)]

    def _fold(self, pool: str, url: str, n: float, y: float) -> None:
        for key in self._fed(url, pool):
            m = self.model(key, pool)
            m.update(n, y)
            if m.due or key in self.pending:
                # Published when its refit has run (learn).
                self.pending.setdefault(key, [None, n])[1] = n
            else:
                for name in self._named(key):
                    self._publish(name, m, n)
        self.last_seen[pool] = self.decisions

    def learn(self, work: int | None = None) -> bool:
        """Run the refits observe() left, for about `work` samples' worth (None: all of them), and publish each one
        finished; True while some remain."""
        budget = math.inf if work is None else work
        while self.pending and budget > 0:
            key, job = next(iter(self.pending.items()))
            m = self.models[key]
            if job[0] is None:
                job[0] = m.fit_steps()
            for done in job[0]:
                budget -= done
                if budget <= 0:
                    break
            else:
                del self.pending[key]
                if m.due:  # rescaled while it ran: that refit was dropped, another is due
                    self.pending[key] = [None, job[1]]
                else:
                    for name in self._named(key):
                        self._publish(name, m, job[1])
        return bool(self.pending)

    def _publish(self, key: str, m: SpeedModel, n: float) -> None:
        if abs(m.spread - self.spreads.get(key, 0.0)) > SPREAD_BAND:
            self.spreads[key] = m.spread
        new, old = m.params(), self.published[key]
        # Follow the fit only when it moved by more than its own wobble (3 sigma) and the deadband, or once it
        # rests on twice the samples the published copy did: a copy made from one or two requests is not kept
        # against a fit of many (prefill-long's speculative server, whose requests scatter by 60%, kept the copy
        # of its first request, one that drew 1 token a step, for a whole level: its 3-sigma band was 48%).
        # Doubling is rare enough (log2 of the samples) not to flap.
        if m.samples >= 2 * self.published_at.get(key, 0):
            self._set(key, new, m)
            return
        band = max(self.deadband, 3 * m.noise())
        for at in (1.0, max(1.0, n)):
            if abs(new.throughput(at) - old.throughput(at)) > band * old.throughput(at):
                self._set(key, new, m)
                return
        if new.max_running != old.max_running:
            self._set(key, new, m)

    def _set(self, key: str, p: Params, m: SpeedModel) -> None:
        self.published[key] = p
        self.published_at[key] = m.samples

    def observe(self, obs: Observation) -> None:
        """One finished exchange: its seconds per token, against the requests running then; its prefill."""
        if obs.running_beside is not None and self.max_running is None and obs.url not in self.reported:
            w = self.witness.setdefault(obs.url, QueueWitness())
            before = w.limit()
            w.note(obs.inflight_at_start, obs.running_beside)
            if w.limit() != before:
                self._limit(obs.url, obs.pool, w.limit())
        m = self.models.get(obs.url)
        limit = m.max_running if m is not None else self.max_running
        uncached = uncached_tokens(obs)
        if self._take(obs, limit, uncached):
            self._log("take", obs, limit, uncached)
        if not obs.ok or uncached is None:
            self._unready()
            return
        self.prompts += 1
        self.prompt_mix += max(1.0 / PROMPT_MIX_MEMORY, 1.0 / self.prompts) * (uncached - self.prompt_mix)
        alone = obs.inflight_at_start == 1 and obs.ttft_s is not None and 0 < obs.ttft_s <= obs.duration_s
        for key in (obs.url, obs.pool, EVERY):
            pm = self.prefill.get(key)
            if pm is None:
                pm = self.prefill[key] = PrefillModel(self.forgetting)
            pm.note(uncached)
            if alone:
                pm.update(uncached, obs.ttft_s)
        if self.early is not None and self.prefill[EVERY].samples >= COVARIATE_SAMPLES:
            self._rebuild()
        self._unready()

    def _log(self, *event) -> None:
        """One thing that fed the models while the covariate is unmeasured, for the rebuild (MAX_EARLY_LOG at most:
        beyond, the models stay as they are)."""
        if self.early is not None:
            self.early.append(event)
            if len(self.early) > MAX_EARLY_LOG:
                self.early = None

    def _unready(self) -> None:
        """MAX_EARLY samples and still no covariate (a server never found idle): they stay as they were folded."""
        if self._unmoved() >= MAX_EARLY:
            self.early = None

    def _unmoved(self) -> int:
        """Samples folded unmoved and kept for the rebuild."""
        return sum(event[0] == "take" for event in self.early or ())

    def _take(self, obs: Observation, limit: int | None, uncached: int | None) -> bool:
        """Fold one finished exchange's sample, moved to the typical prompt where the covariate is known; False
        when it says nothing usable."""
        got = sample(obs, limit, self.prompt_shift(obs.url, obs.pool, uncached))
        if got is None:
            return False
        self._fold(obs.pool, obs.url, got[0], got[1])  # so obs.tokens() is known
        self.finished += 1
        self.tokens += max(0.05, 1.0 / self.finished) * (obs.tokens() - self.tokens)
        return True

    def _rebuild(self) -> None:
        """The covariate is measured: the models start again from what fed them so far, in its order, the
        samples now moved to the typical prompt (the queue limits and accept-length rescales learned meanwhile
        kept). The decisions made meanwhile used the unmoved models."""
        log, self.early = self.early or [], None
        last_seen = dict(self.last_seen)
        self._new_models()
        for kind, *args in log:
            if kind == "take":
                self._take(*args)
            elif kind == "fed":
                self._fed(*args)
            elif kind == "limit":
                self._limit(*args)
            else:
                self._rescale(*args)
        self.last_seen = last_seen

    def prompt_shift(self, url: str, pool: str, uncached: int | None) -> float:
        """Seconds a prompt of `uncached` tokens costs on this server beyond the typical prompt (negative when
        shorter): its prefill model's per-token seconds times the difference; 0 until that model is measured
        (COVARIATE_SAMPLES) or prompts do not vary: the instance's model, else its pool's, else all servers'
        together (a pool that drew three long prompts first is moved before its own model is measured: judged
        on them unmoved, it fell out of exploration for good). Both pools' samples are moved to the one typical
        prompt, so which prompts each happened to draw does not decide which looks faster."""
        if uncached is None:
            return 0.0
        for key in (url, pool, EVERY):
            pm = self.prefill.get(key)
            if pm is not None and pm.samples >= COVARIATE_SAMPLES:
                k = pm.per_token()
                return 0.0 if k is None else k * (uncached - self.prompt_mix)
        return 0.0

    def stall(self, b: BackendView) -> float:
        """Seconds one more request's prefill would hold up each request running on b (its prefill forward,
        from requests that found a server idle): its own instance's, else its pool's; 0 while unmeasured. For
        /router/state only: counted in the latency rule it cost more than it gained (docs/BENCH.md)."""
        own = self.prefill.get(b.url)
        if own is not None and own.samples >= MIN_INSTANCE_PREFILL:
            return own.seconds()
        pm = self.prefill.get(b.pool)
        return pm.seconds() if pm is not None else 0.0

    def observe_loads(self, url: str, pool: str, figs: LoadFigures) -> None:
        """One /v1/loads answer of a backend: its max_running_requests and its accept length."""
        limit = figs.max_running if self.max_running is None else self.max_running
        joined = (self.sole.get(pool), pool in self.split)
        self._fed(url, pool)
        if (self.sole.get(pool), pool in self.split) != joined:
            self._log("fed", url, pool)
        if limit is not None:
            self.reported.add(url)
            self._limit(url, pool, limit)
        if figs.accept_length is not None and figs.accept_length > 0:
            self.accept[url] = figs.accept_length
            if figs.running < ACCEPT_MIN_RUNNING:
                return
            # Against the anchor (a mean of figures, reset to the new one at a rescale), not the last one
            # reported: a figure that jitters (a window average; idle and busy report differently) must not walk
            # the model away in sub-threshold steps. Compared with the last report instead, a compare run walked
            # both models 5x off within minutes. (The anchor exists once a figure has been folded: k >= 1.)
            anchor, x, k = self.anchor.get(url, 0.0), figs.accept_length, self.polls.get(url, 0)
            if k < ANCHOR_POLLS or abs(x - anchor) <= self.accept_jump(url, pool, figs.running) * anchor:
                self._fold_accept(url, x, figs.running)
            elif (beyond := self.beyond.get(url, 0) + 1) < ACCEPT_POLLS:
                self.beyond[url] = beyond
            else:
                # Tokens per step moved (prompt mix, drafter): token time scales inversely, at once.
                self.anchor[url], self.beyond[url], self.polls[url], self.accept_dev[url] = x, 0, 1, 0.0
                self._rescale(url, pool, anchor / x)
                self._log("rescale", url, pool, anchor / x)
        # gen_throughput is not folded into the model. Measured (bench compare at 0.5 s polls): its samples
        # outnumbered the router's own 4 to 1, it is a decode-only window average (time to first token, and
        # the steps other requests' prefills take, are not in it), and its clock need not be the router's (a
        # simulator at --speedup K reports simulated tok/s). A ratio learned against the router's timings
        # drifted with the model it was checked against: the seed speculative server was judged 1.8x faster
        # alone than it is. The router's own timings are the samples; /v1/loads gives the running counts (the
        # load signal), max_running_requests (the queue) and the accept length (a drift, at once).

    def _rescale(self, url: str, pool: str, factor: float) -> None:
        """Scale the token time of the models url's samples feed, published at once (an accept-length jump)."""
        for key in self._fed(url, pool):
            m = self.model(key, pool)
            m.rescale(factor)
            for name in self._named(key):
                self._set(name, m.params(), m)

    def _limit(self, url: str, pool: str, limit: int | None) -> None:
        """b's queue limit, reported or inferred, into the models its samples feed (None: not known)."""
        changed = False
        for key in self._fed(url, pool):
            m = self.model(key, pool)
            if m.max_running != limit:
                changed = True
                m.max_running = limit
                for name in self._named(key):
                    self._publish(name, m, 1.0)
        if changed:
            self._log("limit", url, pool, limit)

    def _fold_accept(self, url: str, x: float, running: int) -> None:
        """One figure within the jump: the anchor is the mean of the first ANCHOR_POLLS, then moves 1/ANCHOR_POLLS
        toward each; so does the figures' mean squared relative deviation from it, times the requests running (a
        mean of more requests' draws scatters less: per request, as the spread term)."""
        self.beyond[url] = 0
        k = self.polls[url] = min(self.polls.get(url, 0) + 1, ANCHOR_POLLS)
        anchor = self.anchor.get(url, x)
        anchor += (x - anchor) / k
        self.anchor[url] = anchor
        dev = self.accept_dev.get(url, 0.0)
        self.accept_dev[url] = dev + ((x / anchor - 1.0) ** 2 * running - dev) / k

    def accept_jump(self, url: str, pool: str, running: int) -> float:
        """How far (relative) the reported accept length must move to be a change of the server's own: ACCEPT_JUMP,
        or ACCEPT_Z times what its running mix alone moves it by (the model's spread, or the figures' own scatter
        around the anchor, per request), over the square root of the requests running, whichever is largest."""
        spread = max(self.spreads.get(url, self.spreads.get(pool, 0.0)), math.sqrt(self.accept_dev.get(url, 0.0)))
        return max(ACCEPT_JUMP, ACCEPT_Z * spread / math.sqrt(max(running, 1)))

    # ---- decisions
    def score(self, b: BackendView) -> tuple[float, float]:
        p, n = self.params(b), b.load_estimate
        speed, gain = p.request_speed(n), p.marginal_gain(n)
        if self.objective == "latency":
            return speed, gain
        # Once every candidate queues, marginal gains are all 0: the per-request speed splits the queue.
        return gain, speed

    def _samples(self, pool: str) -> int:
        m = self.models.get(pool)
        return 0 if m is None else m.samples

    def _best(self, cands: list[BackendView], rng: random.Random) -> tuple[tuple[float, float], BackendView]:
        if len(cands) == 1:
            return self.score(cands[0]), cands[0]
        scored = [(self.score(b), b) for b in cands]
        top = max(sc for sc, _ in scored)
        # Random among equals, as least-inflight does: equal instances at equal loads share the work.
        return top, rng.choice([b for sc, b in scored if sc == top])

    def decide(self, view: View, rng: random.Random) -> Decision | None:
        self.decisions += 1
        spec, base = healthy(view.speculative), healthy(view.baseline)
        if not spec or not base:
            return sole_pool(view, bool(spec), rng, GAIN)
        s_score, s_b = self._best(spec, rng)
        b_score, b_b = self._best(base, rng)
        if s_score == b_score:
            # A tie (in practice: nothing learned yet) goes to the less measured pool, then to speculative.
            spec_first = self._samples(SPECULATIVE) <= self._samples(BASELINE)
        elif (self.finished < YOUNG_SAMPLES and max(s_b.load_estimate, b_b.load_estimate) >= LOW_LOAD
              and s_b.load_estimate != b_b.load_estimate and not self.priors):
            # Busy, on models this young: the less loaded backend (see YOUNG_SAMPLES).
            spec_first = s_b.load_estimate < b_b.load_estimate
        elif (self.objective == "latency" and s_score[1] != b_score[1]
              and max(s_b.load_estimate, b_b.load_estimate) < LOW_LOAD
              and abs(s_score[0] - b_score[0]) <= self.tie(s_b, b_b) * max(s_score[0], b_score[0])):
            spec_first = s_score[1] > b_score[1]
        elif (self.objective == "latency"
              and abs(s_score[0] - b_score[0]) <= self.tie(s_b, b_b) * max(s_score[0], b_score[0])
              and (steady := self.steadier(s_b, b_b)) is not None):
            spec_first = steady is s_b
        else:
            spec_first = s_score > b_score
        pick, alt = (s_b, b_b) if spec_first else (b_b, s_b)
        if self.explore > 0:
            top, low = max(s_score, b_score)[0], min(s_score, b_score)[0]
            cheap = low >= EXPLORE_FLOOR * top
            n_alt = alt.load_estimate + 1
            g = 1 if self.objective == "latency" else 0
            alt_sc, pick_sc = (b_score, s_score) if spec_first else (s_score, b_score)
            if (cheap and alt_sc[g] >= EXPLORE_FLOOR * pick_sc[g] and n_alt <= EXPLORE_LOAD and alt.pool not in self.priors
                    and self.model(alt.pool, alt.pool).band_samples(n_alt) < self.low_load_samples(alt)
                    and self.plausible(alt, alt_sc[0], pick, pick_sc[0])
                    and rng.random() < self.chance(alt, alt_sc[0], pick, pick_sc[0])):
                return self._send(alt, EXPLORE)
            unfed = self.decisions - self.last_sent.get(alt.pool, 0) > FRESH
            if unfed and rng.random() < self.explore:
                stale = self.decisions - self.last_seen.get(alt.pool, 0) > self.stale_after
                if cheap or stale:
                    return self._send(alt, EXPLORE)
        return self._send(pick, GAIN)

    def steadier(self, s_b: BackendView, b_b: BackendView) -> BackendView | None:
        """The backend a busy tie goes to: the one whose requests scatter less, when the two spreads are told apart,
        it would not queue the request and the other is busy; None when neither."""
        s_spread, b_spread = self.spread(s_b), self.spread(b_b)
        if abs(s_spread - b_spread) <= SPREAD_BAND + SPREAD_APART * max(s_spread, b_spread):
            return None
        steady, scatter = (s_b, b_b) if s_spread < b_spread else (b_b, s_b)
        # Not when the steadier would queue the request: its time there is then mostly the wait, whose scatter
        # no spread measures (a queued request's sample is its decode alone). On the TP4 split at 100 clients
        # the baseline, queueing ~40, counted as the steadier and took the ties: 27-28% on the speculative
        # server where balanced keeps 31%, 0.96x (1.00x without the tie-break there).
        # Nor when the scattering server is lightly loaded: its light bands (one per request count) then held
        # few samples, so the tie was wide, and losing every such tie kept them few. The seed TP8 pair at 10
        # clients sat at 2 + 8 (22-25% speculative) where 3 + 7 is 6% faster per request: 0.963x of balanced.
        return None if self.queues(steady) or scatter.load_estimate < LOW_LOAD else steady

    def queues(self, b: BackendView) -> bool:
        """Would one more request wait in b's queue (its max_running_requests known and reached)?"""
        limit = self.params(b).max_running
        return limit is not None and b.load_estimate >= limit

    def low_load_samples(self, b: BackendView) -> float:
        """How many samples at a light load b's pool needs before exploration there ends on the count alone."""
        return min(MAX_LOW_LOAD_SAMPLES, LOW_LOAD_SAMPLES * max(1.0, (self.spread(b) / PRIOR_SPREAD) ** 2))

    def plausible(self, alt: BackendView, alt_speed: float, pick: BackendView, pick_speed: float) -> bool:
        """Could `alt` still be the faster for this request, given how unsure both models are there? A difference
        larger than the two models' uncertainty is acted on: exploring it again costs its whole size. The
        uncertainty of each is its standard error times Student's t for the samples it holds at that load."""
        return alt_speed * (1 + self.unsure(alt)) >= pick_speed * (1 - self.unsure(pick))

    def chance(self, alt: BackendView, alt_speed: float, pick: BackendView, pick_speed: float) -> float:
        """The share of light-load decisions `alt` is explored at while it is plausible: the chance it is the faster
        for this request (Thompson sampling between two), at most LOW_LOAD_EXPLORE. Its log speed's gap to the
        pick's, over the two models' uncertainty there (plausible's interval, each standard error times Student's t
        for the samples held, read as 1.96 standard errors of a normal). A flat LOW_LOAD_EXPLORE sent a server 23%
        slower alone a third to a half of one client's first 64 requests when both servers' requests scattered by
        40-75% (the llama.cpp pair; docs/BENCH.md "s39")."""
        width = math.hypot(self.unsure(alt), self.unsure(pick)) / 1.96
        if alt_speed >= pick_speed or not math.isfinite(width):
            return LOW_LOAD_EXPLORE
        if width <= 0:
            return 0.0
        return min(LOW_LOAD_EXPLORE, 0.5 * math.erfc(math.log(pick_speed / alt_speed) / (width * math.sqrt(2))))

    def unsure(self, b: BackendView) -> float:
        """How unsure (relative) the model is of b's speed for one more request: its standard error times Student's
        t (T95) for the samples it holds at that load (plausible's and chance's interval, each side)."""
        key = self._key(b)
        held = 0 if key is None else self.models[key].band_samples(b.load_estimate + 1)
        t = T95[held - 1] if 1 <= held <= len(T95) else (math.inf if held < 1 else TIE_Z)
        return t * self.stderr(b)

    def _send(self, b: BackendView, reason: str) -> Decision:
        self.last_sent[b.pool] = self.decisions
        return Decision(b, reason)

    # ---- what it learned, for /router/state and the metrics (through state())
    def predicted(self, backends: tuple[BackendView, ...]) -> float:
        """Tok/s the models predict for these backends at their current loads."""
        return sum(self.params(b).throughput(b.load_estimate) for b in backends)

    def accept_length(self, backends: tuple[BackendView, ...]) -> float:
        """Mean accept length these backends last reported (0 when none did)."""
        got = [self.accept[b.url] for b in backends if b.url in self.accept]
        return sum(got) / len(got) if got else 0.0

    def pool_model(self, pool: str) -> SpeedModel:
        return self.model(pool, pool)

    def state(self, view: View) -> dict:
        def describe(key: str, pool: str, b: BackendView | None = None) -> dict:
            m, pub = self.model(key, pool), self.published[key]
            priced = pub if b is None else self.provisional(b, pub)
            fit = m.params()
            return {"alpha_s": fit.alpha, "beta_s": fit.beta, "max_running": fit.max_running,
                    "samples": m.samples, "error": round(m.err, 4), "spread": round(self.spreads[key], 4),
                    "published": {"alpha_s": pub.alpha, "beta_s": pub.beta},
                    "tok_s_alone": round(fit.throughput(1), 1),
                    "tok_s_saturated": round(fit.throughput(fit.max_running or 10**6), 1),
                    # What decisions use (the published model, its shape included): one request's tok/s with n
                    # in flight, beyond max_running its wait in the queue included.
                    "request_tok_s": {str(n): round(priced.throughput(n) / n, 1) for n in STATE_LOADS},
                    # The queue limit decisions price with: the model's, or while none is known the most seen
                    # running at once (provisional).
                    "priced_max_running": priced.max_running}

        def prefill(key: str) -> dict:
            pm = self.prefill.get(key)
            if pm is None:
                return {"prefill_s": 0.0, "prefill_s_per_ktok": None, "prefill_samples": 0}
            k = pm.per_token()
            return {"prefill_s": round(pm.seconds(), 5), "prefill_s_per_ktok": None if k is None else round(k * 1e3, 5),
                    "prefill_samples": pm.samples, "uncached_tokens": round(pm.uncached, 1)}

        pools = {}
        for pool in (SPECULATIVE, BASELINE):
            members = view.pool(pool)
            if not members:
                continue
            pools[pool] = describe(pool, pool) | prefill(pool) | {
                "predicted_tok_s": round(self.predicted(members), 1),
                "accept_length": self.accept_length(members)}
        backends = [describe(b.url, b.pool, b) | prefill(b.url) | {
            "url": b.url, "pool": b.pool, "healthy": b.healthy, "load": b.load_estimate,
            "accept_length": self.accept.get(b.url),
            "uses": "instance" if self.models[b.url].samples >= MIN_INSTANCE_SAMPLES else "pool",
            "max_running_from": ("settings" if self.max_running is not None else "loads" if b.url in self.reported
                                 else "inferred" if self.models[b.url].max_running is not None else None),
            # What the inference has seen (router.queuelimit): the most running at once, and the requests in a
            # row since that could have shown more and did not.
            "running_seen": self.witness[b.url].most if b.url in self.witness else None,
            "queue_witnesses": self.witness[b.url].tries if b.url in self.witness else None,
            "stall_s": round(self.stall(b), 5),
            "predicted_tok_s": round(self.params(b).throughput(b.load_estimate), 1)} for b in view.backends]
        return {"policy": self.name, "objective": self.objective, "forgetting": self.forgetting,
                "explore": self.explore, "deadband": self.deadband, "decisions": self.decisions,
                "tokens_per_request": round(self.tokens, 1),
                # Samples folded unmoved, kept until the prompt covariate is measured (MAX_EARLY): the models are
                # then rebuilt from them moved.
                "samples_unmoved": self._unmoved(),
                "pools": pools, "backends": backends}
