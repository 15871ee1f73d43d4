"""`spec-bench faults`: inject each backend fault under load (subprocesses, loopback) and tabulate what clients saw."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from bench import procs
from bench.cli import ArgError, NotServing, parser, run_async, wait_serving
from bench.streams import (
    DISCONNECTED,
    EXPLICIT,
    OK,
    UNACCOUNTED,
    ClientTally,
    LoadPlan,
    RouterView,
    drive,
    read_router,
    read_sim,
    wait_quiet,
)

# Router settings for the matrix: fast probes so a row takes seconds; every value is printed with the table.
ROUTER_FLAGS = {
    "--threshold": "1000",  # spillover: everything goes to the speculative backend until it fails
    "--health-interval": "0.5", "--health-timeout": "1", "--health-failure-threshold": "3",
    "--health-success-threshold": "2", "--connect-timeout": "1", "--first-byte-timeout": "2",
    "--idle-timeout": "2", "--drain-timeout": "10", "--log-level": "warning",
    # Passive ejection at its defaults, printed so the table says what it ran with.
    "--eject-consecutive-errors": "5", "--eject-base-seconds": "5", "--eject-max-seconds": "60",
    "--eject-trial-requests": "3",
}


@dataclass
class Stack:
    """One router subprocess with one speculative (the victim) and one baseline simulator subprocess."""

    group: procs.ProcGroup
    router: procs.Proc
    spec: procs.Proc
    base: procs.Proc
    speedup: float
    http: aiohttp.ClientSession | None = None

    async def faults(self, url: str, **fields) -> None:
        assert self.http is not None
        async with asyncio.timeout(5), self.http.post(url + "/_sim/faults", json=fields) as r:
            if r.status != 200:
                raise procs.ProcError(f"POST {url}/_sim/faults {fields}: HTTP {r.status} {await r.text()}")


@dataclass
class Timeline:
    """Router state sampled every `every` seconds from /metrics, with the run's own events."""

    t0: float
    samples: list[tuple[float, RouterView]] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.events[name] = time.monotonic() - self.t0

    def first(self, after: float, cond: Callable[[RouterView], bool]) -> float | None:
        for t, v in self.samples:
            if t >= after and cond(v):
                return round(t - after, 2)
        return None


@dataclass
class Row:
    key: str
    fault: str
    how: str
    run: Callable[[Stack, Timeline, asyncio.Event], Awaitable[None]]
    streams: int = 16
    duration: float = 8.0
    max_tokens: int = 64
    router_flags: dict[str, str] = field(default_factory=dict)
    expect: str = ""  # what the router is meant to do, for the reader


async def _sleep_until(tl: Timeline, t: float) -> None:
    await asyncio.sleep(max(0.0, t - (time.monotonic() - tl.t0)))


def _port(url: str) -> int:
    return urlsplit(url).port or 80


# ---- the faults ----------------------------------------------------------------------------------

async def kill_mid_stream(st: Stack, tl: Timeline, stop: asyncio.Event) -> None:
    await _sleep_until(tl, 2.0)
    tl.mark("inject")
    st.spec.proc.kill()  # SIGKILL, by PID


async def kill_then_restart(st: Stack, tl: Timeline, stop: asyncio.Event) -> None:
    await kill_mid_stream(st, tl, stop)
    await _sleep_until(tl, 5.0)
    port = _port(st.spec.url)
    st.group.procs.remove(st.spec)
    st.spec.stop()
    st.spec = st.group.add(await asyncio.to_thread(
        procs.start_sim, "eagle3-tp8", st.speedup, "sim speculative (restarted)", ["--port", str(port)]))
    tl.mark("clear")


def generation_fault(clear_after: float | None = None, **fields) -> Callable:
    async def run(st: Stack, tl: Timeline, stop: asyncio.Event) -> None:
        await _sleep_until(tl, 2.0)
        tl.mark("inject")
        await st.faults(st.spec.url, **fields)
        if clear_after is not None:
            await _sleep_until(tl, 2.0 + clear_after)
            await st.faults(st.spec.url, **{k: _OFF[k] for k in fields})
            tl.mark("clear")
    return run


_OFF = {"hang": False, "stall_after_chunks": None, "health_delay": 0.0, "error_rate": 0.0, "error_status": 500,
        "refuse_for": 0.0, "health_status": None, "drop_after_chunks": None}


async def refuse(st: Stack, tl: Timeline, stop: asyncio.Event) -> None:
    await _sleep_until(tl, 2.0)
    tl.mark("inject")
    await st.faults(st.spec.url, refuse_for=3.0)
    await _sleep_until(tl, 5.0)
    tl.mark("clear")


async def router_sigterm(st: Stack, tl: Timeline, stop: asyncio.Event) -> None:
    await _sleep_until(tl, 3.0)
    stop.set()  # no new requests from here on: the row is about the ones in flight
    await asyncio.sleep(0.2)
    tl.mark("inject")
    os.kill(st.router.pid, signal.SIGTERM)
    code = await asyncio.to_thread(st.router.proc.wait, 60)
    tl.mark("router_exit")
    tl.events["router_exit_code"] = code


ROWS: list[Row] = [
    Row("kill", "backend SIGKILLed mid-stream", "SIGKILL the speculative simulator at t=2 s", kill_mid_stream,
        expect="streams on it end with an SSE error event + [DONE]; new requests retried on the other pool; "
               "ejected after 5 refused connections in a row"),
    Row("hang", "backend hangs before the first byte (its /health too, as SGLang's runs a generation)",
        "POST /_sim/faults {hang, health_delay: 30} at t=2 s", generation_fault(hang=True, health_delay=30.0),
        expect="504 after the 2 s first-byte timeout; ejected after 3 failed probes; then the other pool"),
    Row("hang_health_ok", "backend hangs before the first byte, /health still 200",
        "POST /_sim/faults {hang} at t=2 s, cleared at t=6 s", generation_fault(4.0, hang=True), duration=12.0,
        expect="504 after the 2 s first-byte timeout; ejected after 5 timeouts in a row although probes pass"),
    Row("stall", "backend stalls mid-stream (its /health too)",
        "POST /_sim/faults {stall_after_chunks: 3, health_delay: 30} at t=2 s",
        generation_fault(stall_after_chunks=3, health_delay=30.0),
        expect="SSE error event + [DONE] after the 2 s idle timeout; ejected after 3 failed probes"),
    Row("stall_health_ok", "backend stalls mid-stream, /health still 200",
        "POST /_sim/faults {stall_after_chunks: 3} at t=2 s, cleared at t=6 s", generation_fault(4.0, stall_after_chunks=3),
        duration=12.0,
        expect="SSE error event + [DONE] after the 2 s idle timeout; ejected after 5 in a row although probes pass"),
    Row("error500", "backend answers 500", "POST /_sim/faults {error_rate: 1, error_status: 500} at t=2 s, cleared at t=6 s",
        generation_fault(4.0, error_rate=1.0, error_status=500),
        expect="a handful of 500s passed through (not retried: may be the request's fault), then ejected after 5 "
               "in a row; the other pool serves; trial requests bring it back after the fault clears"),
    Row("error503", "backend answers 503", "POST /_sim/faults {error_rate: 1, error_status: 503} at t=2 s, cleared at t=6 s",
        generation_fault(4.0, error_rate=1.0, error_status=503),
        expect="retried once on the other pool before any byte went out: clients see complete answers; "
               "ejected after 5 in a row"),
    Row("refuse", "backend refuses connections", "POST /_sim/faults {refuse_for: 3} at t=2 s (listener back at t=5 s)",
        refuse, duration=9.0,
        expect="retried on the other pool, ejected after 5 refusals in a row; back after the ejection and 2 "
               "good probes"),
    Row("health_slow", "/health slow (1.5 s > 1 s probe timeout) for 1.5 s, generation fine",
        "POST /_sim/faults {health_delay: 1.5} at t=2 s, cleared at t=3.5 s", generation_fault(1.5, health_delay=1.5),
        expect="at most 2 probes fail (< threshold 3): never ejected, no request moves"),
    Row("comes_back", "backend comes back after being down",
        "SIGKILL at t=2 s, restarted on the same port at t=5 s", kill_then_restart, duration=10.0,
        expect="ejected, then routable again after 2 good probes"),
    Row("sigterm", "router gets SIGTERM with streams in flight (drain 10 s)",
        "SIGTERM the router at t=3 s; clients stop starting requests", router_sigterm, max_tokens=400,
        expect="no new connections; every in-flight stream completes; exit code 0"),
    Row("sigterm_short_drain", "router gets SIGTERM, streams longer than the drain (1 s)",
        "SIGTERM the router at t=3 s with --drain-timeout 1", router_sigterm, max_tokens=3000,
        router_flags={"--drain-timeout": "1"},
        expect="streams still open after the drain end with an SSE error event + [DONE]; backends abort them"),
]


# ---- running one row -----------------------------------------------------------------------------

def start_stack(group: procs.ProcGroup, row: Row, speedup: float) -> Stack:
    spec = group.add(procs.start_sim("eagle3-tp8", speedup, "sim speculative"))
    base = group.add(procs.start_sim("baseline-tp8", speedup, "sim baseline"))
    flags = {**ROUTER_FLAGS, **row.router_flags}
    extra = [x for kv in flags.items() for x in kv if kv[0] != "--threshold"]
    router = group.add(procs.start_router([spec.url], [base.url], "spillover", int(flags["--threshold"]),
                                          extra=extra))
    return Stack(group=group, router=router, spec=spec, base=base, speedup=speedup)


async def sample(st: Stack, tl: Timeline, stop: asyncio.Event, every: float = 0.1) -> None:
    assert st.http is not None
    while not stop.is_set():
        try:
            tl.samples.append((time.monotonic() - tl.t0, await read_router(st.http, st.router.url)))
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def run_row(row: Row, speedup: float, scale: float = 1.0) -> dict:
    with procs.ProcGroup() as group:
        st = await asyncio.to_thread(start_stack, group, row, speedup)
        await wait_serving(st.router.url, within=20.0, every_backend=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            st.http = http
            tally = ClientTally()
            plan = LoadPlan(url=st.router.url, streams=row.streams, duration=row.duration * scale,
                            max_requests=100000, max_tokens=row.max_tokens, disconnect_fraction=0.0,
                            request_timeout=30.0, ramp=0.5)
            tl = Timeline(t0=time.monotonic())
            stop_sampling, stop_load = asyncio.Event(), asyncio.Event()
            sampler = asyncio.create_task(sample(st, tl, stop_sampling))
            fault = asyncio.create_task(row.run(st, tl, stop_load))
            await drive(plan, tally, stop_load)
            await fault
            stop_sampling.set()
            await sampler
            router_alive = st.router.proc.poll() is None
            after = (await wait_quiet(http, st.router.url, [st.spec.url, st.base.url], within=10)
                     if router_alive else None)
            stats = {}
            for name, p in (("speculative", st.spec), ("baseline", st.base)):
                try:
                    stats[name] = await read_sim(http, p.url)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    stats[name] = None  # killed and not restarted
            for _ in range(50):  # let the simulators see the last disconnects (bounded)
                if all(s is None or not (s["running"] or s["queued"]) for s in stats.values()):
                    break
                await asyncio.sleep(0.1)
                stats = {k: (await read_sim(http, p.url) if stats[k] is not None else None)
                         for k, p in (("speculative", st.spec), ("baseline", st.base))}
    return summarise(row, st, tally, tl, after, stats)


def summarise(row: Row, st: Stack, tally: ClientTally, tl: Timeline, after: RouterView | None,
              stats: dict) -> dict:
    spec, base = st.spec.url, st.base.url
    inject = tl.events.get("inject")
    clear = tl.events.get("clear")
    res: dict = {"row": row.key, "fault": row.fault, "how": row.how, "expect": row.expect,
                 "sent": tally.sent, "completed": tally.outcomes[OK], "failed_explicit": tally.outcomes[EXPLICIT],
                 "unaccounted": tally.outcomes[UNACCOUNTED] + tally.outcomes[DISCONNECTED],
                 "clients_saw": dict(tally.seen.most_common())}
    lat = sorted(tally.error_latency)
    res["error_latency_p50_s"] = round(lat[len(lat) // 2], 2) if lat else None
    if inject is not None and tl.samples:
        base_at = _value_before(tl, inject, lambda v: v.served.get(base, 0))
        res["detect_s"] = tl.first(inject, lambda v: v.up.get(spec, 1) == 0)
        res["failover_s"] = tl.first(inject, lambda v: v.served.get(base, 0) > base_at)
        if clear is not None:
            spec_at = _value_before(tl, clear, lambda v: v.served.get(spec, 0))
            res["recover_s"] = tl.first(clear, lambda v: v.up.get(spec, 0) == 1 and v.served.get(spec, 0) > spec_at)
        res["ejected_ever"] = any(v.up.get(spec, 1) == 0 for t, v in tl.samples if t >= inject)
    if "router_exit" in tl.events and inject is not None:
        res["router_exit_s"] = round(tl.events["router_exit"] - inject, 2)
        res["router_exit_code"] = tl.events["router_exit_code"]
        last = [v for t, v in tl.samples if t <= inject]
        res["inflight_at_sigterm"] = last[-1].inflight_total if last else None
    res["gauges_after"] = None if after is None else {("spec" if u == spec else "base"): v
                                                      for u, v in after.inflight.items()}
    res["sims_after"] = {k: None if s is None else {"active": s["running"] + s["queued"],
                                                    "aborted": s["aborted_total"],
                                                    "completed": s["completed_total"]} for k, s in stats.items()}
    res["ok"] = res["unaccounted"] == 0 and (after is None or all(v == 0 for v in after.inflight.values())) and all(
        s is None or s["running"] + s["queued"] == 0 for s in stats.values())
    return res


def _value_before(tl: Timeline, t: float, get: Callable[[RouterView], float]) -> float:
    before = [get(v) for ts, v in tl.samples if ts <= t]
    return before[-1] if before else 0.0


def _fmt_s(v: float | None, none: str) -> str:
    return none if v is None else f"{v:.2f} s"


def render(results: list[dict]) -> str:
    out = ["| fault | injected | clients saw | detect | fail over | recover | gauges after | sims after (active/aborted) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in results:
        saw = "; ".join(f"{n} {k}" for k, n in r["clients_saw"].items())
        if r.get("unaccounted"):
            saw += f" (**{r['unaccounted']} unaccounted**)"
        if r.get("error_latency_p50_s") is not None:
            saw += f"; errors after p50 {r['error_latency_p50_s']} s"
        if "router_exit_s" in r:
            detect = f"in flight at SIGTERM {r['inflight_at_sigterm']:g}"
            failover = "n/a"
            recover = f"exit {r['router_exit_code']} after {r['router_exit_s']} s"
        else:
            detect = _fmt_s(r.get("detect_s"), "not ejected")
            failover = _fmt_s(r.get("failover_s"), "none")
            recover = _fmt_s(r.get("recover_s"), "n/a" if "recover_s" not in r else "not within the row")
            if "recover_s" in r and not r.get("ejected_ever") and not r["failed_explicit"]:
                recover += " (was never out)"
        gauges = "router exited" if r["gauges_after"] is None else ", ".join(
            f"{k} {v:g}" for k, v in r["gauges_after"].items())
        sims = ", ".join(f"{k} {'killed' if s is None else str(s['active']) + '/' + str(s['aborted'])}"
                         for k, s in r["sims_after"].items())
        out.append(f"| {r['fault']} | {r['how']} | {saw} | {detect} | {failover} | {recover} | {gauges} | {sims} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = parser("faults",
               "Inject each backend fault into simulator subprocesses behind a router subprocess "
               "while load runs; print what clients saw, detection / fail-over / recovery times and "
               "the in-flight gauges afterwards as a markdown table.")
    p.add_argument("--rows", default="all", help=f"comma-separated subset of: {', '.join(r.key for r in ROWS)}")
    p.add_argument("--speedup", type=float, default=5.0, help="simulator clock speed-up (default 5)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply each row's load duration (default 1)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        keys = [r.key for r in ROWS] if ns.rows == "all" else [k.strip() for k in ns.rows.split(",") if k.strip()]
        unknown = [k for k in keys if k not in {r.key for r in ROWS}]
        if unknown or not keys:
            raise ArgError(f"unknown row {unknown[0] if unknown else ''!r}; choose from "
                            f"{', '.join(r.key for r in ROWS)}")
        if ns.speedup <= 0 or not 0.5 <= ns.scale <= 10:
            raise ArgError("--speedup must be > 0 and --scale within 0.5..10")
    except ArgError as exc:
        print(f"spec-bench faults: {exc}", file=sys.stderr)
        return 2
    rows = [r for r in ROWS if r.key in keys]
    results = []
    try:
        for row in rows:
            print(f"spec-bench faults: {row.key} ...", file=sys.stderr, flush=True)
            results.append(run_async(run_row(row, ns.speedup, ns.scale)))
    except (procs.ProcError, NotServing) as exc:
        print(f"spec-bench faults: {exc}", file=sys.stderr)
        return 2
    print("router flags: " + " ".join(f"{k} {v}" for k, v in ROUTER_FLAGS.items()) + f"; simulator speedup {ns.speedup:g}")
    print()
    print(render(results))
    bad = [r["row"] for r in results if not r["ok"]]
    print()
    print("RESULT: " + ("PASS" if not bad else f"FAIL ({', '.join(bad)})"))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2))
    return 0 if not bad else 1
