"""Many concurrent streams against a router and what became of each: the load driver, its client-side tally, and
readers of the router's and the simulators' own counts (bench stress, faults, compare use them)."""
from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.load import RequestRecord, build_body, load_prompts, stream_one

# Outcome classes. "explicit" = an HTTP error status, or an in-band SSE error followed by [DONE];
# "unaccounted" = anything else that is not a success (a cut stream, a reset, a client-side timeout).
OK, EXPLICIT, DISCONNECTED, UNACCOUNTED = "completed", "failed_explicit", "disconnected_on_purpose", "unaccounted"



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
    decisions: dict[str, float] = field(default_factory=dict)  # "pool/reason" -> router_route_decisions_total

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
            elif s.name == "router_route_decisions_total":
                key = f"{lab['pool']}/{lab['reason']}"
                v.decisions[key] = v.decisions.get(key, 0) + s.value
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
class LoadShape:
    """How many streams, for how long, and how they behave (bench stress's flags set these)."""

    streams: int
    duration: float
    max_requests: int
    max_tokens: int
    disconnect_fraction: float
    request_timeout: float
    ramp: float


@dataclass
class LoadPlan(LoadShape):
    url: str = ""  # required (a default only because LoadShape's fields come first)
    prompts: str = "general"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("LoadPlan needs the router's url")


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


async def learned_state(url: str) -> dict | None:
    """What a learned configuration ended the run believing (GET /router/state's `model`), for the record; None
    when the router does not answer it."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                s.get(url + "/router/state") as resp:
            return (await resp.json()).get("model") if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
