"""build_app(settings, registry) -> web.Application: state, routes and lifecycle; plus the runner both CLI and tests use."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from router import exchange, exporter, handlers, introspect
from router.accept import Acceptor, listen_socket
from router.affinity import Affinity
from router.discovery import BackendDiscovery, Discovery, Resolver, static_entries
from router.errors import error_middleware
from router.health import HealthChecker
from router.k8s import InferencePoolDiscovery
from router.learner import Learner
from router.loads import LoadPoller
from router.metrics import Metrics
from router.policies import make_policy
from router.pools import Backend, Pools
from router.settings import Settings
from router.state import STATE, RouterState
from router.upstream import Limits, make_client

log = logging.getLogger("router")


def build_app(settings: Settings, registry: CollectorRegistry | None = None,
              resolver: Resolver | None = None) -> web.Application:
    """The router app; `resolver` replaces the system DNS resolver for `discovery: dns` (tests)."""
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry)
    pools = build_pools(settings)
    limits = Limits([b.url for b in pools.backends], settings.max_connections_per_backend)
    gauges = exporter.bind(metrics, pools, limits)
    st = RouterState(settings=settings, pools=pools, metrics=metrics, limits=limits,
                     api_key=settings.api_key.get_secret_value().encode() if settings.api_key else None,
                     resolver=resolver, gauges=gauges)
    app = web.Application(middlewares=[handlers.edge],
                          client_max_size=settings.max_body_bytes, handler_args=_handler_args(settings))
    app[STATE] = st
    _add(app, "POST", exchange.CHAT, exchange.chat_completions)
    _add(app, "POST", exchange.COMPLETIONS, exchange.completions)
    _add(app, "GET", "/v1/models", handlers.models)
    _add(app, "GET", "/health", handlers.health)
    _add(app, "GET", "/ready", handlers.ready)
    _add(app, "GET", "/router/state", introspect.state_handler)
    if settings.metrics_port is None:
        _add(app, "GET", "/metrics", handlers.metrics_handler(st))
    _add(app, "*", "/{tail:.*}", handlers.unrouted)
    app.on_shutdown.append(_stop_accepting)
    app.on_shutdown.append(_drain_deadline)
    app.cleanup_ctx.append(_upstream_ctx)
    if settings.discovery == "dns" or settings.k8s_inference_pools:
        app.cleanup_ctx.append(_discovery_ctx)
    app.cleanup_ctx.append(_health_ctx)
    app.cleanup_ctx.append(_learner_ctx)
    if settings.load_signal == "backend":
        app.cleanup_ctx.append(_loads_ctx)
    if settings.metrics_port is not None:
        app.cleanup_ctx.append(_metrics_listener_ctx)
    return app


def build_pools(settings: Settings) -> Pools:
    """The pools of every front end (serve, epp) from the settings: members, policy, ejection, prefix affinity."""
    keys = {"speculative": settings.speculative_api_key, "baseline": settings.baseline_api_key}
    # With discovery on, named entries are not backends themselves: their addresses are, once resolved.
    return Pools(static_entries(settings, "speculative"), static_entries(settings, "baseline"),
                 policy=make_policy(settings), threshold=settings.threshold,
                 outlier_cfg=settings.outlier(), affinity=make_affinity(settings),
                 keys={k: v.get_secret_value() if v else None for k, v in keys.items()})


def build_discovery(pools: Pools, settings: Settings, metrics: Metrics, resolver: Resolver | None = None,
                    on_added: Callable[[Backend], Awaitable[None]] | None = None
                    ) -> BackendDiscovery | None:
    """The discovery of every front end (serve, epp): DNS names (discovery dns) or InferencePools
    (k8s_inference_pools; Settings allows one of the two), or None when backends are only the configured ones."""
    if settings.k8s_inference_pools:
        return InferencePoolDiscovery(pools, settings, metrics, on_added=on_added)
    if settings.discovery == "dns":
        return Discovery(pools, settings, metrics, resolver, on_added=on_added)
    return None


def make_affinity(settings: Settings) -> Affinity | None:
    """The prefix scorer of every decision (router.affinity), or None when prefix_routing is off."""
    if not settings.prefix_routing:
        return None
    return Affinity(block_bytes=settings.prefix_block_bytes, capacity_tokens=settings.prefix_capacity_tokens,
                    cross_pool=settings.prefix_cross_pool, max_running=settings.max_running_requests)


def _add(app: web.Application, method: str, path: str, handler) -> None:
    # Every path has a route (the last one catches the rest), so every answer passes the middlewares
    # and the router's own Expect handling.
    app.router.add_route(method, path, handler, expect_handler=handlers.expect_handler)
    if method == "GET":
        app.router.add_route("HEAD", path, handler, expect_handler=handlers.expect_handler)


def _handler_args(settings: Settings) -> dict:
    # keepalive_timeout also bounds a connection that never completes its request line or headers
    # (aiohttp's default is an hour: a slow-loris client could hold file descriptors that long).
    return {"max_line_size": settings.max_header_bytes, "max_field_size": settings.max_header_bytes,
            "max_headers": settings.max_headers, "keepalive_timeout": settings.client_timeout,
            # After a 408/413 aiohttp keeps reading the unwanted body for lingering_time (10 s) before closing.
            "lingering_time": min(2.0, settings.client_timeout)}


async def _stop_accepting(app: web.Application) -> None:
    acceptor = app[STATE].acceptor
    if isinstance(acceptor, Acceptor):
        acceptor.close()


async def _drain_deadline(app: web.Application) -> None:
    # on_shutdown runs when the listener has closed, before aiohttp waits drain_timeout for the handlers.
    # At the deadline, whatever is still open gets an explicit error rather than a cut connection. A little
    # before aiohttp's own deadline: a handler ending exactly at it trips an aiohttp race (InvalidStateError),
    # and drain_timeout 0 would mean "wait for ever" to aiohttp.
    st = app[STATE]
    drain = st.settings.drain_timeout
    asyncio.get_running_loop().call_later(max(0.0, drain - min(0.5, drain / 4)), exchange.cut_all, st)


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    st.client = make_client(st.settings, st.limits)
    yield
    # Runs after the drain: no handler uses the client any more.
    st.client.close()


async def _discovery_ctx(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]

    async def probe_new(b: Backend) -> None:
        # Its connection limit first: a newcomer is not routable before this probe passes.
        st.limits.add(b.url)
        if st.gauges is not None:
            st.gauges.limited(b)
        if st.health is not None and st.health.client is not None:
            await st.health.probe(b)

    discovery = st.discovery = build_discovery(st.pools, st.settings, st.metrics, st.resolver, on_added=probe_new)
    assert discovery is not None  # this context is added only with discovery on
    # The first answer before the first health round, so that round already probes the discovered backends.
    await discovery.refresh()
    discovery.start()
    yield
    await discovery.stop()


async def _health_ctx(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    st.health = HealthChecker(st.pools, st.settings, st.metrics)
    st.health.start()
    yield
    await st.health.stop()


async def _learner_ctx(app: web.Application) -> AsyncIterator[None]:
    learner = Learner(app[STATE].pools)
    learner.start()
    yield
    await learner.stop()


async def _loads_ctx(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    assert st.client is not None
    poller = LoadPoller(st.pools, st.settings, st.client, st.metrics)
    poller.start()
    yield
    await poller.stop()


async def _metrics_listener_ctx(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    assert st.settings.metrics_host is not None and st.settings.metrics_port is not None
    mapp = web.Application(middlewares=[error_middleware], handler_args=_handler_args(st.settings))
    mapp[STATE] = st
    _add(mapp, "GET", "/metrics", handlers.metrics_handler(st))
    _add(mapp, "*", "/{tail:.*}", handlers.unrouted)
    runner = web.AppRunner(mapp, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, st.settings.metrics_host, st.settings.metrics_port)
    await site.start()
    st.metrics_url = _bound_url(runner)
    log.info("metrics on %s/metrics", st.metrics_url)
    yield
    await runner.cleanup()


def _bound_url(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0 = any free port); returns the runner and the bound URL."""
    st = app[STATE]
    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream
    # request, so SGLang aborts it at once (also before the first token and for non-streaming calls).
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           shutdown_timeout=st.settings.drain_timeout)
    await runner.setup()
    try:
        sock = listen_socket(host, port, backlog=4096)  # the kernel caps it at somaxconn
    except BaseException:
        await runner.cleanup()
        raise
    assert runner.server is not None
    # Our own accept loop rather than a TCPSite: it takes every pending connection per loop turn.
    st.acceptor = Acceptor(sock, runner.server)
    st.acceptor.start()
    host, port = sock.getsockname()[:2]
    return runner, f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
