"""Every fault row of `bench faults`, fast and under concurrent load: what clients see, gauges, engine aborts."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from bench.streams import DISCONNECTED, EXPLICIT, OK, UNACCOUNTED, ClientTally, LoadPlan, drive
from tests.fixtures_router import poll, set_faults, sim_stats, wait_stat

FAST = {"health_interval": 0.1, "health_timeout": 0.3, "health_failure_threshold": 2,
        "health_success_threshold": 2, "first_byte_timeout": 0.6, "idle_timeout": 0.6, "connect_timeout": 0.5,
        "eject_base_seconds": 1.0, "eject_trial_requests": 4}
# For the rows about what each request sees when ejection does not step in (tests/test_reliability_outlier.py
# covers ejection itself).
NO_EJECT = {"eject_consecutive_errors": 0}
CLOSED = "SSE error event + [DONE]: backend B closed the connection"
IDLE = "SSE error event + [DONE]: backend B sent no next chunk in time"


async def load(url: str, requests: int, streams: int = 8, max_tokens: int = 40) -> ClientTally:
    """`requests` streaming requests from `streams` concurrent clients, through bench.lab.stress's load loop."""
    tally = ClientTally()
    plan = LoadPlan(url=url, streams=streams, duration=30.0, max_requests=requests, max_tokens=max_tokens,
                    disconnect_fraction=0.0, request_timeout=20.0, ramp=0.0)
    await drive(plan, tally)
    assert tally.sent == requests
    assert tally.outcomes[UNACCOUNTED] == 0 and tally.outcomes[DISCONNECTED] == 0, tally.samples
    return tally


async def stack(sim_factory, router_factory, spec_faults=None, speedup=20.0, **router):
    spec = await sim_factory("eagle3-tp8", speedup=speedup, faults=spec_faults)
    base = await sim_factory("baseline-tp8", speedup=20.0)
    r = await router_factory([spec.url], [base.url], threshold=1000, **{**FAST, **router})
    return spec, base, r


async def idle_everywhere(router, *sims) -> None:
    assert set((await router.wait_idle()).values()) == {0}
    for s in sims:
        assert await _quiet(s.url), await sim_stats(s.url)


async def _quiet(url: str, within: float = 5.0) -> bool:
    """Until the simulator has nothing running or queued (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        st = await sim_stats(url)
        if st["running"] == 0 and st["queued"] == 0:
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)


def up(router, url: str) -> float:
    return router.metric("router_backend_up", pool="speculative", backend=url)


async def test_backend_killed_mid_stream_under_load(sim_process_factory, sim_factory, router_factory):
    """SIGKILL of a backend with streams in flight: every client gets a complete answer or an explicit error.

    The accounting, as README "Metrics" and docs/TESTING.md define it: `router_upstream_errors_total` counts
    failed upstream *attempts*, so a request whose connection died before its headers and that was retried on
    the other pool counts one `disconnect` while its client saw a complete answer (this is why an equality
    of disconnects and in-band errors failed under CPU load: more requests are caught before their headers).
    `router_client_disconnects_total` counts only clients that left: a retried request is not one."""
    spec = await sim_process_factory("eagle3-tp8", speedup=5.0)
    base = await sim_factory("baseline-tp8", speedup=20.0)
    # A dead process answers at once (RST): long first-byte and idle deadlines keep a busy machine's slow
    # first tokens from adding 504s and idle errors that have nothing to do with the kill.
    router = await router_factory([spec.url], [base.url], threshold=1000,
                                  **{**FAST, "first_byte_timeout": 30.0, "idle_timeout": 30.0})
    task = asyncio.create_task(load(router.url, 48, streams=8, max_tokens=400))
    # Until at least four streams have sent their first event to their clients (bounded).
    assert await poll(lambda: router.metric("router_time_to_first_token_seconds_count", pool="speculative") >= 4, 10)
    spec.kill()
    tally = await task
    # After headers but before the first chunk, the death is a 502 (nothing reached the client yet).
    assert set(tally.seen) <= {"complete", CLOSED, "HTTP 502"}, tally.seen
    assert tally.seen[CLOSED] >= 4  # the streams in flight at the kill: in-band error, then [DONE]
    assert tally.seen["complete"] >= 48 - 8
    assert up(router, spec.url) == 0
    await idle_everywhere(router, base)
    disconnects = router.metric("router_upstream_errors_total", backend=spec.url, kind="disconnect")
    refused = router.metric("router_upstream_errors_total", backend=spec.url, kind="connect")
    retried = router.metric("router_retries_total", pool="baseline")
    # Every upstream disconnect reached its client (in-band error, or a 502 once no retry was left) or was
    # retried (before the client got a byte, also after headers); the only other retries are of refused
    # connections (after the kill, before the ejection).
    explicit = tally.seen[CLOSED] + tally.seen["HTTP 502"]
    assert disconnects >= explicit
    assert retried == (disconnects - explicit) + refused
    assert tally.seen["complete"] == 48 - explicit
    for pool in ("speculative", "baseline"):
        assert router.metric("router_client_disconnects_total", pool=pool) == 0


async def test_hang_before_first_byte_is_504_then_failover_when_health_fails(sim_factory, router_factory):
    spec, base, router = await stack(sim_factory, router_factory, **NO_EJECT)
    await set_faults(spec.url, hang=True)
    tally = await load(router.url, 12, streams=6)
    # /health still says 200: every request gets an explicit 504 after first_byte_timeout, none is lost.
    assert dict(tally.seen) == {"HTTP 504": 12}
    assert min(tally.error_latency) >= FAST["first_byte_timeout"] * 0.9
    assert up(router, spec.url) == 1
    assert router.metric("router_upstream_errors_total", backend=spec.url, kind="first_byte_timeout") == 12
    # Like SGLang's /health (a 1-token generation), the probe hangs too: ejected, the other pool serves.
    await set_faults(spec.url, health_delay=30)
    assert await poll(lambda: up(router, spec.url) == 0, 5)
    tally = await load(router.url, 12, streams=6)
    assert dict(tally.seen) == {"complete": 12}
    assert (await sim_stats(base.url))["completed_total"] == 12
    assert (await sim_stats(spec.url))["faults_injected"]["hang"] == 12
    await idle_everywhere(router, base)


async def test_stall_mid_stream_is_an_sse_error_then_done_and_aborts(sim_factory, router_factory):
    # Slow clock and long answers: the engine is still generating when the router gives up on the stream.
    spec, base, router = await stack(sim_factory, router_factory, spec_faults={"stall_after_chunks": 2}, speedup=2.0,
                                     **NO_EJECT)
    tally = await load(router.url, 10, streams=5, max_tokens=2000)
    assert dict(tally.seen) == {IDLE: 10}
    assert tally.outcomes[EXPLICIT] == 10
    # The router closed each stalled upstream request: the engine aborted every one of them.
    assert await wait_stat(spec.url, "aborted_total", 10) == 10
    await idle_everywhere(router, spec, base)
    assert router.metric("router_upstream_errors_total", backend=spec.url, kind="idle_timeout") == 10


async def test_500_passes_through_and_503_is_retried_on_the_other_pool(sim_factory, router_factory):
    # No deadline is under test here: a long first-byte timeout keeps a busy machine's slow retries from 504s.
    spec, base, router = await stack(sim_factory, router_factory, spec_faults={"error_rate": 1.0, "error_status": 500},
                                     **NO_EJECT, first_byte_timeout=30.0)
    tally = await load(router.url, 12, streams=6)
    assert dict(tally.seen) == {"HTTP 500": 12}
    await set_faults(spec.url, error_status=503)
    tally = await load(router.url, 12, streams=6)
    assert dict(tally.seen) == {"complete": 12}
    assert router.metric("router_retries_total", pool="baseline") == 12
    assert (await sim_stats(base.url))["completed_total"] == 12
    assert up(router, spec.url) == 1  # ejection off: no error answer takes it out
    await idle_everywhere(router, spec, base)


async def test_refused_connections_fail_over_at_once_and_come_back(sim_factory, router_factory):
    # Deadlines are not under test here: long ones keep a busy machine's slow answers from turning into 504s.
    spec, base, router = await stack(sim_factory, router_factory, first_byte_timeout=30.0, idle_timeout=30.0)
    await set_faults(spec.url, refuse_for=1.5)
    tally = await load(router.url, 16, streams=8)
    assert dict(tally.seen) == {"complete": 16}
    assert up(router, spec.url) == 0  # the first eight all refused: ejected (and the probes agree)
    spec_before = (await sim_stats(base.url))["completed_total"]
    assert spec_before == 16
    # Listener back after 1.5 s: the 1 s ejection is over, two good probes and it is routable again.
    assert await poll(lambda: up(router, spec.url) == 1, 5)
    tally = await load(router.url, 8, streams=4)
    assert dict(tally.seen) == {"complete": 8}
    assert (await sim_stats(spec.url))["completed_total"] == 8
    await idle_everywhere(router, spec, base)


async def test_backend_comes_back_on_the_same_port_after_sigkill(sim_process_factory, sim_factory, router_factory):
    spec = await sim_process_factory("eagle3-tp8", speedup=20.0)
    base = await sim_factory("baseline-tp8", speedup=20.0)
    router = await router_factory([spec.url], [base.url], threshold=1000,
                                  **{**FAST, "first_byte_timeout": 30.0, "idle_timeout": 30.0})
    port = urlsplit(spec.url).port
    spec.kill()
    tally = await load(router.url, 8, streams=4)
    assert dict(tally.seen) == {"complete": 8}
    assert up(router, spec.url) == 0
    again = await sim_process_factory("eagle3-tp8", speedup=20.0, port=port)
    assert again.url == spec.url
    assert await poll(lambda: up(router, spec.url) == 1, 5)
    tally = await load(router.url, 8, streams=4)
    assert dict(tally.seen) == {"complete": 8}
    async with aiohttp.ClientSession() as s, s.get(again.url + "/_sim/stats") as r:
        assert (await r.json())["completed_total"] == 8
    assert set((await router.wait_idle()).values()) == {0}


async def test_one_slow_health_probe_does_not_eject_a_busy_backend(sim_factory, router_factory):
    # Only the probe deadline is under test: long first-byte and idle deadlines keep a busy machine's slow
    # answers from turning into 504s.
    spec, base, router = await stack(sim_factory, router_factory, health_failure_threshold=3,
                                     health_interval=0.2, first_byte_timeout=30.0, idle_timeout=30.0)
    seen_up: list[float] = []

    async def watch() -> None:
        while True:
            seen_up.append(up(router, spec.url))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    failed_before = router.metric("router_health_probes_total", backend=spec.url, result="failed")
    await set_faults(spec.url, health_delay=0.5)  # over the 0.3 s probe timeout
    work = asyncio.create_task(load(router.url, 40, streams=8))
    assert await poll(lambda: router.metric("router_health_probes_total", backend=spec.url, result="failed")
                      > failed_before, 3)
    await set_faults(spec.url, health_delay=0.0)
    tally = await work
    watcher.cancel()
    assert router.metric("router_health_probes_total", backend=spec.url, result="failed") >= failed_before + 1
    assert dict(tally.seen) == {"complete": 40}
    assert min(seen_up) == 1  # never ejected
    assert (await sim_stats(base.url))["requests_total"] == 0  # and no request moved
    await idle_everywhere(router, spec, base)


async def test_sigterm_with_streams_in_flight_lets_them_finish(sim_factory, router_factory):
    spec, base, router = await stack(sim_factory, router_factory, drain_timeout=10)
    stop = asyncio.Event()
    tally = ClientTally()
    plan = LoadPlan(url=router.url, streams=6, duration=30, max_requests=1000, max_tokens=300,
                    disconnect_fraction=0.0, request_timeout=20.0, ramp=0.0)
    work = asyncio.create_task(drive(plan, tally, stop))
    await wait_stat(spec.url, "running", 6)
    stop.set()  # no new requests once shutdown starts; those in flight must complete
    await router.close()
    await work
    assert tally.outcomes[OK] == tally.sent and tally.sent >= 6
    assert (await sim_stats(spec.url))["aborted_total"] == 0
    assert router.inflight() == {spec.url: 0, base.url: 0}
