"""The adaptive policy's speed estimator: one speed model per pool and per instance (router.speedmodel), fed by
finished exchanges, with a published copy of each that moves only beyond a deadband; the running limits; the
prompt covariate (samples moved to a typical prompt's prefill), with the early events that fed the models kept
as typed records and replayed once the covariate is measured."""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from router.core.figures import Figures
from router.policy import BackendView, other
from router.queuelimit import QueueWitness
from router.speedmodel import Params, PrefillModel, SpeedModel, shrink
from router.tuning import DEFAULT, Tuning

if TYPE_CHECKING:
    from router.observe import Observation

EVERY = "*"  # the prefill model of every server together (no backend URL or pool is named so)


def sample(obs: Observation, limit: int | None = None, shift: float = 0.0) -> tuple[float, float] | None:
    """What one finished exchange says of its server: (n running, seconds per token per request), or None
    when it says nothing usable. `limit`: the server's max_running_requests, if known. `shift`: seconds its
    prompt's prefill cost beyond a typical prompt's (SpeedEstimator.prompt_shift), taken off a duration that holds
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
        # (every request of a level's first round) `n / limit` too fast, and queued more there than the server
        # takes.
        if obs.ttft_s is None or obs.inflight_at_end < limit:
            return None
        if limit == 1 and obs.waited_s is not None and obs.waited_s < obs.ttft_s:
            # One place: the release just before its first token let it start (nothing else ran there), so from
            # then on it is the server's whole time for it, its prefill included (its decode alone leaves a serial
            # server's prompt prefill out, and learns it fast alone).
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


# ---- what fed the models while the covariate was unmeasured, in order (SpeedEstimator.rebuild replays them)
@dataclass(frozen=True, slots=True)
class Take:
    """A finished exchange's sample."""

    obs: Observation
    limit: int | None
    uncached: int | None

    def replay(self, est: SpeedEstimator) -> None:
        est.take(self.obs, self.limit, self.uncached)


@dataclass(frozen=True, slots=True)
class Joined:
    """An instance joined its pool's models (a /v1/loads answer before any sample)."""

    url: str
    pool: str

    def replay(self, est: SpeedEstimator) -> None:
        est.fed(self.url, self.pool)


@dataclass(frozen=True, slots=True)
class Limit:
    """A queue limit, reported or inferred."""

    url: str
    pool: str
    limit: int | None

    def replay(self, est: SpeedEstimator) -> None:
        est.set_limit(self.url, self.pool, self.limit)


@dataclass(frozen=True, slots=True)
class Rescale:
    """An accept-length drift: the token time scaled by `factor`."""

    url: str
    pool: str
    factor: float

    def replay(self, est: SpeedEstimator) -> None:
        est.rescale(self.url, self.pool, self.factor)


Event = Take | Joined | Limit | Rescale


class SpeedEstimator:
    """The models and their published copies. `seen(pool)`: told of each sample folded live (exploration's clock);
    `max_running`: a queue limit set for every backend (None: reported, else inferred); `figures`: the figures
    store (router.core.figures) whose reported running limits it reads."""

    def __init__(self, tuning: Tuning = DEFAULT, *, forgetting: float = 0.99, deadband: float = 0.01,
                 max_running: int | None = None, priors: Mapping[str, tuple[float, float]] | None = None,
                 defer_fits: bool = False, seen: Callable[[str], None] | None = None,
                 figures: Figures | None = None) -> None:
        self.t = tuning
        self.forgetting = forgetting
        self.deadband = deadband
        self.max_running = max_running
        self.priors = dict(priors or {})
        # Big refits are left to learn() (SpeedModel.defer): the router runs them in steps between its other work.
        self.defer_fits = defer_fits
        self.seen = seen
        self.figures = figures if figures is not None else Figures()
        self.replaying = False
        self.reset()
        self.prefill: dict[str, PrefillModel] = {}  # by pool name, by backend URL, and EVERY
        self.witness: dict[str, QueueWitness] = {}  # the queue limit of the others, inferred (router.queuelimit)
        # What fed the models while the covariate is unmeasured, in order: the models are rebuilt from it, the
        # samples moved, once it is (rebuild). None once rebuilt or after max_early samples.
        self.early: list[Event] | None = []
        self.prompt_mix = 0.0  # EWMA of every request's uncached prompt tokens: the typical prompt (prompt_shift)
        self.prompts = 0

    def reset(self) -> None:
        """The speed models and what follows from the samples they hold, empty (at start, and for rebuild)."""
        self.pending: dict[str, list] = {}  # key -> [its refit under way (None: not begun), load of its last sample]
        self.models: dict[str, SpeedModel] = {}  # by pool name and by backend URL
        # pool -> the one instance that has fed its model so far: the two are then one object (fed).
        self.sole: dict[str, str] = {}
        self.split: set[str] = set()  # pools fed by more than one instance
        self.published: dict[str, Params] = {}
        self.published_at: dict[str, int] = {}  # the samples its model held when each copy was published
        self.spreads: dict[str, float] = {}  # published per-request spread of each model (log, robust sd)
        self.bounded: dict[str, tuple[Params, int, Params]] = {}  # url -> (params, most seen, them bounded) (provisional)
        self.finished = 0  # samples taken

    # ---- models
    def model(self, key: str, pool: str) -> SpeedModel:
        m = self.models.get(key)
        if m is None:
            m = self.models[key] = SpeedModel(self.forgetting, self.priors.get(pool), self.t)
            m.max_running = self.max_running
            m.defer = self.defer_fits
            self.published[key] = m.params()
            self.spreads[key] = m.spread
        return m

    def pool_model(self, pool: str) -> SpeedModel:
        return self.model(pool, pool)

    def samples(self, pool: str) -> int:
        m = self.models.get(pool)
        return 0 if m is None else m.samples

    def key(self, b: BackendView) -> str | None:
        """Which model a decision uses for backend b: its own, its pool's, or None (a guess, see params)."""
        m = self.models.get(b.url)
        if m is not None and m.samples >= self.t.min_instance_samples:
            return b.url
        pm = self.model(b.pool, b.pool)
        if pm.samples < self.t.min_pool_samples and b.pool not in self.priors:
            return None
        return b.pool

    def stderr(self, b: BackendView) -> float:
        """Relative standard error of the model's speed for one more request on b: its per-request spread
        (shrunk toward prior_spread while it has few samples) over the square root of the samples it holds at
        that load, busier than low_load plus the pseudo-samples that band's estimate is shrunk toward the line by
        (speedmodel.shrink); `unmeasured` at least where it holds none there (the line's extrapolation).

        Busy, the band's own samples alone undercount what is known: its estimate is mostly the line, fitted on
        all samples. At light load the line is at its edge, where bands sit 15-30% off it, so only the band's own
        samples count there."""
        key = self.key(b)
        if key is None:
            return 0.0
        t = self.t
        m = self.models[key]
        k = m.samples
        s = self.spreads.get(key, 0.0)
        held = m.band_samples(b.load_estimate + 1)
        if b.pool in self.priors:
            # Curves from a calibration: measured at every load already, its own samples' scatter only.
            return s / math.sqrt(max(held, 1))
        s = math.sqrt((k * s * s + t.prior_spread_n * t.prior_spread ** 2) / (k + t.prior_spread_n))
        pseudo = shrink(s, t) if b.load_estimate >= t.low_load else 0.0
        return s / math.sqrt(held + pseudo) if held else max(s, t.unmeasured)

    def unsure(self, b: BackendView) -> float:
        """How unsure (relative) the model is of b's speed for one more request: its standard error times Student's
        t (t95) for the samples it holds at that load (exploration's interval, each side)."""
        key = self.key(b)
        held = 0 if key is None else self.models[key].band_samples(b.load_estimate + 1)
        t95 = self.t.t95
        t = t95[held - 1] if 1 <= held <= len(t95) else (math.inf if held < 1 else self.t.tie_z)
        return t * self.stderr(b)

    def spread(self, b: BackendView) -> float:
        """The published per-request scatter of the model a decision uses for b (0 while it has none)."""
        key = self.key(b)
        return 0.0 if key is None else self.spreads.get(key, 0.0)

    def params(self, b: BackendView) -> Params:
        """The published model a decision uses for backend b: its own once it has enough samples."""
        key = self.key(b)
        if key is None:
            # Knowing nothing of this pool, assume it is like the other one (or both neutral while neither is
            # known): the decision is then by load alone until this pool has been measured.
            o = other(b.pool)
            om = self.models.get(o)
            known = om is not None and (om.samples >= self.t.min_pool_samples or o in self.priors)
            src = self.published[o] if known else Params(*self.t.neutral)
            # All of it but the queue limit, shape included: a copy of the line alone, a few percent off the
            # original, lost every tie at equal loads, so this pool never got the samples that end the borrowing.
            return self.provisional(b, replace(src, max_running=self.model(b.pool, b.pool).max_running))
        return self.provisional(b, self.published[key])

    def provisional(self, b: BackendView, p: Params) -> Params:
        """p, or while b's queue limit is not known (none reported, set or inferred yet) and streams were seen, p
        limited to the most requests b was seen running at once: a request beyond that may wait behind a whole
        other one (a serial server), and the models' line says nothing of that until it has. A server that does
        run more shows it the first time it is sent one more, and the figure lifts (router.queuelimit)."""
        if p.max_running is not None or self.max_running is not None or self.reported(b.url) or not self.witness:
            return p
        w = self.witness.get(b.url)
        # One not yet seen at all counts as seen running one, once streams are seen on some backend: the first
        # requests' picks at two clients come before both servers have finished one.
        most = 1 if w is None else w.most
        got = self.bounded.get(b.url)
        if got is None or got[0] is not p or got[1] != most:
            got = self.bounded[b.url] = (p, most, replace(p, max_running=most))
        return got[2]

    def queues(self, b: BackendView) -> bool:
        """Would one more request wait in b's queue (its max_running_requests known and reached)?"""
        limit = self.params(b).max_running
        return limit is not None and b.load_estimate >= limit

    def fed(self, url: str, pool: str) -> tuple[str, ...]:
        """The models a sample or a load figure of `url` goes into: its own and its pool's. While one instance alone
        has fed its pool, the two are one object (the same samples in, the same fit out): updated and refitted once,
        not twice (the refits are most of the policy's CPU per request)."""
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

    def join(self, url: str, pool: str) -> None:
        """url answered /v1/loads: it feeds its pool's models from now on (logged for the rebuild when that changed)."""
        joined = (self.sole.get(pool), pool in self.split)
        self.fed(url, pool)
        if (self.sole.get(pool), pool in self.split) != joined:
            self.log(Joined(url, pool))

    def named(self, key: str) -> list[str]:
        """key, and the pools whose model is key's (fed)."""
        return [key, *(p for p, u in self.sole.items() if u == key)]

    def fold(self, pool: str, url: str, n: float, y: float) -> None:
        for key in self.fed(url, pool):
            m = self.model(key, pool)
            m.update(n, y)
            if m.due or key in self.pending:
                # Published when its refit has run (learn).
                self.pending.setdefault(key, [None, n])[1] = n
            else:
                for name in self.named(key):
                    self.publish(name, m, n)
        if self.seen is not None and not self.replaying:
            self.seen(pool)

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
                    for name in self.named(key):
                        self.publish(name, m, job[1])
        return bool(self.pending)

    def publish(self, key: str, m: SpeedModel, n: float) -> None:
        if abs(m.spread - self.spreads.get(key, 0.0)) > self.t.spread_band:
            self.spreads[key] = m.spread
        new, old = m.params(), self.published[key]
        # Follow the fit only when it moved by more than its own wobble (3 sigma) and the deadband, or once it
        # rests on twice the samples the published copy did: a copy made from one or two requests is not kept
        # against a fit of many (the 3-sigma band of a widely scattering server's first sample is wide).
        # Doubling is rare enough (log2 of the samples) not to flap.
        if m.samples >= 2 * self.published_at.get(key, 0):
            self.set(key, new, m)
            return
        band = max(self.deadband, 3 * m.noise())
        for at in (1.0, max(1.0, n)):
            if abs(new.throughput(at) - old.throughput(at)) > band * old.throughput(at):
                self.set(key, new, m)
                return
        if new.max_running != old.max_running:
            self.set(key, new, m)

    def set(self, key: str, p: Params, m: SpeedModel) -> None:
        self.published[key] = p
        self.published_at[key] = m.samples

    def rescale(self, url: str, pool: str, factor: float) -> None:
        """Scale the token time of the models url's samples feed, published at once (an accept-length jump)."""
        for key in self.fed(url, pool):
            m = self.model(key, pool)
            m.rescale(factor)
            for name in self.named(key):
                self.set(name, m.params(), m)

    def set_limit(self, url: str, pool: str, limit: int | None) -> None:
        """url's queue limit, reported or inferred, into the models its samples feed (None: not known)."""
        changed = False
        for key in self.fed(url, pool):
            m = self.model(key, pool)
            if m.max_running != limit:
                changed = True
                m.max_running = limit
                for name in self.named(key):
                    self.publish(name, m, 1.0)
        if changed:
            self.log(Limit(url, pool, limit))

    def log_rescale(self, url: str, pool: str, factor: float) -> None:
        self.log(Rescale(url, pool, factor))

    def reported(self, url: str) -> bool:
        """Did url's /v1/loads give its queue limit (the figures store's record)?"""
        return self.figures.reported(url)

    # ---- samples and the prompt covariate
    def observe(self, obs: Observation) -> None:
        """One finished exchange: its seconds per token, against the requests running then; its prefill."""
        t = self.t
        if obs.running_beside is not None and self.max_running is None and not self.reported(obs.url):
            w = self.witness.get(obs.url)
            if w is None:
                w = self.witness[obs.url] = QueueWitness(t.queue_witnesses)
            before = w.limit()
            w.note(obs.inflight_at_start, obs.running_beside)
            if w.limit() != before:
                self.set_limit(obs.url, obs.pool, w.limit())
        m = self.models.get(obs.url)
        limit = m.max_running if m is not None else self.max_running
        uncached = uncached_tokens(obs)
        if self.take(obs, limit, uncached):
            self.log(Take(obs, limit, uncached))
        if not obs.ok or uncached is None:
            self.unready()
            return
        self.prompts += 1
        self.prompt_mix += max(1.0 / t.prompt_mix_memory, 1.0 / self.prompts) * (uncached - self.prompt_mix)
        alone = obs.inflight_at_start == 1 and obs.ttft_s is not None and 0 < obs.ttft_s <= obs.duration_s
        for key in (obs.url, obs.pool, EVERY):
            pm = self.prefill.get(key)
            if pm is None:
                pm = self.prefill[key] = PrefillModel(self.forgetting, t)
            pm.note(uncached)
            if alone:
                pm.update(uncached, obs.ttft_s)
        if self.early is not None and self.prefill[EVERY].samples >= t.covariate_samples:
            self.rebuild()
        self.unready()

    def log(self, event: Event) -> None:
        """One thing that fed the models while the covariate is unmeasured, for the rebuild (max_early_log at most:
        beyond, the models stay as they are)."""
        if self.early is not None:
            self.early.append(event)
            if len(self.early) > self.t.max_early_log:
                self.early = None

    def unready(self) -> None:
        """max_early samples and still no covariate (a server never found idle): they stay as they were folded."""
        if self.unmoved() >= self.t.max_early:
            self.early = None

    def unmoved(self) -> int:
        """Samples folded unmoved and kept for the rebuild."""
        return sum(isinstance(event, Take) for event in self.early or ())

    def take(self, obs: Observation, limit: int | None, uncached: int | None) -> bool:
        """Fold one finished exchange's sample, moved to the typical prompt where the covariate is known; False
        when it says nothing usable."""
        got = sample(obs, limit, self.prompt_shift(obs.url, obs.pool, uncached))
        if got is None:
            return False
        self.fold(obs.pool, obs.url, got[0], got[1])
        self.finished += 1
        return True

    def rebuild(self) -> None:
        """The covariate is measured: the models start again from what fed them so far, in its order, the
        samples now moved to the typical prompt (the queue limits and accept-length rescales learned meanwhile
        kept). The decisions made meanwhile used the unmoved models. A cold router's first samples are folded
        unmoved (not held out) so that it decides on them meanwhile; two long prompts among them, unmoved for
        good, would misjudge a server for as long as exploration lasts."""
        log, self.early = self.early or [], None
        self.reset()
        self.replaying = True
        try:
            for event in log:
                event.replay(self)
        finally:
            self.replaying = False

    def prompt_shift(self, url: str, pool: str, uncached: int | None) -> float:
        """Seconds a prompt of `uncached` tokens costs on this server beyond the typical prompt (negative when
        shorter): its prefill model's per-token seconds times the difference; 0 until that model is measured
        (covariate_samples) or prompts do not vary: the instance's model, else its pool's, else all servers'
        together (a pool that drew a few long prompts first is moved before its own model is measured). Both
        pools' samples are moved to the one typical prompt, so which prompts each happened to draw does not
        decide which looks faster."""
        if uncached is None:
            return 0.0
        for key in (url, pool, EVERY):
            pm = self.prefill.get(key)
            if pm is not None and pm.samples >= self.t.covariate_samples:
                k = pm.per_token()
                return 0.0 if k is None else k * (uncached - self.prompt_mix)
        return 0.0

    def stall(self, b: BackendView) -> float:
        """Seconds one more request's prefill would hold up each request running on b (its prefill forward,
        from requests that found a server idle): its own instance's, else its pool's; 0 while unmeasured. For
        /router/state only: counted in the latency rule it cost more than it gained."""
        own = self.prefill.get(b.url)
        if own is not None and own.samples >= self.t.min_instance_prefill:
            return own.seconds()
        pm = self.prefill.get(b.pool)
        return pm.seconds() if pm is not None else 0.0
