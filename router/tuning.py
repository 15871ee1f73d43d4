"""Every tuning number of the adaptive policy, in one frozen, typed object passed in (experiments construct one
rather than patch module globals). Each field: its unit, then why. The measurements behind them: docs/BENCH.md,
"Adaptive: why its constants are what they are"."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tuning:
    # ---- one server's speed model (router.speedmodel)
    neutral: tuple[float, float] = (0.01, 0.0005)  # s/token alone, s/token per request more; a model with no prior starts here (100 tok/s alone, 2000 at saturation)
    prior_weight: float = 20.0  # samples; what a calibration curve given as a prior counts as, fading like them
    min_alpha: float = 1e-5  # s/token; the least token time alone a fit may give
    n_ref: float = 10.0  # requests; the prior's second pseudo-sample is at this typical load
    band_window: int = 128  # samples kept per load band (a band the traffic left keeps its own, faded by age)
    eager_fits: int = 32  # samples; a model refits at every one of its first this many
    refit_every: int = 4  # samples; then refits every this many, or every held/refit_share when more are held
    refit_share: int = 32  # divisor; once more are held, refits every held/this samples (a refit costs ~6 us a sample)
    huber: float = 2.5  # robust sds of log(measured / predicted); samples beyond are down-weighted (stalls, hiccups)
    min_scale: float = 0.02  # log sd; the least robust scatter a fit assumes (a few equal samples have none)
    err_gain: float = 0.05  # EWMA weight of the model's error on each new sample (about the last 20)
    band_shrink: float = 5.0  # pseudo-samples a band's shape factor is shrunk toward the line by, at shape_noise scatter
    shape_noise: float = 0.1  # relative; the scatter at which the shrink is band_shrink (it scales with (noise / this)^2)
    min_shrink: float = 0.04  # share of band_shrink a quiet server's bands are still shrunk by
    slope_prior: float = 0.25  # relative; how far one more request is believed to move a token time off the prior shape
    min_band_level: int = 3  # samples; a band's own median centres its clipping from here, before the line does
    memory_target: float = 0.03  # relative; a scattered server's model forgets no faster than keeps its curve this sure
    max_forgetting: float = 0.998  # weight kept per sample; the longest memory (~500 samples) that lets a model keep
    sync_fit: int = 128  # samples; a deferring model leaves refits over this many to its owner (they would hold the loop)
    fit_step: int = 256  # samples one step of such a refit goes over (~0.1-0.5 ms)
    prefill_min_spread: float = 0.05  # relative sd; prompt lengths varying less leave the prefill's per-token slope unknown
    queue_witnesses: int = 3  # requests in a row that could have shown a backend running more and did not: its limit is inferred
    # ---- the speed estimator: which model a decision uses, and how sure it is
    min_instance_samples: int = 20  # samples; an instance routes on its own model from here, before on its pool's
    min_pool_samples: int = 1  # samples; a pool with fewer (and no prior) borrows the other pool's model
    prior_spread: float = 0.1  # log sd; a young model's per-request scatter is shrunk toward this (one sample has none)
    prior_spread_n: int = 3  # pseudo-samples of that shrink
    unmeasured: float = 0.15  # relative; how unsure a load band with no sample is (the line alone was 15-30% off there)
    spread_band: float = 0.01  # log sd; the published spread moves only by more than this (decisions do not flap)
    # ---- the prompt covariate: samples moved to the typical prompt's prefill
    covariate_samples: int = 8  # idle samples; the prefill model moves samples from here (a prompt's scatter is mostly its prefill)
    min_instance_prefill: int = 3  # idle samples; an instance's own prefill model from here, before its pool's
    prompt_mix_memory: int = 100  # requests; the typical prompt is an EWMA over about this many uncached prompts
    # ---- accept-length drift
    accept_jump: float = 0.2  # relative; the least move of the reported accept length that rescales (it jitters 5-10%)
    accept_polls: int = 2  # polls in a row beyond the jump before a rescale
    accept_min_running: int = 4  # requests; a server running fewer reports a figure too scattered to judge
    accept_z: float = 3.0  # standard errors of the running mix's own swing a move must also exceed
    anchor_polls: int = 10  # polls; the anchor is their mean, then follows by 1/anchor_polls (one poll was too scattered)
    # ---- the decision rule
    low_load: int = 3  # requests; below this running, a decision is "light" (ties by throughput, exploration)
    near_tie: float = 0.03  # relative; per-request speeds this close are a tie the models cannot call
    tie_z: float = 2.0  # standard errors of the two predictions that widen the tie
    max_tie: float = 0.15  # relative; the widest tie
    spread_apart: float = 0.25  # share of the larger spread two spreads must differ by to be told apart (a spread on ~100 samples is known to ~12%)
    # ---- exploration
    explore_floor: float = 0.7  # share of the best score; exploration never picks a backend below it
    explore_load: int = 2  # requests; exploration only where the explored backend would run at most this many
    low_load_samples: int = 5  # samples at a light load that end exploration there, times (spread / prior_spread)^2
    max_low_load_samples: int = 32  # samples; the most that product asks for
    low_load_explore: float = 0.5  # share of decisions; the most a plausible pool is explored at (what a tie gets)
    fresh: int = 10  # decisions; random exploration only of a pool not picked in this many
    # Student's t, two-sided 95%, by samples held (1..10; tie_z from then on): a scatter from few samples is unsure
    t95: tuple[float, ...] = (math.inf, 12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26)

    @property
    def max_early(self) -> int:
        """Samples folded unmoved (and kept for the rebuild) before the covariate is measured, at most."""
        return 2 * self.covariate_samples

    @property
    def max_early_log(self) -> int:
        """Events the rebuild replays, at most (accept-length rescales may come while nothing finishes)."""
        return 4 * self.max_early

    @property
    def young_samples(self) -> int:
        """Samples in all below which busy decisions go to the less loaded backend (a line through a few light-load
        samples, extrapolated, routed worse than load alone): as many as are kept unmoved."""
        return self.max_early


DEFAULT = Tuning()
