"""`python -m bench judge`: adaptive from a cold start against every fixed configuration, on the server family.

For one member pair of bench/family.py (or several), per repeat: a quick sweep of each server alone (the
curves `balanced` gets, and the all-speculative / all-baseline figures), then at each closed-loop level, one
configuration right after the other on the same two servers: round-robin, spillover at each threshold of a
small scan, `balanced` on the curves just measured, and `adaptive` (load_signal backend, no curves), whose
router started cold and got at most `--warmup-seconds` of the servers' time of traffic first. Then the
cold start: per level, a fresh adaptive router runs the level again and again (at most `--cold-runs` times)
until a run is within 5% of that repeat's best fixed configuration; the requests and seconds before that run
are its cold-start cost. Everything is bounded: request counts per level, a per-request timeout, a level cap.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from bench import figures, procs
from bench.cli import ArgError, NotServing, fail, int_list, parser, run_async, wait_serving
from bench.family import MEMBERS, describe, steps_per_token
from bench.load import BenchInputError, LoadSpec, build_body, load_prompts, run_closed
from bench.streams import learned_state

FIXED = ("all-speculative", "all-baseline", "round-robin", "spillover", "balanced")
BAR = 0.95
LOAD_INTERVAL = 0.5
SETTLE_S = 1.0  # before a learned router's level: two of its /v1/loads polls, past the previous drain


class Judge:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.prompts = load_prompts("coding")
        # The prompt order's offset, one per repeat (seed + repeat). A member drawing its acceptance per request
        # draws it from the body (the same request, the same draw, whichever router sent it), so a router that
        # alternates sends a fixed half of the prompts to the speculative server: with one offset for all
        # repeats, round-robin got the same easier half (mean steps per token 0.47 against 0.54) in all three.
        self.load_seed = ns.seed

    def requests_for(self, c: int) -> int:
        return max(self.ns.min_requests, self.ns.rounds * c)

    async def level(self, url: str, c: int, requests: int | None = None, duration: float | None = None) -> dict:
        n = self.requests_for(c) if requests is None and duration is None else requests
        spec = LoadSpec(url=url, prompts=self.prompts, max_tokens=self.ns.max_tokens, requests=n, duration=duration,
                        timeout=60.0, level_timeout=300.0, seed=self.load_seed)
        run = await run_closed(spec, c)
        fig = figures.compute(run, self.ns.speedup)
        out = {k: fig.get(k) for k in ("concurrency", "output_throughput", "completed", "failed", "duration_s",
                                        "speculative_share", "steady_output_throughput", "median_e2e_latency_ms")}
        out["luck"] = self.luck(spec, run.records)
        return out

    def luck(self, spec: LoadSpec, records: list) -> float | None:
        """The mean steps per token of the requests this configuration sent to the speculative server, over
        that of all the level's requests (members drawing acceptance per request; None otherwise): below 1, the
        speculative server got the easier prompts. Request i (in start order) carries prompt offset + i."""
        p = MEMBERS[self.member_name].speculative
        if not p.speculative or p.accept_per != "request":
            return None
        bodies = [build_body(q, spec.model, spec.max_tokens, spec.extra_body) for q in spec.prompts]
        offset = random.Random(spec.seed).randrange(len(bodies))
        draws = [steps_per_token(p, bodies[(offset + i) % len(bodies)], self.ns.seed)
                 for i in range(len(records))]
        ordered = sorted(records, key=lambda r: r.start)
        spec_draws = [d for d, r in zip(draws, ordered, strict=True) if r.pool == "speculative"]
        if not spec_draws or not draws:
            return None
        return round((sum(spec_draws) / len(spec_draws)) / (sum(draws) / len(draws)), 3)

    def router(self, group: procs.ProcGroup, policy: str, spec: bool, base: bool, threshold: int | None = None,
               extra: list[str] | None = None) -> str:
        r = group.add(procs.start_router([self.spec_url] if spec else [], [self.base_url] if base else [], policy,
                                         threshold, extra=extra))
        run_async(wait_serving(r.url, proc=r.proc))
        return r.url

    def adaptive(self, group: procs.ProcGroup) -> str:
        return self.router(group, "adaptive", True, True, None,
                           ["--load-signal", "backend", "--load-interval", str(LOAD_INTERVAL)])

    def warm_up(self, url: str) -> dict:
        """At most --warmup-seconds of the servers' time, in equal shares at each level (a cold router, then
        traffic that moves through the loads it will be judged at)."""
        ns = self.ns
        if ns.warmup_seconds <= 0:
            return {"seconds": 0.0, "requests": 0}
        levels = ns.warmup_levels or ns.levels
        each = ns.warmup_seconds / len(levels) / ns.speedup
        done, t0 = 0, time.monotonic()
        for c in levels:
            fig = run_async(self.level(url, c, requests=None, duration=each))
            done += fig["completed"]
        return {"seconds": ns.warmup_seconds, "wall_s": round(time.monotonic() - t0, 2), "requests": done,
                "levels": levels}

    def repeat(self, k: int) -> dict:
        ns = self.ns
        self.load_seed = ns.seed + k
        out: dict = {"repeat": k, "levels": ns.levels, "configs": {}, "load_seed": self.load_seed}
        with procs.ProcGroup() as group:
            singles = [("all-speculative", self.router(group, "spillover", True, False)),
                       ("all-baseline", self.router(group, "spillover", False, True))]
            for name, _ in singles:
                out["configs"][name] = []
            for c in ns.levels:
                for name, url in singles:
                    out["configs"][name].append(run_async(self.level(url, c)))
            curves = {name: ",".join(f"{f['concurrency']}:{f['output_throughput']:.1f}" for f in out["configs"][name])
                      for name, _ in singles}
            routed = [("round-robin", self.router(group, "round-robin", True, True))]
            routed += [(f"spillover@{t}", self.router(group, "spillover", True, True, t)) for t in ns.thresholds]
            # balanced twice: the second router is the control, how far one routed configuration's figure moves
            # between two runs of a level on this host (never a "best fixed").
            for name in ("balanced", "balanced-again"):
                routed.append((name, self.router(group, "balanced", True, True, None, [
                    "--speculative-curve", curves["all-speculative"], "--baseline-curve", curves["all-baseline"]])))
            adaptive = self.adaptive(group)
            out["warmup"] = self.warm_up(adaptive)
            routed.append(("adaptive", adaptive))
            for name, _ in routed:
                out["configs"][name] = []
            for c in ns.levels:
                for name, url in routed:
                    if name == "adaptive":
                        time.sleep(SETTLE_S)
                    out["configs"][name].append(run_async(self.level(url, c)))
            out["curves"] = curves
            out["learned"] = run_async(learned_state(adaptive))
        self.judge_repeat(out)
        out["cold"] = self.cold_start(out)
        return out

    def judge_repeat(self, out: dict) -> None:
        """The spillover threshold best over the levels (what a user would pin), then per level the best fixed
        configuration and adaptive against it."""
        cfgs, ns = out["configs"], self.ns
        spills = [f"spillover@{t}" for t in ns.thresholds]
        n = len(ns.levels)
        best_each = [max(figures.tput(cfgs[s][i]) for s in spills) for i in range(n)]
        best_spill = max(spills, key=lambda s: sum(figures.tput(cfgs[s][i]) / best_each[i] for i in range(n)))
        out["spillover_best"] = best_spill
        rows = []
        for i, c in enumerate(ns.levels):
            fixed = {name: figures.tput(cfgs[best_spill if name == "spillover" else name][i]) for name in FIXED}
            best = max(fixed, key=fixed.get)
            every = max([*fixed.values(), best_each[i]])
            ad = figures.tput(cfgs["adaptive"][i])
            control = figures.tput(cfgs["balanced-again"][i]) / fixed["balanced"] if fixed["balanced"] else 0.0
            rows.append({"concurrency": c, "best_fixed": best, "control": control, "best_fixed_tput": fixed[best],
                         "adaptive": ad,
                         "ratio": ad / fixed[best] if fixed[best] else 0.0,
                         "ratio_vs_every_threshold": ad / every if every else 0.0,
                         "adaptive_share": cfgs["adaptive"][i]["speculative_share"],
                         "best_share": cfgs[best_spill if best == "spillover" else best][i]["speculative_share"],
                         "adaptive_luck": cfgs["adaptive"][i].get("luck"),
                         "best_luck": cfgs[best_spill if best == "spillover" else best][i].get("luck"),
                         "failed": sum(cfgs[name][i]["failed"] for name in cfgs)})
        out["rows"] = rows

    def cold_start(self, out: dict) -> list[dict]:
        """Per level: a fresh adaptive router; runs of the level until one is within 5% of the best fixed."""
        ns, got = self.ns, []
        for i, c in enumerate(ns.levels):
            target = out["rows"][i]["best_fixed_tput"]
            runs, before_req, before_s = [], 0, 0.0
            reached = None
            with procs.ProcGroup() as group:
                url = self.adaptive(group)
                for j in range(ns.cold_runs):
                    fig = run_async(self.level(url, c))
                    ratio = figures.tput(fig) / target if target else 0.0
                    runs.append(round(ratio, 3))
                    if ratio >= BAR:
                        reached = j
                        break
                    before_req += fig["completed"]
                    before_s += fig["duration_s"]
            got.append({"concurrency": c, "runs": runs, "reached_at_run": reached,
                        "requests_before": before_req if reached is not None else None,
                        "seconds_before": round(before_s, 1) if reached is not None else None,
                        "requests_tried": before_req, "seconds_tried": round(before_s, 1)})
        return got

    def member(self, name: str) -> dict:
        ns = self.ns
        self.member_name = name
        t0, load0 = time.time(), os.getloadavg()
        with procs.ProcGroup() as group:
            pair = group.add(procs.start(f"family {name}", ["bench", "family", "--member", name, "--speedup",
                                                          f"{ns.speedup:g}", "--seed", str(ns.seed)], lines=2))
            self.spec_url, self.base_url = pair.urls
            repeats = []
            for k in range(ns.repeats):
                repeats.append(self.repeat(k))
                r = repeats[-1]
                print(f"{name} repeat {k}: " + ", ".join(
                    f"c={row['concurrency']} {row['ratio']:.3f} ({row['best_fixed']})" for row in r["rows"])
                    + " | cold: " + ", ".join(f"c={x['concurrency']} {x['runs']}" for x in r["cold"]),
                    file=sys.stderr, flush=True)
        m = MEMBERS[name]
        return {"member": name, "physics": m.physics, "expect": m.expect, "describe": describe(m, ns.max_tokens),
                "repeats": repeats,
                "host": {"cpus": os.cpu_count(), "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
                         "wall_seconds": round(time.time() - t0, 1)}}


def render(results: list[dict], cmd: str) -> str:
    """A markdown table per member: per level, adaptive / best fixed in each repeat, and the cold start."""
    out = []
    for res in results:
        reps = res["repeats"]
        host = res["host"]
        out += [f"**{res['member']}**: {res['physics']}; {res['expect']}. Spillover threshold picked per repeat: "
                + ", ".join(r["spillover_best"] for r in reps) + f". Host load average {host['loadavg_at_start'][0]:.1f}"
                f" at start, {host['loadavg_at_end'][0]:.1f} at end, {host['wall_seconds']:.0f} s wall. Warm-up: "
                + ", ".join(f"{r['warmup']['seconds']:g} s of the servers' time ({r['warmup']['requests']} requests"
                            f" at {'/'.join(map(str, r['warmup'].get('levels', r['levels'])))} clients)"
                            for r in reps) + ".",
                "",
                "| concurrency | best fixed (per repeat) | adaptive / best fixed, repeats | min | control: balanced "
                "again / balanced | speculative share: adaptive / best | cold start: runs until within 5% (ratios per "
                "run), requests and seconds before | luck: adaptive / best |",
                "|---|---|---|---|---|---|---|---|"]
        for i, c in enumerate(reps[0]["levels"]):
            rows = [r["rows"][i] for r in reps]
            colds = [r["cold"][i] for r in reps]
            ratios = [row["ratio"] for row in rows]
            mark = min(ratios)
            cold = "; ".join(
                (f"{x['runs']} -> {x['requests_before']} req, {x['seconds_before']} s" if x["reached_at_run"] is not None
                 else f"{x['runs']} -> not within {len(x['runs'])} runs") for x in colds)
            controls = " / ".join(f"{row.get('control', float('nan')):.3f}" for row in rows)
            shares = ", ".join(f"{row['adaptive_share']:.0%}/{row['best_share']:.0%}" for row in rows)
            lucks = ", ".join(f"{row['adaptive_luck']:.2f}/{row['best_luck']:.2f}"
                              if row.get("adaptive_luck") is not None and row.get("best_luck") is not None else "-"
                              for row in rows)
            out.append(f"| {c} | {', '.join(row['best_fixed'] for row in rows)} | "
                       f"{' / '.join(f'{x:.3f}' for x in ratios)} | {'**' if mark < BAR else ''}{mark:.3f}"
                       f"{'**' if mark < BAR else ''} | {controls} | "
                       f"{shares} | {cold} | {lucks} |")
        out.append("")
    return f"```\n{cmd}\n```\n\n" + "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = parser("judge", __doc__.splitlines()[0])
    p.add_argument("--member", action="append", choices=sorted(MEMBERS), help="repeatable; default: all")
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
    p.add_argument("--render", nargs="+", type=Path, metavar="JSON",
                   help="print one markdown report of saved runs (their JSON files) and run nothing")
    try:
        ns = p.parse_args(argv)
    except ArgError as exc:
        return fail("judge", exc)
    if ns.speedup <= 0 or ns.repeats < 1 or ns.rounds < 1 or ns.cold_runs < 1 or not 0 <= ns.warmup_seconds <= 30:
        return fail("judge", "--speedup > 0, --repeats/--rounds/--cold-runs >= 1, 0 <= --warmup-seconds <= 30")
    if ns.render:
        try:
            docs = [json.loads(f.read_text(encoding="utf-8")) for f in ns.render]
            print("\n".join(render(d["results"], d["command"]) for d in docs))
        except (OSError, ValueError, KeyError) as exc:
            return fail("judge", f"cannot render: {exc}")
        return 0
    cmd = "python -m bench judge " + " ".join(argv if argv is not None else sys.argv[1:])
    judge = Judge(ns)
    results = []
    ns.out.mkdir(parents=True, exist_ok=True)
    try:
        for name in ns.member or list(MEMBERS):
            results.append(judge.member(name))
            (ns.out / f"{ns.name}.json").write_text(json.dumps({"command": cmd, "speedup": ns.speedup,
                                                                "max_tokens": ns.max_tokens,
                                                                "results": results}, indent=1), encoding="utf-8")
            (ns.out / f"{ns.name}.md").write_text(render(results, cmd), encoding="utf-8")
    except (BenchInputError, procs.ProcError, NotServing) as exc:
        return fail("judge", exc)
    print(render(results, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
