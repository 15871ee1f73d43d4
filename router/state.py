"""The router's per-app state, reachable from handlers through one typed web.AppKey."""
from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from router.discovery import BackendDiscovery, Resolver
from router.exporter import PoolGauges
from router.health import HealthChecker
from router.metrics import Metrics
from router.pools import Pools
from router.settings import Settings
from router.upstream import Client, Limits


@dataclass
class RouterState:
    settings: Settings
    pools: Pools
    metrics: Metrics
    limits: Limits
    client: Client | None = None  # to the backends (router.upstream)
    health: HealthChecker | None = None
    metrics_url: str | None = None  # set when /metrics listens on its own address
    api_key: bytes | None = field(default=None, repr=False)
    # Open proxied exchanges (router.exchange.Exchange): those left when the drain ends get an explicit error.
    exchanges: set = field(default_factory=set, repr=False)
    acceptor: object | None = field(default=None, repr=False)  # router.accept.Acceptor of the main listener
    resolver: Resolver | None = field(default=None, repr=False)  # discovery's DNS seam (None: the system's)
    discovery: BackendDiscovery | None = None  # DNS names or InferencePools (router.app.build_discovery)
    gauges: PoolGauges | None = field(default=None, repr=False)  # binds the gauges of a backend that joins


STATE: web.AppKey[RouterState] = web.AppKey("router_state", RouterState)
