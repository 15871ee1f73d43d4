"""Factory fixtures that start routers on 127.0.0.1, port 0 (owned by the router work)."""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from router.app import build_app, start
from router.settings import Settings, load_settings
from router.state import STATE, RouterState

__all__ = ["CHAT_BODY", "RouterHandle", "poll", "router_factory", "set_faults", "sim_stats", "wait_stat", "wait_stats"]

# Fast health probing so tests see state changes within a fraction of a second.
TEST_DEFAULTS = {"health_interval": 0.2, "health_timeout": 1.0, "health_failure_threshold": 2,
                 "health_success_threshold": 1, "drain_timeout": 2.0}


def _describe(cond) -> str:
    try:
        return inspect.getsource(cond).strip()
    except (OSError, TypeError):
        return repr(cond)


async def poll(cond, within: float = 5.0, result=None, every: float = 0.02):
    """Re-check `cond()` until true; returns result() then (else True). When `within` seconds pass first, the test
    fails here, with the condition and the last result(): a wait that runs out is never a silent pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():  # noqa: ASYNC110 - the state lives in another task
        if loop.time() >= deadline:
            last = f"; last result: {result()!r}" if result is not None else ""
            raise AssertionError(f"not true within {within:g}s: {_describe(cond)}{last}")
        await asyncio.sleep(every)
    return result() if result is not None else True


@dataclass
class RouterHandle:
    url: str
    app: web.Application
    settings: Settings
    registry: CollectorRegistry
    runner: web.AppRunner

    @property
    def state(self) -> RouterState:
        return self.app[STATE]

    def inflight(self) -> dict[str, int]:
        return {b.url: b.inflight for b in self.state.pools.backends}

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def wait_idle(self, within: float = 5.0) -> dict[str, int]:
        """Wait until every in-flight count is 0 (bounded); returns the last counts seen."""
        return await poll(lambda: not any(self.inflight().values()), within, self.inflight)

    async def close(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()


@pytest.fixture
async def router_factory(caplog):
    """`await router_factory(speculative=[url], baseline=[url], wait_ready=True, resolver=None, **settings)`.

    `resolver` replaces DNS for `discovery="dns"` (router.discovery.Resolver); returns a RouterHandle.
    Teardown fails the test if any in-flight count went below 0 (router.pools logs it as an error)."""
    handles: list[RouterHandle] = []

    async def make(speculative=(), baseline=(), *, wait_ready: bool = True, resolver=None,
                   **settings) -> RouterHandle:
        values = {**TEST_DEFAULTS, "host": "127.0.0.1", "port": 0, **settings}
        values["speculative"] = ",".join(speculative)
        values["baseline"] = ",".join(baseline)
        s = load_settings(None, values, environ={})
        registry = CollectorRegistry()
        app = build_app(s, registry, resolver=resolver)
        runner, url = await start(app, s.host, s.port)
        handle = RouterHandle(url=url, app=app, settings=s, registry=registry, runner=runner)
        handles.append(handle)
        if wait_ready:
            # One full probe round: backends that are up are routable from here on.
            async with asyncio.timeout(5):
                await app[STATE].health.first_round.wait()
        return handle

    yield make
    for h in reversed(handles):
        await h.close()
    below = [r.getMessage() for r in caplog.records if r.name == "router.pools" and "below 0" in r.getMessage()]
    assert not below, below


# ---------------------------------------------------------------- helpers shared by the router tests

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "write a haiku about routers"}],
             "max_tokens": 12}


async def sim_stats(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/_sim/stats") as r:
        return await r.json()


async def set_faults(url: str, **faults) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/faults", json=faults) as r:
        assert r.status == 200, await r.text()


async def wait_stats(url: str, cond, within: float = 5.0) -> dict:
    """Poll the simulator's /_sim/stats until cond(stats); returns those stats. Fails the test after `within`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        stats = await sim_stats(url)
        if cond(stats):
            return stats
        if loop.time() > deadline:
            raise AssertionError(f"{url}/_sim/stats: not true within {within:g}s: {_describe(cond)}; last: {stats}")
        await asyncio.sleep(0.05)


async def wait_stat(url: str, key: str, value: int, within: float = 5.0) -> int:
    """Poll the simulator's /_sim/stats until stats[key] >= value; returns it. Fails the test after `within`."""
    return (await wait_stats(url, lambda stats: stats[key] >= value, within))[key]
