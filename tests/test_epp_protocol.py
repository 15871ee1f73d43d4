"""The endpoint picker's ext_proc protocol spoken directly over gRPC (what Envoy alone cannot show): the subset
hint, the header and the metadata naming the same endpoints in fallback order, the served endpoint moving the
lease, and a lease ending exactly once however the stream ends."""
from __future__ import annotations

import json

import pytest

from tests.fixtures_epp import EPP_SKIP, need_epp
from tests.fixtures_router import poll

pytestmark = [need_epp, pytest.mark.timeout(60)]

if EPP_SKIP is None:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from google.protobuf import struct_pb2

    from router.epp.decide import endpoint_of

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
BODY = json.dumps({**CHAT, "stream_options": {"include_usage": True}}).encode()
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'



def _headers(pairs: dict[str, str], end: bool = False, subset: list[str] | None = None):
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in pairs.items()]), end_of_stream=end))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


REQUEST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


def _body(data: bytes, end: bool = True):
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def _response_headers(served: str | None = None, status: int = 200):
    req = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")])))
    if served is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-served": served})
        req.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
    return req


def _response_body(data: bytes, end: bool = False):
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


class Call:
    """One ext_proc stream to the picker: send requests, read the answers."""

    def __init__(self, channel) -> None:
        self.call = pb_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, *reqs) -> None:
        for r in reqs:
            await self.call.write(r)

    async def read(self, n: int) -> list:
        return [await self.call.read() for _ in range(n)]


def _picked(resp) -> tuple[str, str]:
    """The endpoints of a request-headers answer: in the header and in the dynamic metadata."""
    header = {h.header.key: h.header.raw_value.decode() for h in
              resp.request_headers.response.header_mutation.set_headers}["x-gateway-destination-endpoint"]
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return header, meta.string_value


async def _three(sim_factory, epp_factory, **settings):
    sims = [await sim_factory("eagle3-tp8"), await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")]
    stack = await epp_factory(speculative=[sims[0].url, sims[1].url], baseline=[sims[2].url], envoy=False,
                              **settings)
    return [endpoint_of(s.url) for s in sims], stack


async def test_endpoints_in_header_and_metadata_alike_in_fallback_order(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory, epp_endpoints=3)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(BODY))
        head, body = await c.read(2)
        header, meta = _picked(head)
        assert header == meta
        got = header.split(",")
        # the first holds the lease; the other speculative backend before the baseline one
        assert sorted(got[:2]) == sorted(eps[:2]) and got[2] == eps[2]
        assert body.request_body.response.body_mutation.streamed_response.body == BODY
        assert body.request_body.response.body_mutation.streamed_response.end_of_stream
        assert sum(stack.inflight().values()) == 1
        c.call.cancel()
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_subset_hint_is_honoured(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        # the policy would pick speculative; the hint allows only the baseline backend
        c = Call(ch)
        await c.send(_headers(REQUEST, subset=[eps[2], "10.0.0.9:8000"]), _body(BODY))
        head, _ = await c.read(2)
        assert _picked(head) == (eps[2], eps[2])
        c.call.cancel()
        # nothing eligible in the hint (unknown endpoints, or an empty list): 503 at once
        for subset in (["10.0.0.9:8000"], []):
            c = Call(ch)
            await c.send(_headers(REQUEST, subset=subset), _body(BODY))
            (resp,) = await c.read(1)
            assert resp.immediate_response.status.code == 503
            assert json.loads(resp.immediate_response.body)["error"]["code"] == "no_healthy_backend"
            c.call.cancel()
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_response_stream_ends_the_lease_once_and_served_moves_it(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory, epp_endpoints=2)
    urls = {endpoint_of(u): u for u in stack.inflight()}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(BODY))
        head, _ = await c.read(2)
        first, second = _picked(head)[0].split(",")
        assert stack.inflight()[urls[first]] == 1
        # the data plane fell back to the second endpoint: the lease follows
        await c.send(_response_headers(served=second))
        (resp,) = await c.read(1)
        mutation = {h.header.key: h.header.raw_value.decode()
                    for h in resp.response_headers.response.header_mutation.set_headers}
        assert mutation["X-Router-Backend"] == urls[second]
        assert stack.inflight()[urls[first]] == 0 and stack.inflight()[urls[second]] == 1
        chunks = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', USAGE, b"data: [DONE]\n\n"]
        for i, chunk in enumerate(chunks):
            await c.send(_response_body(chunk, end=i == len(chunks) - 1))
            (echo,) = await c.read(1)
            streamed = echo.response_body.response.body_mutation.streamed_response
            assert streamed.body == chunk and streamed.end_of_stream == (i == len(chunks) - 1)
        assert not any(stack.inflight().values())
        # trailers after the end change nothing (the lease ended once)
        await c.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        await c.read(1)
        await c.call.done_writing()
    await poll(lambda: not stack.epp.processor.open, 5)
    assert not any(stack.inflight().values())


async def test_reset_before_the_answer_ends_the_lease(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(BODY[:10], end=False))
        await c.send(_body(BODY[10:]))
        await c.read(2)
        assert sum(stack.inflight().values()) == 1
        c.call.cancel()  # Envoy resets the stream: the client left before any answer
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)
    await poll(lambda: not stack.epp.processor.open, 5)


async def test_usage_asked_for_by_the_picker_is_read_and_kept_from_the_client(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory)
    bare = json.dumps(CHAT).encode()  # a stream without stream_options
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(bare))
        head, body = await c.read(2)
        sent = body.request_body.response.body_mutation.streamed_response.body
        assert json.loads(sent) == {**CHAT, "stream_options": {"include_usage": True}}
        mutation = {h.header.key: h.header.raw_value.decode()
                    for h in head.request_headers.response.header_mutation.set_headers}
        assert mutation["content-length"] == str(len(sent))
        await c.send(_response_headers())
        await c.read(1)
        # an event split across chunks goes on whole; the usage event does not go on
        token = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        out = b""
        for data, end in ((token[:10], False), (token[10:] + USAGE, False), (b"data: [DONE]\n\n", True)):
            await c.send(_response_body(data, end))
            (echo,) = await c.read(1)
            out += echo.response_body.response.body_mutation.streamed_response.body
        assert out == token + b"data: [DONE]\n\n"
        await c.call.done_writing()
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_body_over_the_limit_is_a_413_and_takes_no_lease(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory, max_body_bytes=64)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(b"x" * 40, end=False), _body(b"x" * 40, end=False))
        (resp,) = await c.read(1)
        assert resp.immediate_response.status.code == 413
        assert json.loads(resp.immediate_response.body)["error"]["type"]
        c.call.cancel()
    assert not any(stack.inflight().values())


async def test_drain_ends_the_leases_of_open_streams(sim_factory, epp_factory):
    eps, stack = await _three(sim_factory, epp_factory, drain_timeout=0.5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(BODY))
        await c.read(2)
        assert sum(stack.inflight().values()) == 1
        await stack.epp.stop()  # SIGTERM's drain: the open stream is cut after drain_timeout
    assert not any(stack.inflight().values())
    assert not stack.epp.processor.open


async def test_every_backend_at_its_limit_sheds_a_429_with_retry_after(sim_factory, epp_factory):
    # one place per backend: the policy's choice when full moves to a backend with room; none left: 429
    eps, stack = await _three(sim_factory, epp_factory, max_connections_per_backend=1, epp_endpoints=3)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        held = []
        for _ in range(3):
            c = Call(ch)
            await c.send(_headers(REQUEST), _body(BODY))
            head, _ = await c.read(2)
            held.append(_picked(head)[0].split(","))
        assert sorted(h[0] for h in held) == sorted(eps)
        assert held[0][1:] and not held[2][1:]  # a full backend is no fallback either
        assert sorted(stack.inflight().values()) == [1, 1, 1]
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(BODY))
        (resp,) = await c.read(1)
        shed = resp.immediate_response
        assert shed.status.code == 429
        headers = {h.header.key: h.header.raw_value.decode() for h in shed.headers.set_headers}
        assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
        err = json.loads(shed.body)["error"]
        assert err["code"] == "backends_at_capacity" and "max_connections_per_backend" in err["message"]
        assert sorted(stack.inflight().values()) == [1, 1, 1]  # the shed request holds nothing
        c.call.cancel()
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


def _failed_upstream(details: str, status: int = 503):
    """Envoy's own answer after a failed attempt: its status and the response.code_details attribute."""
    req = _response_headers(status=status)
    req.attributes["envoy.filters.http.ext_proc"].update({"response.code_details": details})
    return req


def _samples(text: str, name: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


@pytest.mark.parametrize(("details", "reason"), [
    ("upstream_reset_before_response_started{remote_connection_failure,delayed_connect_error:_111}", "refused"),
    ("upstream_reset_before_response_started{connection_termination}", "disconnected"),
    ("upstream_response_timeout", "first_byte_timeout"),
    ("via_upstream", "5xx"),
    ("no_healthy_upstream", None),  # Envoy never tried the backend: nothing counts against it
])
async def test_envoy_failure_details_eject_with_the_failure_name_and_metrics_scrape(sim_factory, epp_factory,
                                                                                    details, reason):
    import aiohttp

    eps, stack = await _three(sim_factory, epp_factory, eject_consecutive_errors=1, eject_base_seconds=30,
                              metrics_host="127.0.0.1", metrics_port=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        c = Call(ch)
        await c.send(_headers(REQUEST), _body(BODY))
        head, _ = await c.read(2)
        picked = {endpoint_of(u): u for u in stack.inflight()}[_picked(head)[0]]
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.epp.metrics_url + "/metrics") as r:
                assert r.status == 200
                during = await r.text()
            await c.send(_failed_upstream(details))
            await c.read(1)
            await c.send(_response_body(b"upstream connect error", end=True))
            await c.read(1)
            await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)
            async with http.get(stack.epp.metrics_url + "/metrics") as r:
                after = await r.text()
            async with http.get(stack.epp.metrics_url + "/nope") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        c.call.cancel()
    pool = next(b.pool for b in stack.epp.pools.backends if b.url == picked)
    key = (("backend", picked), ("pool", pool))
    assert _samples(during, "router_inflight_requests")[key] == 1
    assert sum(_samples(during, "router_route_decisions_total").values()) == 1
    assert _samples(during, "router_backend_up")[key] == 1
    ejections = _samples(after, "router_backend_ejections_total")
    if reason is None:
        assert _samples(after, "router_backend_up")[key] == 1 and sum(ejections.values()) == 0
        return
    assert _samples(after, "router_backend_up")[key] == 0
    assert ejections[(("backend", picked), ("pool", pool), ("reason", reason))] == 1
    assert sum(ejections.values()) == 1


async def test_load_signal_backend_polls_each_backends_own_load_as_in_serve(sim_factory, epp_factory):
    _, stack = await _three(sim_factory, epp_factory, load_signal="backend", load_interval=0.1)
    backends = stack.epp.pools.backends
    await poll(lambda: all(b.reported == 0 for b in backends), 5, lambda: [b.reported for b in backends])
    reg = stack.epp.metrics.registry
    assert all(reg.get_sample_value("router_backend_reported_load", {"pool": b.pool, "backend": b.url}) == 0
               for b in backends)
