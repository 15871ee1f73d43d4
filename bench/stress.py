"""`python -m bench stress`: thousands of concurrent streams through one router subprocess; proves nothing is lost."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import resource
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench import procs
from bench.load import BenchInputError, RequestRecord, build_body, load_prompts, stream_one

# Outcome classes. "explicit" = an HTTP error status, or an in-band SSE error followed by [DONE];
# "unaccounted" = anything else that is not a success (a cut stream, a reset, a client-side timeout).
OK, EXPLICIT, DISCONNECTED, UNACCOUNTED = "completed", "failed_explicit", "disconnected_on_purpose", "unaccounted"


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _ArgError(message)


def classify(rec: RequestRecord) -> str:
    if rec.error is None:
        return OK
    if rec.error.startswith("HTTP "):
        return EXPLICIT
    if rec.error.startswith("stream error") and rec.done:
        return EXPLICIT
    return UNACCOUNTED


_URL = re.compile(r"https?://[\w.\[\]:-]+")


def seen_label(outcome: str, detail: str | None) -> str:
    """A short, URL-free description of what one client saw, for the tables."""
    if outcome == OK:
        return "complete"
    if outcome == DISCONNECTED:
        return "client hung up (on purpose)"
    text = _URL.sub("B", detail or "")
    if outcome == EXPLICIT and text.startswith("HTTP "):
        return text[:8]
    if outcome == EXPLICIT:
        return "SSE error event + [DONE]: " + text.removeprefix("stream error: ")[:60]
    return "UNACCOUNTED: " + text[:60]


# ---- file descriptors ----------------------------------------------------------------------------

def raise_fd_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


# ---- reading the servers -------------------------------------------------------------------------

@dataclass
class RouterView:
    inflight: dict[str, float] = field(default_factory=dict)  # backend -> router_inflight_requests
    up: dict[str, float] = field(default_factory=dict)  # backend -> router_backend_up
    codes: dict[str, float] = field(default_factory=dict)  # HTTP status -> router_requests_total
    served: dict[str, float] = field(default_factory=dict)  # backend -> router_requests_total{code=200}
    disconnects: float = 0.0
    retries: float = 0.0
    upstream_errors: dict[str, float] = field(default_factory=dict)  # kind -> count
    ttft_sum: float = 0.0  # router_time_to_first_token_seconds, all pools
    ttft_count: float = 0.0

    @property
    def inflight_total(self) -> float:
        return sum(self.inflight.values())


def parse_router_metrics(text: str) -> RouterView:
    v = RouterView()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lab = s.labels
            if s.name == "router_inflight_requests":
                v.inflight[lab["backend"]] = s.value
            elif s.name == "router_backend_up":
                v.up[lab["backend"]] = s.value
            elif s.name == "router_requests_total":
                v.codes[lab["code"]] = v.codes.get(lab["code"], 0) + s.value
                if lab["code"] == "200":
                    v.served[lab["backend"]] = v.served.get(lab["backend"], 0) + s.value
            elif s.name == "router_client_disconnects_total":
                v.disconnects += s.value
            elif s.name == "router_retries_total":
                v.retries += s.value
            elif s.name == "router_time_to_first_token_seconds_sum":
                v.ttft_sum += s.value
            elif s.name == "router_time_to_first_token_seconds_count":
                v.ttft_count += s.value
            elif s.name == "router_upstream_errors_total":
                v.upstream_errors[lab["kind"]] = v.upstream_errors.get(lab["kind"], 0) + s.value
    return v


async def read_router(session: aiohttp.ClientSession, url: str) -> RouterView:
    async with asyncio.timeout(5), session.get(url + "/metrics") as r:
        return parse_router_metrics(await r.text())


async def read_sim(session: aiohttp.ClientSession, url: str) -> dict:
    async with asyncio.timeout(5), session.get(url + "/_sim/stats") as r:
        return await r.json()


async def _read_sim_or_none(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        return await read_sim(session, url)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None  # a killed simulator has nothing in flight


class ProcSampler:
    """Samples one process's RSS and CPU from a thread (psutil), so a busy event loop cannot skew it."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.every = every
        self.peak_rss = 0
        self.peak_cpu = 0.0
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._cpu0 = self._cpu_seconds()
        self._cpu1 = self._cpu0
        self._wall = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu_seconds(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def _run(self) -> None:
        import psutil

        self.proc.cpu_percent(None)
        while not self._stop.wait(self.every):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.peak_cpu = max(self.peak_cpu, self.proc.cpu_percent(None))
                self._cpu1 = self._cpu_seconds()
                self._wall = time.monotonic() - self._t0
            except psutil.Error:
                return

    def start(self) -> ProcSampler:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        cpu = self._cpu1 - self._cpu0
        return {"peak_rss_mb": round(self.peak_rss / 2**20, 1), "peak_cpu_percent": round(self.peak_cpu, 1),
                "cpu_seconds": round(cpu, 2), "mean_cpu_percent": round(100 * cpu / self._wall, 1) if self._wall else 0.0}


# ---- the client side -----------------------------------------------------------------------------

async def abandon_one(session: aiohttp.ClientSession, url: str, path: str, body: bytes, limit_s: float) -> str:
    """Read the first SSE event, then hang up: the router must pass the disconnect on (the engine aborts)."""
    try:
        async with asyncio.timeout(limit_s):
            async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    await r.read()
                    return EXPLICIT
                await r.content.readuntil(b"\n\n")
                r.close()
                return DISCONNECTED
    except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError):
        return UNACCOUNTED


@dataclass
class ClientTally:
    sent: int = 0
    open_now: int = 0
    peak_open: int = 0
    outcomes: Counter = field(default_factory=Counter)
    samples: dict[str, list[str]] = field(default_factory=dict)  # outcome -> a few error texts
    ttft: list[float] = field(default_factory=list)
    seen: Counter = field(default_factory=Counter)  # short label of what the client saw -> count
    error_latency: list[float] = field(default_factory=list)  # request start to explicit error, seconds

    def begin(self) -> None:
        self.sent += 1
        self.open_now += 1
        self.peak_open = max(self.peak_open, self.open_now)

    def end(self, outcome: str, detail: str | None = None, latency: float | None = None) -> None:
        self.open_now -= 1
        self.outcomes[outcome] += 1
        self.seen[seen_label(outcome, detail)] += 1
        if outcome == EXPLICIT and latency is not None:
            self.error_latency.append(latency)
        if detail and len(self.samples.setdefault(outcome, [])) < 5:
            self.samples[outcome].append(detail)


@dataclass
class LoadPlan:
    url: str
    streams: int
    duration: float
    max_requests: int
    max_tokens: int
    disconnect_fraction: float
    request_timeout: float
    ramp: float
    prompts: str = "general"
    seed: int = 0


async def drive(plan: LoadPlan, tally: ClientTally, stop: asyncio.Event | None = None) -> None:
    """Closed loop: `streams` clients, each sending its next request when the last one ended; bounded in
    time (duration) and count (max_requests). `stop` ends the issuing of new requests early."""
    prompts = load_prompts(plan.prompts)
    bodies = [(p.path, build_body(p, "default", plan.max_tokens, None)) for p in prompts]
    # A disconnecting request must still be generating when the client leaves, so it asks for many tokens.
    long_bodies = [(p.path, build_body(p, "default", max(plan.max_tokens * 20, 2000), {"ignore_eos": True}))
                   for p in prompts]
    rng = random.Random(plan.seed)
    t0 = time.monotonic()
    url = plan.url.rstrip("/")
    stop = stop or asyncio.Event()

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        await asyncio.sleep(plan.ramp * k / max(1, plan.streams))
        while not stop.is_set() and time.monotonic() - t0 < plan.duration and tally.sent < plan.max_requests:
            i = tally.sent
            tally.begin()
            if rng.random() < plan.disconnect_fraction:
                path, body = long_bodies[i % len(long_bodies)]
                tally.end(await abandon_one(session, url, path, body, plan.request_timeout))
                continue
            path, body = bodies[i % len(bodies)]
            rec = await stream_one(session, url, path, body, plan.request_timeout)
            if rec.ttft is not None:
                tally.ttft.append(rec.ttft)
            tally.end(classify(rec), rec.error, rec.end - rec.start)

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None),
                                     auto_decompress=False) as session:
        tasks = [asyncio.create_task(client(session, k)) for k in range(plan.streams)]
        # Hard cap: a request still open after this is cancelled and counted as unaccounted.
        cap = plan.ramp + plan.duration + plan.request_timeout + 10
        _, pending = await asyncio.wait(tasks, timeout=cap)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            tally.outcomes[UNACCOUNTED] += tally.open_now
            tally.samples.setdefault(UNACCOUNTED, []).append(f"{tally.open_now} cancelled by the {cap:g}s cap")
            tally.open_now = 0


async def sample_router(session: aiohttp.ClientSession, url: str, peak: dict, stop: asyncio.Event,
                        tally: ClientTally, every: float = 1.0) -> None:
    """Peak router in-flight (sum of the gauges) while the load runs, and a coarse timeline."""
    t0 = time.monotonic()
    timeline = peak.setdefault("timeline", [])
    while not stop.is_set():
        try:
            v = await read_router(session, url)
            peak["inflight"] = max(peak.get("inflight", 0), v.inflight_total)
            timeline.append((round(time.monotonic() - t0, 1), v.inflight_total, tally.open_now))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def wait_quiet(session: aiohttp.ClientSession, router: str, sims: list[str], within: float) -> RouterView:
    """Wait (bounded) until the router holds no lease and no live simulator runs or queues anything."""
    deadline = time.monotonic() + within
    while True:
        view = await read_router(session, router)
        stats = [await _read_sim_or_none(session, s) for s in sims]
        busy = view.inflight_total or any(s and (s["running"] or s["queued"]) for s in stats)
        if not busy or time.monotonic() > deadline:
            return view
        await asyncio.sleep(0.2)


# ---- the run -------------------------------------------------------------------------------------

@dataclass
class StressConfig:
    streams: int
    duration: float
    max_requests: int
    max_tokens: int
    disconnect_fraction: float
    request_timeout: float
    ramp: float
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
        f"## bench stress: {cfg['streams']} concurrent streams for {cfg['duration']:g}s "
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
    p = _Parser(prog="python -m bench stress",
                description="Many concurrent streams through one router subprocess in front of simulator "
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
        raise _ArgError("--streams must be 1..20000")
    if ns.duration <= 0 or ns.max_tokens < 1 or ns.request_timeout <= 0 or ns.speedup <= 0:
        raise _ArgError("--duration, --max-tokens, --request-timeout and --speedup must be positive")
    if not 0 <= ns.disconnect_fraction <= 1:
        raise _ArgError("--disconnect-fraction must be within 0..1")
    if ns.sims_per_pool < 1 or ns.sims_per_pool > 8:
        raise _ArgError("--sims-per-pool must be 1..8")
    if ns.requests is not None and ns.requests < 1:
        raise _ArgError("--requests must be >= 1")
    ramp = ns.ramp if ns.ramp is not None else 3.0
    if ramp < 0:
        raise _ArgError("--ramp must be >= 0")
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


async def wait_ready(url: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while True:
            try:
                async with s.get(url + "/ready") as r:
                    body = await r.json()
                    if r.status == 200 and all(body.get("backends", {}).values()):
                        return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise procs.ProcError(f"router {url} not ready with every backend up within {within:g}s")
            await asyncio.sleep(0.1)


def run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        cfg = config_from_args(ns)
    except _ArgError as exc:
        print(f"bench stress: {exc}", file=sys.stderr)
        return 2
    # Client sockets, the router's two sides and the simulators all live on this machine.
    needed = cfg.streams * 4 + 1024
    try:
        got = raise_fd_limit(needed)
    except (ValueError, OSError) as exc:
        print(f"bench stress: cannot raise the open-file limit to {needed}: {exc}", file=sys.stderr)
        return 2
    if got < cfg.streams * 2 + 256:
        print(f"bench stress: open-file limit {got} is too low for {cfg.streams} streams "
              f"(raise the hard limit: ulimit -Hn)", file=sys.stderr)
        return 2
    router_flags = ["--log-level", "warning", "--max-connections", str(max(4096, cfg.streams * 2)),
                    "--health-interval", "1"]
    try:
        with procs.ProcGroup() as group:
            router, sims = start_stack(cfg, group, router_flags)
            run_async(wait_ready(router.url))
            sim_pids = tuple(p.pid for p in group.procs if p is not router)
            res = run_async(run_stress(cfg, router.url, router.pid, sims, sim_pids))
            res["router"]["exit_code"] = router.stop(grace=30)
            res["router"]["stderr_tail"] = router.stderr_tail()
            group.procs.remove(router)
    except (procs.ProcError, BenchInputError) as exc:
        print(f"bench stress: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench stress: interrupted", file=sys.stderr)
        return 130
    res["checks"]["router exited 0 on SIGTERM after the run"] = res["router"]["exit_code"] == 0
    res["ok"] = all(res["checks"].values())
    print(render(res))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1
