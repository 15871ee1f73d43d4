"""The picker's decision seam without the network (router.epp.decide): the cap narrows the choice only when a
backend is at it, fallbacks are named only when asked for, and the open request keeps no copy of its body."""
from __future__ import annotations

import json

import pytest

from router.app import build_pools
from router.epp.decide import Decider, Overloaded, Pick, Request, endpoint_of
from router.settings import load_settings
from tests.fixtures_epp import need_epp

pytestmark = pytest.mark.timeout(30)

SPEC = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
BASE = ["http://10.0.1.1:8000"]
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


def _decider(endpoints: int = 1, cap: int = 1024, **settings) -> Decider:
    s = load_settings(None, {"speculative": ",".join(SPEC), "baseline": ",".join(BASE), **settings}, environ={})
    pools = build_pools(s)
    for b in pools.backends:
        b.healthy = True
    return Decider(pools, block_bytes=s.prefix_block_bytes, endpoints=endpoints, max_per_backend=cap)


def test_a_backend_at_the_cap_is_skipped_and_all_at_it_is_a_429():
    d = _decider(cap=1, threshold=100)
    picks = [d.decide(Request(BODY)) for _ in range(3)]
    assert all(isinstance(p, Pick) for p in picks)
    # spillover would keep the speculative pool (threshold 100); the cap moves the third to the baseline backend
    assert sorted(p.url for p in picks) == sorted(SPEC + BASE)
    assert isinstance(d.decide(Request(BODY)), Overloaded)
    picks[0].end(True)
    again = d.decide(Request(BODY))
    assert isinstance(again, Pick) and again.url == picks[0].url


@pytest.mark.parametrize("endpoints", [1, 2, 3, 5])
def test_fallbacks_are_the_same_pool_first_then_least_loaded(endpoints):
    d = _decider(endpoints=endpoints, threshold=100)
    busy = d.decide(Request(BODY))  # one request on a speculative backend: the other one is less loaded
    pick = d.decide(Request(BODY))
    assert isinstance(busy, Pick) and isinstance(pick, Pick)
    others = [u for u in SPEC if u != pick.url]
    order = [pick.url, *sorted(others, key=lambda u: u == busy.url), *BASE]
    assert pick.endpoints == [endpoint_of(u) for u in order][:endpoints]


@need_epp
def test_the_open_request_keeps_no_copy_of_its_body():
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from router.epp.server import Exchange

    ex = Exchange(_decider(), 1 << 20)
    ex.handle(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True)))
    assert ex.pick is not None and ex.pick.head is None and not ex.body
    ex.closed()
    assert ex.pick.ended
