"""Every tuning number of the adaptive policy, in one frozen, typed object passed in (experiments construct one
rather than patch module globals). Each field: its unit, then why. The measurements behind them: docs/BENCH.md,
"Adaptive: why its constants are what they are"."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tuning:
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
