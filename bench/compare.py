"""`spec-bench compare`: the canonical experiment on one pair of backends. Routers for all-baseline,
all-speculative, spillover at the calibrated threshold, round-robin, balanced, adaptive (and global); winner per
level; a verdict; and, with `--reference`, every configuration against other deployments of the same GPUs."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench import calibration, equal, figures, procs
from bench.calibration import default_hysteresis, global_threshold
from bench.cli import ArgError, NotServing, int_list, parser, positive, run_async, wait_serving
from bench.levels import SweepConfig, add_load_args, run_sweep, write_outputs
from bench.load import BenchInputError, LoadSpec, load_prompts, run_closed
from bench.sim.profiles import ProfileError
from bench.streams import learned_state

NOISE = equal.NOISE
# Result order of the reports. all-baseline and all-speculative always run (they are the calibration data);
# the routed configurations below run as chosen with --configs. To add one: a name here and a branch in
# _routed() that starts its router.
CONFIGS = ("spillover", "all-baseline", "all-speculative", "round-robin", "balanced", "balanced-again", "adaptive",
           "adaptive-again", "adaptive-throughput", "global")
SINGLE = ("all-baseline", "all-speculative")
ROUTED = ("spillover", "round-robin", "balanced", "balanced-again", "adaptive", "adaptive-again", "adaptive-throughput",
          "global")
DEFAULT_ROUTED = ("spillover", "round-robin", "balanced", "adaptive")
# Learn from their own traffic: no curves, no threshold. adaptive-throughput is the same policy with the
# throughput objective (equal marginal gains), run on request to compare the two objectives.
LEARNED = ("adaptive", "adaptive-again", "adaptive-throughput")
# A control, not a contender: a second router running balanced on the same curves, measured in the same
# interleaving. Routed configurations place requests by timing, so the same configuration does not give the same
# figure twice; balanced-again / balanced is that spread, the floor under any per-level bar (adaptive's 0.97x).
# It is left out of every "best other" (it is balanced itself) and out of the winners. adaptive-again is the same
# for adaptive: a second router that learns on its own (its own warm-up), so adaptive-again / adaptive is how far
# one run of the learning policy is from another, its own luck (exploration, which requests it learned from) in.
CONTROL = ("balanced-again", "adaptive-again")
# control -> (the configuration it repeats, the key of their ratio in a verdict row)
REPEATS = {"balanced-again": ("balanced", "repeat_ratio"), "adaptive-again": ("adaptive", "adaptive_repeat_ratio")}
# The learned configurations run with load_signal backend, polling each server's /v1/loads every LOAD_INTERVAL
# wall seconds. Every configuration's level runs on the same two servers right after the one before, so a
# router whose last poll came in while the previous configuration's level drained sees that traffic (gone by
# now) as other routers' load for up to one interval, and the first round of its level, every client at once,
# is placed on it. Measured (TP4+TP4 split, 30 clients, right after balanced's level): adaptive 0.81-0.93x of
# balanced over six prompt orders; with 1.5 s between the levels 0.99-1.01x over four. So when a learned
# configuration is in the run, each level starts SETTLE_POLLS intervals after the one before ended.
LOAD_INTERVAL = 0.5
SETTLE_POLLS = 3


def winners(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    names = [n for n in results if n not in CONTROL]
    for i, f0 in enumerate(results[names[0]]):
        figs = {n: results[n][i] for n in names}
        ok = {n: f for n, f in figs.items() if f["completed"]}
        tp = max(ok, key=lambda n: figures.tput(ok[n])) if ok else None
        lat = min(ok, key=lambda n: ok[n]["median_e2e_latency_ms"]) if ok else None
        rows.append({"concurrency": f0["concurrency"], "throughput_winner": tp, "latency_winner": lat})
    return rows


def verdict(results: dict[str, list[dict]], rec: calibration.Recommendation | None, threshold: int,
            spec: calibration.Curve | None, base: calibration.Curve | None) -> tuple[list[str], list[dict]]:
    """Per level: spillover against the best other configuration, and why when it is behind."""
    lines, rows = [], [{"concurrency": f["concurrency"]} for f in results["all-baseline"]]
    # Spillover is judged against the four configurations it was built to beat; balanced gets its own lines.
    others = [n for n in results if n not in ("spillover", "balanced", "global", *LEARNED, *CONTROL)]
    for i, sp in enumerate(results.get("spillover", [])):
        c = sp["concurrency"]
        best = max(others, key=lambda n: figures.tput(results[n][i]))
        b = figures.tput(results[best][i])
        ratio = figures.tput(sp) / b if b else float("inf")
        status = "above" if ratio >= 1.0 else ("within noise" if ratio >= 1 - NOISE else "BELOW")
        row = rows[i]
        row |= {"spillover": figures.tput(sp), "best_other": best,
                "best_other_tput": b, "ratio": ratio, "status": status}
        if rec is not None and c in rec.expected:
            row["expected_spillover"] = rec.expected[c]["spillover"]
        text = (f"c={c}: spillover@{threshold} {figures.tput(sp):.1f} tok/s vs best other "
                f"({best}) {b:.1f} -> {ratio:.2f}x, {status}")
        if status == "BELOW":
            text += "; " + explain(c, threshold, best, rec, spec, base, figures.tput(sp), b,
                                   sp.get("steady_output_throughput"))
        lines.append(text)
    if "balanced" in results:
        lines += balanced_verdict(results, rec, rows)
    for again, (first, key) in REPEATS.items():
        if again in results and first in results:
            lines += repeat_verdict(results, rows, first, again, key)
    if "adaptive" in results:
        lines += adaptive_verdict(results, rows)
    return lines, rows


def repeat_verdict(results: dict[str, list[dict]], rows: list[dict], first: str, again: str,
                   key: str) -> list[str]:
    """Per level: one configuration measured twice (two routers, same settings, same interleaving): how far one
    routed configuration's figure moves between two runs of the same level."""
    lines = []
    for i, (one, two) in enumerate(zip(results[first], results[again], strict=True)):
        a, b = figures.tput(one), figures.tput(two)
        ratio = b / a if a else float("inf")
        rows[i] |= {again.replace("-", "_"): b, key: ratio}
        lines.append(f"c={one['concurrency']}: {first} measured twice: {a:.1f} and {b:.1f} tok/s -> "
                     f"{ratio:.3f}x (the spread of one routed configuration between two runs of a level)")
    return lines


def adaptive_verdict(results: dict[str, list[dict]], rows: list[dict]) -> list[str]:
    """Per level: adaptive (no curves given) against the best of every other configuration; the bar is 0.97x.
    Its own variants (adaptive-throughput) are not among the others: they are the alternatives it is chosen over;
    nor are the controls (balanced-again and adaptive-again, each measured twice)."""
    others = [n for n in results if n not in LEARNED and n not in CONTROL]
    lines = []
    for i, ad in enumerate(results["adaptive"]):
        best = max(others, key=lambda n: figures.tput(results[n][i]))
        b = figures.tput(results[best][i])
        ratio = figures.tput(ad) / b if b else float("inf")
        status = "at or above 0.97x" if ratio >= 0.97 else "BELOW 0.97x"
        rows[i] |= {"adaptive": figures.tput(ad), "adaptive_best_other": best, "adaptive_ratio": ratio}
        text = (f"c={ad['concurrency']}: adaptive {figures.tput(ad):.1f} tok/s vs best other ({best}) "
                f"{b:.1f} -> {ratio:.2f}x, {status}")
        repeat = rows[i].get("repeat_ratio")  # set by repeat_verdict when the control ran
        if ratio < 0.97 and repeat is not None:
            # A shortfall the control's own spread could explain is not the routing's to answer for.
            spread = abs(repeat - 1)
            text += (f"; the control (balanced measured twice) moved {spread:.1%} at this level: the shortfall is "
                     + ("within it" if 1 - ratio <= spread else "beyond it"))
        own = rows[i].get("adaptive_repeat_ratio")  # adaptive-again / adaptive, when that control ran
        if ratio < 0.97 and own is not None:
            text += f"; adaptive measured twice moved {abs(own - 1):.1%} at this level"
        shares = [f"{n} {results[n][i]['speculative_share']:.0%}" for n in results
                  if n not in SINGLE and results[n][i].get("speculative_share") is not None]
        if shares:
            text += " (speculative share: " + ", ".join(shares) + ")"
        lines.append(text)
    return lines


def balanced_verdict(results: dict[str, list[dict]], rec, rows: list[dict]) -> list[str]:
    """Per level: balanced against the best of the other configurations (spillover included)."""
    lines = []
    others = [n for n in results if n not in ("balanced", "global", *LEARNED, *CONTROL)]
    for i, bal in enumerate(results["balanced"]):
        c = bal["concurrency"]
        best = max(others, key=lambda n: figures.tput(results[n][i]))
        b = figures.tput(results[best][i])
        ratio = figures.tput(bal) / b if b else float("inf")
        status = "above" if ratio >= 1.0 else ("within noise" if ratio >= 1 - NOISE else "BELOW")
        rows[i] |= {"balanced": figures.tput(bal), "balanced_best_other": best, "balanced_best_other_tput": b,
                    "balanced_ratio": ratio, "balanced_status": status}
        text = (f"c={c}: balanced {figures.tput(bal):.1f} tok/s vs best other ({best}) {b:.1f} -> "
                f"{ratio:.2f}x, {status}")
        e = rec.expected.get(c) if rec is not None else None
        if e and "balanced" in e:
            rows[i]["expected_balanced"] = e["balanced"]
            text += (f" (the pool curves predict {e['balanced']:.0f} tok/s with {e['balanced_speculative_inflight']}"
                     f" of {c} in flight on the speculative server)")
        lines.append(text)
    return lines


def explain(c: int, threshold: int, best: str, rec, spec, base, measured: float, other: float,
            steady: float | None = None) -> str:
    """Why spillover trails `best` at `c`, in numbers from the pool curves (calibrate's model)."""
    if rec is None or spec is None or base is None:
        return "no calibration data to explain it (threshold given with --threshold)"
    k = min(c, threshold)
    e = rec.expected.get(c, {})
    parts = [f"spillover@{threshold} keeps {k} of the {c} in-flight requests on the speculative server "
             f"and {c - k} on the baseline"]
    if best == "round-robin":
        x = calibration.round_robin_split(spec, base, c)
        parts.append(f"round-robin settles near {x:.1f} / {c - x:.1f}")
    elif best == "all-baseline":
        parts.append(f"all-baseline keeps all {c} on the baseline")
    if e:
        parts.append(f"the pool curves predict {e['spillover']:.0f} tok/s for spillover@{threshold} and "
                     f"{e.get(best, float('nan')):.0f} for {best} (measured {measured:.0f} and {other:.0f})")
    here = rec.best_per_level.get(c)
    if here is not None and here != threshold:
        parts.append(f"threshold {here} would be best at this level alone "
                     f"({e.get('best_here', float('nan')):.0f} tok/s predicted) but scores {rec.scores[here]:.3f} "
                     f"over all levels against {rec.scores[threshold]:.3f} for {threshold}: one threshold cannot "
                     "follow the best split at every load")
    if e and e["spillover"] > 1.05 * measured:
        note = f"the run fell {1 - measured / e['spillover']:.0%} short of the model here"
        if steady is not None:
            note += (f" (until its last request was sent it ran at {steady:.0f} tok/s: the closed loop's "
                     "drain, where the slower of spillover's two request speeds finishes alone, costs the rest)")
        parts.append(note)
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    p = parser("compare",
               "spillover (calibrated) vs all-baseline vs all-speculative vs round-robin vs balanced on one pair of "
               "backends: simulated ones started here (default) or your own servers; with --reference, each of "
               "them against other deployments of the same GPUs.")
    p.add_argument("--speculative-profile", default="eagle3-tp8", help="simulator profile (default eagle3-tp8)")
    p.add_argument("--baseline-profile", default="baseline-tp8", help="simulator profile (default baseline-tp8)")
    p.add_argument("--speculative", metavar="URL", help="use this running speculative server instead of a sim")
    p.add_argument("--baseline", metavar="URL", help="use this running baseline server instead of a sim")
    p.add_argument("--colocated", action="store_true",
                   help="simulators: both servers share one simulated set of GPUs (spec-bench sim --colocated-with); "
                        "the pair then uses the GPUs of one of them, not both")
    p.add_argument("--kv-share", type=float, default=0.5,
                   help="--colocated: the speculative server's share of the KV memory (default 0.5)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="GPUs the two servers use together (default: from the profiles' TP sizes; required "
                        "with --speculative/--baseline URLs when --reference is given)")
    p.add_argument("--reference", type=equal.parse_reference, action="append", default=[],
                   metavar="NAME=URL[@GPUS]|NAME=profile:PROFILE",
                   help="another deployment of the same GPUs to measure the same way (repeatable): a running "
                        "server, or a simulator of PROFILE started here")
    p.add_argument("--reference-gpus", type=int, default=None, metavar="N",
                   help="GPUs of URL references that do not say @GPUS")
    p.add_argument("--configs", default=None, metavar="LIST",
                   help=f"routed configurations to run, comma-separated, from {','.join(ROUTED)} (default "
                        f"{','.join(DEFAULT_ROUTED)}, plus global with --colocated); all-baseline and "
                        "all-speculative always run")
    p.add_argument("--threshold", type=int, default=None,
                   help="spillover threshold to test (default: calibrated from the all-* runs)")
    p.add_argument("--global-threshold", type=int, default=None,
                   help="global: total in-flight below which requests go to the speculative server (default: "
                        "where the measured all-speculative curve falls below all-baseline)")
    p.add_argument("--hysteresis", type=int, default=None,
                   help="global: come back to speculative only below threshold - hysteresis (default: a quarter "
                        "of the global threshold, at least 1)")
    p.add_argument("--objective", choices=calibration.OBJECTIVES, default="throughput")
    p.add_argument("--min-requests", type=positive(int), default=16, metavar="N",
                   help="closed loop: at least N requests per level whatever --rounds gives (default 16); "
                        "a level of a few requests per client measures mostly its start and its drain")
    p.add_argument("--single-again", action="store_true",
                   help="measure all-baseline and all-speculative again in phase 2, interleaved with the routed "
                        "configurations, and report those (phase 1 stays the calibration): a busy host then "
                        "weighs on every column alike")
    p.add_argument("--warmup-seconds", type=float, default=0.0, metavar="S",
                   help="before the first level, S seconds of the servers' time of closed-loop traffic to "
                        "each learned configuration (adaptive), stepping through --warmup-concurrency; the "
                        "report states the seconds and requests (default 0: no warm-up)")
    p.add_argument("--warmup-concurrency", type=int_list, default=int_list("5,30,100"), metavar="LIST",
                   help="concurrency levels the warm-up steps through, equal time each (default 5,30,100)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default=None, help="output file stem (default compare-SPEC-BASE)")
    p.add_argument("--from-json", type=Path, metavar="FILE",
                   help="re-render the reports (.txt, .md) of a saved compare JSON; runs nothing")
    add_load_args(p)
    p.set_defaults(speedup=None)
    try:
        ns = p.parse_args(argv)
        if ns.from_json is not None:
            return _rerender(ns.from_json)
        if (ns.speculative is None) != (ns.baseline is None):
            raise ArgError("give both --speculative and --baseline URLs, or neither (simulators)")
        for flag in ("threshold", "global_threshold", "hysteresis"):
            if getattr(ns, flag) is not None and getattr(ns, flag) < 0:
                raise ArgError(f"--{flag.replace('_', '-')} must be >= 0")
        for flag in ("gpus", "reference_gpus"):
            if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
                raise ArgError(f"--{flag.replace('_', '-')} must be >= 1")
        if ns.warmup_seconds < 0:
            raise ArgError("--warmup-seconds must be >= 0")
        if not 0 < ns.kv_share < 1:
            raise ArgError("--kv-share must be between 0 and 1")
        if ns.colocated and ns.speculative is not None:
            raise ArgError("--colocated starts simulators; for your own co-located servers give their URLs "
                           "and --gpus (the GPUs they share)")
        ns.routed = _parse_configs(ns.configs, ns.colocated)
        names = [r.name for r in ns.reference]
        if len(set(names)) != len(names) or set(names) & set(CONFIGS):
            raise ArgError("reference names must be unique and differ from the configuration names")
        ns.reference = equal.resolve_gpus(ns.reference, ns.reference_gpus)
    except (ArgError, ProfileError, ValueError) as exc:
        print(f"spec-bench compare: {exc}", file=sys.stderr)
        return 2
    external = ns.speculative is not None
    if ns.speedup is None:
        ns.speedup = 1.0 if external else 5.0
    try:
        ns.pair_gpus = ns.gpus if ns.gpus is not None or external else _pair_gpus(ns)
    except ProfileError as exc:
        print(f"spec-bench compare: {exc}", file=sys.stderr)
        return 2
    if ns.reference and ns.pair_gpus is None:
        print("spec-bench compare: say how many GPUs your two servers use together (--gpus N) to compare them "
              "with references", file=sys.stderr)
        return 2
    name = ns.name or ("compare" if external else
                       f"compare-{Path(ns.speculative_profile).stem}-{Path(ns.baseline_profile).stem}"
                       + ("-colocated" if ns.colocated else ""))
    try:
        with procs.ProcGroup() as group:
            return _run(ns, group, external, name, "python -m bench compare " + " ".join(argv))
    except (BenchInputError, procs.ProcError, NotServing) as exc:
        print(f"spec-bench compare: {exc}", file=sys.stderr)
        return 2


def _parse_configs(text: str | None, colocated: bool) -> list[str]:
    if text is None:
        return [*DEFAULT_ROUTED, "global"] if colocated else list(DEFAULT_ROUTED)
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ROUTED and n not in SINGLE]
    if bad:
        raise ArgError(f"--configs: unknown configuration {bad[0]!r}; choose from {', '.join(ROUTED)}")
    return [n for n in ROUTED if n in names]


def _pair_gpus(ns) -> int:
    """Simulated pair: the two servers' TP sizes add up, unless they share their GPUs (co-located)."""
    gpus = []
    for role, profile in (("speculative sim", ns.speculative_profile), ("baseline sim", ns.baseline_profile)):
        try:
            gpus.append(equal.profile_gpus(profile))
        except ProfileError as exc:
            raise ProfileError(f"{role}: {exc}") from None
    return max(gpus) if ns.colocated else sum(gpus)


def _rerender(path: Path) -> int:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        text, md, extra = report(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BenchInputError) as exc:
        print(f"spec-bench compare: cannot re-render {path}: {type(exc).__name__} {exc}", file=sys.stderr)
        return 2
    print(text)
    figures.plot(path.with_suffix(".png"), data["results"], title=extra["title"], gpus=data.get("gpus"))
    path.with_suffix(".md").write_text(md, encoding="utf-8")
    path.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
    return 0


def settle_seconds(names) -> float:
    """Wall seconds between two configurations' levels: SETTLE_POLLS load polls when a learned configuration
    (load_signal backend) is among them, else none."""
    return SETTLE_POLLS * LOAD_INTERVAL if any(n in LEARNED for n in names) else 0.0


def _cfg(ns, targets) -> SweepConfig:
    return SweepConfig(targets=targets, concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                       prompts=ns.prompts, requests_per_level=ns.requests_per_level,
                       duration_per_level=ns.duration_per_level, model=ns.model, speedup=ns.speedup,
                       timeout=ns.timeout, ignore_eos=ns.ignore_eos, seed=ns.seed,
                       rounds=ns.rounds, min_requests=ns.min_requests,
                       settle_s=settle_seconds(n for n, _ in targets))


async def warm_up(url: str, ns) -> dict:
    """Closed-loop traffic to a learned configuration before its first measured level: equal time at each
    warm-up concurrency (the model sees both pools at several loads). Returns what it got, for the report."""
    prompts = load_prompts(ns.prompts)
    extra = {"ignore_eos": True} if ns.ignore_eos else {}
    each = ns.warmup_seconds / len(ns.warmup_concurrency) / ns.speedup  # wall seconds per step
    done = failed = 0
    for c in ns.warmup_concurrency:
        spec = LoadSpec(url=url, prompts=prompts, model=ns.model, max_tokens=ns.max_tokens, duration=each,
                        timeout=ns.timeout, extra_body=extra, seed=ns.seed + 1,
                        level_timeout=each + ns.timeout + 60.0)
        run = await run_closed(spec, c)
        done += sum(1 for r in run.records if r.ok)
        failed += sum(1 for r in run.records if not r.ok)
    return {"seconds": ns.warmup_seconds, "concurrency": list(ns.warmup_concurrency), "requests": done,
            "failed": failed}


def _start_pair(ns, group: procs.ProcGroup) -> tuple[str, str]:
    if ns.colocated:
        pair, spec_url, base_url = procs.start_colocated(ns.speculative_profile, ns.baseline_profile, ns.speedup,
                                                         kv_share=ns.kv_share)
        group.add(pair)
        return spec_url, base_url
    spec_url = group.add(procs.start_sim(ns.speculative_profile, ns.speedup, "speculative sim")).url
    base_url = group.add(procs.start_sim(ns.baseline_profile, ns.speedup, "baseline sim")).url
    return spec_url, base_url


def _run(ns, group: procs.ProcGroup, external: bool, name: str, cmd: str) -> int:
    load_start, t_start = os.getloadavg(), time.time()
    if external:
        spec_url, base_url = ns.speculative.rstrip("/"), ns.baseline.rstrip("/")
    else:
        spec_url, base_url = _start_pair(ns, group)
    print(f"speculative backend {spec_url}, baseline backend {base_url}, speedup {ns.speedup:g}"
          + (" (co-located: one set of GPUs)" if ns.colocated else ""), file=sys.stderr)
    refs = []
    for r in ns.reference:
        url = r.url or group.add(procs.start_sim(r.profile, ns.speedup, f"reference {r.name}")).url
        refs.append((r.name, url))
        print(f"reference {r.describe()} at {url}", file=sys.stderr)

    def router(policy: str, spec: bool, base: bool, threshold: int | None = None,
               extra: list[str] | None = None) -> str:
        r = group.add(procs.start_router([spec_url] if spec else [], [base_url] if base else [], policy,
                                         threshold, extra=extra))
        run_async(wait_serving(r.url, model=ns.model))
        return r.url

    # Phase 1: each pool alone behind its own router (also the calibration data), and the references,
    # measured the same way at the same levels.
    phase1 = [("all-baseline", router("spillover", False, True)),
              ("all-speculative", router("spillover", True, False)), *refs]
    single = run_async(run_sweep(_cfg(ns, phase1)))
    rec = None
    spec_curve = calibration.Curve.from_figs(single["all-speculative"])
    base_curve = calibration.Curve.from_figs(single["all-baseline"])
    threshold = ns.threshold
    if threshold is None:
        levels = sorted(set(spec_curve.levels) & set(base_curve.levels))
        rec = calibration.recommend(spec_curve, base_curve, levels, ns.objective)
        threshold = rec.threshold
        print(calibration.render(rec, spec_curve, base_curve, levels), file=sys.stderr)
    g_threshold = ns.global_threshold if ns.global_threshold is not None else global_threshold(spec_curve,
                                                                                               base_curve)
    hysteresis = ns.hysteresis if ns.hysteresis is not None else default_hysteresis(g_threshold)
    # Phase 2: both pools behind the routers that choose between them.
    # balanced runs on the curves phase 1 just measured, exactly as calibrate prints them for the router.
    spec_pts, base_pts = calibration.curve_setting(spec_curve), calibration.curve_setting(base_curve)
    targets = [(n, _routed(n, router, threshold, spec_pts, base_pts, g_threshold, hysteresis)) for n in ns.routed]
    warmups = {}
    if ns.warmup_seconds > 0:
        for n, url in targets:
            if n in LEARNED:
                time.sleep(settle_seconds(ns.routed))  # the one before may have just ended its own warm-up
                warmups[n] = run_async(warm_up(url, ns))
                print(f"warm-up of {n}: {warmups[n]['requests']} requests in {ns.warmup_seconds:g} s",
                      file=sys.stderr)
    if ns.single_again and targets:
        # The single pools once more, interleaved level by level with the routed configurations: other work on
        # the host in phase 2 then weighs on them alike (phase 1 stays the calibration the routers were given).
        targets += [(n, url) for n, url in phase1 if n in SINGLE]
    mixed = run_async(run_sweep(_cfg(ns, targets))) if targets else {}
    learned = {n: run_async(learned_state(url)) for n, url in targets if n in LEARNED}
    configs = [n for n in CONFIGS if n in mixed or n in SINGLE]
    results = {n: (single | mixed)[n] for n in configs} | {n: single[n] for n, _ in refs}
    gpus = {n: ns.pair_gpus for n in configs} | {r.name: r.gpus for r in ns.reference}
    cfg = _cfg(ns, []).as_dict() | {
        "speculative": spec_url if external else ns.speculative_profile,
        "baseline": base_url if external else ns.baseline_profile, "threshold": threshold,
        "speculative_curve": spec_pts, "baseline_curve": base_pts,
        "objective": ns.objective, "command": cmd, "colocated": ns.colocated,
        "deployment": "colocated" if ns.colocated else "split", "min_requests": ns.min_requests,
        "warmup": warmups, "learned": learned, "single_again": bool(ns.single_again and ns.routed),
        "settle_seconds": settle_seconds(ns.routed)}
    if ns.colocated:
        cfg["kv_share"] = ns.kv_share
    if "global" in mixed:
        cfg |= {"global_threshold": g_threshold, "hysteresis": hysteresis}
    # Other work on the host skews a closed-loop run; record how busy it was for whoever reads the results.
    host = {"cpus": os.cpu_count(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
            "wall_seconds": round(time.time() - t_start, 1)}
    data = {"config": cfg, "results": results, "host": host, "calibrated": rec is not None,
            "configs": configs, "references": {r.name: r.as_dict() for r in ns.reference}, "gpus": gpus}
    text, md, extra = report(data)
    print(text)
    paths = write_outputs(ns.out, name, cfg, results, title=extra["title"], plot=not ns.no_plot,
                          extra={k: v for k, v in (data | extra).items() if k not in ("config", "results")},
                          gpus=gpus)
    (ns.out / f"{name}.md").write_text(md, encoding="utf-8")
    (ns.out / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
    print("wrote " + ", ".join(str(x) for x in [*paths, ns.out / f"{name}.md", ns.out / f"{name}.txt"]))
    return 0


def _routed(name: str, router, threshold: int, spec_pts: str, base_pts: str, g_threshold: int,
            hysteresis: int) -> str:
    """Start the router of one routed configuration; returns its URL."""
    if name == "spillover":
        return router("spillover", True, True, threshold)
    if name == "round-robin":
        return router("round-robin", True, True)
    if name in ("balanced", "balanced-again"):
        return router("balanced", True, True, None, ["--speculative-curve", spec_pts, "--baseline-curve", base_pts])
    if name == "global":
        return router("global", True, True, g_threshold, ["--hysteresis", str(hysteresis)])
    if name in LEARNED:
        # No curves: it learns, from its own requests and the servers' /v1/loads figures.
        objective = "throughput" if name == "adaptive-throughput" else "latency"
        return router("adaptive", True, True, None, ["--load-signal", "backend", "--load-interval",
                                                     str(LOAD_INTERVAL), "--objective", objective])
    raise ValueError(f"no router recipe for configuration {name!r}")


def report(data: dict) -> tuple[str, str, dict]:
    """Text and markdown reports of one compare run from its JSON-able data (so a saved run can be
    re-rendered with --from-json): equal-hardware verdict, calibration evidence, tables, winners, verdict."""
    cfg, results = data["config"], data["results"]
    configs = data.get("configs") or [n for n in results if n in CONFIGS]
    refs = list(data.get("references") or {})
    gpus = data.get("gpus") or {}
    own = {n: results[n] for n in configs}
    threshold = cfg["threshold"]
    rec = spec_curve = base_curve = None
    calib = ""
    if data.get("calibrated", True) and data.get("calibration", True) is not None:
        spec_curve = calibration.Curve.from_figs(results["all-speculative"])
        base_curve = calibration.Curve.from_figs(results["all-baseline"])
        levels = sorted(set(spec_curve.levels) & set(base_curve.levels))
        rec = calibration.recommend(spec_curve, base_curve, levels, cfg.get("objective", "throughput"))
        calib = calibration.render(rec, spec_curve, base_curve, levels)
    win = winners(own)
    lines, rows = verdict(own, rec, threshold, spec_curve, base_curve)
    pair = "co-located pair" if cfg.get("colocated") else "pair"
    title = f"spec-bench compare: {cfg['speculative']} vs {cfg['baseline']}, spillover threshold {threshold}"
    if configs and gpus.get(configs[0]):
        title += f" ({pair} on {equal.gpus_label(gpus[configs[0]])})"
    text = [title, ""]
    eq_rows, eq_lines = [], []
    # The routed configurations are the deployments judged; all-baseline and all-speculative stay in the tables.
    routed = [n for n in configs if n not in SINGLE] or configs
    if refs:
        eq_rows = equal.judge(results, routed, refs, gpus)
        eq_lines = equal.verdict_lines(eq_rows, routed, refs, gpus)
        text += [eq_lines[0], ""]
        text += ["references: " + ", ".join(f"{n} = " + (r.get("profile") and f"profile {r['profile']}"
                                                          or str(r.get("url"))) + f" ({equal.gpus_label(r.get('gpus'))})"
                                            for n, r in data["references"].items()), ""]
    if "speculative_curve" in cfg:
        text += [f"balanced ran with --speculative-curve {cfg['speculative_curve']} "
                 f"--baseline-curve {cfg['baseline_curve']}", ""]
    if "global_threshold" in cfg:
        text += [f"global ran with --threshold {cfg['global_threshold']} --hysteresis {cfg['hysteresis']} "
                 "(total in-flight; where the all-speculative curve falls below all-baseline)", ""]
    if calib:
        text += ["calibration from the all-speculative and all-baseline runs:", calib, ""]
    text += [figures.render_table(results, gpus=gpus or None), "",
             "winners per level among the router configurations (throughput / median E2E latency):"]
    text += [f"  c={w['concurrency']}: {w['throughput_winner']} / {w['latency_winner']}" for w in win]
    text += ["", f"verdict: spillover@{threshold} against the best other configuration, then balanced "
                 f"against the best other configuration (noise band {NOISE:.0%}):"]
    text += ["  " + line for line in lines]
    warm = warmup_line(cfg, configs)
    if cfg.get("single_again"):
        warm += ("; " if warm else "") + ("all-baseline and all-speculative as reported were measured again in "
                                          "phase 2, interleaved with the routed configurations (the calibration "
                                          "the routers got is from phase 1)")
    if warm:
        text.append(warm)
    if ran := requests_line(results):
        text.append(ran)
    if rec is not None:
        text.append("calibrate's expected spillover vs measured (tok/s): " + ", ".join(
            f"c={r['concurrency']} {r['expected_spillover']:.0f}/{r['spillover']:.0f}"
            for r in rows if "expected_spillover" in r))
    if refs:
        text += ["", "equal hardware: which deployment of these GPUs wins at each level (noise band "
                     f"{NOISE:.0%}):"]
        text += ["  " + line for line in eq_lines]
        text += ["", equal.render_text(eq_rows, routed, refs, gpus)]
    host = data.get("host")
    if host:
        text.append(f"host: {host['cpus']} CPUs, load average {host['loadavg_at_start'][0]:.1f} at start, "
                    f"{host['loadavg_at_end'][0]:.1f} at end, {host['wall_seconds']:.0f} s wall")
    extra = {"title": title, "winners": win, "verdict": rows, "verdict_text": lines,
             "calibration": calibration.rec_json(rec) if rec else None}
    if refs:
        extra |= {"equal_hardware": eq_rows, "equal_hardware_text": eq_lines}
    md = _markdown(title, own, win, lines, calib, cfg.get("command", ""), rows, threshold, gpus)
    if warm:
        md = md.replace("\n\nCalibration (from", f"\n\n{warm}\n\nCalibration (from", 1) if calib else md + f"\n{warm}\n"
    if refs:
        md = _with_equal(md, eq_lines, equal.render_markdown(results, eq_rows, routed, refs, gpus))
    return "\n".join(text), md, extra


def requests_line(results: dict[str, list[dict]]) -> str:
    """The requests each level actually ran (completed + failed), not what the flags would have asked for."""
    counts: dict[int, set[int]] = {}
    for figs in results.values():
        for f in figs:
            counts.setdefault(f["concurrency"], set()).add(f["completed"] + f["failed"])
    if not counts:
        return ""
    return "requests per level as run (completed + failed): " + ", ".join(
        f"c={c}: {'/'.join(map(str, sorted(n)))}" for c, n in counts.items())


def warmup_line(cfg: dict, configs: list[str]) -> str:
    """What the learned configurations were given before their first level (the issue asks the report to say)."""
    learned = [n for n in configs if n in LEARNED]
    if not learned:
        return ""
    warm = cfg.get("warmup") or {}
    speedup = cfg.get("speedup", 1.0)
    parts = []
    for n in learned:
        w = warm.get(n)
        if not w:
            parts.append(f"{n}: no warm-up (it starts cold at the first level and keeps learning through them)")
        else:
            parts.append(f"{n}: warm-up of {w['seconds']:g} s of the servers' time ({w['seconds'] / speedup:g} s "
                         f"wall at speedup {speedup:g}), {w['requests']} requests at concurrency "
                         f"{'/'.join(map(str, w['concurrency']))} in equal shares, before the first level; "
                         "it keeps learning through the levels")
    if cfg.get("requests_per_level"):
        levels_note = f"; {cfg['requests_per_level']} requests per level"
    elif cfg.get("duration_per_level"):
        levels_note = f"; {cfg['duration_per_level']:g} s per level"
    elif cfg.get("min_requests"):
        levels_note = f"; at least {cfg['min_requests']} requests per level"
    else:
        levels_note = ""
    if cfg.get("settle_seconds"):
        levels_note += (f"; each level (and warm-up) starts {cfg['settle_seconds']:g} s wall after the one before "
                        "ended, so the /v1/loads figures the learned routers poll no longer show the previous "
                        "configuration's traffic")
    return "warm-up: " + "; ".join(parts) + levels_note


def _with_equal(md: str, eq_lines: list[str], table: str) -> str:
    """The equal-hardware verdict goes first, right under the title and command."""
    head, sep, rest = md.partition("Output throughput (tok/s, bench_serving")
    body = [f"**{eq_lines[0]}**", "", table, "Per level:", ""] + [f"- {x}" for x in eq_lines[1:]] + [
        "", "### The router configurations among themselves", "", ""]
    return head + "\n".join(body) + sep + rest


def _markdown(title, results, win, lines, calib, cmd, rows, threshold, gpus=None) -> str:
    out = [f"## {title}", ""]
    if cmd:
        out += ["```", cmd, "```", ""]
    names = list(results)
    gpus = gpus or {}
    heads = [equal.header(n, gpus) for n in names]
    out += ["Output throughput (tok/s, bench_serving's `output_throughput`) and the winners per level:", "",
            "| concurrency | " + " | ".join(heads) + " | throughput winner | median-latency winner |",
            "|" + "---|" * (len(names) + 3)]
    for i, w in enumerate(win):
        out.append(f"| {w['concurrency']} | " + " | ".join(f"{figures.tput(results[n][i]):.1f}"
                                                            for n in names)
                   + f" | {w['throughput_winner']} | {w['latency_winner']} |")
    out += ["", "Median TTFT / median E2E latency (s):", "",
            "| concurrency | " + " | ".join(heads) + " |", "|" + "---|" * (len(names) + 1)]
    for i, w in enumerate(win):
        out.append(f"| {w['concurrency']} | " + " | ".join(
            f"{results[n][i]['median_ttft_ms'] / 1000:.2f} / {results[n][i]['median_e2e_latency_ms'] / 1000:.1f}"
            for n in names) + " |")
    failed = sum(f["failed"] for figs in results.values() for f in figs)
    out += ["", f"Failed requests: {failed}.", "",
            f"Verdict (spillover at threshold {threshold} vs the best other configuration; then balanced vs "
            "the best other configuration):", ""]
    out += [f"- {line}" for line in lines]
    if calib:
        out += ["", "Calibration (from the all-speculative and all-baseline runs above):", "", "```", calib, "```"]
    return "\n".join(out) + "\n"
