"""An online speed model of one server: seconds per token per request t(n) = alpha + beta*n, robust and forgetting."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from router.tuning import DEFAULT, Tuning


def shrink(noise: float, t: Tuning = DEFAULT) -> float:
    """The pseudo-samples a load band's mean is shrunk toward the line by, for requests scattering by `noise`
    (relative): the band's estimate weighs its own samples against this many on the line, and is known as well
    as its samples and these together (the posterior of that shrink: what SpeedEstimator.stderr counts). The
    shrink is the empirical-Bayes one, noise^2 / tau^2 with tau = shape_noise / sqrt(band_shrink) how far a band
    is believed to sit off the line; not capped (capped, a widely scattering server's band follows its noise)."""
    return t.band_shrink * max(t.min_shrink, (noise / t.shape_noise) ** 2)


EDGES = (1.0, 1.5, 2.5, 3.5, 8.0, 16.0, 32.0, 64.0, math.inf)  # band k holds loads from EDGES[k] up to EDGES[k + 1]


def band(n: float) -> int:
    """The load band of n running requests: one per request count below 4 (1 -> 0, 2 -> 1, 3 -> 2, to the
    nearest), then doubling: 4-7 -> 3, 8-15 -> 4, ..., 32-63 -> 6, 64+ -> 7.

    Light load has a band per count because the decisions there are between one, two and three running, and a
    server is least a straight line there (a speculative server alone runs ~8% faster than a line fitted to
    busier traffic says); with 2-3 in one band, samples at 1.7 running pull the estimate alone toward the line's
    error."""
    if n < 3.5:
        return max(int(n + 0.5), 1) - 1
    return max(int(n), 4).bit_length()


@dataclass(frozen=True, slots=True)
class Params:
    """A fitted model: X(n) = m / (alpha + beta*m) tok/s with m = min(n, max_running) running requests
    (beyond max_running requests wait in the server's queue and add no throughput)."""

    alpha: float  # seconds per token of a request running alone
    beta: float  # seconds per token added by each other running request
    max_running: int | None = None
    # (band, factor, load): measured token time over the line's, in the load bands where the model has samples,
    # and the mean load of those samples (where the factor holds), in band order
    shape: tuple[tuple[int, float, float], ...] = ()

    # (n, token time) at each shaped band's load, never falling: computed once from alpha, beta and shape.
    knots: tuple[tuple[float, float], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.shape:
            knots, top = [], 0.0
            for _, f, at in self.shape:
                top = max(top, self.line(at) * f)
                knots.append((at, top))
            object.__setattr__(self, "knots", tuple(knots))

    def line(self, n: float) -> float:
        return self.alpha + self.beta * n

    def running(self, n: float) -> float:
        return n if self.max_running is None else min(n, float(self.max_running))

    def token_time(self, n: float) -> float:
        """Seconds per token of each of n running requests. With a shape: through each measured band's point
        (its samples' mean load), straight between two of them, never falling as n rises (one more request
        running makes no request faster; a factor constant over each band made the curve a sawtooth: saturating
        baselines were learned faster at 16 running than at 12). Outside the points: the line times the nearest
        band's factor within that band, the line beyond it, held so that it never falls."""
        n = max(n, 1.0)
        t = self.line(n)
        if not self.shape:
            return t
        knots = self.knots
        if n >= knots[-1][0]:
            k, f, _ = self.shape[-1]
            upper = EDGES[k + 1]
            return max(knots[-1][1], self.line(min(n, upper)) * f, t if n >= upper else 0.0)
        if n <= knots[0][0]:
            k, f, _ = self.shape[0]
            lower = EDGES[k]
            return t * f if n >= lower else min(t, self.line(lower) * f)
        lo_n, lo_t = knots[0]
        for hi_n, hi_t in knots[1:]:
            if n <= hi_n:
                return lo_t + (hi_t - lo_t) * (n - lo_n) / (hi_n - lo_n)
            lo_n, lo_t = hi_n, hi_t
        return knots[-1][1]  # not reached: n < the last centre

    def throughput(self, n: float) -> float:
        """Output tok/s of the server with n requests in flight."""
        m = self.running(n)
        return 0.0 if m <= 0 else m / self.token_time(m)

    def request_speed(self, n: int) -> float:
        """Tok/s a new request gets on a server already holding n: X(n+1)/(n+1), falls as 1/n once queued."""
        return self.throughput(n + 1) / (n + 1)

    def marginal_gain(self, n: int) -> float:
        """Tok/s the server gains from one more request: X(n+1) - X(n); 0 once it queues."""
        return self.throughput(n + 1) - self.throughput(n)


class SpeedModel:
    """Weighted least squares of y = alpha + beta*n over the last band_window samples of each load band (n
    running, y seconds per token per request), on relative errors (a request at high load weighs as much as
    one alone), with weights forgetting^age so it follows drift, and Huber weights around the median error so stalled
    requests and hiccups do not drag the fit (refitted a few times from the last fit: IRLS). A prior
    (from a calibration curve) counts as `prior_weight` samples and fades like one."""

    __slots__ = ("forgetting", "theta", "prior", "prior_weight", "bands", "samples", "err", "scale", "max_running",
                 "_since_fit", "shape", "counts", "spread", "defer", "due", "epoch", "t")

    def __init__(self, forgetting: float = 0.99, prior: tuple[float, float] | None = None,
                 tuning: Tuning = DEFAULT) -> None:
        self.t = tuning
        self.forgetting = forgetting
        self.prior = prior
        self.prior_weight = tuning.prior_weight
        self.theta = list(prior if prior is not None else tuning.neutral)
        self.bands: dict[int, deque[tuple[float, float, int]]] = {}  # load band -> its latest (n, y, sample no.)
        self.samples = 0
        self.err = 0.0  # EWMA of |relative error| of the prediction made before each sample
        self.scale = 0.0  # robust standard deviation of log(measured / predicted) at the last fit
        self.max_running: int | None = None
        self._since_fit = 0
        self.shape: tuple[tuple[int, float], ...] = ()
        self.counts: dict[int, int] = {}  # samples held per load band
        self.spread = 0.0  # robust standard deviation of one request's log(measured / model), shape included
        # Leave a refit over sync_fit samples or more to the owner (due, fit_steps), who runs it fit_step samples
        # at a time between the event loop's other work: run at once, each such refit holds every stream.
        self.defer = False
        self.due = False  # a refit is due and left to the owner
        self.epoch = 0  # counts rescale()s: a refit begun before one is of the old scale and is dropped

    def params(self) -> Params:
        a, b = self.theta
        return Params(max(a, self.t.min_alpha), max(b, 0.0), self.max_running, self.shape)

    def held(self) -> int:
        """Samples held over all load bands."""
        return sum(len(b) for b in self.bands.values())

    def band_samples(self, n: float) -> int:
        """Samples the model holds at about n running (n's load band)."""
        return self.counts.get(band(n), 0)

    def predict(self, n: float) -> float:
        return self.params().token_time(n)

    def update(self, n: float, y: float) -> float:
        """Fold in one sample: n requests running (>= 1), y seconds per token per request. Returns the
        relative error the model had on it before the update."""
        if not (n >= 1 and y > 0 and math.isfinite(y) and math.isfinite(n)):
            return 0.0
        rel = abs(self.predict(n) - y) / y
        t = self.t
        gain = t.err_gain if self.samples >= 1.0 / t.err_gain else 1.0 / (self.samples + 1)
        self.err += gain * (min(rel, 1.0) - self.err)
        held = self.bands.get(band(n))
        if held is None:
            held = self.bands[band(n)] = deque(maxlen=t.band_window)
        held.append((float(n), y, self.samples))
        self.samples += 1
        self._since_fit += 1
        # Refit every refit_every samples, or every held/refit_share when more are held (~6 us per sample held).
        if self.samples <= t.eager_fits or self._since_fit >= max(t.refit_every, self.held() // t.refit_share):
            if self.defer and self.held() >= t.sync_fit:
                self.due = True
            else:
                self.fit()
        return rel

    def fit(self) -> None:
        for _ in self.fit_steps():
            pass

    def fit_steps(self, step: int | None = None) -> Iterator[int]:
        """The refit, in steps of about `step` samples each: yields the samples each step went over. Works on the
        samples held when it began; the model changes only at its end, all at once (the line, its shape, its
        spread), and not at all when the model was rescaled meanwhile (then another refit is due)."""
        t = self.t
        step = t.fit_step if step is None else step
        self._since_fit = 0
        self.due = False
        epoch = self.epoch
        lam = self.memory()
        data: list[tuple[float, float]] = []
        ages: list[float] = []
        last = self.samples - 1
        for held in self.bands.values():
            for n, y, no in held:
                data.append((n, y))
                ages.append(lam ** (last - no))
        m, age_sum = len(data), sum(ages)
        yield m
        a, b = self.theta
        pa, pb = self.prior if self.prior is not None else t.neutral
        r = pb / pa  # the prior shape the slope's ridge pulls toward
        for _ in range(3):
            preds: list[float] = []
            lrs: list[float] = []
            for i in range(0, m, step):
                part = [max(a + b * n, t.min_alpha) for n, _ in data[i:i + step]]
                lrs += [math.log(y / p) for (_, y), p in zip(data[i:i + step], part, strict=True)]
                preds += part
                yield len(part)
            med = sorted(lrs)[m // 2]
            mad = sorted(abs(x - med) for x in lrs)[m // 2]
            s = max(1.4826 * mad, t.min_scale)
            # Normal equations of sum w (y - a - b n)^2 with w = age * huber / y_hat^2 (relative errors).
            s00 = s01 = s11 = t0 = t1 = 0.0
            for i in range(0, m, step):
                for (n, y), p, lr, age in zip(data[i:i + step], preds[i:i + step], lrs[i:i + step], ages[i:i + step],
                                              strict=True):
                    w = age / (p * p)
                    # Around the median, not 0: when the fit is far off (a first sample that was an outlier), the
                    # bulk of the samples still agree with each other and the strays are the ones left out.
                    dev = abs(lr - med)
                    if dev > t.huber * s:
                        w *= (t.huber * s / dev) ** 2
                    s00 += w
                    s01 += w * n
                    s11 += w * n * n
                    t0 += w * y
                    t1 += w * n * y
                yield min(step, m - i)
            if self.prior is not None:
                # The prior as pseudo-samples at n=1 and n=n_ref, fading as the data comes in.
                wp = self.prior_weight * lam ** self.samples / 2
                for n in (1.0, t.n_ref):
                    yp = pa + pb * n
                    w = wp / (yp * yp)
                    s00 += w
                    s01 += w * n
                    s11 += w * n * n
                    t0 += w * yp
                    t1 += w * n * yp
            # The slope is as sure as the samples' spread in load makes it, against a prior belief (the prior's or
            # the neutral shape, b/a) worth (s / slope_prior)^2 samples a request apart: a ridge on b - r a. Loads
            # that barely differ leave the shape (a steep slope from samples at 1 and 1.13 running would shut a server
            # out of every busier load); a few requests a whole request apart that took twice as long (a server
            # that serves one at a time) move it.
            mu = (s / t.slope_prior) ** 2 * s00 / max(age_sum, 1e-12)
            r00, r01, r11 = s00 + mu * r * r, s01 - mu * r, s11 + mu
            det = r00 * r11 - r01 * r01
            if det > 0:
                a, b = (r11 * t0 - r01 * t1) / det, (r00 * t1 - r01 * t0) / det
            if b < 0:
                # A flat or falling curve is noise: no slope, the weighted mean level.
                b = 0.0
                a = t0 / s00
            a = max(a, t.min_alpha)
        shape, counts = yield from self._fit_shape(data, ages, a, b, s, step)
        spread = yield from self._fit_spread(data, Params(a, max(b, 0.0), self.max_running, shape), step)
        if epoch != self.epoch:
            self.due = True
            return
        self.theta = [a, b]
        self.scale = s
        self.shape, self.counts, self.spread = shape, counts, spread

    @staticmethod
    def _fit_spread(data, p: Params, step: int) -> Iterator[int]:
        """How far one request's token time scatters around the model (line and shape), robustly (MAD): what
        the server does to a request beyond its load, e.g. a speculative server's per-request acceptance."""
        devs: list[float] = []
        for i in range(0, len(data), step):
            devs += [abs(math.log(y / p.token_time(n))) for n, y in data[i:i + step]]
            yield min(step, len(data) - i)
        devs.sort()
        return 1.4826 * devs[len(devs) // 2] if devs else 0.0

    def _fit_shape(self, data, ages, a, b, s, step: int) -> Iterator[int]:
        """Per load band: the age-weighted mean of measured / line, each sample's deviation clipped at `huber`
        robust deviations around the band's median (a stalled request cannot bend a band; a band the line
        misses by 25% is still followed), shrunk toward the line by `band_shrink` samples (fewer when the
        samples are quiet, more when they scatter) against the band's effective sample count (Kish: (sum w)^2 / sum w^2). That
        count does not fall when all of a band's samples fade alike: a band the traffic left long ago keeps
        its correction instead of falling back on the line, which the busy band alone now sets (shrinking by
        the faded weights' sum, a bend at 1 running came back 15% off after 300 samples at 3-5)."""
        t = self.t
        a, b = max(a, t.min_alpha), max(b, 0.0)
        per: dict[int, list[tuple[float, float]]] = {}
        loads: dict[int, float] = {}  # per band: the age-weighted sum of its samples' loads
        for i in range(0, len(data), step):
            for (n, y), age in zip(data[i:i + step], ages[i:i + step], strict=True):
                k = band(n)
                per.setdefault(k, []).append((y / (a + b * n) - 1.0, age))
                loads[k] = loads.get(k, 0.0) + age * n
            yield min(step, len(data) - i)
        counts = {k: len(v) for k, v in per.items()}
        centres = {k: sorted(r for r, _ in rs)[len(rs) // 2] if len(rs) >= t.min_band_level else 0.0
                   for k, rs in per.items()}
        # The requests' own scatter, within bands (the line's misfit between bands is not noise).
        within = sorted(abs(r - centres[k]) for k, rs in per.items() if len(rs) >= t.min_band_level for r, _ in rs)
        noise = max(1.4826 * within[len(within) // 2], t.min_scale) if within else s
        yield len(data)
        lim = t.huber * noise
        pseudo = shrink(noise, t)
        got: dict[int, float] = {}
        effs: dict[int, float] = {}
        at: dict[int, float] = {}  # where in the band its factor is measured: its samples' mean load
        for k, rs in per.items():
            centre = centres[k]
            w = sum(age for _, age in rs)
            w2 = sum(age * age for _, age in rs)
            if w > 0 and w2 > 0:
                sr = sum(age * min(max(r, centre - lim), centre + lim) for r, age in rs)
                eff = w * w / w2
                got[k] = 1.0 + (sr / w) * eff / (eff + pseudo)
                effs[k] = eff
                at[k] = min(max(loads[k] / w, EDGES[k]), EDGES[k + 1])
        got = monotone(got, effs, at, a, b)
        # A band between two measured ones is on the straight line between their points (Params.token_time), not
        # on the fitted line, which measured bands either side bend off the server where it has no samples.
        yield len(data)
        return tuple((k, got[k], at[k]) for k in sorted(got)), counts

    def rescale(self, factor: float) -> None:
        """Scale the whole curve's token time (the server's tokens per step changed by 1/factor), the samples
        held included, so the next fit starts from the new level rather than averaging the old one in."""
        if factor > 0 and factor != 1.0:
            self.epoch += 1
            self.theta = [self.theta[0] * factor, self.theta[1] * factor]
            self.bands = {k: deque(((n, y * factor, no) for n, y, no in held), maxlen=self.t.band_window)
                          for k, held in self.bands.items()}
            if self.prior is not None:
                self.prior = (self.prior[0] * factor, self.prior[1] * factor)

    def memory(self) -> float:
        """The forgetting factor in use: the configured one, or slower where the requests scatter widely."""
        t = self.t
        if self.spread <= t.memory_target:
            return self.forgetting
        return max(self.forgetting, min(t.max_forgetting, 1.0 - (t.memory_target / self.spread) ** 2))

    def noise(self) -> float:
        """Relative standard deviation of the fitted curve itself (what its estimate wobbles by under noise)."""
        lam = self.memory()
        held = self.held()
        eff = min(held, (1 + lam) / (1 - lam) if lam < 1 else held)
        return self.scale / math.sqrt(eff) if eff > 0 else 0.0


def monotone(factors: dict[int, float], weights: dict[int, float], at: dict[int, float], a: float,
             b: float) -> dict[int, float]:
    """The bands' factors made to give a token time that never falls from one band's centre to the next: the
    weighted least-squares fit under that order (pool-adjacent violators, each band weighing its effective
    sample count), so two bands that disagree meet where their samples put them rather than the later one
    being raised to the earlier. Unchanged where the order already holds."""
    ks = sorted(factors)
    blocks: list[list[float]] = []  # [weighted sum of token times, weight, bands in the block]
    for k in ks:
        t, w = (a + b * at[k]) * factors[k], max(weights.get(k, 0.0), 1e-9)
        blocks.append([t * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w
            blocks[-1][2] += c
    out, i = {}, 0
    for s, w, c in blocks:
        for k in ks[i:i + c]:
            out[k] = factors[k] if c == 1 else (s / w) / (a + b * at[k])
        i += c
    return out


class PrefillModel:
    """A server's prefill forward: seconds = fixed + per_token * uncached prompt tokens, fitted (weighted least
    squares, forgetting per sample) on the time to first token of requests that found the server idle: there
    the first token is that forward alone, which is also what the forward costs every request running beside it
    (the batch waits for it). Kept apart from the speed model's whole-duration token times, which hold a
    request's own prefill and the stalls others caused it but not the stall it causes the others."""

    __slots__ = ("forgetting", "w", "su", "suu", "st", "sut", "samples", "uncached", "seen", "t")

    def __init__(self, forgetting: float = 0.99, tuning: Tuning = DEFAULT) -> None:
        self.t = tuning
        self.forgetting = forgetting
        self.w = self.su = self.suu = self.st = self.sut = 0.0
        self.samples = 0
        self.uncached = 0.0  # EWMA of every request's uncached prompt tokens: the mix a stall is predicted for
        self.seen = 0

    def note(self, uncached: float) -> None:
        """Any finished request's uncached prompt tokens (alone or not)."""
        if uncached >= 0 and math.isfinite(uncached):
            self.seen += 1
            self.uncached += max(0.05, 1.0 / self.seen) * (uncached - self.uncached)

    def update(self, uncached: float, ttft: float) -> None:
        """One request that found the server idle: its uncached prompt tokens and its time to first token."""
        if not (uncached >= 0 and ttft > 0 and math.isfinite(ttft) and math.isfinite(uncached)):
            return
        lam = self.forgetting
        self.w = self.w * lam + 1.0
        self.su = self.su * lam + uncached
        self.suu = self.suu * lam + uncached * uncached
        self.st = self.st * lam + ttft
        self.sut = self.sut * lam + uncached * ttft
        self.samples += 1

    def per_token(self) -> float | None:
        """Seconds per uncached prompt token, when the lengths seen vary enough to tell it from the fixed part."""
        if self.samples < 3:
            return None
        mu = self.su / self.w
        var = self.suu / self.w - mu * mu
        if mu <= 0 or var <= (self.t.prefill_min_spread * mu) ** 2:
            return None
        return max(0.0, (self.sut / self.w - mu * self.st / self.w) / var)

    def seconds(self, uncached: float | None = None) -> float:
        """The forward's predicted seconds for `uncached` tokens (default: this server's recent mix); 0 unknown.
        With the slope unknown, the mean of what was measured (prompts of one length: the fixed part and the
        per-token part cannot be told apart, and their sum is what was seen)."""
        if self.samples == 0:
            return 0.0
        mean_t = self.st / self.w
        k = self.per_token()
        if k is None:
            return mean_t
        u = self.uncached if uncached is None else uncached
        return max(0.0, mean_t + k * (u - self.su / self.w))
