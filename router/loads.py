"""Polls each backend's SGLang /v1/loads so several router replicas share one picture of backend load."""
from __future__ import annotations

import asyncio
import json
import logging

from router import upstream
from router.metrics import Metrics
from router.observe import LoadFigures
from router.pools import Backend, Pools
from router.settings import Settings
from router.tasks import cancel

log = logging.getLogger("router.loads")


def parse_figures(doc: object) -> LoadFigures | None:
    """SGLang's /v1/loads summed over data-parallel ranks (accept length: their mean); None if not usable."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    running = waiting = limit = 0
    gen: float | None = None
    accepts: list[float] = []
    kv: int | None = 0
    hits: list[float] = []
    for entry in loads:
        if not isinstance(entry, dict):
            return None
        r, w = entry.get("num_running_reqs"), entry.get("num_waiting_reqs", 0)
        if not isinstance(r, int) or not isinstance(w, int):
            return None
        running, waiting = running + r, waiting + w
        # The learning figures are optional: a backend without them still gives its load.
        g = entry.get("gen_throughput")
        if isinstance(g, (int, float)) and g >= 0:
            gen = (gen or 0.0) + g
        m = entry.get("max_running_requests")
        limit = limit + m if isinstance(m, int) and m > 0 and limit is not None else None
        t = entry.get("max_total_num_tokens")
        kv = kv + t if isinstance(t, int) and t > 0 and kv is not None else None
        hit = entry.get("cache_hit_rate")
        if isinstance(hit, (int, float)) and 0 <= hit <= 1:
            hits.append(float(hit))
        spec = entry.get("speculative")
        a = spec.get("accept_length") if isinstance(spec, dict) else None
        if isinstance(a, (int, float)) and a > 0:
            accepts.append(float(a))
    return LoadFigures(running, waiting, gen, sum(accepts) / len(accepts) if accepts else None, limit or None,
                       kv or None, sum(hits) / len(hits) if hits else None)


def parse_loads(doc: object) -> int | None:
    """running + waiting requests summed over data-parallel ranks; None if the document is not usable."""
    figs = parse_figures(doc)
    return None if figs is None else figs.running + figs.waiting


class LoadPoller:
    """Every `load_interval` seconds, asks each healthy backend for its load; a failed poll forgets the figure."""

    def __init__(self, pools: Pools, settings: Settings, client: upstream.Client, metrics: Metrics) -> None:
        self.pools = pools
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self._task: asyncio.Task | None = None

    async def poll(self, b: Backend) -> None:
        headers = b.auth_headers
        figs = None
        try:
            async with asyncio.timeout(self.settings.health_timeout):
                status, body = await upstream.get(self.client, b.url, "/v1/loads?include=core,spec", headers)
            if status == 200:
                figs = parse_figures(json.loads(body))
        except (*upstream.TRANSPORT_ERRORS, ValueError):
            figs = None
        load = None if figs is None else figs.running + figs.waiting
        # Without a fresh figure fall back to our own counts rather than trust a stale one.
        b.report(load)
        if figs is not None:
            self.pools.report_loads(b, figs)
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
