"""Polls each backend's SGLang /v1/loads so several router replicas share one picture of backend load."""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.metrics import Metrics
from router.pools import Backend, Pools
from router.settings import Settings
from router.tasks import cancel

log = logging.getLogger("router.loads")


def parse_loads(doc: object) -> int | None:
    """running + waiting requests summed over data-parallel ranks; None if the document is not usable."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    total = 0
    for entry in loads:
        if not isinstance(entry, dict):
            return None
        running, waiting = entry.get("num_running_reqs"), entry.get("num_waiting_reqs", 0)
        if not isinstance(running, int) or not isinstance(waiting, int):
            return None
        total += running + waiting
    return total


class LoadPoller:
    """Every `load_interval` seconds, asks each healthy backend for its load; a failed poll forgets the figure."""

    def __init__(self, pools: Pools, settings: Settings, session: aiohttp.ClientSession, metrics: Metrics) -> None:
        self.pools = pools
        self.settings = settings
        self.session = session
        self.metrics = metrics
        self._task: asyncio.Task | None = None

    async def poll(self, b: Backend) -> None:
        headers = b.auth_headers
        load = None
        try:
            async with asyncio.timeout(self.settings.health_timeout):
                async with self.session.get(b.url + "/v1/loads", params={"include": "core"},
                                            headers=headers) as resp:
                    if resp.status == 200:
                        load = parse_loads(await resp.json(content_type=None))
        except (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError):
            load = None
        # Without a fresh figure fall back to our own counts rather than trust a stale one.
        b.report(load)
        self.metrics.reported_load.labels(b.pool, b.url).set(-1 if load is None else load)

    async def run_round(self) -> None:
        for b in self.pools.backends:
            if not b.healthy:
                b.report(None)
        await asyncio.gather(*(self.poll(b) for b in self.pools.backends if b.healthy))

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_round()
            except Exception:
                # A bug in one round must not end polling for the life of the process.
                log.exception("load poll round failed; polling continues")
            await asyncio.sleep(self.settings.load_interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-loads")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
