"""The router's error hierarchy and the one middleware that renders every router-made error as OpenAI-style JSON."""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum

from aiohttp import web

log = logging.getLogger("router")


class RouterError(Exception):
    """An error the router answers itself: status, OpenAI `type` and `code`, and a message."""

    status = 500
    type = "internal_error"
    code = "internal_error"
    param: str | None = None  # the request parameter at fault (OpenAI's `param`), shown when set
    retry_after_s: int | None = None  # a shed request's Retry-After, seconds (429s)

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "code": self.code}
        if self.param is not None:
            err["param"] = self.param
        return {"error": err}


class BadRequest(RouterError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(RouterError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class NotFound(RouterError):
    status, type, code = 404, "not_found_error", "not_found"


class MethodNotAllowed(RouterError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    def __init__(self, message: str, *, allow: str = "") -> None:
        super().__init__(message)
        self.allow = allow


class RequestTimeout(RouterError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class ExpectationFailed(RouterError):
    status, type, code = 417, "invalid_request_error", "expectation_failed"


class PayloadTooLarge(RouterError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class TargetsUnmet(RouterError):
    """A sheddable request (service tier `flex`, or any tier marked sheddable) whose latency targets no backend can
    meet now: 429 with Retry-After (the predicted wait, router.core.latency), the client's cue to come back."""

    status, type, code = 429, "rate_limit_error", "latency_targets_unmet"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoHealthyBackend(RouterError):
    status, type, code = 503, "service_unavailable", "no_healthy_backend"

    def __init__(self, message: str, *, probes: dict | None = None) -> None:
        super().__init__(message)
        self.probes = probes  # per backend: pool, state, last probe result (router.health.report)

    def body(self) -> dict:
        body = super().body()
        if self.probes is not None:
            body["probes"] = self.probes
        return body


class ShuttingDown(RouterError):
    status, type, code = 503, "service_unavailable", "router_shutting_down"


class Failure(StrEnum):
    """How one upstream attempt failed: the one set of failure names. The exchange reports it as the attempt's
    outcome (router.observe.Attempt), router.outlier judges it (LOCAL is ours, never the backend's), it labels
    router_backend_ejections_total, and a health probe that failed to connect counts as REFUSED or LOCAL."""

    REFUSED = "refused"
    CONNECT_TIMEOUT = "connect_timeout"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    DISCONNECTED = "disconnected"
    LOCAL = "local"


# A health probe's other outcomes (router_health_probes_total's result label, with Failure.REFUSED and LOCAL).
PROBE_OK, PROBE_FAILED = "ok", "failed"


# router_upstream_errors_total's `kind` label of each failure: its name, but for refusals and disconnects the older
# names `connect` and `disconnect`, kept for dashboards. The one other kind: a failure the router could not
# classify (UNCLASSIFIED), and a retried 502/503 answer (status_kind).
ERROR_KINDS: dict[Failure, str] = {**{f: f.value for f in Failure},
                                   Failure.REFUSED: "connect", Failure.DISCONNECTED: "disconnect"}
UNCLASSIFIED = "error"


def status_kind(status: int) -> str:
    """The kind label of an answer retried for its status (502, 503)."""
    return f"status_{status}"


class UpstreamError(RouterError):
    """A backend failed at transport level. `failure`: what the attempt's outcome was (Failure); `kind`: its
    router_upstream_errors_total label (ERROR_KINDS; UNCLASSIFIED for this class itself, which the learning
    seam sees as a disconnect)."""

    status, type, code = 502, "upstream_error", "bad_gateway"
    failure = Failure.DISCONNECTED
    classified = False
    retryable = False

    @property
    def kind(self) -> str:
        return ERROR_KINDS[self.failure] if self.classified else UNCLASSIFIED


class UpstreamConnectError(UpstreamError):
    code, failure, classified, retryable = "backend_unreachable", Failure.REFUSED, True, True


class UpstreamLocalError(UpstreamError):
    """The router itself could not open the connection (out of file descriptors or ports, DNS): not the
    backend's fault, so it never counts against the backend."""

    status, type, code, failure, classified, retryable = (503, "service_unavailable", "router_local_error",
                                                          Failure.LOCAL, True, True)


class UpstreamDisconnected(UpstreamError):
    code, failure, classified = "backend_disconnected", Failure.DISCONNECTED, True


class UpstreamTimeout(UpstreamError):
    status, type, code = 504, "timeout_error", "upstream_timeout"
    classified = True

    def __init__(self, message: str, *, failure: Failure) -> None:
        super().__init__(message)
        self.failure = failure  # CONNECT_TIMEOUT | FIRST_BYTE_TIMEOUT | IDLE_TIMEOUT

    @classmethod
    def silent(cls, backend: str, failure: Failure) -> UpstreamTimeout:
        """The backend sent no first byte (FIRST_BYTE_TIMEOUT) or no next chunk (IDLE_TIMEOUT) within its deadline."""
        what = "next chunk" if failure == Failure.IDLE_TIMEOUT else "first byte"
        return cls(f"backend {backend} sent no {what} in time", failure=failure)


def error_response(err: RouterError, headers: dict[str, str] | None = None) -> web.Response:
    if err.retry_after_s is not None:
        headers = {**(headers or {}), "Retry-After": str(err.retry_after_s)}
    resp = web.Response(status=err.status, text=json.dumps(err.body()), content_type="application/json",
                        headers=headers)
    if err.status in (408, 413):
        # The rest of the body may never come (408) or is not wanted (413): close rather than wait for it.
        resp.force_close()
    return resp


def sse_error_event(err: RouterError) -> bytes:
    """What a client sees when a stream that has started fails: an error event, then [DONE]."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"


_HTTP_MAP: dict[int, type[RouterError]] = {
    400: BadRequest, 404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge,
}


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:
        return translate(request, exc)


def translate(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The answer for an exception a handler raised (called from an `except` block); re-raises what is not ours
    to answer (a client that went away, a redirect)."""
    if isinstance(exc, RouterError):
        allow = getattr(exc, "allow", "")
        return error_response(exc, {"Allow": allow} if allow else None)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        cls = _HTTP_MAP.get(exc.status)
        if cls is None:
            err: RouterError = RouterError(exc.reason)
            err.status, err.type, err.code = exc.status, "invalid_request_error", exc.reason.lower().replace(" ", "_")
        elif cls is NotFound:
            err = NotFound(f"no route for {request.path_qs[:200]!r}; the router serves only /v1/chat/completions, "
                           "/v1/completions, /v1/models, /health, /ready, /metrics and /router/state")
        elif cls is MethodNotAllowed:
            err = MethodNotAllowed(f"method {request.method} not allowed on {request.path[:200]}")
        elif cls is PayloadTooLarge:
            err = PayloadTooLarge("request body is larger than the configured limit")
        else:
            err = cls(exc.text or exc.reason)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(err, headers)
    if isinstance(exc, ConnectionError):
        raise exc
    log.exception("unhandled error for %s %s", request.method, request.path[:200])
    return error_response(RouterError("internal router error"))
