"""Routing through real sockets: spillover exactness, failover, retries before the first byte, error shapes."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from contextlib import AsyncExitStack

import aiohttp
import pytest

from tests.fixtures_router import CHAT_BODY, poll, set_faults, sim_stats, wait_stat

STREAM = {**CHAT_BODY, "stream": True, "max_tokens": 200}
# At real speed (speedup 1) this generation runs ~20 s, so the engine is still busy when the client leaves.
LONG = {**STREAM, "max_tokens": 2000, "ignore_eos": True}


async def open_streams(url: str, n: int, stack: AsyncExitStack, body: dict = STREAM) -> list[aiohttp.ClientResponse]:
    """Start n streams at once and return their responses once each has its headers (bytes still flowing)."""
    session = await stack.enter_async_context(aiohttp.ClientSession())

    async def one() -> aiohttp.ClientResponse:
        resp = await session.post(url + "/v1/chat/completions", json=body)
        stack.push_async_callback(_close, resp)
        return resp

    async with asyncio.timeout(10):
        return await asyncio.gather(*(one() for _ in range(n)))


async def _close(resp: aiohttp.ClientResponse) -> None:
    resp.close()


@pytest.mark.parametrize("threshold", [1, 4])
async def test_spillover_exactly_threshold_on_speculative(sim_factory, router_factory, threshold):
    # The stall fault keeps every stream open after its first chunk, so all 2x threshold overlap.
    spec = await sim_factory("eagle3-tp8", speedup=1.0, faults={"stall_after_chunks": 1})
    base = await sim_factory("baseline-tp8", speedup=1.0, faults={"stall_after_chunks": 1})
    router = await router_factory([spec.url], [base.url], threshold=threshold)
    async with AsyncExitStack() as stack:
        resps = await open_streams(router.url, 2 * threshold, stack, LONG)
        assert all(r.status == 200 for r in resps)
        pools = Counter(r.headers["X-Router-Pool"] for r in resps)
        assert pools == {"speculative": threshold, "baseline": threshold}
        assert router.inflight() == {spec.url: threshold, base.url: threshold}
        assert router.metric("router_inflight_requests", pool="speculative", backend=spec.url) == threshold
        assert (await sim_stats(spec.url))["running"] == threshold
        assert router.metric("router_route_decisions_total", pool="baseline", reason="above_threshold") == threshold
    # Every client left mid-stream: counts return to 0 and each simulator aborted its requests.
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}
    assert await wait_stat(spec.url, "aborted_total", threshold) == threshold
    assert await wait_stat(base.url, "aborted_total", threshold) == threshold
    assert router.metric("router_client_disconnects_total", pool="speculative") == threshold


async def test_threshold_zero_never_speculates(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8")
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], threshold=0)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
                assert r.status == 200 and r.headers["X-Router-Pool"] == "baseline"
    assert (await sim_stats(spec.url))["requests_total"] == 0


@pytest.mark.parametrize("policy", ["least-inflight", "round-robin"])
async def test_comparison_policies_use_both_pools(sim_factory, router_factory, policy):
    spec = await sim_factory("eagle3-tp8", faults={"stall_after_chunks": 1})
    base = await sim_factory(faults={"stall_after_chunks": 1})
    router = await router_factory([spec.url], [base.url], policy=policy, threshold=0)
    async with AsyncExitStack() as stack:
        resps = await open_streams(router.url, 6, stack)
        assert Counter(r.headers["X-Router-Pool"] for r in resps) == {"speculative": 3, "baseline": 3}
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}


async def test_failover_when_one_pool_is_down(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8")
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], threshold=100)
    await set_faults(spec.url, health_status=503)  # SGLang says 503 while it loads or shuts down
    assert await poll(lambda: not router.state.pools.backends[0].healthy, 3)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
                assert r.status == 200 and r.headers["X-Router-Pool"] == "baseline"
        assert router.metric("router_route_decisions_total", pool="baseline", reason="failover") == 3
        assert router.metric("router_backend_up", pool="speculative", backend=spec.url) == 0
        # ... and the speculative pool takes traffic again once it is back.
        async with s.delete(spec.url + "/_sim/faults") as r:
            assert r.status == 200
        assert await poll(lambda: router.state.pools.backends[0].healthy, 3)
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.headers["X-Router-Pool"] == "speculative"


async def test_refused_connections_are_retried_on_the_other_pool_and_eject_when_consecutive(sim_factory,
                                                                                         router_factory):
    spec = await sim_factory("eagle3-tp8")
    base = await sim_factory()
    # Slow probes: the router only learns of the outage from the refused requests themselves.
    router = await router_factory([spec.url], [base.url], threshold=100, health_interval=30,
                                  eject_consecutive_errors=3)
    await spec.stop_listener()
    spec_backend = router.state.pools.backends[0]
    async with aiohttp.ClientSession() as s:
        for i in range(5):
            async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
                assert r.status == 200 and r.headers["X-Router-Pool"] == "baseline"
            # One refusal is not enough (a restart, a full accept queue): only the third in a row ejects.
            assert spec_backend.state() == ("up" if i < 2 else "ejected")
    assert spec_backend.healthy  # the probes have not spoken; the ejection is passive
    assert router.metric("router_upstream_errors_total", backend=spec.url, kind="connect") == 3
    assert router.metric("router_retries_total", pool="baseline") == 3
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="refused") == 1
    assert router.metric("router_backend_up", pool="speculative", backend=spec.url) == 0
    assert router.inflight() == {spec.url: 0, base.url: 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_503_is_retried_once_500_passes_through(sim_factory, router_factory, stream):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 503})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], threshold=100)
    body = {**CHAT_BODY, "stream": stream}
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["X-Router-Pool"] == "baseline"
            await r.read()
        await set_faults(spec.url, error_status=500)
        async with s.post(router.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 500 and r.headers["X-Router-Pool"] == "speculative"
            assert (await r.json())["object"] == "error"  # SGLang's own error body, unchanged
    assert (await sim_stats(base.url))["requests_total"] == 1
    assert router.metric("router_upstream_errors_total", backend=spec.url, kind="status_503") == 1


async def test_no_retry_after_first_byte(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", faults={"drop_after_chunks": 2})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], threshold=100)
    async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/chat/completions", json=STREAM) as r:
        assert r.status == 200
        events = [e for e in (await r.read()).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][len(b"data: "):])
    assert err["error"]["code"] == "backend_disconnected"
    assert (await sim_stats(base.url))["requests_total"] == 0
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}


async def test_no_healthy_backend_503_and_ready(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", faults={"health_status": 503})
    router = await router_factory([spec.url], [])
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 503
            assert await r.json() == {
                "error": {"message": f"no healthy backend: {spec.url} (speculative): down, GET /health -> 503",
                          "type": "service_unavailable", "code": "no_healthy_backend"},
                "probes": {spec.url: {"pool": "speculative", "state": "down", "last_probe": "GET /health -> 503"}}}
        async with s.get(router.url + "/ready") as r:
            assert r.status == 503
        async with s.get(router.url + "/health") as r:
            assert r.status == 200
    assert (await sim_stats(spec.url))["requests_total"] == 0


async def test_starts_while_backend_loads_then_routes(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", startup_delay=2.0)
    router = await router_factory([spec.url], [])
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/ready") as r:
            assert r.status == 503
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 503
        assert await poll(lambda: router.state.pools.any_healthy(), 5)
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 200


@pytest.mark.parametrize("signal", ["local", "backend"])
async def test_replicas_share_load_through_backend_signal(sim_factory, router_factory, signal):
    """Two router replicas, one speculative backend: with the backend's own figures, B sees A's load."""
    spec = await sim_factory("eagle3-tp8", speedup=1.0, faults={"stall_after_chunks": 1})
    base = await sim_factory(speedup=1.0, faults={"stall_after_chunks": 1})
    opts = {"threshold": 2, "load_signal": signal, "load_interval": 0.05}
    a = await router_factory([spec.url], [base.url], **opts)
    b = await router_factory([spec.url], [base.url], **opts)
    async with AsyncExitStack() as stack:
        first = await open_streams(a.url, 2, stack, LONG)
        assert [r.headers["X-Router-Pool"] for r in first] == ["speculative", "speculative"]
        if signal == "backend":
            assert await poll(lambda: b.state.pools.backends[0].reported == 2, 3)
        second = await open_streams(b.url, 1, stack, LONG)
        expected = "baseline" if signal == "backend" else "speculative"
        assert second[0].headers["X-Router-Pool"] == expected
    assert await a.wait_idle() == {spec.url: 0, base.url: 0}
    assert await b.wait_idle() == {spec.url: 0, base.url: 0}


def test_load_estimate_counts_requests_sent_since_the_report():
    from router.loads import parse_loads
    from router.pools import Backend

    b = Backend("http://x:1", "speculative")
    leases = [b.lease() for _ in range(2)]
    b.report(parse_loads({"loads": [{"num_running_reqs": 5, "num_waiting_reqs": 1}]}))
    assert b.load_estimate == 6
    leases.append(b.lease())
    assert b.load_estimate == 7  # one more since the report
    for lease in leases:
        lease.release()
    assert b.load_estimate == 4  # our two that it counted have ended
    b.report(None)
    assert b.load_estimate == 0
    assert parse_loads({"loads": [{"num_running_reqs": 1}, {"num_running_reqs": 2, "num_waiting_reqs": 3}]}) == 6
    assert parse_loads({"loads": "x"}) is None and parse_loads([]) is None


async def test_one_slow_probe_does_not_eject_a_busy_backend(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8")
    router = await router_factory([spec.url], [], health_timeout=0.3, health_failure_threshold=3)
    backend = router.state.pools.backends[0]
    await set_faults(spec.url, health_delay=1.0)  # probes now time out
    seen_down = False

    def failed_once() -> bool:
        nonlocal seen_down
        seen_down |= not backend.healthy
        return router.metric("router_health_probes_total", backend=spec.url, result="failed") >= 1

    assert await poll(failed_once, 5, every=0.01)
    async with aiohttp.ClientSession() as s:
        async with s.delete(spec.url + "/_sim/faults") as r:
            assert r.status == 200
        async with s.post(router.url + "/v1/chat/completions", json=CHAT_BODY) as r:
            assert r.status == 200
    assert not seen_down and backend.healthy
    # Failures in a row past the threshold do eject it.
    await set_faults(spec.url, health_delay=1.0)
    assert await poll(lambda: not backend.healthy, 5)
