"""`python -m bench judge`: adaptive from a cold start against every fixed configuration, on the server family.

For one member pair of bench/lab/family.py (or several), per repeat: a quick sweep of each server alone (the
curves `balanced` gets, and the all-speculative / all-baseline figures), then at each closed-loop level, one
configuration right after the other on the same two servers: round-robin, spillover at each threshold of a
small scan, `balanced` on the curves just measured, and `adaptive` (load_signal backend, no curves), whose
router started cold and got at most `--warmup-seconds` of the servers' time of traffic first. Then the
cold start: per level, a fresh adaptive router runs the level again and again (at most `--cold-runs` times)
until a run is within 5% of that repeat's best fixed configuration; the requests and seconds before that run
are its cold-start cost. Everything is bounded: request counts per level, a per-request timeout, a level cap.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import procs
from bench.cli import BARE_TARGET, ArgError, NotServing, fail, int_list, parser, target
from bench.lab import routesim
from bench.lab.family import MEMBERS
from bench.lab.judging import BAR, Judge, luck_adjusted, luck_slope
from bench.load import BenchInputError


def render(results: list[dict], cmd: str) -> str:
    """A markdown table per member: per level, adaptive / best fixed in each repeat, and the cold start."""
    out = []
    for res in results:
        reps = res["repeats"]
        host = res["host"]
        fit = luck_slope(res)
        out += [f"**{res['member']}**: {res['physics']}; {res['expect']}. Spillover threshold picked per repeat: "
                + ", ".join(r["spillover_best"] for r in reps) + f". Host load average {host['loadavg_at_start'][0]:.1f}"
                f" at start, {host['loadavg_at_end'][0]:.1f} at end, {host['wall_seconds']:.0f} s wall. Warm-up: "
                + ", ".join(f"{r['warmup']['seconds']:g} s of the servers' time ({r['warmup']['requests']} requests"
                            f" at {'/'.join(map(str, r['warmup'].get('levels', r['levels'])))} clients)"
                            for r in reps) + ".",
                "",
                "| concurrency | best fixed (per repeat) | adaptive / best fixed, repeats | min | control: balanced "
                "again / balanced | control / best fixed (the bar's resolution) | speculative share: adaptive / best | cold start: runs until within 5% (ratios per "
                "run), requests and seconds before | luck: adaptive / best | luck-adjusted: adaptive / best fixed | sent behind "
                "another of the level's: adaptive / best (adaptive's explorations) |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, c in enumerate(reps[0]["levels"]):
            rows = [r["rows"][i] for r in reps]
            colds = [r["cold"][i] for r in reps]
            ratios = [row["ratio"] for row in rows]
            mark = min(ratios)
            cold = "; ".join(
                (f"{x['runs']} -> {x['requests_before']} req, {x['seconds_before']} s" if x["reached_at_run"] is not None
                 else f"{x['runs']} -> not within {len(x['runs'])} runs") for x in colds)
            controls = " / ".join(f"{row.get('control', float('nan')):.3f}" for row in rows)
            floor = " / ".join(_marked(control_vs_best(r, i)) for r in reps)
            shares = ", ".join(f"{row['adaptive_share']:.0%}/{row['best_share']:.0%}" for row in rows)
            lucks = ", ".join(f"{row['adaptive_luck']:.2f}/{row['best_luck']:.2f}"
                              if row.get("adaptive_luck") is not None and row.get("best_luck") is not None else "-"
                              for row in rows)
            behind = ", ".join(_behind(row) for row in rows)
            adjusted = " / ".join(_marked(luck_adjusted(r, i, fit[0])) for r in reps) if fit is not None else "-"
            out.append(f"| {c} | {', '.join(row['best_fixed'] for row in rows)} | "
                       f"{' / '.join(f'{x:.3f}' for x in ratios)} | {'**' if mark < BAR else ''}{mark:.3f}"
                       f"{'**' if mark < BAR else ''} | {controls} | {floor} | "
                       f"{shares} | {cold} | {lucks} | {adjusted} | {behind} |")
        out += ["", summary(res), *([luck_summary(res, fit)] if fit is not None else []),
                *([forced] if (forced := forced_summary(res)) else []), ""]
    return f"```\n{cmd}\n```\n\n" + "\n".join(out)


def _behind(row: dict) -> str:
    """A row's requests sent behind another: adaptive's / the best's (and adaptive's explorations); - in files
    written before the judge counted them."""
    if row.get("adaptive_behind") is None:
        return "-"
    explored = sum(v for k, v in (row.get("adaptive_decisions") or {}).items() if k.endswith("/explore"))
    return f"{row['adaptive_behind']}/{row['best_behind']} ({explored})"


def control_vs_best(rep: dict, i: int) -> float:
    """The control's figure over the best fixed one at level i (computed for files written before the row held it)."""
    row = rep["rows"][i]
    if "control_vs_best" in row:
        return row["control_vs_best"]
    best = row["best_fixed_tput"]
    return rep["configs"]["balanced-again"][i]["output_throughput"] / best if best else 0.0


def _marked(x: float) -> str:
    return f"**{x:.3f}**" if x < BAR else f"{x:.3f}"


def summary(res: dict) -> str:
    """Cells (level x repeat) at or above the bar, for adaptive and for the control (which routes as `balanced`
    does): the control's count is how many of adaptive's the host's scatter alone lets through."""
    reps = res["repeats"]
    levels = reps[0]["levels"]
    rows = [row for r in reps for row in r["rows"]]
    ad = sum(row["ratio"] >= BAR for row in rows)
    ctl = sum(control_vs_best(r, i) >= BAR for r in reps for i in range(len(levels)))
    held = sum(all(r["rows"][i]["ratio"] >= BAR for r in reps) for i in range(len(levels)))
    return (f"{res['member']}: adaptive >= {BAR} x best fixed in {ad} of {len(rows)} cells ({held} of {len(levels)}"
            f" levels in every repeat); the control (balanced again) in {ctl} of {len(rows)}.")


def forced_spread(rep: dict, i: int) -> tuple[list[str], float] | None:
    """At a level of two or more clients where adaptive and the best fixed configuration sent no request behind
    another (each went to the server left idle: on one server a pool, the routing is forced), the routed
    configurations that did the same and their throughputs' max over min: how far the level's draw of prompts
    and the host move configurations that decide alike, the bar's resolution there. None elsewhere."""
    row, cfgs = rep["rows"][i], rep["configs"]
    if rep["levels"][i] < 2 or row.get("adaptive_behind") != 0 or row.get("best_behind") != 0:
        return None
    alike = [n for n, figs in cfgs.items() if n not in ("all-speculative", "all-baseline") and figs[i].get("behind") == 0]
    tputs = [cfgs[n][i]["output_throughput"] for n in alike]
    return (alike, max(tputs) / min(tputs)) if len(alike) > 1 and min(tputs) > 0 else None


def forced_summary(res: dict) -> str | None:
    """One line per member: the levels where routing was forced, and how far the configurations that routed
    alike there spread (forced_spread), per repeat."""
    reps = res["repeats"]
    parts = []
    for i, c in enumerate(reps[0]["levels"]):
        got = [forced_spread(r, i) for r in reps]
        if any(g is not None for g in got):
            names = sorted({n for g in got if g is not None for n in g[0]})
            parts.append(f"{c} clients ({', '.join(names)}): " + " / ".join(
                "-" if g is None else f"{(g[1] - 1):.1%}" for g in got))
    if not parts:
        return None
    return ("Routing forced (adaptive and the best sent nothing behind another: every request went to the idle "
            "server), the configurations that routed alike spread by (max/min - 1, per repeat) "
            + "; ".join(parts) + ". Where that passes 5%, the bar there measures the draw, not routing.")


def luck_summary(res: dict, fit: tuple[float, float, float]) -> str:
    """The luck-adjusted count (members drawing acceptance per request), with the fit it rests on."""
    reps = res["repeats"]
    n = len(reps[0]["levels"])
    held = sum(luck_adjusted(r, i, fit[0]) >= BAR for r in reps for i in range(n))
    return (f"Luck-adjusted (log tok/s against share x (luck - 1), fitted within each configuration and level across"
            f" the repeats: slope {fit[0]:.2f}, the cells' scatter {fit[1]:.1%} -> {fit[2]:.1%}): adaptive >= {BAR}"
            f" x best fixed in {held} of {n * len(reps)} cells. An estimate to the first order, beside the measured"
            f" count, not instead of it.")


def _url(text: str) -> str:
    name, url = target(text)
    if name != BARE_TARGET:
        raise ValueError(f"a URL, not NAME=URL: {text}")
    return url


def main(argv: list[str] | None = None) -> int:
    p = parser("judge", __doc__.splitlines()[0])
    p.add_argument("--member", action="append", choices=sorted(MEMBERS), help="repeatable; default: all")
    p.add_argument("--speculative", type=_url, metavar="URL",
                   help="with --baseline: judge this running pair instead of family members (e.g. `spec-bench engines`)")
    p.add_argument("--baseline", type=_url, metavar="URL")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="passed to every router started (repeatable), e.g. --router-arg=--health-path=/openapi.json "
                        "in front of llama-cpp-python")
    p.add_argument("--speedup", type=float, default=5.0)
    p.add_argument("--levels", type=int_list, default=int_list("1,2,4,8,16,32"), help="closed-loop levels")
    p.add_argument("--thresholds", type=int_list, default=int_list("1,2,4,8"), help="spillover thresholds scanned")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--warmup-seconds", type=float, default=30.0, help="servers' seconds of warm-up (<= 30)")
    p.add_argument("--warmup-levels", type=int_list, default=None,
                   help="levels the warm-up steps through, equal time each (default: --levels)")
    p.add_argument("--cold-runs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--name", default="judge")
    p.add_argument("--virtual", type=int, default=0, metavar="SEEDS",
                   help="judge on a virtual clock instead (bench/lab/routesim.py: the router's own policies in front of "
                        "the members' engines in one process, no servers, no host scatter), over SEEDS seeds")
    p.add_argument("--render", nargs="+", type=Path, metavar="JSON",
                   help="print one markdown report of saved runs (their JSON files) and run nothing")
    try:
        ns = p.parse_args(argv)
    except ArgError as exc:
        return fail("judge", exc)
    if ns.speedup <= 0 or ns.repeats < 1 or ns.rounds < 1 or ns.cold_runs < 1 or not 0 <= ns.warmup_seconds <= 30:
        return fail("judge", "--speedup > 0, --repeats/--rounds/--cold-runs >= 1, 0 <= --warmup-seconds <= 30")
    if (ns.speculative is None) != (ns.baseline is None) or (ns.speculative and ns.member):
        return fail("judge", "--speculative and --baseline go together, and not with --member")
    if ns.virtual < 0 or (ns.virtual and ns.speculative):
        return fail("judge", "--virtual SEEDS >= 1 judges family members only (not a running pair)")
    if ns.render:
        try:
            docs = [json.loads(f.read_text(encoding="utf-8")) for f in ns.render]
            print("\n".join(render(d["results"], d["command"]) for d in docs))
        except (OSError, ValueError, KeyError) as exc:
            return fail("judge", f"cannot render: {exc}")
        return 0
    cmd = "python -m bench judge " + " ".join(argv if argv is not None else sys.argv[1:])
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.virtual:
        return virtual(ns, cmd)
    judge = Judge(ns)
    results = []
    try:
        pairs = [(ns.name, (ns.speculative, ns.baseline))] if ns.speculative else [(m, None) for m in ns.member or MEMBERS]
        for name, urls in pairs:
            results.append(judge.member(name, urls))
            (ns.out / f"{ns.name}.json").write_text(json.dumps({"command": cmd, "speedup": ns.speedup,
                                                                "max_tokens": ns.max_tokens,
                                                                "results": results}, indent=1), encoding="utf-8")
            (ns.out / f"{ns.name}.md").write_text(render(results, cmd), encoding="utf-8")
    except (BenchInputError, procs.ProcError, NotServing) as exc:
        return fail("judge", exc)
    print(render(results, cmd))
    return 0


def virtual(ns, cmd: str) -> int:
    """--virtual: every member on the virtual clock, `--virtual` seeds each, from --seed on."""
    results, text = [], ""
    try:
        for name in ns.member or MEMBERS:
            results.append(routesim.judge_member(
                MEMBERS[name], ns.levels, ns.virtual, seed=ns.seed, min_requests=ns.min_requests, rounds=ns.rounds,
                warmup_s=ns.warmup_seconds, cold_runs=ns.cold_runs, thresholds=tuple(ns.thresholds),
                max_tokens=ns.max_tokens))
            text = routesim.render(results, cmd)
            (ns.out / f"{ns.name}.json").write_text(json.dumps({"command": cmd, "virtual": ns.virtual,
                                                                "results": results}, indent=1), encoding="utf-8")
            (ns.out / f"{ns.name}.md").write_text(text, encoding="utf-8")
    except BenchInputError as exc:
        return fail("judge", exc)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
