"""`spec-router epp` behind a real Envoy: the OpenAI SDK through Envoy reaches the backend the picker chose, and
every lease the picker takes ends exactly once."""
from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.fixtures_epp import error_of, need_epp
from tests.fixtures_router import poll, set_faults, sim_stats, wait_stats

pytestmark = [need_epp, pytest.mark.timeout(60)]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "write a haiku about gateways"}], "max_tokens": 8}


async def _two(sim_factory, epp_factory, **settings):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[spec.url], baseline=[base.url], **settings)
    return spec, base, stack


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_sdk_not_streamed_reaches_the_picked_backend(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(**CHAT)
    reply = raw.parse()
    assert reply.choices[0].message.content
    # spillover, idle: the speculative pool, and the backend that answered is the one the picker named
    assert raw.headers["x-router-pool"] == "speculative"
    assert raw.headers["x-router-backend"] == spec.url
    assert (await sim_stats(spec.url))["completed_total"] == 1
    assert (await sim_stats(base.url))["requests_total"] == 0
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_sdk_streamed_reaches_the_picked_backend_and_the_lease_ends(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(
            **CHAT, stream=True, stream_options={"include_usage": True})
        assert raw.headers["x-router-backend"] == spec.url
        text, usage = "", None
        async for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
    assert text and usage is not None and usage.completion_tokens > 0
    assert (await sim_stats(spec.url))["completed_total"] == 1
    assert (await sim_stats(base.url))["requests_total"] == 0
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_pin_header_picks_the_pool(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(
            **CHAT, extra_headers={"X-Router-Pool": "baseline"})
        assert raw.headers["x-router-backend"] == base.url
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(**CHAT, extra_headers={"X-Router-Pool": "fastest"})
    assert bad.value.body["code"] == "invalid_pool"
    assert (await sim_stats(base.url))["completed_total"] == 1
    assert (await sim_stats(spec.url))["requests_total"] == 0


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
async def test_unparsable_body_is_an_openai_400_and_reaches_no_backend(sim_factory, epp_factory, body):
    spec, base, stack = await _two(sim_factory, epp_factory)
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions", data=body,
                                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400, await r.text()
        assert r.content_type == "application/json"
        err = error_of(await r.text())
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert "x-gateway-destination-endpoint" not in r.headers
    for url in (spec.url, base.url):
        assert (await sim_stats(url))["requests_total"] == 0
    assert not any(stack.inflight().values())


async def test_nothing_ready_is_a_503(epp_factory, unused_tcp_port):
    stack = await epp_factory(baseline=[f"http://127.0.0.1:{unused_tcp_port}"])
    async with _client(stack) as client:
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(**CHAT)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "no_healthy_backend"


async def test_client_leaving_mid_stream_ends_the_lease(sim_factory, epp_factory):
    # slow enough that the stream is still running when the client leaves
    spec = await sim_factory("eagle3-tp8", speedup=1.0)
    stack = await epp_factory(speculative=[spec.url])
    body = {**CHAT, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(stack.url + "/v1/chat/completions", json=body)
        assert r.status == 200
        first = await r.content.readany()
        assert first.startswith(b"data:")
        assert stack.inflight()[spec.url] == 1
        r.close()  # the client goes away mid-stream
    await poll(lambda: stack.inflight()[spec.url] == 0, 10, stack.inflight)
    await poll(lambda: not stack.epp.processor.open, 5)
    # Envoy reset the upstream stream too: the backend aborted the request
    await wait_stats(spec.url, lambda st: st["aborted_total"] == 1 and st["running"] == 0)


async def test_health_services_answer(epp_factory, sim_factory):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    spec = await sim_factory("eagle3-tp8")
    stack = await epp_factory(speculative=[spec.url], envoy=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            got = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_cli_epp_prints_its_port_and_drains_on_sigterm(tmp_path):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "router", "epp", "--baseline", "http://127.0.0.1:1",
                             "--epp-port", "0", "--drain-timeout", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        assert int(line.rsplit(":", 1)[1]) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("port_in_use", [False, True])
def test_cli_epp_bad_flag_or_port_in_use_is_one_line_exit_2(port_in_use):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1] if port_in_use else 99999
        res = subprocess.run([sys.executable, "-m", "router", "epp", "--epp-port", str(port),
                              "--baseline", "http://127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spec-router: error:"), res.stderr
    if port_in_use:
        assert f"cannot listen on 127.0.0.1:{port}" in lines[0]


async def test_stream_without_usage_asked_reports_usage_to_the_pools_not_the_client(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    seen = []
    report_done = stack.epp.pools.report_done
    stack.epp.pools.report_done = lambda b, obs, placement=None: (seen.append(obs), report_done(b, obs, placement))
    async with _client(stack) as client:
        stream = await client.chat.completions.create(**CHAT, stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (obs,) = seen
    assert obs.ok and obs.url == spec.url and obs.ttft_s is not None
    assert obs.completion_tokens and obs.completion_tokens > 0 and obs.prompt_tokens


async def test_backend_answering_5xx_is_ejected_and_traffic_moves(sim_factory, epp_factory):
    # spillover sends everything to the (idle) speculative backend until it is ejected
    a, b = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[a.url], baseline=[b.url], eject_consecutive_errors=2,
                              eject_base_seconds=30)
    await set_faults(a.url, error_rate=1.0)
    served = []
    async with _client(stack) as client:
        for _ in range(6):
            try:
                raw = await client.chat.completions.with_raw_response.create(**CHAT)
                served.append(raw.headers["x-router-backend"])
            except openai.InternalServerError as err:
                assert err.status_code == 500
                served.append("500")
    # two 500s eject it; then every request goes to the healthy backend
    assert served == ["500", "500"] + [b.url] * 4, served
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_backends_from_dns_discovery_as_in_serve(sim_factory, epp_factory):
    sim = await sim_factory("baseline-tp8")
    port = int(sim.url.rsplit(":", 1)[1])

    async def resolver(host: str, port_: int) -> list[tuple[str, int]]:
        assert host == "sims.example"
        return [("127.0.0.1", port)]

    stack = await epp_factory(baseline=[f"http://sims.example:{port}"], discovery="dns", resolver=resolver)
    assert list(stack.inflight()) == [sim.url]
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(**CHAT)
    assert raw.headers["x-router-backend"] == sim.url


async def test_client_cannot_steer_with_the_destination_header(sim_factory, epp_factory):
    spec, base, stack = await _two(sim_factory, epp_factory)
    base_endpoint = base.url.removeprefix("http://")
    async with _client(stack) as client:
        raw = await client.chat.completions.with_raw_response.create(
            **CHAT, extra_headers={"x-gateway-destination-endpoint": base_endpoint})
    assert raw.headers["x-router-backend"] == spec.url
    assert (await sim_stats(base.url))["requests_total"] == 0


async def test_backend_refusing_connections_is_ejected_as_refused(sim_factory, epp_factory):
    # The probes (every 30 s) still call the closed backend up: Envoy's own 503 after the refused connection is
    # what ejects it, under Envoy's failure name, and the next request goes to the other backend.
    a, b = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[a.url], baseline=[b.url], eject_consecutive_errors=1,
                              eject_base_seconds=30, health_interval=30)
    await a.close()
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            first = r.status, await r.text()
        async with http.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            second = r.status, r.headers.get("x-router-backend")
    assert first[0] == 503, first
    assert second == (200, b.url)
    ejected = stack.epp.pools.backends[0]
    assert ejected.url == a.url and ejected.state() == "ejected"
    key = ("speculative", a.url, "refused")
    assert stack.epp.metrics.registry.get_sample_value(
        "router_backend_ejections_total", dict(zip(("pool", "backend", "reason"), key, strict=True))) == 1
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


async def test_every_backend_full_is_a_429_the_sdk_reads_as_rate_limited(sim_factory, epp_factory):
    a, b = await sim_factory("eagle3-tp8", speedup=1.0), await sim_factory("baseline-tp8", speedup=1.0)
    stack = await epp_factory(speculative=[a.url], baseline=[b.url], max_connections_per_backend=1)
    long = {**CHAT, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as http:
        held = []
        try:
            for _ in range(2):
                r = await http.post(stack.url + "/v1/chat/completions", json=long)
                held.append(r)
                assert r.status == 200
                await r.content.readline()  # its first chunk: the stream runs
            assert sorted(stack.inflight().values()) == [1, 1]
            async with _client(stack) as client:
                with pytest.raises(openai.RateLimitError) as err:
                    await client.chat.completions.create(**CHAT)
            assert err.value.response.headers["retry-after"] == "1"
            assert err.value.body["code"] == "backends_at_capacity"
        finally:
            for r in held:
                r.close()
    await poll(lambda: not any(stack.inflight().values()), 10, stack.inflight)


@pytest.mark.parametrize("failure_mode_allow", [False, True])
async def test_picker_gone_is_a_500_from_envoy_either_way(sim_factory, epp_factory, failure_mode_allow):
    # What docs/DEPLOY.md says: with both bodies FULL_DUPLEX_STREAMED, Envoy 1.40 does not fail open; a picker
    # it cannot reach is a 500 with an empty body (details ext_proc_error_gRPC_error_14), never an unrouted request.
    a = await sim_factory("eagle3-tp8")
    stack = await epp_factory(speculative=[a.url], failure_mode_allow=failure_mode_allow)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        await stack.epp.stop()
        async with http.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            assert (r.status, await r.read()) == (500, b"")
    assert (await sim_stats(a.url))["requests_total"] == 1, "the request after the picker died reached no backend"


async def test_plain_envoy_cannot_use_a_list_of_endpoints(sim_factory, epp_factory):
    # The limitation docs/DEPLOY.md states: Envoy's ORIGINAL_DST cluster reads one address, so `ip:port,ip:port`
    # is "no healthy upstream"; keep epp_endpoints 1 with plain Envoy. Envoy never tried the backend, so
    # nothing counts against it.
    a, b = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    stack = await epp_factory(speculative=[a.url], baseline=[b.url], epp_endpoints=2, eject_consecutive_errors=1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            assert (r.status, await r.text()) == (503, "no healthy upstream")
    assert [b.state() for b in stack.epp.pools.backends] == ["up", "up"]
    assert (await sim_stats(a.url))["requests_total"] == (await sim_stats(b.url))["requests_total"] == 0
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


def test_cli_epp_metrics_port_in_use_is_one_line_exit_2():
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "router", "epp", "--epp-port", "0", "--metrics-host", "127.0.0.1",
                              "--metrics-port", str(port), "--baseline", "http://127.0.0.1:1"],
                             capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"spec-router: error: cannot listen on 127.0.0.1:{port}: "), lines
