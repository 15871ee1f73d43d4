"""The router's own headers, read and written by both front ends (the proxy and the endpoint picker): the pool a
request pins, its latency targets, which pool and backend served it and the latency predicted there."""
from __future__ import annotations

from router.errors import BadRequest
from router.policy import POOLS

POOL_HEADER = "X-Router-Pool"
BACKEND_HEADER = "X-Router-Backend"
# Latency targets a request asks for, in milliseconds (llm-d's names; router.slo), and what the router predicted
# for the backend it chose (answers to requests with targets; the endpoint picker also tells the backend).
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
PREDICTED_TTFT_HEADER = "X-Router-Predicted-TTFT-Ms"
PREDICTED_TPOT_HEADER = "X-Router-Predicted-TPOT-Ms"


def predicted_headers(forecast) -> dict[str, str]:
    """The prediction of a request with targets (router.core.latency.Forecast) as response headers, in ms."""
    return {PREDICTED_TTFT_HEADER: f"{forecast.ttft_s * 1000:.3f}", PREDICTED_TPOT_HEADER: f"{forecast.tpot_s * 1000:.3f}"}


def pinned_pool(value: str | None) -> str | None:
    """The pool an `X-Router-Pool` header value pins (case and spaces ignored); None when absent. A value naming no
    pool is the client's error (400 invalid_pool)."""
    if value is None:
        return None
    value = value.strip().lower()
    if value not in POOLS:
        raise BadRequest(f"{POOL_HEADER} must be one of {', '.join(POOLS)}", code="invalid_pool")
    return value
