"""The break-even from measured curves (compare/demo JSON): which deployment of the same GPUs wins at which load,
and what single-stream speedup the speculative server would need for the router's deployments to win; pure, the
library of `spec-bench plan` and `spec-bench demo`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench import calibration, equal, figures
from bench.cli import profile as load_profile
from bench.load import BenchInputError
from bench.sim.profiles import ProfileError

SINGLE = ("all-baseline", "all-speculative")


@dataclass
class Candidate:
    """One router configuration of one measured deployment (split or co-located pair)."""

    name: str
    kind: str  # "split" | "colocated" | "alone" (another reference: one server on the same GPUs)
    gpus: int | None
    figs: list[dict]
    spec: calibration.Curve | None = None  # the pair's speculative server alone
    base: calibration.Curve | None = None  # the pair's baseline server alone
    pair: str = ""  # the measured pair it runs on (several router configurations share one)
    file_refs: dict[str, list[dict]] = field(default_factory=dict)  # the references measured in its own run


@dataclass
class Plan:
    reference: str
    reference_gpus: int | None
    levels: list[int]
    candidates: list[Candidate]
    ratios: dict[str, dict[int, float]]  # candidate -> level -> its throughput / the reference's
    wins: dict[str, list[int]]  # candidate -> levels where it beats the reference beyond the noise band
    best: dict[int, str]  # level -> the deployment to run there (the reference unless a candidate beats it)
    # pair label ("split eagle3-tp4" ...) -> level -> speedup needed; its kind; its measured speedup today
    needed: dict[str, dict[int, float | None]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    today: dict[str, float] = field(default_factory=dict)
    unfit: dict[str, str] = field(default_factory=dict)  # candidate -> why it does not fit (never recommended)


def needed_scale(kind: str, spec: calibration.Curve, base: calibration.Curve, ref_tput: float, c: int) -> float | None:
    """The smallest factor s on the speculative server's whole curve for which the pair reaches the
    reference's throughput at c in-flight requests (0 if the baseline alone does; None if no s can).
    split: the best placement, max over k of s*S(k) + B(c-k). colocated (global): one server serves all,
    max(s*S(c), B(c)); the interleaving cost while both run is left out, so this is a lower bound."""
    if base.throughput(c) >= ref_tput:
        return 0.0
    if kind == "colocated":
        s_c = spec.throughput(c)
        return ref_tput / s_c if s_c > 0 else None
    best = None
    for k in range(1, c + 1):
        s_k = spec.throughput(k)
        if s_k > 0:
            need = (ref_tput - base.throughput(c - k)) / s_k
            best = need if best is None else min(best, need)
    return best


def single_stream(spec: calibration.Curve, base: calibration.Curve) -> float:
    """Speculative over baseline at one request (the speedup a single-stream benchmark shows)."""
    b = base.throughput(1)
    return spec.throughput(1) / b if b else float("inf")


def make_plan(files: list[dict], against: str | None = None, noise: float = equal.NOISE,
              unfit: dict[str, str] | None = None) -> Plan:
    """Raises BenchInputError (one line) when the files hold no usable reference or candidate. `unfit`: deployment
    kinds ("split", "colocated") that do not fit the user's GPUs (bench.sim.memory), never recommended."""
    unfit = unfit or {}
    refs: dict[str, tuple[list[dict], int | None, dict]] = {}
    cands: list[Candidate] = []
    others: list[Candidate] = []  # the references themselves: deployments of the same GPUs too
    for data in files:
        results, gpus = data["results"], data.get("gpus") or {}
        own_refs = {name: results[name] for name in (data.get("references") or {})}
        for name, meta in (data.get("references") or {}).items():
            if name not in refs:
                refs[name] = (results[name], gpus.get(name), meta or {})
                others.append(Candidate(name, "alone", gpus.get(name), results[name], file_refs=own_refs))
        cfg = data.get("config") or {}
        kind = cfg.get("deployment") or ("colocated" if cfg.get("colocated") else "split")
        # Files of different drafters side by side: name each pair by its speculative server.
        label = f"{kind} {Path(str(cfg['speculative'])).stem}" if cfg.get("speculative") else kind
        spec = base = None
        if all(n in results for n in SINGLE):
            spec = calibration.Curve.from_figs(results["all-speculative"])
            base = calibration.Curve.from_figs(results["all-baseline"])
        # a file that lists its configurations (a demo's: only the deployments that fit) is taken at its word
        configs = (data["configs"] if data.get("configs") is not None else
                   [n for n in results if n not in (data.get("references") or {})])
        kinds = data.get("kinds") or {}  # a demo run: several deployments in one file, each named already
        for n in configs:
            if n in SINGLE:
                continue
            cands.append(Candidate(n if n in kinds else f"{label} + {n}", kinds.get(n, kind), gpus.get(n),
                                   results[n], spec, base, pair=n if n in kinds else label, file_refs=own_refs))
    if not refs:
        raise BenchInputError("no reference deployment in these files: run `python -m bench compare ... "
                              "--reference tp8=profile:baseline-tp8` (or URL@GPUS) first")
    if not cands and len(refs) < 2:
        raise BenchInputError("no router configuration in these files to judge against the reference")
    if against is None:
        plain = [n for n, (_, _, m) in refs.items() if _not_speculative(m.get("profile"))]
        against = plain[0] if plain else next(iter(refs))
    if against not in refs:
        raise BenchInputError(f"--against {against}: no such reference; the files have {', '.join(refs)}")
    # The other references are deployments of the same GPUs too (TP8 EAGLE-3 alone may win at low load).
    cands += [c for c in others if c.name != against]
    ref_figs, ref_gpus, _ = refs[against]
    ref = {f["concurrency"]: f for f in ref_figs if f.get("completed")}
    levels = sorted(ref)
    ratios, wins, best_at = {}, {}, {}
    for cand in cands:
        mine = {f["concurrency"]: f for f in cand.figs if f.get("completed")}
        # Against the reference as measured in the candidate's own run when it has one: runs made at other
        # times on a shared machine differ by more than the noise band.
        theirs = {f["concurrency"]: f for f in cand.file_refs.get(against, ref_figs) if f.get("completed")}
        ratios[cand.name] = {c: figures.tput(mine[c]) / figures.tput(theirs[c])
                             for c in levels if c in mine and c in theirs and figures.tput(theirs[c])}
        wins[cand.name] = [] if cand.kind in unfit else [c for c, r in ratios[cand.name].items() if r >= 1 + noise]
    usable = {c.name for c in cands if c.kind not in unfit}
    for c in levels:
        top = max(((r[c], n) for n, r in ratios.items() if c in r and n in usable), default=None)
        best_at[c] = top[1] if top and top[0] >= 1 + noise else against
    plan = Plan(against, ref_gpus, levels, cands, ratios, wins, best_at)
    plan.unfit = {c.name: unfit[c.kind] for c in cands if c.kind in unfit}
    for cand in cands:
        if cand.spec is None or cand.base is None or cand.pair in plan.needed:
            continue
        today = single_stream(cand.spec, cand.base)
        plan.today[cand.pair], plan.kinds[cand.pair] = today, cand.kind
        plan.needed[cand.pair] = {}
        theirs = {f["concurrency"]: f for f in cand.file_refs.get(against, ref_figs) if f.get("completed")}
        for c in levels:
            if c not in theirs:
                continue
            s = needed_scale(cand.kind, cand.spec, cand.base, figures.tput(theirs[c]), c)
            plan.needed[cand.pair][c] = None if s is None else max(s * today, 0.0)
    return plan


def _not_speculative(profile: str | None) -> bool:
    if not profile:
        return False
    try:
        prof = load_profile(profile)
    except ProfileError:
        return False
    return not prof.speculative


def render(plan: Plan) -> str:
    ref = f"{plan.reference} [{equal.gpus_label(plan.reference_gpus)}]"
    winners = [n for n, w in plan.wins.items() if w]
    lines = []
    if not winners:
        top = max(plan.candidates, key=lambda c: max(plan.ratios[c.name].values(), default=0.0))
        r = plan.ratios[top.name]
        span = equal.span(list(r.values())) if r else "-"
        lines.append(f"RUN {ref}: nothing measured here beats it at any load "
                     f"(the closest, {top.name}, reaches {span} of its throughput).")
    else:
        where = "; ".join(f"{n} at c={_levels(plan.wins[n])}" for n in winners)
        rest = [c for c in plan.levels if plan.best[c] == plan.reference]
        lines.append(f"Beats {ref}: {where}" + (f"; at c={_levels(rest)} run {plan.reference}." if rest else "."))
    lines.append("")
    lines.append(f"throughput of each candidate / {plan.reference} (beats it at >= {1 + equal.NOISE:.2f}x):")
    rows = [["conc"] + [f"{c.name} [{equal.gpus_label(c.gpus)}]" for c in plan.candidates] + ["run"]]
    for lv in plan.levels:
        rows.append([str(lv)] + [f"{plan.ratios[c.name][lv]:.2f}x" if lv in plan.ratios[c.name] else "-"
                                 for c in plan.candidates] + [plan.best[lv]])
    lines += figures.grid(rows)
    if plan.unfit:
        lines.append("NOT RECOMMENDED, does not fit your GPUs: " + "; ".join(
            f"{n} ({why})" for n, why in plan.unfit.items()))
    unequal = [c for c in plan.candidates if c.gpus != plan.reference_gpus]
    if unequal:
        lines.append("UNEQUAL HARDWARE: " + ", ".join(f"{c.name} uses {equal.gpus_label(c.gpus)}" for c in unequal)
                     + f", {plan.reference} uses {equal.gpus_label(plan.reference_gpus)}")
    for pair, need in plan.needed.items():
        kind = plan.kinds[pair]
        lines.append("")
        lines.append(f"break-even, {pair} pair: the single-stream speedup (speculative over its own baseline "
                     f"server, at 1 request; today {plan.today[pair]:.2f}x) it would need to match "
                     f"{plan.reference} at each load:")
        cells = [f"c={c} " + ("unreachable" if v is None else "its baseline alone matches" if v == 0 else f"{v:.2f}x")
                 for c, v in need.items()]
        lines.append("  " + ", ".join(cells))
        reach = [c for c, v in need.items() if v is not None and v <= plan.today[pair]]
        lines.append(f"  with today's drafter it matches {plan.reference} at " +
                     (f"c={_levels(reach)}" if reach else "no load measured") +
                     ("; model: the speculative server's measured curve scaled by one factor at every load, "
                      + ("placed as well as possible between the two servers" if kind == "split" else
                         "one server serving everything (global), interleaving cost left out")) + ".")
    return "\n".join(lines)


def _levels(levels: list[int]) -> str:
    return ",".join(str(c) for c in levels)


def plan_json(plan: Plan) -> dict:
    return {"reference": plan.reference, "reference_gpus": plan.reference_gpus, "levels": plan.levels,
            "ratios": {n: {str(c): r for c, r in v.items()} for n, v in plan.ratios.items()},
            "wins": plan.wins, "run": {str(c): n for c, n in plan.best.items()},
            "needed_single_stream_speedup": {k: {str(c): v for c, v in n.items()} for k, n in plan.needed.items()},
            "single_stream_speedup_today": plan.today, "pair_kinds": plan.kinds}
