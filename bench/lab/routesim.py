"""Routing on a virtual clock: the router's own Pools and policies in front of a family member's engines, in one
process, no sockets; what a routing rule does on exact physics, without this host's timing scatter.

The engines are bench.family's (the same continuous batching and acceptance draws as `spec-bench family`), the
requests the judge's (coding prompts, the same bodies, so a member drawing acceptance per request draws the same
for each), the decisions, leases, observations and /v1/loads figures the router's (`router.pools.Pools`,
`router.policies.make_policy`, `router.loads.parse_figures` on the document the family server would answer). Time is
the servers' own: the loop's clock jumps to the next step instead of sleeping, so a level of 64 requests costs
milliseconds of CPU and no two runs of the same seed differ. What it leaves out is the real router's: HTTP, the
proxy's own latency, a poll that lands late; `bench judge` measures those.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import selectors
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from bench.lab.family import Engine, Member, Req, _prompt_tokens, loads_document
from bench.lab.judging import best_threshold
from bench.load import build_body, load_prompts
from router import pools as pools_mod
from router.curves import parse_curve
from router.loads import parse_figures
from router.observe import Observation
from router.policies import Balanced, make_policy
from router.policy import Policy
from router.pools import Pools
from router.settings import load_settings

SPEC, BASE = "http://speculative", "http://baseline"
POLL_S = 2.5  # the judge's 0.5 s /v1/loads polls at --speedup 5, in the servers' time


class _Selector(selectors.SelectSelector):
    """Never waits: a wait for `timeout` moves the loop's clock on by that much (there is no I/O to wait for)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualLoop | None = None

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if timeout is None:
            raise RuntimeError("virtual clock: nothing scheduled and nothing ready (every task waits on another)")
        if timeout > 0 and self.loop is not None:
            self.loop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        sel = _Selector()
        super().__init__(sel)
        sel.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def run_virtual(coro):
    """Run a coroutine on a fresh virtual-clock loop, the router's in-flight integral on that clock too."""
    loop = VirtualLoop()
    saved = pools_mod.clock
    pools_mod.clock = loop.time
    try:
        return loop.run_until_complete(coro)
    finally:
        pools_mod.clock = saved
        loop.close()


@dataclass
class Level:
    clients: int
    requests: int
    tok_s: float  # output tokens over first start to last end, the servers' clock
    share: float  # of the requests, sent to the speculative server


class Bench:
    """One member's pair of engines (fresh for each configuration's run) and the judge's request bodies."""

    def __init__(self, member: Member, max_tokens: int = 96, seed: int = 0, prompts: str = "coding") -> None:
        self.member = member
        self.max_tokens = max_tokens
        self.seed = seed
        self.bodies = []
        for p in load_prompts(prompts):
            raw = build_body(p, "default", max_tokens, None)
            self.bodies.append((zlib.crc32(raw), _prompt_tokens(json.loads(raw), p.messages is not None)))

    async def run(self, policy: Policy, levels: list[tuple[int, int]], offset: int = 0,
                  warmup: list[tuple[int, float]] | None = None, pools: tuple[bool, bool] = (True, True)
                  ) -> list[Level]:
        """Closed-loop levels (clients, requests), one after the other on one pair of engines and one policy;
        before them, `warmup` (clients, seconds) with no figures kept. Request i of a level carries body
        offset + i, as the judge's load generator sends them."""
        m = self.member
        engines = {SPEC: Engine(m.speculative, 1.0, self.seed), BASE: Engine(m.baseline, 1.0, self.seed)}
        spec_urls, base_urls = ([SPEC] if pools[0] else []), ([BASE] if pools[1] else [])
        pl = Pools(spec_urls, base_urls, policy=policy, rng=random.Random(self.seed))
        for b in pl.backends:
            b.healthy = True
        for e in engines.values():
            e.start()
        loop = asyncio.get_running_loop()

        async def poller() -> None:
            while True:
                for b in pl.backends:
                    figs = parse_figures(loads_document(engines[b.url]))
                    b.report(None if figs is None else figs.running + figs.waiting)
                    if figs is not None:
                        pl.report_loads(b, figs)
                await asyncio.sleep(POLL_S)

        async def one(i: int, out: list) -> None:
            key, pt = self.bodies[i % len(self.bodies)]
            got = pl.acquire()
            if got is None:
                raise RuntimeError("no backend")
            lease, _ = got
            b = lease.backend
            at_start, t0 = b.inflight, loop.time()
            e = engines[b.url]
            r = Req(self.max_tokens, e.p.prompt_tokens or pt)
            e.submit(r, key)
            while not r.done:
                await r.event.wait()
                r.event.clear()
            end = loop.time()
            obs = Observation(pool=b.pool, url=b.url, inflight_at_start=at_start, inflight_at_end=b.inflight,
                              duration_s=end - t0, ttft_s=(r.first_at or end) - t0, completion_tokens=r.gen,
                              chunks=1 + r.gen // 16, ok=True, inflight_mean=lease.mean_inflight(),
                              prompt_tokens=r.prompt_tokens)
            pl.report_done(b, obs)
            lease.release()
            out.append((t0, end, r.gen, b.pool))

        async def level(clients: int, requests: int | None, seconds: float | None, start: int) -> list:
            out: list = []
            counter = itertools.count()
            t0 = loop.time()

            async def client() -> None:
                while True:
                    if seconds is not None and loop.time() - t0 >= seconds:
                        return
                    i = next(counter)
                    if requests is not None and i >= requests:
                        return
                    await one(start + i, out)

            await asyncio.gather(*(client() for _ in range(clients)))
            return out

        task = loop.create_task(poller())
        try:
            for c, s in warmup or []:
                await level(c, None, s, offset)
            got = []
            for c, n in levels:
                recs = await level(c, n, None, offset)
                span = max(r[1] for r in recs) - min(r[0] for r in recs)
                got.append(Level(c, len(recs), sum(r[2] for r in recs) / span if span > 0 else 0.0,
                                 sum(r[3] == "speculative" for r in recs) / len(recs)))
            return got
        finally:
            task.cancel()
            for e in engines.values():
                await e.stop()


def policy_of(**settings) -> Policy:
    """The policy `spec-router serve` builds with these settings over the defaults."""
    return make_policy(load_settings(None, {"speculative": [SPEC], "baseline": [BASE], **settings}, environ={}))


def adaptive_policy(**settings) -> Policy:
    """adaptive as `spec-router serve --policy adaptive` builds it, with these settings over the defaults."""
    return policy_of(policy="adaptive", **settings)


FIXED = ("all-speculative", "all-baseline", "round-robin", "spillover", "balanced")
THRESHOLDS = (1, 2, 4, 8)
BAR = 0.95


def judge(member: Member, levels: list[int], *, seed: int = 0, offset: int = 0, min_requests: int = 64,
          rounds: int = 4, warmup_s: float = 30.0, cold_runs: int = 3, thresholds: tuple[int, ...] = THRESHOLDS,
          max_tokens: int = 96, make: Callable[[], Policy] = adaptive_policy) -> dict:
    """The judge's procedure (bench.judging.Judge) on a virtual clock: each server alone (balanced's curves),
    every fixed configuration, then `make()`'s policy after `warmup_s` of the servers' time at the levels in
    equal shares; per level its tok/s over the best fixed configuration's (spillover at the one threshold best
    over the levels). Cold start, per level: a fresh policy runs the level up to `cold_runs` times; the
    requests and seconds before the first run within 5% of the best."""
    bench = Bench(member, max_tokens, seed=seed)
    plan = [(c, max(min_requests, rounds * c)) for c in levels]

    def go(policy: Policy, runs: list[tuple[int, int]] | None = None, **kw) -> list[Level]:
        return run_virtual(bench.run(policy, runs or plan, offset=offset, **kw))

    alone = {"all-speculative": go(policy_of(policy="spillover", threshold=10 ** 6), pools=(True, False)),
             "all-baseline": go(policy_of(policy="spillover", threshold=10 ** 6), pools=(False, True))}
    curves = tuple(parse_curve(",".join(f"{x.clients}:{x.tok_s:.1f}" for x in alone[k]))
                   for k in ("all-speculative", "all-baseline"))
    runs = dict(alone)
    runs["round-robin"] = go(policy_of(policy="round-robin"))
    for t in thresholds:
        runs[f"spillover@{t}"] = go(policy_of(policy="spillover", threshold=t))
    # Balanced on the curves measured just now: one level gives one point, fewer than the settings take.
    runs["balanced"] = go(Balanced(curves))
    warm = [(c, warmup_s / len(levels)) for c in levels] if warmup_s > 0 else None
    runs["adaptive"] = go(make(), warmup=warm)
    _, best_spill = best_threshold({f"spillover@{t}": [x.tok_s for x in runs[f"spillover@{t}"]] for t in thresholds})
    rows = []
    for i, (c, n) in enumerate(plan):
        fixed = {name: runs[best_spill if name == "spillover" else name][i] for name in FIXED}
        best = max(fixed, key=lambda name: fixed[name].tok_s)
        ad, top = runs["adaptive"][i], fixed[best].tok_s
        cold = [x.tok_s / top for x in go(make(), [(c, n)] * cold_runs)]
        reached = next((j for j, r in enumerate(cold) if r >= BAR), None)
        rows.append({"clients": c, "best": best, "best_tok_s": top, "best_share": fixed[best].share,
                     "tok_s": ad.tok_s, "share": ad.share, "ratio": ad.tok_s / top,
                     "balanced_ratio": fixed["balanced"].tok_s / top,
                     "cold_runs": [round(r, 3) for r in cold], "cold_reached_at": reached,
                     "cold_requests_before": None if reached is None else reached * n})
    return {"seed": seed, "offset": offset, "spillover_best": best_spill, "rows": rows}


def judge_member(member: Member, levels: list[int], seeds: int, *, seed: int = 0, **kw) -> dict:
    """`judge` over seeds seed .. seed + seeds - 1: each seed its servers' own draws and its own prompt offset."""
    runs = [judge(member, levels, seed=s, offset=random.Random(s).randrange(1 << 16), **kw)
            for s in range(seed, seed + seeds)]
    return {"member": member.name, "physics": member.physics, "expect": member.expect, "levels": levels,
            "seeds": runs}


def render(results: list[dict], cmd: str) -> str:
    """Per member and level: cells at the bar (the policy judged, and `balanced` on exact curves), the lowest and
    median ratio, the speculative shares, the cold start."""
    out = [f"```\n{cmd}\n```", ""]
    total = bal_total = cells = 0
    for res in results:
        n = len(res["seeds"])
        out += [f"**{res['member']}** ({n} seeds; virtual clock): {res['physics']}; {res['expect']}.", "",
                "| clients | at the bar: judged / balanced | lowest | median | speculative share: judged / best "
                "(mean) | cold: first run within 5% | cold: most requests before | cold: never in its runs |",
                "|---|---|---|---|---|---|---|---|"]
        for i, c in enumerate(res["levels"]):
            rows = [r["rows"][i] for r in res["seeds"]]
            ratios = sorted(row["ratio"] for row in rows)
            held = sum(x >= BAR for x in ratios)
            bal = sum(row["balanced_ratio"] >= BAR for row in rows)
            total, bal_total, cells = total + held, bal_total + bal, cells + n
            first = sum(row["cold_reached_at"] == 0 for row in rows)
            before = [row["cold_requests_before"] for row in rows if row["cold_reached_at"] is not None]
            never = sum(row["cold_reached_at"] is None for row in rows)
            low = ratios[0]
            out.append(f"| {c} | {held} / {bal} of {n} | {'**' if low < BAR else ''}{low:.3f}{'**' if low < BAR else ''}"
                       f" | {ratios[n // 2]:.3f} | {sum(r['share'] for r in rows) / n:.2f} / "
                       f"{sum(r['best_share'] for r in rows) / n:.2f} | {first} of {n} | {max(before, default=0)} | "
                       f"{never} |")
        out.append("")
    out.append(f"All members: {total} of {cells} cells at {BAR} x the best fixed configuration; `balanced` on the "
               f"servers' exact curves: {bal_total} of {cells}.")
    return "\n".join(out)
