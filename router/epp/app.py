"""The endpoint picker as a whole: pools from the same settings as `serve`, health probes, the gRPC server; started
and drained by `spec-router epp` and by the tests."""
from __future__ import annotations

import asyncio
import logging
import socket

import grpc
from prometheus_client import CollectorRegistry

from router.app import make_affinity, make_policy
from router.discovery import Discovery, Resolver, static_entries
from router.epp.decide import Decider
from router.epp.server import Processor, build_server, set_health
from router.health import HealthChecker
from router.learner import Learner
from router.metrics import Metrics
from router.pools import Backend, Pools
from router.settings import Settings

log = logging.getLogger("router.epp")


def build_pools(settings: Settings) -> Pools:
    keys = {"speculative": settings.speculative_api_key, "baseline": settings.baseline_api_key}
    return Pools(static_entries(settings, "speculative"), static_entries(settings, "baseline"),
                 policy=make_policy(settings), threshold=settings.threshold,
                 outlier_cfg=settings.outlier(), affinity=make_affinity(settings),
                 keys={k: v.get_secret_value() if v else None for k, v in keys.items()})


def _check_free(host: str, port: int) -> None:
    """Raise OSError (EADDRINUSE, ...) when host:port cannot be bound: a clear error before gRPC's own log lines."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


class Epp:
    """`await start()` binds host:epp_port and returns the port; `await stop()` drains for drain_timeout.
    `resolver` replaces the system DNS resolver for `discovery: dns` (tests)."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None,
                 resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.pools = build_pools(settings)
        self.metrics = Metrics(registry if registry is not None else CollectorRegistry())
        self.decider = Decider(self.pools, block_bytes=settings.prefix_block_bytes,
                               endpoints=settings.epp_endpoints)
        self.server: grpc.aio.Server | None = None
        self.processor: Processor | None = None
        self.health_checker = HealthChecker(self.pools, settings, self.metrics)
        self.learner = Learner(self.pools)
        self.discovery = (Discovery(self.pools, settings, self.metrics, resolver, on_added=self._probe_new)
                          if settings.discovery == "dns" else None)
        self._ready_task: asyncio.Task | None = None

    async def start(self) -> int:
        s = self.settings
        self.server, self.processor, self.health = build_server(self.decider, s.max_body_bytes)
        _check_free(s.host, s.epp_port)
        host = f"[{s.host}]" if ":" in s.host else s.host
        port = self.server.add_insecure_port(f"{host}:{s.epp_port}")
        if port == 0:
            raise OSError(f"cannot listen on {s.host}:{s.epp_port}")
        await set_health(self.health, ready=False)
        await self.server.start()
        if self.discovery is not None:
            # The first answer before the first health round, so that round already probes what it found.
            await self.discovery.refresh()
            self.discovery.start()
        self.health_checker.start()
        self.learner.start()
        self._ready_task = asyncio.create_task(self._ready(), name="epp-ready")
        return port

    async def _probe_new(self, b: Backend) -> None:
        # A newcomer carries no traffic until a probe passes: probe it now rather than at the next round.
        if self.health_checker.client is not None:
            await self.health_checker.probe(b)

    async def _ready(self) -> None:
        # Ready once every backend was probed once: the picker's view of the pools is synced then.
        await self.health_checker.first_round.wait()
        await set_health(self.health, ready=True)

    async def stop(self) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        await set_health(self.health, ready=False)
        # grace: open streams may finish; then they are cancelled and their leases end (Processor.Process).
        await server.stop(grace=self.settings.drain_timeout)
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.learner.stop()
        await self.health_checker.stop()
