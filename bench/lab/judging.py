"""One family member pair judged (bench judge, scripts/judge_record.py): its servers, the routers of every
configuration, the closed-loop levels, the cold-start runs."""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

import aiohttp

from bench import figures, procs
from bench.cli import run_async, wait_serving
from bench.lab.family import MEMBERS, describe, steps_per_token
from bench.load import LoadSpec, build_body, load_prompts, run_closed
from bench.streams import learned_state, read_router

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
        self.external: tuple[str, str] | None = None  # a running pair judged instead of a family member
        # A running pair's luck, measured (its acceptance draws are unknown): per prompt index of this repeat,
        # the speculative server's seconds per output token when all-speculative served it at one client.
        self.costs: dict[int, float] | None = None

    def requests_for(self, c: int) -> int:
        return max(self.ns.min_requests, self.ns.rounds * c)

    async def level(self, url: str, c: int, requests: int | None = None, duration: float | None = None,
                    costs: bool = False) -> dict:
        n = self.requests_for(c) if requests is None and duration is None else requests
        spec = LoadSpec(url=url, prompts=self.prompts, max_tokens=self.ns.max_tokens, requests=n, duration=duration,
                        timeout=60.0, level_timeout=300.0, seed=self.load_seed)
        run = await run_closed(spec, c)
        if costs:
            self.costs = prompt_costs(run.records)
        fig = figures.compute(run, self.ns.speedup)
        out = {k: fig.get(k) for k in ("concurrency", "output_throughput", "completed", "failed", "duration_s",
                                        "speculative_share", "steady_output_throughput", "median_e2e_latency_ms")}
        out["luck"] = self.luck(spec, run.records)
        out["behind"] = sent_behind(run.records)
        return out

    async def decided(self, url: str, c: int) -> dict:
        """A learned router's level, with its decisions there by pool and reason (router_route_decisions_total)."""
        async with aiohttp.ClientSession() as s:
            before = (await read_router(s, url)).decisions
            fig = await self.level(url, c)
            after = (await read_router(s, url)).decisions
        fig["decisions"] = {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v > before.get(k, 0)}
        return fig

    def luck(self, spec: LoadSpec, records: list) -> float | None:
        """The mean steps per token of the requests this configuration sent to the speculative server, over
        that of all the level's requests (members drawing acceptance per request; None otherwise): below 1, the
        speculative server got the easier prompts. Request i (in start order) carries prompt offset + i.
        A running pair: the same ratio of measured costs (`self.costs`), over the prompts whose cost is known."""
        if self.external is not None:
            return luck_ratio(self.costs, records)
        m = MEMBERS.get(self.member_name)
        p = m.speculative if m is not None else None
        if p is None or not p.speculative or p.accept_per != "request":
            return None
        bodies = [build_body(q, spec.model, spec.max_tokens, spec.extra_body) for q in spec.prompts]
        offset = random.Random(spec.seed).randrange(len(bodies))
        return luck_ratio({i: steps_per_token(p, bodies[(offset + i) % len(bodies)], self.ns.seed)
                           for i in range(len(records))}, records)

    def router(self, group: procs.ProcGroup, policy: str, spec: bool, base: bool, threshold: int | None = None,
               extra: list[str] | None = None) -> str:
        r = group.add(procs.start_router([self.spec_url] if spec else [], [self.base_url] if base else [], policy,
                                         threshold, extra=[*(extra or []), *getattr(self.ns, "router_arg", [])]))
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
        self.costs = None  # this repeat's prompts are others
        out: dict = {"repeat": k, "levels": ns.levels, "configs": {}, "load_seed": self.load_seed}
        with procs.ProcGroup() as group:
            singles = [("all-speculative", self.router(group, "spillover", True, False)),
                       ("all-baseline", self.router(group, "spillover", False, True))]
            for name, _ in singles:
                out["configs"][name] = []
            for c in ns.levels:
                for name, url in singles:
                    # every level draws its prompts from the same offset, so one client's costs serve them all
                    costs = self.external is not None and name == "all-speculative" and c == 1
                    out["configs"][name].append(run_async(self.level(url, c, costs=costs)))
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
                    measure = self.decided if name == "adaptive" else self.level
                    out["configs"][name].append(run_async(measure(url, c)))
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
        best_each, best_spill = best_threshold({s: [figures.tput(f) for f in cfgs[s]] for s in spills})
        out["spillover_best"] = best_spill
        rows = []
        for i, c in enumerate(ns.levels):
            fixed = {name: figures.tput(cfgs[best_spill if name == "spillover" else name][i]) for name in FIXED}
            best = max(fixed, key=fixed.get)
            every = max([*fixed.values(), best_each[i]])
            top, ours = cfgs[best_spill if best == "spillover" else best][i], cfgs["adaptive"][i]
            ad = figures.tput(ours)
            again = figures.tput(cfgs["balanced-again"][i])
            control = again / fixed["balanced"] if fixed["balanced"] else 0.0
            # The bar applied to the control: a second router routing exactly as `balanced` does, against the best
            # fixed configuration of the same repeat. Where it falls below the bar, the bar there measures this
            # host's run-to-run scatter (and which prompts drew which acceptance), not a routing rule.
            rows.append({"concurrency": c, "best_fixed": best, "control": control, "best_fixed_tput": fixed[best],
                         "control_vs_best": again / fixed[best] if fixed[best] else 0.0,
                         "adaptive": ad,
                         "ratio": ad / fixed[best] if fixed[best] else 0.0,
                         "ratio_vs_every_threshold": ad / every if every else 0.0,
                         "adaptive_share": ours["speculative_share"], "best_share": top["speculative_share"],
                         "adaptive_behind": ours.get("behind"), "best_behind": top.get("behind"),
                         "adaptive_decisions": ours.get("decisions"),
                         "adaptive_luck": ours.get("luck"), "best_luck": top.get("luck"),
                         "failed": sum(cfgs[name][i]["failed"] for name in cfgs)})
        out["rows"] = rows

    def cold_start(self, out: dict) -> list[dict]:
        """Per level: a fresh adaptive router; runs of the level until one is within 5% of the best fixed."""
        ns, got = self.ns, []
        for i, c in enumerate(ns.levels):
            target = out["rows"][i]["best_fixed_tput"]
            runs, seen, before_req, before_s = [], [], 0, 0.0
            reached = None
            with procs.ProcGroup() as group:
                url = self.adaptive(group)
                for j in range(ns.cold_runs):
                    fig = run_async(self.decided(url, c))
                    ratio = figures.tput(fig) / target if target else 0.0
                    runs.append(round(ratio, 3))
                    seen.append({k: fig[k] for k in ("decisions", "behind", "luck", "speculative_share")})
                    if ratio >= BAR:
                        reached = j
                        break
                    before_req += fig["completed"]
                    before_s += fig["duration_s"]
            got.append({"concurrency": c, "runs": runs, "reached_at_run": reached,
                        "requests_before": before_req if reached is not None else None,
                        "seconds_before": round(before_s, 1) if reached is not None else None,
                        "requests_tried": before_req, "seconds_tried": round(before_s, 1),
                        "seen": seen})  # per run: its decisions, requests sent behind another, luck, share
        return got

    def member(self, name: str, urls: tuple[str, str] | None = None) -> dict:
        """One family member's servers (started here), or with `urls` a running pair (speculative, baseline)."""
        ns = self.ns
        self.member_name, self.external = name, urls
        t0, load0 = time.time(), os.getloadavg()
        with procs.ProcGroup() as group:
            if urls is None:
                pair = group.add(procs.start(f"family {name}", ["bench", "family", "--member", name, "--speedup",
                                                              f"{ns.speedup:g}", "--seed", str(ns.seed)], lines=2))
                self.spec_url, self.base_url = pair.urls
            else:
                self.spec_url, self.base_url = urls
                for url in urls:
                    run_async(wait_serving(url, within=60.0))
            repeats = []
            for k in range(ns.repeats):
                repeats.append(self.repeat(k))
                r = repeats[-1]
                print(f"{name} repeat {k}: " + ", ".join(
                    f"c={row['concurrency']} {row['ratio']:.3f} ({row['best_fixed']})" for row in r["rows"])
                    + " | cold: " + ", ".join(f"c={x['concurrency']} {x['runs']}" for x in r["cold"]),
                    file=sys.stderr, flush=True)
        if urls is None:
            m = MEMBERS[name]
            what = {"physics": m.physics, "expect": m.expect, "describe": describe(m, ns.max_tokens)}
        else:
            what = {"physics": f"a running pair: speculative {urls[0]}, baseline {urls[1]}",
                    "expect": "unknown beforehand", "describe": ""}
        return {"member": name, **what,
                "repeats": repeats,
                "host": {"cpus": os.cpu_count(), "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
                         "wall_seconds": round(time.time() - t0, 1)}}


def prompt_costs(records: list) -> dict[int, float]:
    """Per prompt index (start order) of a one-client level on one server, its seconds per output token there:
    what the request cost that server (its prefill and its acceptance both in), with nothing else running."""
    ordered = sorted(records, key=lambda r: r.start)
    return {i: (r.end - r.start) / r.output_tokens for i, r in enumerate(ordered)
            if r.error is None and r.output_tokens > 0}


def luck_ratio(costs: dict[int, float] | None, records: list) -> float | None:
    """The mean cost (a member's steps per token, or a running pair's measured `prompt_costs`) of the prompts a
    level sent to the speculative server, over that of all the level's prompts whose cost is known: below 1, the
    speculative server got the cheaper prompts. None without costs. Request i in start order carries prompt i."""
    if not costs:
        return None
    ordered = sorted(records, key=lambda r: r.start)
    every = [costs[i] for i in range(len(ordered)) if i in costs]
    spec = [costs[i] for i, r in enumerate(ordered) if i in costs and r.pool == "speculative"]
    if not spec or not every:
        return None
    return round((sum(spec) / len(spec)) / (sum(every) / len(every)), 3)


def sent_behind(records: list) -> int:
    """How many of a level's requests were sent to a pool while an earlier one of the level's was in flight there:
    with one server a pool, the requests that shared (or queued on) a server while the other may have been idle.
    At one client, 0."""
    latest: dict[str, float] = {}  # per pool, the latest end among its earlier requests
    behind = 0
    for r in sorted((r for r in records if r.pool is not None), key=lambda r: r.start):
        behind += r.start < latest.get(r.pool, -math.inf)
        latest[r.pool] = max(latest.get(r.pool, -math.inf), r.end)
    return behind


def best_threshold(tputs: dict[str, list[float]]) -> tuple[list[float], str]:
    """Spillover at each scanned threshold, tok/s per level -> (the best of them at each level, the one threshold
    best over all the levels: the highest sum of its tok/s over each level's best, what a user would pin)."""
    names = list(tputs)
    n = len(tputs[names[0]])
    best_each = [max(tputs[s][i] for s in names) for i in range(n)]
    return best_each, max(names, key=lambda s: sum(tputs[s][i] / best_each[i] for i in range(n)))


def luck_slope(res: dict) -> tuple[float, float, float] | None:
    """How much a configuration's tok/s moves with its luck, fitted on the run's own cells: log tok/s against
    share x (luck - 1), within each configuration and level across the repeats (so routing and load drop out).
    Returns (slope, scatter before, scatter after: sd of log tok/s around each cell's mean), or None where the
    member draws no per-request acceptance or the run has one repeat."""
    reps = res["repeats"]
    if len(reps) < 2:
        return None
    xs, ys = [], []
    for name in reps[0]["configs"]:
        for i in range(len(reps[0]["levels"])):
            figs = [r["configs"][name][i] for r in reps]
            if any(f.get("luck") is None and f.get("speculative_share") for f in figs):
                continue
            pts = [(f["speculative_share"] * ((f.get("luck") or 1.0) - 1.0), math.log(figures.tput(f)))
                   for f in figs if figures.tput(f) > 0]
            if len(pts) < 2:
                continue
            mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
            xs += [p[0] - mx for p in pts]
            ys += [p[1] - my for p in pts]
    sxx = sum(x * x for x in xs)
    if not xs or sxx <= 0:
        return None
    g = sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx
    before = math.sqrt(sum(y * y for y in ys) / len(ys))
    after = math.sqrt(sum((y - g * x) ** 2 for x, y in zip(xs, ys, strict=True)) / len(ys))
    return g, before, after


def luck_adjusted(rep: dict, i: int, slope: float) -> float:
    """Adaptive over the best fixed configuration at level i, each configuration's tok/s first taken to even
    luck (divided by exp(slope x share x (luck - 1))): which prompts a routing happened to send to the
    speculative server taken out, to the first order the run's own cells measure."""
    def even(name: str) -> float:
        f = rep["configs"][name][i]
        return figures.tput(f) / math.exp(slope * f["speculative_share"] * ((f.get("luck") or 1.0) - 1.0))

    best = max(even(rep["spillover_best"] if name == "spillover" else name) for name in FIXED)
    return even("adaptive") / best if best else 0.0
