"""`spec-router epp --epp-response-body none` behind a real Envoy (deploy/envoy/envoy-headers.yaml): the picker
sees the response headers and the end of the ext_proc stream only, and still ends every lease exactly once, at the
end of the HTTP stream (completion, client gone, backend gone); it learns what headers and that end tell."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import openai
import pytest

from tests.fixtures_epp import EPP_SKIP, need_epp
from tests.fixtures_router import poll, set_faults, sim_stats, wait_stats

pytestmark = [need_epp, pytest.mark.timeout(60)]

if EPP_SKIP is None:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

CHAT = {"model": "m", "messages": [{"role": "user", "content": "write a haiku about gateways"}], "max_tokens": 8}
NONE = {"epp_response_body": "none"}


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _observed(stack) -> list:
    """The observations the pools are told from now on (Pools.report_done), in order."""
    seen = []
    pools = stack.epp.pools
    report_done = pools.report_done
    pools.report_done = lambda b, obs, placement=None: (seen.append(obs), report_done(b, obs, placement))
    return seen


async def _two(sim_factory, epp_factory, **settings):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[spec.url], baseline=[base.url], **{**NONE, **settings})
    return spec, base, stack


async def test_sdk_not_streamed_routes_and_the_lease_ends_without_tokens(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    seen = _observed(stack)
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(**CHAT)
    assert raw.parse().choices[0].message.content
    assert (raw.headers["x-router-pool"], raw.headers["x-router-backend"]) == ("speculative", spec.url)
    assert (await sim_stats(spec.url))["completed_total"] == 1
    assert (await sim_stats(base.url))["requests_total"] == 0
    await poll(lambda: len(seen) == 1, 5, lambda: seen)
    assert not any(stack.inflight().values())
    (obs,) = seen
    # What the headers and the stream's end tell: backend, success, duration; no usage, no first token.
    assert obs.ok and obs.url == spec.url and obs.duration_s > 0
    assert (obs.ttft_s, obs.completion_tokens, obs.prompt_tokens, obs.data_events) == (None, None, None, 0)


@pytest.mark.parametrize("usage", [False, True])
async def test_sdk_streamed_holds_the_lease_to_the_end_and_usage_is_the_clients_own(sim_factory, epp_factory,
                                                                                      usage):
    # real-time simulator: the stream lasts long enough to look at the lease half-way
    spec = await sim_factory("eagle3-tp8", speedup=1.0)
    stack = await epp_factory(speculative=[spec.url], **NONE)
    seen = _observed(stack)
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    held = []
    async with _client(stack) as client:
        stream = await client.chat.completions.create(**CHAT, stream=True, **extra)
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            held.append(stack.inflight()[spec.url])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The picker cannot take a usage chunk out of a body it does not see, so it asks for none.
    assert any(c.usage is not None for c in chunks) == usage
    # Envoy keeps the ext_proc stream open until the HTTP stream ends: the lease is held throughout (the last
    # chunk's read may race the stream's end in this one event loop).
    assert len(held) > 2 and set(held[:-1]) == {1}, held
    await poll(lambda: len(seen) == 1, 5, lambda: seen)
    assert stack.inflight()[spec.url] == 0
    (obs,) = seen
    assert obs.ok and obs.ttft_s is None and obs.completion_tokens is None


async def test_client_leaving_mid_stream_ends_the_lease(sim_factory, epp_factory):
    spec = await sim_factory("eagle3-tp8", speedup=1.0)
    stack = await epp_factory(speculative=[spec.url], **NONE)
    seen = _observed(stack)
    async with aiohttp.ClientSession() as s:
        r = await s.post(stack.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2000, "stream": True})
        assert r.status == 200
        assert (await r.content.readany()).startswith(b"data:")
        await asyncio.sleep(0.2)
        assert stack.inflight()[spec.url] == 1
        r.close()
    await poll(lambda: stack.inflight()[spec.url] == 0, 10, stack.inflight)
    await poll(lambda: not stack.epp.processor.open, 5)
    await wait_stats(spec.url, lambda st: st["aborted_total"] == 1 and st["running"] == 0)
    # Without the body the picker cannot tell a client that left from a finished stream (docs/DEPLOY.md).
    assert [o.ok for o in seen] == [True]


async def test_backend_killed_mid_stream_ends_the_lease(sim_process_factory, epp_factory):
    sim = await sim_process_factory("eagle3-tp8", speedup=1.0)
    stack = await epp_factory(speculative=[sim.url], **NONE)
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions",
                                                    json={**CHAT, "max_tokens": 2000, "stream": True}) as r:
        assert r.status == 200
        await r.content.readany()
        assert stack.inflight()[sim.url] == 1
        sim.kill()
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(r.content.read(), 10)
    await poll(lambda: stack.inflight()[sim.url] == 0, 10, stack.inflight)
    await poll(lambda: not stack.epp.processor.open, 5)


async def test_backend_answering_5xx_is_still_ejected(sim_factory, epp_factory):
    # The status comes with the response headers, so outlier ejection works as with the body.
    a, b, stack = await _two(sim_factory, epp_factory, eject_consecutive_errors=2, eject_base_seconds=30)
    await set_faults(a.url, error_rate=1.0)
    served = []
    async with _client(stack) as client:
        for _ in range(5):
            try:
                raw = await client.chat.completions.with_raw_response.create(**CHAT)
                served.append(raw.headers["x-router-backend"])
            except openai.InternalServerError as err:
                served.append(err.status_code)
    assert served == [500, 500] + [b.url] * 3, served
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_adaptive_routes_but_learns_no_speeds_without_the_body(sim_factory, epp_factory):
    # What docs/DEPLOY.md says of the adaptive policy in this mode: its speed models take no sample (no tokens),
    # while the same requests with the body watched do feed them.
    learned = {}
    for mode in ("none", "stream"):
        spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
        stack = await epp_factory(speculative=[spec.url], baseline=[base.url], policy="adaptive",
                                  epp_response_body=mode)
        async with _client(stack) as client:
            for i in range(6):
                if i % 2:
                    await client.chat.completions.create(**CHAT)
                else:
                    async for _ in await client.chat.completions.create(**CHAT, stream=True):
                        pass
        await poll(lambda st=stack: not any(st.inflight().values()), 5, stack.inflight)
        ran = sum([(await sim_stats(u))["completed_total"] for u in (spec.url, base.url)])
        assert ran == 6
        learned[mode] = stack.epp.pools.policy.speeds.finished
    assert learned["none"] == 0 and learned["stream"] == 6, learned


@pytest.mark.parametrize("setting, envoy", [("stream", "none"), ("none", "stream")])
async def test_envoys_body_mode_wins_over_the_setting(sim_factory, epp_factory, caplog, setting, envoy):
    spec = await sim_factory("eagle3-tp8")
    stack = await epp_factory(speculative=[spec.url], epp_response_body=setting, envoy_config=envoy)
    seen = _observed(stack)
    caplog.set_level(logging.WARNING, logger="router.epp")
    async with _client(stack) as client:
        for _ in range(2):
            chunks = [c async for c in await client.chat.completions.create(**CHAT, stream=True)]
            assert chunks and all(c.usage is None for c in chunks)
    await poll(lambda: len(seen) == 2, 5, lambda: seen)
    assert all(o.ok for o in seen) and not any(stack.inflight().values())
    # read as Envoy sends it: a first token and usage only where the body came
    assert all((o.ttft_s is not None, o.completion_tokens is not None) == (envoy == "stream",) * 2 for o in seen)
    warned = [r.getMessage() for r in caplog.records if "epp_response_body" in r.getMessage()]
    assert len(warned) == 1 and f"epp_response_body is {setting}" in warned[0], warned


# ---- the protocol spoken directly: how a stream without the response body ends

def _request_headers(response_body_mode):
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
            response_body_mode=response_body_mode))


def _response_headers(status: int):
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")])))


@pytest.mark.parametrize("status, answered, ok", [(200, True, True), (503, True, False), (None, False, False)])
async def test_stream_end_ends_the_lease_by_the_status(sim_factory, epp_factory, status, answered, ok):
    sim = await sim_factory("eagle3-tp8")
    stack = await epp_factory(speculative=[sim.url], envoy=False, **NONE)
    seen = _observed(stack)
    body = json.dumps({**CHAT, "stream": True}).encode()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        await call.write(_request_headers(processing_mode_pb2.ProcessingMode.NONE))
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        head, sent = await call.read(), await call.read()
        assert head.HasField("request_headers")
        # no usage asked for: nothing could take the chunk out of the answer
        assert sent.request_body.response.body_mutation.streamed_response.body == body
        assert stack.inflight()[sim.url] == 1
        if answered:
            await call.write(_response_headers(status))
            await call.read()
            assert stack.inflight()[sim.url] == 1, "the headers do not end the lease: the stream's end does"
        await call.done_writing()  # Envoy closes the stream when the HTTP stream ends, however it ended
        await poll(lambda: stack.inflight()[sim.url] == 0, 5, stack.inflight)
    await poll(lambda: not stack.epp.processor.open, 5)
    assert [o.ok for o in seen] == [ok]


def test_the_headers_config_is_the_streaming_one_but_for_the_response_body():
    # The two Envoy configs stay one config: only the response body mode differs, and response trailers stay SEND
    # (with SKIP, Envoy closes the ext_proc stream at the response headers: the lease would end at the first byte).
    import yaml

    from tests.fixtures_epp import ENVOY_TEMPLATES

    def load(mode):
        text = ENVOY_TEMPLATES[mode].read_text().replace("${LISTEN_PORT}", "0").replace("${EPP_PORT}", "1")
        return yaml.safe_load(text.replace("${EPP_HOST}", "127.0.0.1"))

    def processing_mode(config):
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        return ext_proc["typed_config"]["processing_mode"]

    stream, none = load("stream"), load("none")
    assert processing_mode(stream)["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert processing_mode(none) == {**processing_mode(stream), "response_body_mode": "NONE"}
    assert processing_mode(none)["response_trailer_mode"] == "SEND"
    processing_mode(none)["response_body_mode"] = "FULL_DUPLEX_STREAMED"
    assert none == stream
