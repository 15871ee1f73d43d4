"""DNS discovery: a pool entry naming a host (a headless Service) becomes one backend per address, re-resolved."""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from router.metrics import Metrics
from router.policy import POOLS
from router.pools import Backend, Pools
from router.settings import Settings
from router.tasks import cancel

log = logging.getLogger("router.discovery")

# (host, port) -> the endpoints behind it as (address, port). The seam tests use instead of DNS: a headless
# Service gives addresses (the port is the URL's); SRV-style answers with their own ports fit the same shape.
Resolver = Callable[[str, int], Awaitable[list[tuple[str, int]]]]


async def system_resolver(host: str, port: int) -> list[tuple[str, int]]:
    """The operating system's resolver (getaddrinfo), TCP endpoints only, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         proto=socket.IPPROTO_TCP)
    return sorted({(info[4][0], info[4][1]) for info in infos})


def is_name(url: str) -> bool:
    """True when the URL's host is a DNS name rather than an IP literal."""
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def endpoint_url(url: str, address: str, port: int) -> str:
    """The configured URL with its host replaced by one resolved address (and port)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    return f"{parts.scheme}://{host}:{port}{parts.path}".rstrip("/")


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None  # settings checked every URL
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


@dataclass
class _Name:
    pool: str
    url: str
    members: frozenset[str] = frozenset()

    @property
    def origin(self) -> str:
        return urlsplit(self.url).hostname or self.url


class Source(Protocol):
    """One discovered set of backends of one pool (a DNS name, an InferencePool's pods of that pool)."""

    pool: str
    members: frozenset[str]

    @property
    def origin(self) -> str: ...


@runtime_checkable
class BackendDiscovery(Protocol):
    """What a front end (serve, epp) runs to follow changing backends: DNS names (Discovery) or InferencePools
    (router.k8s.InferencePoolDiscovery)."""

    async def refresh(self) -> None:
        """One round: read every source now and apply what changed."""

    def start(self) -> None:
        """Refresh in the background from now on."""

    async def stop(self) -> None:
        """End the background refreshes and release what they hold."""


def apply_answers(pools: Pools, sources: Sequence[Source], answers: Sequence[frozenset[str] | None],
                  static: frozenset[str]) -> list[Backend]:
    """Each source's new members (None: no answer, keep the known ones) applied to the pools, with no await:
    the backends that joined are returned (to be probed), those that left drain (Pools.remove_backend)."""
    before = [source.members for source in sources]
    for source, members in zip(sources, answers, strict=True):
        if members is None or members == source.members:
            continue
        # Another source of the same pool may still list an address this one dropped: it stays while one does.
        kept = {u for other in sources if other is not source and other.pool == source.pool
                for u in other.members} | static
        for url in sorted(source.members - members - kept):
            log.info("backend %s (%s) left %s", url, source.pool, source.origin)
            pools.remove_backend(url)
        source.members = members
    # Removals first: an address that left one pool in this round (a pod relabelled) may join the other.
    added: list[Backend] = []
    for source, old in zip(sources, before, strict=True):
        for url in sorted(source.members):
            b = pools.by_url.get(url)
            if b is None:
                log.info("backend %s (%s) joined from %s", url, source.pool, source.origin)
                added.append(pools.add_backend(url, source.pool))
            elif b.pool != source.pool and url not in old:
                log.warning("backend %s is already in the %s pool; not adding it to %s", url, b.pool,
                            source.pool)
    return added


class Discovery:
    """Re-resolves every named pool entry each `discovery_interval` and adds/removes backends to match.

    A failed or empty answer keeps the previous members: a DNS hiccup must not empty a pool. Removed
    backends drain (Pools.remove_backend), so in-flight requests finish where they are.
    """

    def __init__(self, pools: Pools, settings: Settings, metrics: Metrics, resolver: Resolver | None = None,
                 on_added: Callable[[Backend], Awaitable[None]] | None = None) -> None:
        self.pools = pools
        self.settings = settings
        self.metrics = metrics
        self.resolver = resolver or system_resolver
        self.on_added = on_added
        self.names = [_Name(pool, url) for pool in POOLS for url in named_entries(settings, pool)]
        self.static = frozenset(u for pool in POOLS for u in static_entries(settings, pool))
        self._task: asyncio.Task | None = None

    async def _resolve(self, name: _Name) -> frozenset[str] | None:
        host, port = _host_port(name.url)
        try:
            async with asyncio.timeout(self.settings.health_timeout):
                endpoints = await self.resolver(host, port)
        except (OSError, TimeoutError, UnicodeError) as exc:  # UnicodeError: a label IDNA cannot encode
            log.warning("cannot resolve %s (%s pool): %s; keeping %d known backend(s)", host, name.pool,
                        exc, len(name.members))
            self.metrics.discovery_failures.labels(name.pool).inc()
            return None
        if not endpoints:
            log.warning("%s (%s pool) resolved to no address; keeping %d known backend(s)", host, name.pool,
                        len(name.members))
            self.metrics.discovery_failures.labels(name.pool).inc()
            return None
        return frozenset(endpoint_url(name.url, addr, p) for addr, p in endpoints)

    async def refresh(self) -> None:
        """One round: resolve every name, then apply all changes with no await in between."""
        answers = await asyncio.gather(*(self._resolve(n) for n in self.names))
        added = apply_answers(self.pools, self.names, answers, self.static)
        if self.on_added is not None and added:
            # Probe newcomers at once rather than at the next health round: they carry no traffic until then.
            await asyncio.gather(*(self.on_added(b) for b in added))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.discovery_interval)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery for the router's lifetime
                log.exception("discovery round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-discovery")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None


def named_entries(settings: Settings, pool: str) -> list[str]:
    """The pool's entries that discovery expands (none when discovery is off)."""
    urls = getattr(settings, pool)
    return [u for u in urls if is_name(u)] if settings.discovery == "dns" else []


def static_entries(settings: Settings, pool: str) -> list[str]:
    """The pool's entries used as given: all of them when discovery is off, else the IP literals."""
    urls = getattr(settings, pool)
    return [u for u in urls if not is_name(u)] if settings.discovery == "dns" else list(urls)
