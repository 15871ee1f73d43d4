"""The router's own headers, read and written by both front ends (the proxy and the endpoint picker): the pool a
request pins, and which pool and backend served it."""
from __future__ import annotations

from router.errors import BadRequest
from router.policy import POOLS

POOL_HEADER = "X-Router-Pool"
BACKEND_HEADER = "X-Router-Backend"


def pinned_pool(value: str | None) -> str | None:
    """The pool an `X-Router-Pool` header value pins (case and spaces ignored); None when absent. A value naming no
    pool is the client's error (400 invalid_pool)."""
    if value is None:
        return None
    value = value.strip().lower()
    if value not in POOLS:
        raise BadRequest(f"{POOL_HEADER} must be one of {', '.join(POOLS)}", code="invalid_pool")
    return value
