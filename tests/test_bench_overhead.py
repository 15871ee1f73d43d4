"""`bench overhead`: the raw keep-alive client, the fake backend, the table and its JSON, end to end at tiny size."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys

import pytest
import yaml
from aiohttp import web

from bench import fastbackend, overhead, procs
from bench.rawhttp import Connection, HTTPFailure, request_bytes
from tests.test_router_h1 import FakeTransport

HAVE_PEER = importlib.util.find_spec("sglang_router") is not None
TINY = ["--duration", "0.3", "--warmup", "0.1", "--concurrency", "8", "--long-tokens", "300", "--long-streams",
        "2", "--stream-tokens", "3", "--idle-streams", "20"]


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"a\":1}\n\n\r\n"
           b"1d\r\ndata: {\"a\":2}\n\ndata: [DONE]\n\n\r\n0\r\n\r\n")
LENGTH = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nContent-Type: application/json\r\n\r\n{\"ok\":true}"


@pytest.mark.parametrize("raw, body_bytes, events", [(CHUNKED, 44, 3), (LENGTH, 11, 0)])
@pytest.mark.parametrize("piece", [1, 2, 7, 10_000])
async def test_raw_client_reads_responses_split_anywhere(raw, body_bytes, events, piece):
    conn = Connection()
    conn.connection_made(FakeTransport())
    for _ in range(2):  # the same connection serves the next request: keep-alive
        waiter = conn.send(b"POST / HTTP/1.1\r\n\r\n")
        for i in range(0, len(raw), piece):
            conn.data_received(raw[i:i + piece])
        reply = await asyncio.wait_for(waiter, 1)
        assert (reply.status, reply.body_bytes, reply.events) == (200, body_bytes, events)
        assert reply.first_body is not None and reply.sent <= reply.first_body <= reply.end
    assert conn.total_replies == 2 and conn.total_events == 2 * events


async def test_raw_client_fails_on_error_status_and_on_a_cut():
    conn = Connection()
    conn.connection_made(FakeTransport())
    waiter = conn.send(b"x")
    conn.data_received(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\nno")
    with pytest.raises(HTTPFailure, match="503"):
        await waiter
    waiter = conn.send(b"x")
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nonly part")
    conn.connection_lost(None)
    with pytest.raises(HTTPFailure, match="closed mid-response"):
        await waiter
    with pytest.raises(HTTPFailure, match="closed"):
        conn.send(b"x")


@pytest.mark.parametrize("cpus, pin, expected", [
    ({0}, True, {"proxy": None, "backend": None, "load": None}),
    ({0, 1}, False, {"proxy": None, "backend": None, "load": None}),
    ({0, 1}, True, {"proxy": {0}, "backend": {1}, "load": {1}}),
    ({2, 3, 5, 7}, True, {"proxy": {2}, "backend": {3}, "load": {5, 7}}),
])
def test_each_process_gets_its_own_core_where_there_are_cores(monkeypatch, cpus, pin, expected):
    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: cpus)
    assert procs.plan_cpus(pin) == expected


SUMMARY = {"c1_req_per_s": 1000.0, "c1_p50_ms": 1.0, "high_req_per_s": 3000.0, "high_p50_ms": 20.0,
           "stream_ttfb_p50_ms": 2.0, "chunks_per_s": 120_000.0, "kib_per_idle_stream": 10.0}


@pytest.mark.parametrize("router, other, expected", [
    (SUMMARY, dict(SUMMARY, c1_req_per_s=4000.0, c1_p50_ms=0.25, high_req_per_s=6000.0, stream_ttfb_p50_ms=1.5,
                   chunks_per_s=240_000.0, kib_per_idle_stream=None),
     {"c1_req_per_s_ratio": 0.25, "high_req_per_s_ratio": 0.5, "c1_p50_added_ms": 0.75, "high_p50_added_ms": 0.0,
      "stream_ttfb_added_ms": 0.5, "chunks_per_s_ratio": 0.5, "kib_per_idle_stream_ratio": None}),
    (dict(SUMMARY, c1_req_per_s=None), dict(SUMMARY, high_req_per_s=0.0),
     {"c1_req_per_s_ratio": None, "high_req_per_s_ratio": None, "c1_p50_added_ms": 0.0, "high_p50_added_ms": 0.0,
      "stream_ttfb_added_ms": 0.0, "chunks_per_s_ratio": 1.0, "kib_per_idle_stream_ratio": 1.0}),
])
def test_compare_gives_ratios_for_rates_and_added_ms_for_latencies(router, other, expected):
    assert overhead.compare(router, other) == expected


def test_median_summary_takes_each_figure_from_the_middle_repeat_and_keeps_the_spread():
    runs = [dict(SUMMARY, c1_req_per_s=900.0, c1_p50_ms=3.0), dict(SUMMARY, c1_req_per_s=1500.0, c1_p50_ms=1.0),
            dict(SUMMARY, c1_req_per_s=1000.0, c1_p50_ms=1.2, kib_per_idle_stream=None)]
    med, spread = overhead.median_summary(runs)
    # one slow repeat (900 req/s, 3 ms) decides nothing; each figure has its own median
    assert med["c1_req_per_s"] == 1000.0 and med["c1_p50_ms"] == 1.2
    assert spread["c1_req_per_s"] == [900.0, 1500.0] and spread["c1_p50_ms"] == [1.0, 3.0]
    # a figure missing from one repeat: the median of the repeats that have it
    assert med["kib_per_idle_stream"] == 10.0 and spread["kib_per_idle_stream"] == [10.0, 10.0]
    assert overhead.median_summary([dict(SUMMARY, chunks_per_s=None)])[0]["chunks_per_s"] is None


def test_goals_are_checked_against_issue_11_targets():
    vs_direct = {"c1_p50_added_ms": 0.3, "stream_ttfb_added_ms": 1.2}
    vs_peer = {"high_req_per_s_ratio": 0.59}
    got = overhead.goals({"router": SUMMARY}, vs_direct, vs_peer)
    assert [g["met"] for g in got] == [False, True, False, True, True]
    assert [g["met"] for g in overhead.goals({"router": SUMMARY}, None, None)] == [None, None, None, True, True]


async def test_fast_backend_streams_paced_and_idle():
    runner = web.AppRunner(fastbackend.build_app("m"), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        body = dict(overhead.CHAT, stream=True, max_tokens=5, stream_options={"include_usage": True})
        await fastbackend.set_mode(url, pace_ms=1)
        figs = await overhead.closed_loop(url, body, 1, 0.3, 0.05)
        assert figs["requests"] > 0 and figs["errors"] == 0
        assert figs["events_per_s"] > 0 and figs["ttfb_p50_ms"] < figs["p50_ms"]
        await fastbackend.set_mode(url, pace_ms=0, hold_s=5)
        conn = await Connection.open(url)
        waiter = conn.send(request_bytes(url, overhead.PATH, json.dumps(body).encode()))
        await asyncio.sleep(0.3)
        assert conn.first is not None and not waiter.done()  # first token, then quiet: an idle stream
        assert conn.events == 2
        waiter.cancel()
        conn.close()
    finally:
        await runner.cleanup()


def _run(args: list[str], timeout: float, pre: str = "pass") -> subprocess.CompletedProcess:
    code = f"import sys; {pre}; from bench.__main__ import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "overhead", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(240)
def test_overhead_end_to_end_tiny(tmp_path):
    out = tmp_path / "o.json"
    targets = "direct,router" + (",sglang-router" if HAVE_PEER else "")
    r = _run([*TINY, "--targets", targets, "--repeat", "2", "--json", str(out)], timeout=220)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    data = json.loads(out.read_text())
    names = targets.split(",")
    assert list(data["targets"]) == names
    direct, router = data["targets"]["direct"]["summary"], data["targets"]["router"]["summary"]
    for s in (direct, router):
        assert s["c1_req_per_s"] > 0 and s["high_req_per_s"] > 0 and s["chunks_per_s"] > 0
        assert s["c1_p50_ms"] > 0 and s["stream_ttfb_p50_ms"] > 0
    assert direct["kib_per_idle_stream"] is None  # no proxy, no proxy memory
    # loopback straight to the fake backend never fails; closing connections at a window's end is no error
    assert all(p["errors"] == 0 for figs in data["targets"]["direct"]["runs"] for p in figs.values())
    assert data["config"]["repeat"] == 2 and all(len(t["runs"]) == 2 for t in data["targets"].values())
    for figs in data["targets"]["router"]["runs"]:  # a fresh router each repeat, each measured in full
        idle = figs["idle"]
        assert idle["open"] == 20 and len(idle["rss_mib"]) == 3 and all(m > 0 for m in idle["rss_mib"])
    rates = [figs["c1"]["req_per_s"] for figs in data["targets"]["router"]["runs"]]
    assert router["c1_req_per_s"] == round(sum(rates) / 2, 3)  # the median of two
    assert data["targets"]["router"]["spread"]["c1_req_per_s"] == [min(rates), max(rates)]
    assert set(data["router_vs_direct"]) == {"c1_req_per_s_ratio", "high_req_per_s_ratio", "c1_p50_added_ms",
                                             "high_p50_added_ms", "stream_ttfb_added_ms", "chunks_per_s_ratio",
                                             "kib_per_idle_stream_ratio"}
    assert len(data["goals"]) == 5
    table = r.stdout
    assert "| this router (spillover) |" in table and "| direct to the backend |" in table
    assert "| this router vs direct |" in table and "| &nbsp; spread of 2 |" in table
    if HAVE_PEER:
        assert data["targets"]["sglang-router"]["summary"]["c1_req_per_s"] > 0
        assert data["router_vs_peer"]["high_req_per_s_ratio"] > 0
        assert "| this router vs sglang-router |" in table
    else:
        assert data["router_vs_peer"] is None


@pytest.mark.timeout(60)
def test_overhead_skips_sglang_router_with_one_line_when_absent(tmp_path):
    r = _run([*TINY, "--targets", "sglang-router", "--json", str(tmp_path / "o.json")], timeout=50,
             pre="sys.modules['sglang_router'] = None")
    assert r.returncode == 0, r.stderr
    assert "sglang-router: skipped (not installed; pip install 'spec-router[peers]')" in r.stdout
    assert json.loads((tmp_path / "o.json").read_text())["targets"] == {}


@pytest.mark.timeout(60)
def test_overhead_points_picks_figures(tmp_path):
    r = _run([*TINY, "--targets", "direct", "--points", "c1", "--json", str(tmp_path / "o.json")], timeout=50)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "o.json").read_text())
    assert [list(figs) for figs in data["targets"]["direct"]["runs"]] == [["c1"]] * 3  # --repeat's default
    s = data["targets"]["direct"]["summary"]
    assert s["c1_req_per_s"] > 0 and s["high_req_per_s"] is None and s["chunks_per_s"] is None
    assert "| direct to the backend |" in r.stdout and "—" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--duration", "0"], "--duration must be > 0"),
    (["--targets", "direct,nginx"], "unknown nginx"),
    (["--idle-streams", "-1"], "--idle-streams >= 0"),
    (["--bogus"], "unrecognized arguments"),
    (["--points", "c1,p99"], "unknown p99"),
    (["--repeat", "0"], "--repeat must be >= 1"),
])
def test_overhead_bad_flags_one_line_exit_2(args, words):
    r = _run(args, timeout=30)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr


def test_envoy_alone_is_the_picker_config_without_the_picker():
    with_picker = yaml.safe_load(overhead.envoy_config("http://127.0.0.1:8001", 9002))
    alone = yaml.safe_load(overhead.envoy_config("http://127.0.0.1:8001", None))

    def filters(config):
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return [f["name"] for f in hcm["http_filters"]]

    assert filters(with_picker) == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert filters(alone) == ["envoy.filters.http.router"]
    (cluster,) = alone["static_resources"]["clusters"]
    assert cluster["type"] == "STATIC" and cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8001}
    # everything else (listener, timeouts, admin) is the same file's
    for config in (with_picker, alone):
        del config["static_resources"]["clusters"]
    filtered = [f for f in with_picker["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    with_picker["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"] = filtered
    assert with_picker == alone


@pytest.mark.timeout(120)
def test_overhead_envoy_and_envoy_with_the_picker_tiny(tmp_path):
    if overhead.envoy_path() is None:
        pytest.skip("Envoy not installed (the epp extra)")
    out = tmp_path / "o.json"
    r = _run([*TINY, "--targets", "envoy,envoy+epp,envoy+epp-headers", "--repeat", "1", "--json", str(out)],
             timeout=110)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for name in ("envoy", "envoy+epp", "envoy+epp-headers"):
        s = data["targets"][name]["summary"]
        assert s["c1_req_per_s"] > 0 and s["chunks_per_s"] > 0 and s["kib_per_idle_stream"] is None
        assert all(p["errors"] == 0 for figs in data["targets"][name]["runs"] for p in figs.values())
    assert data["epp_vs_envoy"]["c1_req_per_s_ratio"] > 0
    assert data["epp_headers_vs_envoy"]["c1_req_per_s_ratio"] > 0
    assert "| envoy+epp vs envoy alone |" in r.stdout and data["goals"] == []
    assert "| envoy+epp-headers vs envoy alone |" in r.stdout
    # the picker's and Envoy's CPU per request at the high concurrency, each measured
    for name in ("envoy+epp", "envoy+epp-headers"):
        s = data["targets"][name]["summary"]
        assert s["high_cpu_us_per_request_picker"] > 0 and s["high_cpu_us_per_request_envoy"] > 0
    assert "CPU per request at c=8 (Envoy" in r.stdout
