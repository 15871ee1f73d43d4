"""`spec-bench replicas`: N router replicas in front of the same simulators, load_signal backend vs local.

One closed-loop client spreads its requests over the replicas; the speculative simulators' own running +
queued counts are sampled over time and compared with the pool's threshold (spillover: threshold x
speculative instances). Reports overshoot (max, p99, share of samples above) and throughput per signal.
`--front epp`: the replicas are `spec-router epp` pickers behind one Envoy (deploy/envoy/envoy.yaml, its picker
cluster holding every replica, round robin per request), as a gateway's Envoy reaches a picker Service.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import yaml

from bench import procs
from bench.cli import ArgError, NotServing, parser, run_async, wait_serving
from bench.figures import percentile
from bench.load import RequestRecord, build_body, load_prompts, stream_one

SIGNALS = ("backend", "local")
FRONTS = ("proxy", "epp")


@dataclass
class Config:
    replicas: int = 3
    speculative: int = 2
    baseline: int = 1
    threshold: int = 8
    concurrency: int = 64
    duration: float = 40.0
    ramp: float = 10.0
    max_tokens: int = 128
    speedup: float = 1.0
    load_interval: float = 0.5
    sample_interval: float = 0.05
    signals: tuple[str, ...] = SIGNALS
    speculative_profile: str = "eagle3-tp4"
    baseline_profile: str = "baseline-tp4"
    prompts: str = "general"
    front: str = "proxy"
    out: str | None = None


@dataclass
class SignalRun:
    signal: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, pool running+queued)
    per_instance_max: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    wall: float = 0.0
    spec_requests: int = 0
    base_requests: int = 0


def build_parser() -> argparse.ArgumentParser:
    p = parser("replicas", __doc__.splitlines()[0])
    d = Config()
    p.add_argument("--replicas", type=int, default=d.replicas, help="router replicas (default 3)")
    p.add_argument("--speculative", type=int, default=d.speculative, help="speculative simulators (default 2)")
    p.add_argument("--baseline", type=int, default=d.baseline, help="baseline simulators (default 1)")
    p.add_argument("--threshold", type=int, default=d.threshold,
                   help="spillover threshold per speculative instance (default 8)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="closed-loop clients (default 64)")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load per signal (default 40)")
    p.add_argument("--ramp", type=float, default=d.ramp,
                   help="seconds over which the clients start, evenly spaced (default 10; 0: all at once, the "
                        "worst case for any polled signal)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="per request (default 128)")
    p.add_argument("--speedup", type=float, default=d.speedup, help="simulator clock speedup (default 1: real time)")
    p.add_argument("--load-interval", type=float, default=d.load_interval,
                   help="routers' /v1/loads poll interval, seconds (default 0.5)")
    p.add_argument("--sample-interval", type=float, default=d.sample_interval,
                   help="seconds between samples of the simulators' running counts (default 0.05)")
    p.add_argument("--signals", default=",".join(d.signals), help="comma list of backend,local (default both)")
    p.add_argument("--speculative-profile", default=d.speculative_profile,
                   help=f"simulator profile of the speculative servers (default {d.speculative_profile})")
    p.add_argument("--baseline-profile", default=d.baseline_profile,
                   help=f"simulator profile of the baseline servers (default {d.baseline_profile})")
    p.add_argument("--prompts", default=d.prompts, help="built-in prompt set or JSONL file (default general)")
    p.add_argument("--front", choices=FRONTS, default=d.front,
                   help="proxy: `spec-router serve` replicas, the client round-robin over them; epp: `spec-router "
                        "epp` replicas behind one Envoy (the envoy extra), the client sending to Envoy (default proxy)")
    p.add_argument("--out", help="directory for replicas.json, replicas.csv (samples) and replicas.md")
    return p


def config_from_args(ns: argparse.Namespace) -> Config:
    signals = tuple(s.strip() for s in ns.signals.split(",") if s.strip())
    if not signals or any(s not in SIGNALS for s in signals):
        raise ArgError(f"--signals takes a comma list of {', '.join(SIGNALS)}")
    for name in ("replicas", "speculative", "threshold", "concurrency", "max_tokens"):
        if getattr(ns, name) < 1:
            raise ArgError(f"--{name.replace('_', '-')} must be at least 1")
    if ns.baseline < 0:
        raise ArgError("--baseline must be 0 or more")
    for name in ("duration", "speedup", "load_interval", "sample_interval"):
        if not getattr(ns, name) > 0:
            raise ArgError(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= ns.ramp < ns.duration:
        raise ArgError("--ramp must be at least 0 and below --duration")
    if ns.duration > 3600:
        raise ArgError("--duration is capped at 3600 seconds")
    return Config(replicas=ns.replicas, speculative=ns.speculative, baseline=ns.baseline, threshold=ns.threshold,
                  concurrency=ns.concurrency, duration=ns.duration, ramp=ns.ramp, max_tokens=ns.max_tokens, speedup=ns.speedup,
                  load_interval=ns.load_interval, sample_interval=ns.sample_interval, signals=signals,
                  speculative_profile=ns.speculative_profile, baseline_profile=ns.baseline_profile,
                  prompts=ns.prompts, front=ns.front, out=ns.out)


async def _running(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(url + "/_sim/stats") as r:
            st = await r.json()
        return int(st["running"]) + int(st["queued"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return None


async def drive(cfg: Config, run: SignalRun, routers: list[str], spec_sims: list[str]) -> None:
    """The client (round-robin over replicas) and the sampler, both bounded by cfg.duration."""
    prompts = load_prompts(cfg.prompts)
    bodies = [(p.path, build_body(p, "default", cfg.max_tokens, None)) for p in prompts]
    counter = itertools.count()
    t0 = time.perf_counter()
    stop_at = t0 + cfg.duration
    per_request = max(60.0, cfg.duration)

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        await asyncio.sleep(k * cfg.ramp / cfg.concurrency)
        while time.perf_counter() < stop_at:
            i = next(counter)
            path, body = bodies[i % len(bodies)]
            run.records.append(await stream_one(session, routers[i % len(routers)], path, body, per_request))

    async def sampler(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop_at:
            counts = await asyncio.gather(*(_running(session, u) for u in spec_sims))
            if all(c is not None for c in counts):
                run.samples.append((time.perf_counter() - t0, sum(counts)))  # type: ignore[arg-type]
                run.per_instance_max = max(run.per_instance_max, *counts)  # type: ignore[type-var]
            await asyncio.sleep(cfg.sample_interval)

    conn = aiohttp.TCPConnector(limit=cfg.concurrency + 16)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as side:
        async with asyncio.timeout(cfg.duration + per_request + 30):
            await asyncio.gather(sampler(side), *(client(session, k) for k in range(cfg.concurrency)))
    run.wall = time.perf_counter() - t0


async def _served(urls: list[str]) -> int:
    return sum(int(st["completed_total"]) for st in await procs.sim_stats(urls))


def run_signal(cfg: Config, signal: str) -> SignalRun:
    run = SignalRun(signal)
    with procs.ProcGroup() as group:
        spec = [group.add(procs.start_sim(cfg.speculative_profile, cfg.speedup, f"sim speculative {i}"))
                for i in range(cfg.speculative)]
        base = [group.add(procs.start_sim(cfg.baseline_profile, cfg.speedup, f"sim baseline {i}"))
                for i in range(cfg.baseline)]
        flags = ["--load-signal", signal, "--load-interval", f"{cfg.load_interval:g}", "--log-level", "warning",
                 "--health-interval", "1"]
        if cfg.front == "epp":
            routers = [start_epp_front(group, cfg, [p.url for p in spec], [p.url for p in base], flags, signal)]
        else:
            routers = [group.add(procs.start_router([p.url for p in spec], [p.url for p in base], "spillover",
                                                    cfg.threshold, name=f"router {signal} {i}", extra=flags))
                       for i in range(cfg.replicas)]
            for r in routers:
                run_async(wait_serving(r.url, within=20.0, every_backend=True))
        run_async(drive(cfg, run, [r.url for r in routers], [p.url for p in spec]))
        run.spec_requests = run_async(_served([p.url for p in spec]))
        run.base_requests = run_async(_served([p.url for p in base])) if base else 0
    return run


def start_epp_front(group: procs.ProcGroup, cfg: Config, spec: list[str], base: list[str], flags: list[str],
                    signal: str) -> procs.Proc:
    """`cfg.replicas` pickers and one Envoy whose picker cluster holds them all; returns Envoy (its URL)."""
    from bench.envoyproc import EnvoyError, envoy_config, start_envoy

    ports = []
    for i in range(cfg.replicas):
        args = ["router", "epp", "--policy", "spillover", "--threshold", str(cfg.threshold), "--host", "127.0.0.1",
                "--epp-port", "0", *flags]
        for u in spec:
            args += ["--speculative", u]
        for u in base:
            args += ["--baseline", u]
        picker = group.add(procs.start(f"epp {signal} {i}", args))
        ports.append(int(picker.url.rpartition(":")[2]))
    config = yaml.safe_load(envoy_config(spec[0], ports[0]))
    (epp,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "epp"]
    epp["lb_policy"] = "ROUND_ROBIN"
    epp["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        for port in ports]}]
    tmp = Path(tempfile.mkdtemp(prefix="replicas-envoy-"))
    try:
        envoy = group.add(start_envoy(f"envoy-{signal}", yaml.safe_dump(config), tmp))
    except EnvoyError as exc:
        raise procs.ProcError(str(exc)) from None
    run_async(wait_picked(envoy.url, within=30.0))
    return envoy


async def wait_picked(url: str, within: float) -> None:
    """Until a request through Envoy is answered by a backend (every picker has probed its backends)."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/v1/models") as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise NotServing(f"Envoy + pickers at {url}: no backend answered within {within:g}s")


def figures(cfg: Config, run: SignalRun) -> dict:
    limit = cfg.threshold * cfg.speculative
    counts = [c for _, c in run.samples]
    over = [max(0, c - limit) for c in counts]
    ok = [r for r in run.records if r.ok]
    served = run.spec_requests + run.base_requests
    window = max(1.0, cfg.duration / 10)
    timeline: dict[int, int] = {}
    for t, c in run.samples:
        timeline[int(t // window)] = max(timeline.get(int(t // window), 0), c)
    return {
        "signal": run.signal, "pool_limit": limit, "samples": len(counts),
        "window_s": window, "timeline_max": [timeline.get(k) for k in range(max(timeline, default=-1) + 1)],
        "mean_running": sum(counts) / len(counts) if counts else 0.0,
        "max_running": max(counts, default=0), "overshoot_max": max(over, default=0),
        "overshoot_p99": percentile(over, 99) if over else 0.0,
        "share_above": sum(1 for o in over if o > 0) / len(over) if over else 0.0,
        "instance_max": run.per_instance_max,
        "requests_ok": len(ok), "errors": len(run.records) - len(ok),
        "req_s": len(ok) / run.wall if run.wall else 0.0,
        "out_tok_s": sum(r.output_tokens for r in ok) / run.wall if run.wall else 0.0,
        "speculative_share": run.spec_requests / served if served else 0.0,
    }


def render(cfg: Config, rows: list[dict]) -> str:
    front = ("router replicas" if cfg.front == "proxy"
             else "`spec-router epp` replicas behind one Envoy (round robin over the pickers)")
    lines = [f"{cfg.replicas} {front} (spillover, threshold {cfg.threshold} per instance), "
             f"{cfg.speculative} x {cfg.speculative_profile} + {cfg.baseline} x {cfg.baseline_profile} simulators, "
             f"{cfg.concurrency} closed-loop clients "
             f"{'round-robin over the replicas' if cfg.front == 'proxy' else 'sending to Envoy'} "
             f"(started over {cfg.ramp:g} s), "
             f"{cfg.duration:g} s, "
             f"max_tokens {cfg.max_tokens}, speedup {cfg.speedup:g}, load_interval {cfg.load_interval:g} s",
             "",
             "| load_signal | pool limit | mean running | max running | overshoot max | overshoot p99 "
             "| samples above | max per instance | req/s | output tok/s | speculative share | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in rows:
        lines.append(f"| `{f['signal']}` | {f['pool_limit']} | {f['mean_running']:.1f} | {f['max_running']} "
                     f"| {f['overshoot_max']} | {f['overshoot_p99']:.1f} | {f['share_above']:.0%} "
                     f"| {f['instance_max']} | {f['req_s']:.1f} | {f['out_tok_s']:.0f} "
                     f"| {f['speculative_share']:.0%} | {f['errors']} |")
    if rows:
        window = rows[0]["window_s"]
        n = max(len(f["timeline_max"]) for f in rows)
        lines += ["", f"Speculative pool running + queued over time (max per {window:g} s window; pool limit "
                  f"{rows[0]['pool_limit']}):", "",
                  "| load_signal | " + " | ".join(f"{k * window:g}s" for k in range(n)) + " |",
                  "|---|" + "---|" * n]
        for f in rows:
            lines.append(f"| `{f['signal']}` | " + " | ".join("-" if v is None else str(v) for v in f["timeline_max"]) + " |")
    return "\n".join(lines)


def write_out(cfg: Config, runs: list[SignalRun], rows: list[dict], table: str) -> None:
    assert cfg.out is not None
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.md").write_text(table + "\n", encoding="utf-8")
    (out / "replicas.json").write_text(json.dumps({"config": asdict(cfg), "figures": rows}, indent=2) + "\n",
                                       encoding="utf-8")
    with (out / "replicas.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["signal", "t_s", "pool_running", "pool_limit"])
        for run in runs:
            for t, c in run.samples:
                w.writerow([run.signal, f"{t:.3f}", c, cfg.threshold * cfg.speculative])


def main(argv: list[str]) -> int:
    try:
        cfg = config_from_args(build_parser().parse_args(argv))
        load_prompts(cfg.prompts)
    except ArgError as exc:
        print(f"spec-bench replicas: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bad prompt file: BenchInputError and friends, one line
        print(f"spec-bench replicas: {exc}", file=sys.stderr)
        return 2
    runs: list[SignalRun] = []
    try:
        for signal in cfg.signals:
            runs.append(run_signal(cfg, signal))
    except (procs.ProcError, NotServing) as exc:
        print(f"spec-bench replicas: {exc}", file=sys.stderr)
        return 2
    rows = [figures(cfg, r) for r in runs]
    table = render(cfg, rows)
    print(table)
    if cfg.out:
        write_out(cfg, runs, rows, table)
    return 0
