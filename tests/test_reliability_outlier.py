"""Passive outlier ejection through real sockets: simulators with faults, the router, the `openai` SDK."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter

import openai
import pytest

from router.health import HealthChecker
from router.loads import LoadPoller
from tests.fixtures_router import CHAT_BODY, poll, set_faults, sim_stats, wait_stat

STATES = ("up", "down", "ejected", "trial")
# Fast ejection settings: three failures in a row eject; the rest per test.
EJECT = {"threshold": 100, "eject_consecutive_errors": 3, "eject_trial_requests": 2}


def client(router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=10)


async def ask(router, **extra) -> tuple[int, str]:
    """One chat completion through the SDK: (HTTP status, pool that answered)."""
    async with client(router) as c:
        try:
            raw = await c.chat.completions.with_raw_response.create(**{**CHAT_BODY, **extra})
        except openai.APIStatusError as exc:
            return exc.status_code, exc.response.headers.get("X-Router-Pool", "none")
        raw.parse()
        return raw.status_code, raw.headers["X-Router-Pool"]


def state_of(router, url: str) -> str:
    """The backend's state as /metrics tells it; exactly one state reads 1 (read where the state is not about
    to change by itself: each gauge reads the clock on its own)."""
    pool = next(b.pool for b in router.state.pools.backends if b.url == url)
    on = [s for s in STATES if router.metric("router_backend_state", pool=pool, backend=url, state=s) == 1]
    assert len(on) == 1, on
    return on[0]


async def test_consecutive_500s_eject_and_the_other_pool_serves(sim_factory, router_factory, caplog):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 500})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=60, **EJECT)
    caplog.set_level(logging.INFO, logger="router")
    got = [await ask(router) for _ in range(8)]
    # The backend's 500s pass through until the third in a row; then the healthy pool serves everything.
    assert got == [(500, "speculative")] * 3 + [(200, "baseline")] * 5
    assert state_of(router, spec.url) == "ejected" and state_of(router, base.url) == "up"
    assert router.metric("router_backend_up", pool="speculative", backend=spec.url) == 0
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="5xx") == 1
    assert router.metric("router_requests_total", pool="speculative", backend=spec.url, code="500") == 3
    assert router.metric("router_route_decisions_total", pool="baseline", reason="failover") == 5
    assert (await sim_stats(spec.url))["faults_injected"] == {"error": 3}
    assert router.state.pools.backends[0].healthy  # /health still answers 200: only the passive check sees it
    assert f"backend {spec.url} (speculative) ejected for 60 s" in caplog.text
    assert router.inflight() == {spec.url: 0, base.url: 0}


async def test_streams_that_stall_after_good_headers_eject(sim_factory, router_factory):
    # /health stays 200 and every answer starts well: only the streams' ends show the backend is broken.
    spec = await sim_factory("eagle3-tp8", faults={"stall_after_chunks": 2})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=60, idle_timeout=0.3, **EJECT)
    pools = []
    async with client(router) as c:
        for _ in range(3):  # each ends with the router's SSE error event after idle_timeout
            raw = await c.chat.completions.with_raw_response.create(**{**CHAT_BODY, "stream": True})
            pools.append(raw.headers["X-Router-Pool"])
            with pytest.raises(openai.APIError):
                async for _chunk in raw.parse():
                    pass
        raw = await c.chat.completions.with_raw_response.create(**{**CHAT_BODY, "stream": True})
        pools.append(raw.headers["X-Router-Pool"])
        assert len([chunk async for chunk in raw.parse()]) > 1  # complete, from the other pool
    assert pools == ["speculative"] * 3 + ["baseline"]
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="idle_timeout") == 1
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}


async def test_4xx_and_client_disconnects_do_not_eject(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", speedup=5.0)
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=60, **EJECT)
    async with client(router) as c:
        for _ in range(6):  # the request's fault: the backend answers 400, passed through
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(model="m", messages=[{"content": "no role"}])
            assert info.value.response.headers["X-Router-Pool"] == "speculative"
        for _ in range(6):  # clients that leave after the first chunk
            stream = await c.chat.completions.create(**{**CHAT_BODY, "max_tokens": 400, "stream": True})
            async for _chunk in stream:
                break
            await stream.close()
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}
    assert await wait_stat(spec.url, "aborted_total", 6) == 6
    assert router.metric("router_client_disconnects_total", pool="speculative") == 6
    assert state_of(router, spec.url) == "up"
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="5xx") == 0
    assert await ask(router) == (200, "speculative")


async def test_trial_requests_bring_it_back(sim_factory, router_factory, caplog):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 500})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=0.5, **EJECT)
    caplog.set_level(logging.INFO, logger="router")
    assert [await ask(router) for _ in range(4)] == [(500, "speculative")] * 3 + [(200, "baseline")]
    await set_faults(spec.url, error_rate=0.0)  # the engine is fixed
    assert await poll(lambda: router.state.pools.by_url[spec.url].state() == "trial", 5)
    assert router.metric("router_backend_up", pool="speculative", backend=spec.url) == 1
    # Two successful trial requests bring it fully back; spillover then prefers it again.
    assert await ask(router) == (200, "speculative")
    assert state_of(router, spec.url) == "trial"
    assert await ask(router) == (200, "speculative")
    assert state_of(router, spec.url) == "up"
    assert "passed its trial: fully back" in caplog.text
    assert await ask(router) == (200, "speculative")
    assert router.inflight() == {spec.url: 0, base.url: 0}


async def test_repeated_failures_lengthen_the_ejection(sim_factory, router_factory, caplog):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 500})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=0.3, **EJECT)
    caplog.set_level(logging.INFO, logger="router")
    for _ in range(3):
        await ask(router)
    assert "ejected for 0.3 s (ejection 1 in a row) after 3 consecutive failures" in caplog.text
    for n, length in ((2, "0.6"), (3, "1.2")):
        assert await poll(lambda: router.state.pools.by_url[spec.url].state() == "trial", 5)
        # The trial request fails too: out again, for twice as long.
        assert await ask(router) == (500, "speculative")
        assert state_of(router, spec.url) == "ejected"
        assert f"ejected for {length} s (ejection {n} in a row) after a failed trial request" in caplog.text
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="5xx") == 3
    assert router.inflight() == {spec.url: 0, base.url: 0}


async def test_the_only_backend_is_never_ejected(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 500})
    router = await router_factory([spec.url], [], **EJECT)
    # Nobody else could serve: the errors pass through, as without ejection, rather than 503 for everyone.
    assert [await ask(router) for _ in range(8)] == [(500, "speculative")] * 8
    assert state_of(router, spec.url) == "up"
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="5xx") == 0


async def test_ejected_backend_comes_back_when_the_other_pool_goes_down(sim_factory, router_factory, caplog):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 500})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=60, **EJECT)
    caplog.set_level(logging.INFO, logger="router")
    for _ in range(3):
        await ask(router)
    assert state_of(router, spec.url) == "ejected"
    await set_faults(base.url, health_status=503)  # the baseline pool goes down (probes see it)
    assert await poll(lambda: state_of(router, base.url) == "down", 5)
    assert state_of(router, spec.url) == "up"
    assert "taken back early: no other backend is routable" in caplog.text
    # The last routable backend answers, errors and all; the router does not answer 503 itself.
    assert await ask(router) == (500, "speculative")
    assert router.metric("router_requests_total", pool="none", backend="none", code="503") == 0


async def test_concurrent_load_few_500s_and_exact_counts(sim_factory, router_factory):
    spec = await sim_factory("eagle3-tp8", faults={"error_rate": 1.0, "error_status": 500})
    base = await sim_factory()
    router = await router_factory([spec.url], [base.url], eject_base_seconds=60, **EJECT)
    streams, per_stream = 8, 6
    seen: Counter = Counter()

    async def worker() -> None:
        for _ in range(per_stream):
            status, pool = await ask(router, stream=False)
            seen[(status, pool)] += 1

    async with asyncio.timeout(60):
        await asyncio.gather(*(worker() for _ in range(streams)))
    # Only requests sent before the third failure came back can see a 500: at most 3 + the others in flight.
    fails = seen[(500, "speculative")]
    assert 3 <= fails <= 3 + streams - 1
    assert seen[(200, "baseline")] == streams * per_stream - fails
    assert set(seen) <= {(500, "speculative"), (200, "baseline")}
    assert router.inflight() == {spec.url: 0, base.url: 0}
    assert router.metric("router_inflight_requests", pool="speculative", backend=spec.url) == 0
    assert router.metric("router_requests_total", pool="speculative", backend=spec.url, code="500") == fails
    assert router.metric("router_backend_ejections_total", pool="speculative", backend=spec.url,
                         reason="5xx") == 1
    assert (await sim_stats(spec.url))["faults_injected"] == {"error": fails}


# ---- the background loops survive a bug in one round

async def test_health_loop_survives_an_unexpected_exception(sim_factory, router_factory, monkeypatch, caplog):
    sim = await sim_factory()
    real = HealthChecker.probe
    calls = Counter()

    async def flaky(self, b):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        await real(self, b)

    monkeypatch.setattr(HealthChecker, "probe", flaky)
    caplog.set_level(logging.ERROR, logger="router.health")
    router = await router_factory([], [sim.url])
    assert "health probe round failed; probing continues" in caplog.text
    assert "RuntimeError: injected" in caplog.text
    # Later rounds still run: the backend is found healthy and traffic flows.
    assert await poll(lambda: router.metric("router_health_probes_total", backend=sim.url, result="ok") >= 2, 5)
    assert await ask(router) == (200, "baseline")


async def test_load_loop_survives_an_unexpected_exception(sim_factory, router_factory, monkeypatch, caplog):
    sim = await sim_factory()
    real = LoadPoller.poll
    calls = Counter()

    async def flaky(self, b):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        await real(self, b)

    monkeypatch.setattr(LoadPoller, "poll", flaky)
    caplog.set_level(logging.ERROR, logger="router.loads")
    router = await router_factory([], [sim.url], load_signal="backend", load_interval=0.05)
    assert await poll(lambda: calls["n"] >= 3, 5)
    assert "load poll round failed; polling continues" in caplog.text
    assert await poll(lambda: router.metric("router_backend_reported_load", pool="baseline", backend=sim.url) == 0, 5)
