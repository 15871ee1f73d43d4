"""GET /router/state: what the router knows of its backends and what its policy has learned, as JSON."""
from __future__ import annotations

from aiohttp import web

from router.state import STATE


async def state_handler(request: web.Request) -> web.Response:
    st = request.app[STATE]
    pools = st.pools
    policy = pools.policy
    backends = [{"url": b.url, "pool": b.pool, "healthy": b.healthy, "routable": b.routable,
                 "inflight": b.inflight,
                 "reported_load": b.reported, "load": b.load_estimate} for b in pools.backends]
    aff = pools.affinity
    if aff is not None:
        for entry in backends:
            entry["prefix_blocks"] = aff.index.size(entry["url"])
            entry["prefix_capacity_blocks"] = aff.capacity_of(entry["url"])
    body: dict = {"policy": policy.name, "backends": backends}
    if aff is not None:
        body["prefix"] = aff.state()
    model = policy.state(pools.view)
    if model is not None:
        body["model"] = model
    return web.json_response(body)
