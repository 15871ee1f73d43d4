"""Active /health probes of every backend, with failure and success thresholds."""
from __future__ import annotations

import asyncio
import logging

from router import upstream
from router.errors import PROBE_FAILED, PROBE_OK, Failure
from router.metrics import Metrics
from router.pools import Backend, Pools
from router.settings import Settings
from router.tasks import cancel

log = logging.getLogger("router.health")


class HealthChecker:
    """Probes all backends every interval; `first_round` is set once every backend has been probed once."""

    def __init__(self, pools: Pools, settings: Settings, metrics: Metrics) -> None:
        self.pools = pools
        self.settings = settings
        self.client: upstream.Client | None = None
        self.metrics = metrics
        self.first_round = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def probe(self, b: Backend) -> None:
        s = self.settings
        headers = b.auth_headers
        was = b.healthy
        assert self.client is not None
        try:
            async with asyncio.timeout(s.health_timeout):
                status, _ = await upstream.get(self.client, b.url, s.health_path, headers)
                ok = status == 200
        except upstream.ConnectFailed as exc:
            if upstream.is_local(exc):
                # Our own trouble (file descriptors, DNS) says nothing about the backend: no verdict.
                log.warning("health probe of %s not sent: %s", b.url, exc)
                self.metrics.health_probes.labels(b.url, Failure.LOCAL).inc()
                return
            # Refused counts like any failed probe: one refusal (a restart) must not take it out alone.
            b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, Failure.REFUSED).inc()
        except upstream.TRANSPORT_ERRORS:
            b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, PROBE_FAILED).inc()
        else:
            if ok:
                b.probe_ok(s.health_success_threshold)
            else:
                b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, PROBE_OK if ok else PROBE_FAILED).inc()
        if b.healthy != was:
            log.log(logging.INFO if b.healthy else logging.WARNING, "backend %s (%s) is now %s", b.url, b.pool,
                    "up" if b.healthy else "down")
            if not b.healthy:
                self.pools.tick()  # it may have been the last routable one: ejected backends come back now

    async def run_round(self) -> None:
        await asyncio.gather(*(self.probe(b) for b in self.pools.backends))
        self.pools.tick()

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_round()
            except Exception:
                # A bug in one round must not end probing for the life of the process.
                log.exception("health probe round failed; probing continues")
            self.first_round.set()
            await asyncio.sleep(self.settings.health_interval)

    def start(self) -> None:
        # A fresh connection per probe: a backend that stopped accepting connections must fail its probe
        # even while an old keep-alive connection to it still works.
        # The probe as a whole is bounded by health_timeout, its connect included (as before).
        self.client = upstream.Client(self.settings.health_timeout, 10**6, 0, keep_alive=False)
        self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        if self.client is not None:
            self.client.close()
