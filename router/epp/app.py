"""The endpoint picker as a whole: pools from the same settings as `serve`, health probes, the gRPC server; started
and drained by `spec-router epp` and by the tests."""
from __future__ import annotations

import asyncio
import logging
import socket

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from router import exporter, handlers
from router.app import build_discovery, build_pools
from router.discovery import Resolver
from router.epp.decide import Decider
from router.epp.server import Processor, build_server, set_health
from router.errors import error_middleware
from router.health import HealthChecker
from router.learner import Learner
from router.loads import LoadPoller
from router.metrics import Metrics
from router.pools import Backend
from router.settings import Settings
from router.upstream import Client, Limits, make_client

log = logging.getLogger("router.epp")


class ListenError(OSError):
    """A port the picker cannot bind, named in one line (the CLI prints it and exits 2)."""


def _cannot_listen(host: str, port: int, exc: BaseException | None = None) -> ListenError:
    why = (getattr(exc, "strerror", None) or str(exc)) if exc is not None else "the port cannot be bound"
    return ListenError(f"cannot listen on {host}:{port}: {why}")


def _check_free(host: str, port: int) -> None:
    """Raise ListenError (EADDRINUSE, ...) when host:port cannot be bound: a clear error before gRPC's own log
    lines."""
    if port == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise _cannot_listen(host, port, exc) from None


class Epp:
    """`await start()` binds host:epp_port and returns the port; `await stop()` drains for drain_timeout.
    `resolver` replaces the system DNS resolver for `discovery: dns` (tests)."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None,
                 resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.pools = build_pools(settings)
        self.metrics = Metrics(registry if registry is not None else CollectorRegistry())
        # The router_* gauges that read the pools (in flight, up, state, ejections), bound as serve binds them.
        self.gauges = exporter.bind(self.metrics, self.pools)
        self.decider = Decider(self.pools, block_bytes=settings.prefix_block_bytes, endpoints=settings.epp_endpoints,
                               max_per_backend=settings.max_connections_per_backend, metrics=self.metrics,
                               slo_tiers=settings.slo_tiers)
        self.metrics_runner: web.AppRunner | None = None
        self.metrics_url: str | None = None  # http://host:port of the /metrics listener, once started
        self.server: grpc.aio.Server | None = None
        self.processor: Processor | None = None
        self.health_checker = HealthChecker(self.pools, settings, self.metrics)
        self.learner = Learner(self.pools)
        self.discovery = build_discovery(self.pools, settings, self.metrics, resolver, on_added=self._probe_new)
        self._ready_task: asyncio.Task | None = None
        self.is_ready = False  # the gRPC readiness service says SERVING
        # load_signal backend, as in serve: each backend's own running + waiting figures (other pickers' and
        # routers' requests included), polled through a client of the picker's own (it proxies nothing).
        self.load_client: Client | None = None
        self.loads: LoadPoller | None = None

    async def start(self) -> int:
        s = self.settings
        self.server, self.processor, self.health = build_server(self.decider, s.max_body_bytes, s.epp_response_body)
        _check_free(s.host, s.epp_port)
        host = f"[{s.host}]" if ":" in s.host else s.host
        port = self.server.add_insecure_port(f"{host}:{s.epp_port}")
        if port == 0:
            raise _cannot_listen(s.host, s.epp_port)
        await set_health(self.health, ready=False)
        if s.metrics_port is not None:
            await self._serve_metrics()
        await self.server.start()
        if self.discovery is not None:
            # The first answer before the first health round, so that round already probes what it found.
            await self.discovery.refresh()
            self.discovery.start()
        self.health_checker.start()
        self.learner.start()
        if s.load_signal == "backend":
            self.load_client = make_client(s, Limits([], s.max_connections_per_backend))
            self.loads = LoadPoller(self.pools, s, self.load_client, self.metrics)
            self.loads.start()
        self._ready_task = asyncio.create_task(self._ready(), name="epp-ready")
        return port

    async def _serve_metrics(self) -> None:
        """/metrics on metrics_host:metrics_port, as serve's separate metrics listener (the picker's own port
        speaks gRPC only)."""
        s = self.settings
        registry = self.metrics.registry

        async def metrics(_request: web.Request) -> web.Response:
            out = web.Response(body=generate_latest(registry))
            out.headers["Content-Type"] = CONTENT_TYPE_LATEST
            return out

        mapp = web.Application(middlewares=[error_middleware])
        mapp.router.add_get("/metrics", metrics)
        mapp.router.add_route("*", "/{tail:.*}", handlers.unrouted)
        runner = web.AppRunner(mapp, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, s.metrics_host, s.metrics_port)
            await site.start()
        except BaseException as exc:
            await runner.cleanup()
            if isinstance(exc, OSError):
                raise _cannot_listen(s.metrics_host or "", s.metrics_port or 0, exc) from None
            raise
        self.metrics_runner = runner
        host, port = runner.addresses[0][:2]
        self.metrics_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("metrics on %s/metrics", self.metrics_url)

    async def _probe_new(self, b: Backend) -> None:
        # A newcomer carries no traffic until a probe passes: probe it now rather than at the next round.
        if self.health_checker.client is not None:
            await self.health_checker.probe(b)
        await self._maybe_ready()

    async def _ready(self) -> None:
        # Ready once every backend was probed once: the picker's view of the pools is synced then.
        await self.health_checker.first_round.wait()
        await self._maybe_ready()

    async def _maybe_ready(self) -> None:
        # With no backend yet (discovery found none: its API unreachable at start, a pool at zero) there is
        # nothing to pick: not ready until one has joined and been probed (_probe_new calls this again).
        if self.is_ready or self.server is None or not self.health_checker.first_round.is_set() \
                or not self.pools.backends:
            return
        self.is_ready = True
        await set_health(self.health, ready=True)

    async def stop(self) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        self.is_ready = False
        await set_health(self.health, ready=False)
        # grace: open streams may finish; then they are cancelled and their leases end (Processor.Process).
        await server.stop(grace=self.settings.drain_timeout)
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.learner.stop()
        await self.health_checker.stop()
        if self.loads is not None:
            await self.loads.stop()
        if self.load_client is not None:
            self.load_client.close()
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
            self.metrics_runner = None
