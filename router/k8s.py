"""InferencePool discovery: the ready pods an InferencePool (Gateway API Inference Extension, inference.networking
.k8s.io/v1) selects become backends, read from the Kubernetes API every k8s_interval.

Each round reads the InferencePool (its spec.selector.matchLabels and spec.targetPorts, so an edited pool is
followed), lists the pods its selector matches, and keeps those Ready, Running, not terminating and with a pod IP:
one backend http://POD_IP:PORT per target port. A pod's pool is the entry's =POOL, else the value of its
k8s_pool_label (speculative or baseline). The API's answer is authoritative: a pool scaled to zero empties. A failed
read (401, 403, 404, refused, a timeout, a body of the wrong shape) keeps the last known members; it is logged when
the state changes and counted in router_k8s_discovery_errors_total. Members change through
router.discovery.apply_answers, as with DNS: a backend that leaves drains."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from router.discovery import apply_answers, endpoint_url, static_entries
from router.metrics import Metrics
from router.policy import POOLS
from router.pools import Backend, Pools
from router.settings import Settings, parse_pool_ref
from router.tasks import cancel

log = logging.getLogger("router.k8s")

INFERENCE_POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools/{name}"
PODS = "/api/v1/namespaces/{namespace}/pods"
# The reasons router_k8s_discovery_errors_total counts (a closed set, as metric labels must be).
_BY_STATUS = {401: "unauthorized", 403: "forbidden", 404: "not_found"}
REASONS = ("unauthorized", "forbidden", "not_found", "http_error", "unreachable", "bad_answer")


class ApiError(Exception):
    """A read that gave no usable answer: `reason` is one of REASONS, the message says more."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KubeApi:
    """GETs on the Kubernetes API with the service account's bearer token, re-read on every call (the kubelet
    rotates projected tokens) and omitted when the file is absent (e.g. behind `kubectl proxy`)."""

    def __init__(self, settings: Settings) -> None:
        assert settings.k8s_api is not None  # Settings requires it with k8s_inference_pools
        self.base = settings.k8s_api
        self.token_file = Path(settings.k8s_token_file)
        self.ca_file = Path(settings.k8s_ca_file)
        self.timeout = aiohttp.ClientTimeout(total=settings.health_timeout, connect=settings.connect_timeout)
        self.session: aiohttp.ClientSession | None = None
        self._had_token: bool | None = None

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.base.startswith("https:"):
            return None
        ctx = ssl.create_default_context()
        if self.ca_file.is_file():
            ctx.load_verify_locations(cafile=str(self.ca_file))
        return ctx

    def _token(self) -> str | None:
        try:
            token = self.token_file.read_text(encoding="utf-8").strip() or None
        except OSError:
            token = None
        if (token is not None) != self._had_token:
            if token is None:
                log.warning("no token in %s: Kubernetes API requests go without one", self.token_file)
            elif self._had_token is False:
                log.info("token found in %s", self.token_file)
            self._had_token = token is not None
        return token

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout,
                                                 connector=aiohttp.TCPConnector(ssl=self._ssl() or True))
        headers = {"Accept": "application/json"}
        token = self._token()
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with self.session.get(self.base + path, params=params, headers=headers,
                                        allow_redirects=False) as r:
                if r.status != 200:
                    raise ApiError(_BY_STATUS.get(r.status, "http_error"),
                                   f"GET {path}: HTTP {r.status} {_status_message(await r.read())}".rstrip())
                try:
                    body = await r.json(content_type=None)
                except ValueError:
                    raise ApiError("bad_answer", f"GET {path}: not JSON") from None
        except TimeoutError as exc:  # aiohttp's connect timeout says which; the total one says nothing
            raise ApiError("unreachable", f"GET {path}: {exc or f'no answer within {self.timeout.total:g} s'}"
                           ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ApiError("unreachable", f"GET {path}: {_why(exc)}") from None
        if not isinstance(body, dict):
            raise ApiError("bad_answer", f"GET {path}: not a JSON object")
        return body

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def _why(exc: BaseException) -> str:
    # A refused or unresolvable address reads better as the OS's words than as aiohttp's whole sentence.
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"certificate not trusted ({exc.certificate_error})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error  # errno > 0: an OS error ("Connection refused"); a resolver's (gaierror) is negative
        return f"cannot connect: {os.strerror(err.errno) if (err.errno or 0) > 0 else err.strerror or err}"
    return f"{type(exc).__name__} {exc}".rstrip()


def _status_message(raw: bytes) -> str:
    # The API server explains a refusal in a Status object's message; one short line of it is enough.
    try:
        message = json.loads(raw).get("message", "")
    except (ValueError, AttributeError):
        return ""
    return str(message).splitlines()[0][:200] if message else ""


def pool_spec(obj: dict[str, Any]) -> tuple[str, list[int]]:
    """An InferencePool object -> (its label selector as the API's labelSelector text, its target ports)."""
    spec = obj.get("spec")
    labels = spec.get("selector", {}).get("matchLabels") if isinstance(spec, dict) else None
    ports = spec.get("targetPorts") if isinstance(spec, dict) else None
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ApiError("bad_answer", "InferencePool without spec.selector.matchLabels")
    if not isinstance(ports, list) or not ports:
        raise ApiError("bad_answer", "InferencePool without spec.targetPorts")
    numbers = [p.get("number") if isinstance(p, dict) else None for p in ports]
    if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 65535 for n in numbers):
        raise ApiError("bad_answer", f"InferencePool targetPorts {ports!r}: each needs a number 1-65535")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), sorted(set(numbers))  # type: ignore[arg-type]


def pod_address(pod: dict[str, Any]) -> str | None:
    """The pod's IP when it can take requests now: Running, Ready, not terminating; else None."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    # A terminating pod may still report Ready; the endpoints controller drops it at once, and so do we.
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
                if isinstance(c, dict))
    return str(status["podIP"]) if ready else None


@dataclass
class _PoolPods:
    """The pods of one InferencePool in one pool: a router.discovery.Source."""

    pool: str
    origin: str
    members: frozenset[str] = frozenset()


@dataclass
class _Ref:
    namespace: str
    name: str
    pool: str | None  # None: each pod's k8s_pool_label decides
    sources: dict[str, _PoolPods] = field(default_factory=dict)
    state: str = "unread"  # "ok" or the reason of the last failure: what is logged is each change
    skipped: set[str] = field(default_factory=set)  # pods already warned about (no pool label)

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


class InferencePoolDiscovery:
    """The members of every k8s_inference_pools entry, re-read each k8s_interval; `refresh()` is one round."""

    def __init__(self, pools: Pools, settings: Settings, metrics: Metrics,
                 on_added: Callable[[Backend], Awaitable[None]] | None = None) -> None:
        self.pools = pools
        self.settings = settings
        self.metrics = metrics
        self.on_added = on_added
        self.api = KubeApi(settings)
        self.refs: list[_Ref] = []
        for entry in settings.k8s_inference_pools:
            namespace, name, pool = parse_pool_ref(entry)
            ref = _Ref(namespace or settings.k8s_namespace or "", name, pool)
            ref.sources = {p: _PoolPods(p, f"InferencePool {ref.label}") for p in ((pool,) if pool else POOLS)}
            self.refs.append(ref)
        self.static = frozenset(u for p in POOLS for u in static_entries(settings, p))
        self._task: asyncio.Task | None = None

    async def _read(self, ref: _Ref) -> dict[str, frozenset[str]] | None:
        try:
            obj = await self.api.get(INFERENCE_POOLS.format(namespace=ref.namespace, name=ref.name))
            selector, ports = pool_spec(obj)
            listed = await self.api.get(PODS.format(namespace=ref.namespace), {"labelSelector": selector})
            items = listed.get("items")
            if not isinstance(items, list):
                raise ApiError("bad_answer", "pod list without items")
        except ApiError as exc:
            self.metrics.child(self.metrics.k8s_errors, ref.label, exc.reason).inc()
            if exc.reason != ref.state:
                known = sum(len(s.members) for s in ref.sources.values())
                # One line that names the API, the failure and what the pools do meanwhile (at start: nothing).
                log.warning("cannot read InferencePool %s from the Kubernetes API at %s: %s; %s", ref.label,
                            self.api.base, exc,
                            f"keeping {known} known backend(s)" if known else
                            f"no backends from it until a read succeeds (next in {self.settings.k8s_interval:g} s)")
            ref.state = exc.reason
            return None
        if ref.state != "ok":
            log.info("InferencePool %s read: selector %s, port(s) %s, %d pod(s)", ref.label, selector,
                     ",".join(map(str, ports)), len(items))
            ref.state = "ok"
        members: dict[str, set[str]] = {p: set() for p in ref.sources}
        for pod in items:
            if not isinstance(pod, dict) or (address := pod_address(pod)) is None:
                continue
            pool = ref.pool or ((pod.get("metadata") or {}).get("labels") or {}).get(self.settings.k8s_pool_label)
            if pool not in members:
                name = str((pod.get("metadata") or {}).get("name"))
                if name not in ref.skipped:
                    ref.skipped.add(name)
                    log.warning("InferencePool %s: pod %s has %s=%r, not speculative or baseline; not used",
                                ref.label, name, self.settings.k8s_pool_label, pool)
                continue
            members[pool].update(endpoint_url("http://pod", address, port) for port in ports)
        return {p: frozenset(m) for p, m in members.items()}

    async def refresh(self) -> None:
        """One round: read every InferencePool and its pods, then apply all changes with no await in between."""
        answers = await asyncio.gather(*(self._read(ref) for ref in self.refs))
        sources: list[_PoolPods] = []
        members: list[frozenset[str] | None] = []
        for ref, answer in zip(self.refs, answers, strict=True):
            for pool, source in ref.sources.items():
                sources.append(source)
                members.append(None if answer is None else answer[pool])
        added = apply_answers(self.pools, sources, members, self.static)
        if self.on_added is not None and added:
            # Probe newcomers at once rather than at the next health round: they carry no traffic until then.
            await asyncio.gather(*(self.on_added(b) for b in added))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.k8s_interval)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery for the router's lifetime
                log.exception("InferencePool discovery round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-k8s-discovery")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        await self.api.close()
