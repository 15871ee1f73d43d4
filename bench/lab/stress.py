"""`spec-bench stress`: thousands of concurrent streams through one router subprocess; proves nothing is lost."""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench import procs
from bench.cli import ArgError, NotServing, parser, raise_fd_limit, run_async, wait_serving
from bench.load import BenchInputError
from bench.streams import (
    DISCONNECTED,
    EXPLICIT,
    OK,
    UNACCOUNTED,
    ClientTally,
    LoadPlan,
    LoadShape,
    ProcSampler,
    drive,
    read_router,
    read_sim,
    sample_router,
    wait_quiet,
)

# ---- the run -------------------------------------------------------------------------------------

@dataclass
class StressConfig(LoadShape):
    speedup: float
    sims_per_pool: int
    max_running: int
    policy: str
    threshold: int
    router_args: list[str]


async def run_stress(cfg: StressConfig, router_url: str, router_pid: int, sims: dict[str, list[str]],
                     sim_pids: tuple[int, ...] = ()) -> dict:
    all_sims = sims["speculative"] + sims["baseline"]
    tally = ClientTally()
    plan = LoadPlan(url=router_url, streams=cfg.streams, duration=cfg.duration, max_requests=cfg.max_requests,
                    max_tokens=cfg.max_tokens, disconnect_fraction=cfg.disconnect_fraction,
                    request_timeout=cfg.request_timeout, ramp=cfg.ramp)
    sampler = ProcSampler(router_pid).start()
    sim_samplers = [ProcSampler(pid).start() for pid in sim_pids]
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    peak: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as admin:
        before = await read_router(admin, router_url)
        stop = asyncio.Event()
        watcher = asyncio.create_task(sample_router(admin, router_url, peak, stop, tally))
        t0 = time.monotonic()
        await drive(plan, tally)
        wall = time.monotonic() - t0
        stop.set()
        await watcher
        after = await wait_quiet(admin, router_url, all_sims, within=15)
        stats = {u: await read_sim(admin, u) for u in all_sims}
    usage = sampler.stop()
    sim_usage = [x.stop() for x in sim_samplers]
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    client_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    o = tally.outcomes
    sim_completed = sum(s["completed_total"] for s in stats.values())
    sim_aborted = sum(s["aborted_total"] for s in stats.values())
    sim_active = sum(s["running"] + s["queued"] for s in stats.values())
    router_answered = sum(after.codes.values()) - sum(before.codes.values())
    accounted = o[OK] + o[EXPLICIT] + o[DISCONNECTED]
    checks = {
        "every request accounted for (unaccounted == 0)": o[UNACCOUNTED] == 0 and accounted == tally.sent,
        "router in-flight gauges all 0 after the run": all(v == 0 for v in after.inflight.values()),
        "simulators idle after the run (running + queued == 0)": sim_active == 0,
        "router answered every request it was sent": router_answered == tally.sent,
        # The router reads a stream at the backend's pace, not the client's: a backend can finish an answer the
        # client then leaves before reading in full. So aborts are at most the requests clients left.
        "simulators aborted only requests clients left, completed the rest":
            sim_aborted <= o[DISCONNECTED] and sim_aborted + sim_completed == o[DISCONNECTED] + o[OK],
        "simulators completed every request clients completed": sim_completed >= o[OK],
        f"{cfg.streams} streams were open at once (client side)": tally.peak_open >= cfg.streams,
    }
    ttft = sorted(tally.ttft)
    return {
        "config": asdict(cfg),
        "wall_seconds": round(wall, 1),
        "client": {"sent": tally.sent, "completed": o[OK], "failed_explicit": o[EXPLICIT],
                   "disconnected_on_purpose": o[DISCONNECTED], "unaccounted": o[UNACCOUNTED],
                   "peak_open_streams": tally.peak_open,
                   "cpu_seconds": round(client_cpu, 2),
                   "ttft_p50_s": round(ttft[len(ttft) // 2], 3) if ttft else None,
                   "ttft_p99_s": round(ttft[int(len(ttft) * 0.99)], 3) if ttft else None,
                   "error_samples": tally.samples},
        "timeline (s, router in-flight, client open)": peak.get("timeline", []),
        "router": {"peak_inflight_seen": peak.get("inflight", 0), "inflight_after": after.inflight,
                   "answered": router_answered,
                   "by_status": {k: after.codes[k] - before.codes.get(k, 0) for k in sorted(after.codes)},
                   "client_disconnects": after.disconnects - before.disconnects,
                   "retries": after.retries - before.retries,
                   "mean_ttft_s": round((after.ttft_sum - before.ttft_sum) / (after.ttft_count - before.ttft_count), 3)
                   if after.ttft_count > before.ttft_count else None, "upstream_errors": after.upstream_errors, **usage},
        "simulator_processes": sim_usage,
        "simulators": {u: {k: stats[u][k] for k in ("running", "queued", "requests_total", "completed_total",
                                                     "aborted_total")} for u in all_sims},
        "checks": checks,
        "ok": all(checks.values()),
    }


def render(res: dict) -> str:
    c, r, cfg = res["client"], res["router"], res["config"]
    lines = [
        f"## spec-bench stress: {cfg['streams']} concurrent streams for {cfg['duration']:g}s "
        f"(wall {res['wall_seconds']}s)",
        "",
        "| client | count |", "|---|---:|",
        f"| sent | {c['sent']} |", f"| completed | {c['completed']} |",
        f"| failed with an explicit error | {c['failed_explicit']} |",
        f"| disconnected on purpose | {c['disconnected_on_purpose']} |",
        f"| **unaccounted** | **{c['unaccounted']}** |",
        f"| peak open streams (client) | {c['peak_open_streams']} |",
        "",
        f"router: peak in-flight seen on /metrics {r['peak_inflight_seen']:g}; in-flight after "
        f"{json.dumps(r['inflight_after'])}; answered {r['answered']:g} by status "
        f"{json.dumps(r['by_status'])}; client disconnects {r['client_disconnects']:g}; retries {r['retries']:g}",
        f"router process: peak RSS {r['peak_rss_mb']} MB, CPU {r['cpu_seconds']} s "
        f"(mean {r['mean_cpu_percent']}%, peak {r['peak_cpu_percent']}% of one core)",
        f"client TTFT p50 {c['ttft_p50_s']} s, p99 {c['ttft_p99_s']} s (router-side mean {r['mean_ttft_s']} s); client CPU {c['cpu_seconds']} s; "
        f"simulators CPU {[x['cpu_seconds'] for x in res['simulator_processes']]} s",
        "",
        "| simulator | running | queued | requests | completed | aborted |", "|---|---:|---:|---:|---:|---:|",
    ]
    for url, s in res["simulators"].items():
        lines.append(f"| {url} | {s['running']} | {s['queued']} | {s['requests_total']} | "
                     f"{s['completed_total']} | {s['aborted_total']} |")
    lines += ["", "checks:"]
    lines += [f"- [{'x' if ok else ' '}] {name}" for name, ok in res["checks"].items()]
    for kind, texts in c["error_samples"].items():
        lines.append(f"sample {kind}: {texts[:3]}")
    lines.append("RESULT: " + ("PASS" if res["ok"] else "FAIL"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = parser("stress",
               "Many concurrent streams through one router subprocess in front of simulator "
               "subprocesses (loopback only); checks that every request is accounted for, every "
               "gauge returns to 0 and the simulators agree with the clients.")
    p.add_argument("--streams", type=int, default=200, help="concurrent client streams (default 200)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds during which new requests start")
    p.add_argument("--requests", type=int, help="cap on requests sent (default streams x 50)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each normal request")
    p.add_argument("--disconnect-fraction", type=float, default=0.05,
                   help="share of requests whose client hangs up after the first event (default 0.05)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client-side limit per request")
    p.add_argument("--ramp", type=float, default=None, help="seconds over which clients start (default 3)")
    p.add_argument("--speedup", type=float, default=20.0, help="simulator clock speed-up")
    p.add_argument("--sims-per-pool", type=int, default=1, help="simulators in each pool (default 1)")
    p.add_argument("--max-running", type=int, help="simulator max running requests (default: streams)")
    p.add_argument("--policy", default="spillover", help="router policy (default spillover)")
    p.add_argument("--threshold", type=int, help="router threshold (default: half the streams per instance)")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG=VALUE",
                   help="extra flag for `python -m router serve`, e.g. --router-arg=--idle-timeout=30")
    p.add_argument("--json", type=Path, help="also write the full result as JSON here")
    return p


def config_from_args(ns: argparse.Namespace) -> StressConfig:
    if ns.streams < 1 or ns.streams > 20000:
        raise ArgError("--streams must be 1..20000")
    if ns.duration <= 0 or ns.max_tokens < 1 or ns.request_timeout <= 0 or ns.speedup <= 0:
        raise ArgError("--duration, --max-tokens, --request-timeout and --speedup must be positive")
    if not 0 <= ns.disconnect_fraction <= 1:
        raise ArgError("--disconnect-fraction must be within 0..1")
    if ns.sims_per_pool < 1 or ns.sims_per_pool > 8:
        raise ArgError("--sims-per-pool must be 1..8")
    if ns.requests is not None and ns.requests < 1:
        raise ArgError("--requests must be >= 1")
    ramp = ns.ramp if ns.ramp is not None else 3.0
    if ramp < 0:
        raise ArgError("--ramp must be >= 0")
    threshold = ns.threshold if ns.threshold is not None else max(1, ns.streams // (2 * ns.sims_per_pool))
    router_args = []
    for a in ns.router_arg:
        router_args += a.split("=", 1) if a.startswith("--") and "=" in a else [a]
    return StressConfig(streams=ns.streams, duration=ns.duration, max_requests=ns.requests or ns.streams * 50,
                        max_tokens=ns.max_tokens, disconnect_fraction=ns.disconnect_fraction,
                        request_timeout=ns.request_timeout, ramp=ramp, speedup=ns.speedup,
                        sims_per_pool=ns.sims_per_pool, max_running=ns.max_running or ns.streams,
                        policy=ns.policy, threshold=threshold, router_args=router_args)


def start_stack(cfg: StressConfig, group: procs.ProcGroup, router_flags: list[str]) -> tuple[procs.Proc, dict]:
    sims: dict[str, list[str]] = {"speculative": [], "baseline": []}
    for pool, profile in (("speculative", "eagle3-tp8"), ("baseline", "baseline-tp8")):
        for i in range(cfg.sims_per_pool):
            p = group.add(procs.start_sim(profile, cfg.speedup, name=f"sim {pool} {i}",
                                          extra=["--max-running-requests", str(cfg.max_running),
                                                 "--seed", str(i)]))
            sims[pool].append(p.url)
    router = group.add(procs.start_router(sims["speculative"], sims["baseline"], cfg.policy, cfg.threshold,
                                          extra=router_flags + cfg.router_args))
    return router, sims


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        cfg = config_from_args(ns)
    except ArgError as exc:
        print(f"spec-bench stress: {exc}", file=sys.stderr)
        return 2
    # Client sockets, the router's two sides and the simulators all live on this machine.
    needed = cfg.streams * 4 + 1024
    try:
        got = raise_fd_limit(needed)
    except (ValueError, OSError) as exc:
        print(f"spec-bench stress: cannot raise the open-file limit to {needed}: {exc}", file=sys.stderr)
        return 2
    if got < cfg.streams * 2 + 256:
        print(f"spec-bench stress: open-file limit {got} is too low for {cfg.streams} streams "
              f"(raise the hard limit: ulimit -Hn)", file=sys.stderr)
        return 2
    router_flags = ["--log-level", "warning", "--max-connections", str(max(4096, cfg.streams * 2)),
                    "--health-interval", "1"]
    try:
        with procs.ProcGroup() as group:
            router, sims = start_stack(cfg, group, router_flags)
            run_async(wait_serving(router.url, within=20.0, every_backend=True))
            sim_pids = tuple(p.pid for p in group.procs if p is not router)
            res = run_async(run_stress(cfg, router.url, router.pid, sims, sim_pids))
            res["router"]["exit_code"] = router.stop(grace=30)
            res["router"]["stderr_tail"] = router.stderr_tail()
            group.procs.remove(router)
    except (procs.ProcError, BenchInputError, NotServing) as exc:
        print(f"spec-bench stress: {exc}", file=sys.stderr)
        return 2
    res["checks"]["router exited 0 on SIGTERM after the run"] = res["router"]["exit_code"] == 0
    res["ok"] = all(res["checks"].values())
    print(render(res))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1
