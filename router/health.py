"""Active health probes of every backend: thresholds, the /v1/models fallback, and saying why a backend is down."""
from __future__ import annotations

import asyncio
import errno
import logging
import time

from router import outlier, upstream
from router.errors import PROBE_FAILED, PROBE_OK, Failure, NoHealthyBackend
from router.metrics import Metrics
from router.pools import Backend, Pools
from router.settings import Settings
from router.tasks import cancel

log = logging.getLogger("router.health")

# Every OpenAI-compatible server answers this; used when the health path does not exist there (llama.cpp through
# llama-cpp-python, LM Studio, Ollama: 404 on /health), unless health_path was set explicitly.
FALLBACK_PATH = "/v1/models"
_MISSING = (404, 405)  # "no such path" (or method) is not "down"


class ProbeState:
    """What the checker keeps per backend (on `Backend.probe`): the path in use and the result last logged."""

    __slots__ = ("path", "logged", "fell_back")

    def __init__(self) -> None:
        self.path: str | None = None  # None: the configured health_path
        self.logged: str | None = None  # what the last WARNING said (its result), None while up
        self.fell_back = False  # the fallback was announced (once per backend)


def _state(b: Backend) -> ProbeState:
    if not isinstance(b.probe, ProbeState):
        b.probe = ProbeState()
    return b.probe


def describe_connect(exc: upstream.ConnectFailed) -> str:
    e = exc.os_error
    if e.errno == errno.ECONNREFUSED:
        return "connection refused"
    return f"cannot connect: {e.strerror or e}"


def _ejection(b: Backend) -> str:
    """Why outlier detection keeps the backend out, or "" when it does not."""
    now = time.monotonic()
    if outlier.phase_at(b.outlier, now) != outlier.EJECTED:
        return ""
    return f"ejected by outlier detection for {b.outlier.until - now:.3g} s more, then on trial"


def summary(backends: list[Backend], limit: int = 4) -> str:
    """`URL (pool): last probe result; ...` for a 503 message, at most `limit` backends named."""
    if not backends:  # discovery found none yet (its API or DNS unreachable, a pool at zero)
        return "no backend configured or discovered yet"
    parts = [f"{b.url} ({b.pool}): {b.state()}, {b.last_probe}" for b in backends[:limit]]
    if len(backends) > limit:
        parts.append(f"{len(backends) - limit} more on /ready")
    return "; ".join(parts)


def report(backends: list[Backend], now: float | None = None) -> dict[str, dict[str, str]]:
    """Each backend's pool, state (at `now`) and last probe result, for /ready and 503 bodies."""
    now = time.monotonic() if now is None else now
    return {b.url: {"pool": b.pool, "state": b.state(now), "last_probe": b.last_probe} for b in backends}


class HealthChecker:
    """Probes all backends every interval; `first_round` is set once every backend has been probed once."""

    def __init__(self, pools: Pools, settings: Settings, metrics: Metrics) -> None:
        self.pools = pools
        self.settings = settings
        self.client: upstream.Client | None = None
        self.metrics = metrics
        self.first_round = asyncio.Event()
        self._task: asyncio.Task | None = None
        # An explicit health_path is the user's choice: probe only that.
        self.fallback = "health_path" not in settings.model_fields_set and settings.health_path != FALLBACK_PATH

    async def _get(self, b: Backend, path: str) -> int:
        assert self.client is not None
        status, _ = await upstream.get(self.client, b.url, path, b.auth_headers)
        return status

    async def probe(self, b: Backend) -> None:
        s = self.settings
        st = _state(b)
        was = b.healthy
        path = st.path or s.health_path
        if path == FALLBACK_PATH and st.path is not None and b.inflight:
            # On the fallback, a backend serving our requests is not probed: llama-cpp-python's /v1/models waits
            # for the model lock (a timeout behind any long generation) and, with its default interrupt_requests,
            # cuts the running stream short. Its own answers are the evidence meanwhile (passive ejection).
            return
        try:
            async with asyncio.timeout(s.health_timeout):
                status = await self._get(b, path)
                result = f"GET {path} -> {status}"
                if status in _MISSING and self.fallback and path != FALLBACK_PATH:
                    missing, path = status, FALLBACK_PATH
                    status = await self._get(b, path)
                    result += f", GET {path} -> {status}"
                    if status == 200:
                        st.path = FALLBACK_PATH  # from now on only the fallback
                        result = f"GET {path} -> {status}"
                        if not st.fell_back:
                            st.fell_back = True
                            log.info("backend %s (%s) answers GET %s with %d: probing GET %s instead "
                                     "(set health_path to choose the path)", b.url, b.pool, s.health_path,
                                     missing, FALLBACK_PATH)
                elif status in _MISSING and st.path is not None:
                    st.path = None  # the fallback is gone too: back to the configured path next time
                ok = status == 200
        except upstream.ConnectFailed as exc:
            if upstream.is_local(exc):
                # Our own trouble (file descriptors, DNS) says nothing about the backend: no verdict.
                log.warning("health probe of %s not sent: %s", b.url, exc)
                self.metrics.health_probes.labels(b.url, Failure.LOCAL).inc()
                return
            # Refused counts like any failed probe: one refusal (a restart) must not take it out alone.
            b.last_probe = describe_connect(exc)
            b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, Failure.REFUSED).inc()
        except TimeoutError:
            b.last_probe = f"GET {path}: no answer within {s.health_timeout:g} s"
            b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, PROBE_FAILED).inc()
        except upstream.TRANSPORT_ERRORS as exc:
            b.last_probe = f"GET {path}: {exc or type(exc).__name__}"
            b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, PROBE_FAILED).inc()
        else:
            b.last_probe = result
            if ok:
                b.probe_ok(s.health_success_threshold)
            else:
                b.probe_failed(s.health_failure_threshold)
            self.metrics.health_probes.labels(b.url, PROBE_OK if ok else PROBE_FAILED).inc()
        self._say(b, st, was)
        if was and not b.healthy:
            self.pools.tick()  # it may have been the last routable one: ejected backends come back now

    def _say(self, b: Backend, st: ProbeState, was: bool) -> None:
        """Up: INFO once. Not up: WARNING after the first probe, on going down, and whenever the result changes,
        so a backend that never comes up is never silent and one that stays down does not repeat itself. A
        backend whose probe answers 200 but is not in rotation says why: too few good probes in a row yet, or
        an ejection by outlier detection (passive, from its answers) that has not run out."""
        ejection = _ejection(b)
        if b.healthy:
            if not was:
                if ejection:
                    log.info("backend %s (%s) health OK (%s) but not in rotation: %s", b.url, b.pool,
                             b.last_probe, ejection)
                else:
                    log.info("backend %s (%s) is now up", b.url, b.pool)
            st.logged = None
            return
        said = b.last_probe
        if b.successes:  # this probe answered 200: the success threshold is not reached yet
            said = (f"{b.last_probe}, health OK but {b.successes} of {self.settings.health_success_threshold} "
                    "good probes in a row so far" + (f"; {ejection}" if ejection else ""))
        # said again only when the result changes (not the ejection's seconds left)
        key = f"{b.last_probe} {b.successes} {bool(ejection)}" if b.successes else b.last_probe
        if st.logged == key:
            return
        if b.successes:
            how = "is not in rotation yet"
        elif was:
            how = "is now down"
        elif st.logged is None:
            how = "is not up"
        else:
            how = "is still down"
        log.warning("backend %s (%s) %s: %s", b.url, b.pool, how, said)
        st.logged = key

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


def no_backend(backends: list[Backend]) -> NoHealthyBackend:
    """The 503 for a request no backend can take (a pinned pool fails over, so none at all is routable), naming
    each backend's state and last probe result; both front ends answer it."""
    return NoHealthyBackend(f"no healthy backend: {summary(backends)}" if backends else "no healthy backend",
                            probes=report(backends))
