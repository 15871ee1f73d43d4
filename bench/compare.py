"""`python -m bench compare`: the canonical experiment on one pair of backends. Routers for all-baseline,
all-speculative, spillover at the calibrated threshold and round-robin; winner per level; a verdict."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import aiohttp

from bench import calibrate, figures, procs
from bench.load import BenchInputError
from bench.sweep import ArgError, SweepConfig, add_load_args, parser, run_async, run_sweep, write_outputs

NOISE = 0.03  # closed-loop runs of a few requests per client repeat within about this fraction
CONFIGS = ("spillover", "all-baseline", "all-speculative", "round-robin", "balanced")


async def wait_routing(url: str, model: str, wait_s: float = 30.0) -> None:
    """A router may start before its health probes mark backends up; wait until a request streams."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + wait_s
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.2)
    raise BenchInputError(f"router {url} did not route a request within {wait_s:g}s (last: {last})")


def winners(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    names = list(results)
    for i, f0 in enumerate(results[names[0]]):
        figs = {n: results[n][i] for n in names}
        ok = {n: f for n, f in figs.items() if f["completed"]}
        tp = max(ok, key=lambda n: figures.tput(ok[n])) if ok else None
        lat = min(ok, key=lambda n: ok[n]["median_e2e_latency_ms"]) if ok else None
        rows.append({"concurrency": f0["concurrency"], "throughput_winner": tp, "latency_winner": lat})
    return rows


def verdict(results: dict[str, list[dict]], rec: calibrate.Recommendation | None, threshold: int,
            spec: calibrate.Curve | None, base: calibrate.Curve | None) -> tuple[list[str], list[dict]]:
    """Per level: spillover against the best other configuration, and why when it is behind."""
    lines, rows = [], []
    # Spillover is judged against the four configurations it was built to beat; balanced gets its own lines.
    others = [n for n in results if n not in ("spillover", "balanced")]
    for i, sp in enumerate(results["spillover"]):
        c = sp["concurrency"]
        best = max(others, key=lambda n: figures.tput(results[n][i]))
        b = figures.tput(results[best][i])
        ratio = figures.tput(sp) / b if b else float("inf")
        status = "above" if ratio >= 1.0 else ("within noise" if ratio >= 1 - NOISE else "BELOW")
        row = {"concurrency": c, "spillover": figures.tput(sp), "best_other": best,
               "best_other_tput": b, "ratio": ratio, "status": status}
        if rec is not None and c in rec.expected:
            row["expected_spillover"] = rec.expected[c]["spillover"]
        rows.append(row)
        text = (f"c={c}: spillover@{threshold} {figures.tput(sp):.1f} tok/s vs best other "
                f"({best}) {b:.1f} -> {ratio:.2f}x, {status}")
        if status == "BELOW":
            text += "; " + explain(c, threshold, best, rec, spec, base, figures.tput(sp), b,
                                   sp.get("steady_output_throughput"))
        lines.append(text)
    if "balanced" in results:
        lines += balanced_verdict(results, rec, rows)
    return lines, rows


def balanced_verdict(results: dict[str, list[dict]], rec, rows: list[dict]) -> list[str]:
    """Per level: balanced against the best of the other configurations (spillover included)."""
    lines = []
    others = [n for n in results if n != "balanced"]
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
        x = calibrate.round_robin_split(spec, base, c)
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
    p = parser("python -m bench compare",
               "spillover (calibrated) vs all-baseline vs all-speculative vs round-robin vs balanced on one pair of "
               "backends: simulated ones started here (default) or your own servers.")
    p.add_argument("--speculative-profile", default="eagle3-tp8", help="simulator profile (default eagle3-tp8)")
    p.add_argument("--baseline-profile", default="baseline-tp8", help="simulator profile (default baseline-tp8)")
    p.add_argument("--speculative", metavar="URL", help="use this running speculative server instead of a sim")
    p.add_argument("--baseline", metavar="URL", help="use this running baseline server instead of a sim")
    p.add_argument("--threshold", type=int, default=None,
                   help="spillover threshold to test (default: calibrated from the all-* runs)")
    p.add_argument("--objective", choices=calibrate.OBJECTIVES, default="throughput")
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
        if ns.threshold is not None and ns.threshold < 0:
            raise ArgError("--threshold must be >= 0")
    except ArgError as exc:
        print(f"bench compare: {exc}", file=sys.stderr)
        return 2
    external = ns.speculative is not None
    if ns.speedup is None:
        ns.speedup = 1.0 if external else 5.0
    name = ns.name or ("compare" if external else
                       f"compare-{Path(ns.speculative_profile).stem}-{Path(ns.baseline_profile).stem}")
    try:
        with procs.ProcGroup() as group:
            return _run(ns, group, external, name, "python -m bench compare " + " ".join(argv))
    except (BenchInputError, procs.ProcError) as exc:
        print(f"bench compare: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench compare: interrupted", file=sys.stderr)
        return 130


def _rerender(path: Path) -> int:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        text, md, extra = report(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BenchInputError) as exc:
        print(f"bench compare: cannot re-render {path}: {type(exc).__name__} {exc}", file=sys.stderr)
        return 2
    print(text)
    figures.plot(path.with_suffix(".png"), data["results"], title=extra["title"])
    path.with_suffix(".md").write_text(md, encoding="utf-8")
    path.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
    return 0


def _cfg(ns, targets) -> SweepConfig:
    return SweepConfig(targets=targets, concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                       prompts=ns.prompts, requests_per_level=ns.requests_per_level,
                       duration_per_level=ns.duration_per_level, model=ns.model, speedup=ns.speedup,
                       timeout=ns.timeout, ignore_eos=ns.ignore_eos, seed=ns.seed,
                       rounds=ns.rounds)


def _run(ns, group: procs.ProcGroup, external: bool, name: str, cmd: str) -> int:
    load_start, t_start = os.getloadavg(), time.time()
    if external:
        spec_url, base_url = ns.speculative.rstrip("/"), ns.baseline.rstrip("/")
    else:
        spec_url = group.add(procs.start_sim(ns.speculative_profile, ns.speedup, "speculative sim")).url
        base_url = group.add(procs.start_sim(ns.baseline_profile, ns.speedup, "baseline sim")).url
    print(f"speculative backend {spec_url}, baseline backend {base_url}, speedup {ns.speedup:g}",
          file=sys.stderr)

    def router(policy: str, spec: bool, base: bool, threshold: int | None = None) -> str:
        r = group.add(procs.start_router([spec_url] if spec else [], [base_url] if base else [], policy,
                                         threshold))
        run_async(wait_routing(r.url, ns.model))
        return r.url

    # Phase 1: each pool alone behind its own router; this is also the calibration data.
    targets = [("all-baseline", router("spillover", False, True)),
               ("all-speculative", router("spillover", True, False))]
    single = run_async(run_sweep(_cfg(ns, targets)))
    rec = spec_curve = base_curve = None
    levels = ns.concurrency
    threshold = ns.threshold
    if threshold is None:
        spec_curve = calibrate.Curve.from_figs(single["all-speculative"])
        base_curve = calibrate.Curve.from_figs(single["all-baseline"])
        levels = sorted(set(spec_curve.levels) & set(base_curve.levels))
        rec = calibrate.recommend(spec_curve, base_curve, levels, ns.objective)
        threshold = rec.threshold
        print(calibrate.render(rec, spec_curve, base_curve, levels), file=sys.stderr)
    # Phase 2: both pools behind the two routers that choose between them.
    # balanced runs on the curves phase 1 just measured, exactly as calibrate prints them for the router.
    spec_pts = calibrate.curve_setting(calibrate.Curve.from_figs(single["all-speculative"]))
    base_pts = calibrate.curve_setting(calibrate.Curve.from_figs(single["all-baseline"]))
    bal = group.add(procs.start_router([spec_url], [base_url], "balanced", None, extra=[
        "--speculative-curve", spec_pts, "--baseline-curve", base_pts]))
    run_async(wait_routing(bal.url, ns.model))
    targets = [("spillover", router("spillover", True, True, threshold)),
               ("round-robin", router("round-robin", True, True)), ("balanced", bal.url)]
    mixed = run_async(run_sweep(_cfg(ns, targets)))
    results = {n: (mixed | single)[n] for n in CONFIGS}
    cfg = _cfg(ns, []).as_dict() | {
        "speculative": spec_url if external else ns.speculative_profile,
        "baseline": base_url if external else ns.baseline_profile, "threshold": threshold,
        "speculative_curve": spec_pts, "baseline_curve": base_pts,
        "objective": ns.objective, "command": cmd}
    # Other work on the host skews a closed-loop run; record how busy it was for whoever reads the results.
    host = {"cpus": os.cpu_count(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
            "wall_seconds": round(time.time() - t_start, 1)}
    data = {"config": cfg, "results": results, "host": host, "calibrated": rec is not None}
    text, md, extra = report(data)
    print(text)
    paths = write_outputs(ns.out, name, cfg, results, title=extra["title"], plot=not ns.no_plot,
                          extra={k: v for k, v in (data | extra).items() if k not in ("config", "results")})
    (ns.out / f"{name}.md").write_text(md, encoding="utf-8")
    (ns.out / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
    print("wrote " + ", ".join(str(x) for x in [*paths, ns.out / f"{name}.md", ns.out / f"{name}.txt"]))
    return 0


def report(data: dict) -> tuple[str, str, dict]:
    """Text and markdown reports of one compare run from its JSON-able data (so a saved run can be
    re-rendered with --from-json): calibration evidence, tables, winners, verdict."""
    cfg, results = data["config"], data["results"]
    threshold = cfg["threshold"]
    rec = spec_curve = base_curve = None
    calib = ""
    if data.get("calibrated", True) and data.get("calibration", True) is not None:
        spec_curve = calibrate.Curve.from_figs(results["all-speculative"])
        base_curve = calibrate.Curve.from_figs(results["all-baseline"])
        levels = sorted(set(spec_curve.levels) & set(base_curve.levels))
        rec = calibrate.recommend(spec_curve, base_curve, levels, cfg.get("objective", "throughput"))
        calib = calibrate.render(rec, spec_curve, base_curve, levels)
    win = winners(results)
    lines, rows = verdict(results, rec, threshold, spec_curve, base_curve)
    title = f"bench compare: {cfg['speculative']} vs {cfg['baseline']}, spillover threshold {threshold}"
    text = [title, ""]
    if "speculative_curve" in cfg:
        text += [f"balanced ran with --speculative-curve {cfg['speculative_curve']} "
                 f"--baseline-curve {cfg['baseline_curve']}", ""]
    if calib:
        text += ["calibration from the all-speculative and all-baseline runs:", calib, ""]
    text += [figures.render_table(results), "", "winners per level (throughput / median E2E latency):"]
    text += [f"  c={w['concurrency']}: {w['throughput_winner']} / {w['latency_winner']}" for w in win]
    text += ["", f"verdict: spillover@{threshold} against the best other configuration, then balanced "
                 f"against the best other configuration (noise band {NOISE:.0%}):"]
    text += ["  " + line for line in lines]
    if rec is not None:
        text.append("calibrate's expected spillover vs measured (tok/s): " + ", ".join(
            f"c={r['concurrency']} {r['expected_spillover']:.0f}/{r['spillover']:.0f}"
            for r in rows if "expected_spillover" in r))
    host = data.get("host")
    if host:
        text.append(f"host: {host['cpus']} CPUs, load average {host['loadavg_at_start'][0]:.1f} at start, "
                    f"{host['loadavg_at_end'][0]:.1f} at end, {host['wall_seconds']:.0f} s wall")
    extra = {"title": title, "winners": win, "verdict": rows, "verdict_text": lines,
             "calibration": calibrate.rec_json(rec) if rec else None}
    md = _markdown(title, results, win, lines, calib, cfg.get("command", ""), rows, threshold)
    return "\n".join(text), md, extra


def _markdown(title, results, win, lines, calib, cmd, rows, threshold) -> str:
    out = [f"## {title}", ""]
    if cmd:
        out += ["```", cmd, "```", ""]
    names = list(results)
    out += ["Output throughput (tok/s, bench_serving's `output_throughput`) and the winners per level:", "",
            "| concurrency | " + " | ".join(names) + " | throughput winner | median-latency winner |",
            "|" + "---|" * (len(names) + 3)]
    for i, w in enumerate(win):
        out.append(f"| {w['concurrency']} | " + " | ".join(f"{figures.tput(results[n][i]):.1f}"
                                                            for n in names)
                   + f" | {w['throughput_winner']} | {w['latency_winner']} |")
    out += ["", "Median TTFT / median E2E latency (s):", "",
            "| concurrency | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
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
