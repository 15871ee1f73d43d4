"""Throughput curves of one pool, measured or modelled, and what routing does with two of them: spillover,
round-robin, balanced and global modelled on the curves, the threshold recommendation, and a profile's model curve
(the arithmetic behind calibrate, compare, demo, drift, modelcheck and plan)."""
from __future__ import annotations

from dataclasses import dataclass

from bench import figures
from bench.load import BenchInputError
from router.curves import curve_throughput, interpolate, parse_curve, request_speed

# The demo's and drift's modelled curves: levels and the prompt length they are predicted at.
PROMPT_TOKENS = 23
CURVE_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

OBJECTIVES = ("throughput", "latency")
SCORE_TIE = 0.005


@dataclass
class Curve:
    """One pool's measured figures vs concurrency, interpolated between the measured levels."""

    levels: list[int]
    tput: list[float]  # output tok/s
    e2e: list[float]  # median E2E ms

    @classmethod
    def from_figs(cls, figs: list[dict]) -> Curve:
        pts = sorted((f["concurrency"], figures.tput(f), f["median_e2e_latency_ms"])
                     for f in figs if f.get("completed"))
        if not pts:
            raise BenchInputError("no level of this pool completed a request; nothing to calibrate on")
        return cls([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])

    def throughput(self, c: float) -> float:
        """Linear between measured levels, 0 at 0, flat beyond the last (a saturated server)."""
        return curve_throughput(tuple(zip(self.levels, self.tput, strict=True)), c)

    def latency(self, c: float) -> float:
        """Median E2E ms; beyond the last level requests queue, so latency grows in proportion to c."""
        if c <= self.levels[0]:
            return self.e2e[0]
        if c > self.levels[-1]:
            return self.e2e[-1] * c / self.levels[-1]
        return interpolate(tuple(zip(self.levels, self.e2e, strict=True)), c)

    @classmethod
    def from_setting(cls, setting: str) -> Curve:
        """A curve from the router's `*_curve` setting ("1:77.5,2:125.1,..."; no latencies: 1.0 each)."""
        pts = parse_curve(setting)
        return cls([int(c) for c, _ in pts], [t for _, t in pts], [1.0] * len(pts))


@dataclass
class Fleet:
    """`n` instances of one measured server; the router's least-in-flight choice spreads load evenly."""

    curve: Curve
    n: int = 1

    def throughput(self, c: float) -> float:
        return self.n * self.curve.throughput(c / self.n)

    def latency(self, c: float) -> float:
        return self.curve.latency(c / self.n)


def spillover(spec, base, threshold: int, c: int, n_spec: int = 1) -> tuple[float, float]:
    """Expected (tok/s, median E2E ms) at `c` concurrent requests: in a closed loop spillover keeps
    min(c, threshold x instances) in flight on the speculative pool and the rest on the baseline."""
    cs = min(c, threshold * n_spec)
    cb = c - cs
    tput = spec.throughput(cs) + base.throughput(cb)
    return tput, _mixed_median(spec, cs, base, cb)


def _mixed_median(spec: Curve, cs: float, base: Curve, cb: float) -> float:
    """Median latency of the completed requests of two groups: each group completes requests at
    in-flight / latency (Little's law); the median falls in the group holding the middle request."""
    groups = [(g.latency(n), n / g.latency(n)) for g, n in ((spec, cs), (base, cb)) if n > 0]
    if len(groups) == 1:
        return groups[0][0]
    groups.sort()
    share = groups[0][1] / (groups[0][1] + groups[1][1])
    if abs(share - 0.5) < 1e-9:
        return (groups[0][0] + groups[1][0]) / 2
    return groups[0][0] if share > 0.5 else groups[1][0]


def round_robin_split(spec, base, c: int, n_spec: int = 1, n_base: int = 1) -> float:
    """In-flight requests on the speculative pool when requests are dealt in turn to every backend in a
    closed loop: each backend completes requests at the same rate, so the slower pool holds more."""
    lo, hi = 0.0, float(c)
    for _ in range(60):
        cs = (lo + hi) / 2
        if spec.throughput(cs) / n_spec < base.throughput(c - cs) / n_base:
            lo = cs
        else:
            hi = cs
    return (lo + hi) / 2


def round_robin(spec, base, c: int, n_spec: int = 1, n_base: int = 1) -> tuple[float, float]:
    """Expected (tok/s, median E2E ms) of round-robin at `c` concurrent requests."""
    cs = round_robin_split(spec, base, c, n_spec, n_base)
    return spec.throughput(cs) + base.throughput(c - cs), _mixed_median(spec, cs, base, c - cs)


def curve_points(curve: Curve) -> tuple[tuple[float, float], ...]:
    """The router's `*_curve` setting of one measured pool: (concurrency, tok/s) of each measured level."""
    return tuple((float(c), round(t, 1)) for c, t in zip(curve.levels, curve.tput, strict=True))


def curve_setting(curve: Curve) -> str:
    """`*_curve` as a flag / env value: "1:77.5,2:125.1,..."."""
    return ",".join(f"{c:g}:{t:g}" for c, t in curve_points(curve))


def balanced_split(spec: Curve, base: Curve, c: int, n_spec: int = 1, n_base: int = 1) -> list[int]:
    """In-flight requests per instance (speculative instances first) when the router's balanced policy
    places `c` requests one at a time: each goes to the least-loaded instance of the pool whose
    X(n+1)/(n+1) is higher, ties to speculative (router.policies.Balanced, on the same curves)."""
    sp, bp = curve_points(spec), curve_points(base)
    counts = [0] * (n_spec + n_base)
    for _ in range(c):
        i = min(range(n_spec), key=lambda k: counts[k])
        j = min(range(n_spec, n_spec + n_base), key=lambda k: counts[k])
        counts[i if request_speed(sp, counts[i]) >= request_speed(bp, counts[j]) else j] += 1
    return counts


def balanced(spec: Curve, base: Curve, c: int, n_spec: int = 1, n_base: int = 1) -> tuple[float, float]:
    """Expected (tok/s, median E2E ms) of the balanced policy at `c` concurrent requests."""
    counts = balanced_split(spec, base, c, n_spec, n_base)
    tput = sum(spec.throughput(k) for k in counts[:n_spec]) + sum(base.throughput(k) for k in counts[n_spec:])
    cs = sum(counts[:n_spec])
    return tput, _mixed_median(Fleet(spec, n_spec), cs, Fleet(base, n_base), c - cs)


@dataclass
class Recommendation:
    threshold: int
    objective: str
    scores: dict[int, float]  # threshold -> mean fraction of the best achievable per level
    best_per_level: dict[int, int]  # level -> the threshold that would be best at that level alone
    expected: dict[int, dict]  # level -> expected figures of the recommendation and the alternatives
    notes: list[str]
    worst: dict[int, float]  # threshold -> its worst level's ratio to the best of the alternatives


def recommend(spec_curve: Curve, base_curve: Curve, levels: list[int], objective: str = "throughput",
              n_spec: int = 1, n_base: int = 1) -> Recommendation:
    """The threshold (per speculative instance) that maximises, averaged over `levels` with each level
    weighted alike, the fraction of the best achievable combined throughput (or lowest median latency).
    `levels` are client concurrencies against the whole deployment of n_spec + n_base instances."""
    spec, base = Fleet(spec_curve, n_spec), Fleet(base_curve, n_base)
    candidates = range(0, -(-max(levels) // n_spec) + 1)
    pred = {t: {c: spillover(spec, base, t, c, n_spec) for c in levels} for t in candidates}
    idx = 0 if objective == "throughput" else 1
    if objective == "throughput":
        best = {c: max(pred[t][c][0] for t in candidates) for c in levels}
        frac = {t: {c: (pred[t][c][0] / best[c] if best[c] else 0.0) for c in levels} for t in candidates}
    else:
        best = {c: min(pred[t][c][1] for t in candidates) for c in levels}
        frac = {t: {c: best[c] / pred[t][c][1] for c in levels} for t in candidates}
    scores = {t: sum(frac[t].values()) / len(levels) for t in candidates}
    top = max(scores.values())
    # The alternatives a user would otherwise run: each pool alone, and round-robin.
    alt = {}
    for c in levels:
        rr = round_robin(spec, base, c, n_spec, n_base)
        opts = [(base.throughput(c), base.latency(c)), (spec.throughput(c), spec.latency(c)), rr]
        alt[c] = max(o[0] for o in opts) if idx == 0 else min(o[1] for o in opts)
    worst = {t: min((pred[t][c][0] / alt[c]) if idx == 0 else (alt[c] / pred[t][c][1]) for c in levels)
             for t in candidates}
    # Scores closer than SCORE_TIE are within what a sweep can resolve; among those, take the threshold
    # whose worst level against the alternatives is best, then the smaller one.
    near = [t for t in candidates if scores[t] >= top - SCORE_TIE]
    threshold = min(near, key=lambda t: (-round(worst[t], 6), t))
    best_per_level = {}
    for c in levels:
        vals = {t: pred[t][c][idx] for t in candidates}
        goal = max(vals.values()) if idx == 0 else min(vals.values())
        best_per_level[c] = min(t for t in candidates if abs(vals[t] - goal) <= 1e-9 * max(1.0, abs(goal)))
    expected = {}
    for c in levels:
        rr = round_robin(spec, base, c, n_spec, n_base)
        bal = balanced(spec_curve, base_curve, c, n_spec, n_base)
        expected[c] = {
            "spillover": pred[threshold][c][0], "spillover_median_e2e_ms": pred[threshold][c][1],
            "best_threshold_here": best_per_level[c],
            "best_here": pred[best_per_level[c]][c][0],
            "all-baseline": base.throughput(c), "all-baseline_median_e2e_ms": base.latency(c),
            "all-speculative": spec.throughput(c), "all-speculative_median_e2e_ms": spec.latency(c),
            "round-robin": rr[0], "round-robin_median_e2e_ms": rr[1],
            "balanced": bal[0], "balanced_median_e2e_ms": bal[1],
            "balanced_speculative_inflight": sum(balanced_split(spec_curve, base_curve, c, n_spec, n_base)[:n_spec]),
        }
    return Recommendation(threshold, objective, scores, best_per_level, expected,
                          diagnose(spec_curve, base_curve), worst)


def diagnose(spec: Curve, base: Curve) -> list[str]:
    """Plain statements about what speculation buys on this deployment."""
    c0 = min(spec.levels[0], base.levels[0])
    s1, b1 = spec.throughput(c0), base.throughput(c0)
    notes = []
    if s1 < b1:
        notes.append(
            f"WARNING: the speculative server is SLOWER than the baseline even at concurrency {c0} "
            f"({s1:.1f} vs {b1:.1f} tok/s, {s1 / b1:.2f}x). Speculation buys no latency on this deployment; "
            "the threshold only decides how the speculative GPUs add capacity next to the baseline.")
    else:
        notes.append(f"The speculative server is faster at concurrency {c0} ({s1:.1f} vs {b1:.1f} tok/s, "
                     f"{s1 / b1:.2f}x): below the threshold requests get lower latency.")
    shared = [c for c in spec.levels if c in base.levels]
    cross = next((c for c in shared if spec.throughput(c) < base.throughput(c)), None)
    if s1 >= b1 and cross is not None:
        notes.append(f"From concurrency {cross} on the baseline is faster "
                     f"({spec.throughput(cross):.1f} vs {base.throughput(cross):.1f} tok/s).")
    return notes


def render(rec: Recommendation, spec: Curve, base: Curve, levels: list[int]) -> str:
    out = ["measured, each pool alone (output tok/s, median E2E s):"]
    rows = [["conc", "speculative", "baseline", "spec/base", "spec E2E s", "base E2E s"]]
    for c in levels:
        s, b = spec.throughput(c), base.throughput(c)
        rows.append([str(c), f"{s:.1f}", f"{b:.1f}", f"{s / b:.2f}x" if b else "-",
                     f"{spec.latency(c) / 1000:.2f}", f"{base.latency(c) / 1000:.2f}"])
    out += figures.grid(rows)
    out += ["", *rec.notes, ""]
    out.append(f"recommended spillover threshold: {rec.threshold}  (objective: {rec.objective}; in-flight "
               f"requests per speculative instance: `python -m router serve --policy spillover "
               f"--threshold {rec.threshold} ...`)")
    out.append("expected curve (tok/s) next to the alternatives; 'best T here' is the threshold that "
               "would win at that level alone:")
    rows = [["conc", f"spillover@{rec.threshold}", "best T here", "(its tok/s)", "all-baseline",
             "all-speculative", "round-robin", "balanced", "(spec in-flight)", f"spill@{rec.threshold} E2E s",
             "balanced E2E s"]]
    for c in levels:
        e = rec.expected[c]
        rows.append([str(c), f"{e['spillover']:.1f}", str(e["best_threshold_here"]), f"{e['best_here']:.1f}",
                     f"{e['all-baseline']:.1f}", f"{e['all-speculative']:.1f}", f"{e['round-robin']:.1f}",
                     f"{e['balanced']:.1f}", str(e["balanced_speculative_inflight"]),
                     f"{e['spillover_median_e2e_ms'] / 1000:.2f}", f"{e['balanced_median_e2e_ms'] / 1000:.2f}"])
    out += figures.grid(rows)
    ranked = sorted(rec.scores.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    what = "of the best throughput" if rec.objective == "throughput" else "of the lowest median latency"
    out.append(f"score = mean over levels of the fraction {what} achievable there: "
               + ", ".join(f"T={t} {s:.3f}" for t, s in ranked)
               + f"; T=0 (all baseline) {rec.scores[0]:.3f}, T={max(rec.scores)} {rec.scores[max(rec.scores)]:.3f}")
    near = sorted(t for t, s in rec.scores.items() if s >= max(rec.scores.values()) - SCORE_TIE)
    if len(near) > 1:
        out.append(f"thresholds within {SCORE_TIE} of the best score ({_ranges(near)}) are a tie a sweep cannot "
                   f"resolve; {rec.threshold} is the one whose worst level is best against all-baseline, "
                   f"all-speculative and round-robin (expected {rec.worst[rec.threshold]:.2f}x of the best of them)")
    else:
        out.append(f"expected worst level against all-baseline, all-speculative and round-robin: "
                   f"{rec.worst[rec.threshold]:.2f}x of the best of them")
    out += ["", "balanced policy (no threshold: each request goes to the pool that would serve it faster, per "
            "these curves of ONE instance each); ready-to-paste router config:",
            "  policy: balanced",
            f"  speculative_curve: {_yaml_points(curve_points(spec))}",
            f"  baseline_curve: {_yaml_points(curve_points(base))}",
            f"  (flags: --policy balanced --speculative-curve {curve_setting(spec)} "
            f"--baseline-curve {curve_setting(base)})"]
    return "\n".join(out)


def _yaml_points(points: tuple[tuple[float, float], ...]) -> str:
    return "[" + ", ".join(f"[{c:g}, {t:g}]" for c, t in points) + "]"


def _ranges(ts: list[int]) -> str:
    out, start = [], ts[0]
    for a, b in zip(ts, ts[1:] + [None], strict=True):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def rec_json(rec: Recommendation) -> dict:
    return {"threshold": rec.threshold, "objective": rec.objective, "notes": rec.notes,
            "best_threshold_per_level": rec.best_per_level, "expected": rec.expected,
            "worst_ratio_to_alternatives": {str(t): w for t, w in rec.worst.items()},
            "scores": {str(t): s for t, s in rec.scores.items()}}


def global_threshold(spec: Curve, base: Curve) -> int:
    """Total in-flight below which the speculative server alone is at least as fast as the baseline alone:
    where the two measured curves cross (linear between levels), 0 when it is slower from the start."""
    levels = sorted(set(spec.levels) | set(base.levels))
    if spec.throughput(levels[0]) < base.throughput(levels[0]):
        return 0
    prev = levels[0]
    for c in levels[1:]:
        if spec.throughput(c) < base.throughput(c):
            # the crossing between prev and c, from the straight lines of both curves
            ds = spec.throughput(c) - spec.throughput(prev)
            db = base.throughput(c) - base.throughput(prev)
            gap = spec.throughput(prev) - base.throughput(prev)
            x = prev + gap / (db - ds) * (c - prev) if db != ds else prev
            return max(1, int(x))
        prev = c
    return levels[-1]


def default_hysteresis(threshold: int) -> int:
    return max(1, threshold // 4) if threshold > 0 else 0


def model_curve(profile: str, max_tokens: int, accept_length: float | None = None) -> str:
    """The closed-loop throughput curve a simulator profile's engine model predicts (bench.sim.fit.predict), as
    the router's `*_curve` setting. On real servers `spec-bench calibrate` measures this curve; the demo and drift
    take it from the model so they stay short."""
    from bench.cli import profile as load
    from bench.sim import fit

    prof = load(profile)
    return ",".join(f"{c}:{fit.predict(prof, c, max_tokens, PROMPT_TOKENS, accept_length):.1f}"
                    for c in CURVE_LEVELS)
