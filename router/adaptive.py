"""The adaptive policy: learns each pool's (and instance's) speed online and routes on the learned models. Its
parts: the speed estimator (router.estimator), accept-length drift (router.acceptdrift), the decision rule
(router.rule) and exploration (router.explorer), all tuned by one router.tuning.Tuning."""
from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

from router.acceptdrift import AcceptDrift
from router.core.figures import Figures
from router.estimator import SpeedEstimator, sample, uncached_tokens
from router.explorer import Explorer
from router.policy import EXPLORE, GAIN, POOLS, BackendView, Decision, View, healthy, sole_pool
from router.rule import OBJECTIVES, DecisionRule
from router.speedmodel import SpeedModel
from router.tuning import DEFAULT, Tuning

if TYPE_CHECKING:
    from router.observe import LoadFigures, Observation

STATE_LOADS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the loads /router/state shows each model's per-request speed at

__all__ = ["OBJECTIVES", "STATE_LOADS", "Adaptive", "sample", "uncached_tokens"]


class Adaptive:
    """Route on speed models fitted online (router.speedmodel), one per pool and one per instance.

    The models feed on finished exchanges (observe); with load_signal backend, /v1/loads sets the queue limit and
    rescales them when the accept length moves. Routing uses a published copy of each model that moves only when
    the fit moved by more than `deadband`, so noise cannot flip decisions back and forth.

    The figures it shares with the prefix scorer (the running limits backends report, output tokens per request)
    it reads from `figures` (router.core.figures). router.pools.Pools shares its store (share_figures) and updates
    it once per event; a bare policy (tests, replays) keeps its own store up itself."""

    name = "adaptive"

    def __init__(self, *, objective: str = "latency", forgetting: float = 0.99, explore: float = 0.03,
                 deadband: float = 0.01, max_running: int | None = None,
                 priors: Mapping[str, tuple[float, float]] | None = None, defer_fits: bool = False,
                 tuning: Tuning = DEFAULT) -> None:
        self.tuning = tuning
        self.figures = Figures()
        self.keeps_figures = True  # no Pools updates its store: observe / observe_loads do (share_figures)
        self.speeds = SpeedEstimator(tuning, forgetting=forgetting, deadband=deadband, max_running=max_running,
                                     priors=priors, defer_fits=defer_fits, figures=self.figures)
        self.rule = DecisionRule(self.speeds, objective)
        self.explorer = Explorer(self.speeds, explore, objective)
        self.speeds.seen = self.explorer.seen
        self.drift = AcceptDrift(tuning)

    # The settings it was built with (/router/state, tests).
    objective = property(lambda self: self.rule.objective)
    explore = property(lambda self: self.explorer.explore)
    forgetting = property(lambda self: self.speeds.forgetting)
    deadband = property(lambda self: self.speeds.deadband)
    max_running = property(lambda self: self.speeds.max_running)
    priors = property(lambda self: self.speeds.priors)
    defer_fits = property(lambda self: self.speeds.defer_fits)

    def share_figures(self, figures: Figures) -> None:
        """Read `figures`, which router.pools.Pools updates (before this policy hears the same event)."""
        self.figures = self.speeds.figures = figures
        self.keeps_figures = False

    def pool_model(self, pool: str) -> SpeedModel:
        return self.speeds.pool_model(pool)

    # ---- decisions
    def decide(self, view: View, rng: random.Random) -> Decision | None:
        ex = self.explorer
        ex.decisions += 1
        spec, base = healthy(view.speculative), healthy(view.baseline)
        if not spec or not base:
            return sole_pool(view, bool(spec), rng, GAIN)
        s_score, s_b = self.rule.best(spec, rng)
        b_score, b_b = self.rule.best(base, rng)
        spec_first = self.rule.speculative_first(s_score, s_b, b_score, b_b)
        pick, alt = (s_b, b_b) if spec_first else (b_b, s_b)
        pick_sc, alt_sc = (s_score, b_score) if spec_first else (b_score, s_score)
        if ex.explore > 0 and ex.explores(pick, alt, pick_sc, alt_sc, rng):
            return self._send(alt, EXPLORE)
        return self._send(pick, GAIN)

    def _send(self, b: BackendView, reason: str) -> Decision:
        self.explorer.sent(b.pool)
        return Decision(b, reason)

    # ---- learning
    def observe(self, obs: Observation) -> None:
        if self.keeps_figures:
            self.figures.observe(obs)
        self.speeds.observe(obs)

    def learn(self, work: int | None = None) -> bool:
        return self.speeds.learn(work)

    def observe_loads(self, url: str, pool: str, figs: LoadFigures) -> None:
        """One /v1/loads answer of a backend: its max_running_requests and its accept length. (Its gen_throughput
        is not folded in: a decode-only window average on the server's clock, it drifted the models it was
        checked against; the router's own timings are the samples.)"""
        est = self.speeds
        if self.keeps_figures:
            self.figures.observe_loads(url, figs)
        # The setting, else the limit this answer reported (the store keeps it: router.core.figures).
        limit = figs.max_running if est.max_running is None else est.max_running
        est.join(url, pool)
        if limit is not None:
            est.set_limit(url, pool, limit)
        if figs.accept_length is not None and figs.accept_length > 0:
            spread = est.spreads.get(url, est.spreads.get(pool, 0.0))
            factor = self.drift.poll(url, figs.accept_length, figs.running, spread)
            if factor is not None:
                # Tokens per step moved (prompt mix, drafter): token time scales inversely, at once.
                est.rescale(url, pool, factor)
                est.log_rescale(url, pool, factor)

    # ---- what it learned, for /router/state and the metrics (through state())
    def predicted(self, backends: tuple[BackendView, ...]) -> float:
        """Tok/s the models predict for these backends at their current loads."""
        return sum(self.speeds.params(b).throughput(b.load_estimate) for b in backends)

    def accept_length(self, backends: tuple[BackendView, ...]) -> float:
        """Mean accept length these backends last reported (0 when none did)."""
        accept = self.drift.accept
        got = [accept[b.url] for b in backends if b.url in accept]
        return sum(got) / len(got) if got else 0.0

    def state(self, view: View) -> dict:
        est = self.speeds

        def describe(key: str, pool: str, b: BackendView | None = None) -> dict:
            m, pub = est.model(key, pool), est.published[key]
            priced = pub if b is None else est.provisional(b, pub)
            fit = m.params()
            return {"alpha_s": fit.alpha, "beta_s": fit.beta, "max_running": fit.max_running,
                    "samples": m.samples, "error": round(m.err, 4), "spread": round(est.spreads[key], 4),
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
            pm = est.prefill.get(key)
            if pm is None:
                return {"prefill_s": 0.0, "prefill_s_per_ktok": None, "prefill_samples": 0}
            k = pm.per_token()
            return {"prefill_s": round(pm.seconds(), 5), "prefill_s_per_ktok": None if k is None else round(k * 1e3, 5),
                    "prefill_samples": pm.samples, "uncached_tokens": round(pm.uncached, 1)}

        pools = {}
        for pool in POOLS:
            members = view.pool(pool)
            if not members:
                continue
            pools[pool] = describe(pool, pool) | prefill(pool) | {
                "predicted_tok_s": round(self.predicted(members), 1),
                "accept_length": self.accept_length(members)}
        backends = [describe(b.url, b.pool, b) | prefill(b.url) | {
            "url": b.url, "pool": b.pool, "healthy": b.healthy, "load": b.load_estimate,
            "accept_length": self.drift.accept.get(b.url),
            "uses": "instance" if est.models[b.url].samples >= self.tuning.min_instance_samples else "pool",
            "max_running_from": ("settings" if est.max_running is not None else "loads" if est.reported(b.url)
                                 else "inferred" if est.models[b.url].max_running is not None else None),
            # What the inference has seen (router.queuelimit): the most running at once, and the requests in a
            # row since that could have shown more and did not.
            "running_seen": est.witness[b.url].most if b.url in est.witness else None,
            "queue_witnesses": est.witness[b.url].tries if b.url in est.witness else None,
            "stall_s": round(est.stall(b), 5),
            "predicted_tok_s": round(est.params(b).throughput(b.load_estimate), 1)} for b in view.backends]
        return {"policy": self.name, "objective": self.objective, "forgetting": self.forgetting,
                "explore": self.explore, "deadband": self.deadband, "decisions": self.explorer.decisions,
                "tokens_per_request": round(self.figures.output_tokens, 1),
                # Samples folded unmoved, kept until the prompt covariate is measured (Tuning.max_early): the
                # models are then rebuilt from them moved.
                "samples_unmoved": est.unmoved(),
                "pools": pools, "backends": backends}
