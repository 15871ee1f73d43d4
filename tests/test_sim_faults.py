"""Each simulator fault, switched at start-up or through /_sim/faults, does what it says and is counted."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}
STREAM = {**CHAT, "stream": True}


async def counted(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as s, s.get(url + "/_sim/stats") as r:
        return (await r.json())["faults_injected"]


async def metric(url: str, kind: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    line = next(ln for ln in text.splitlines() if ln.startswith(f'sim_faults_injected_total{{kind="{kind}"}}'))
    return float(line.rsplit(" ", 1)[1])


async def set_faults(url: str, **faults) -> dict:
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/faults", json=faults) as r:
        assert r.status == 200
        return await r.json()


@pytest.mark.parametrize("status", [500, 503])
async def test_error_rate_answers_errors(sim_factory, sglang_protocol, status):
    sim = await sim_factory(speedup=500, faults={"error_rate": 1.0, "error_status": status})
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(**CHAT)
    finally:
        await client.close()
    assert info.value.status_code == status
    body = info.value.response.text
    assert sglang_protocol.ErrorResponse.model_validate_json(body).model_dump_json() == body
    assert await counted(sim.url) == {"error": 1}
    assert await metric(sim.url, "error") == 1.0


async def test_error_rate_is_a_fraction(sim_factory):
    sim = await sim_factory(speedup=1000, seed=3, faults={"error_rate": 0.5})
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            async with s.post(sim.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}) as r:
                statuses.append(r.status)
    assert set(statuses) == {200, 500}
    assert (await counted(sim.url))["error"] == statuses.count(500)


async def test_hang_sends_nothing(sim_factory):
    sim = await sim_factory(speedup=500, faults={"hang": True})
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        with pytest.raises(TimeoutError):
            async with s.post(sim.url + "/v1/chat/completions", json=STREAM) as r:
                await r.read()
    assert await counted(sim.url) == {"hang": 1}
    assert sim.engine.requests_total == 0


async def test_stall_after_chunks(sim_factory):
    sim = await sim_factory(speedup=500, faults={"stall_after_chunks": 3})
    got = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(sock_read=1.0)) as s:
        async with s.post(sim.url + "/v1/chat/completions", json=STREAM) as r:
            assert r.status == 200
            with pytest.raises(TimeoutError):
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(line)
    assert len(got) == 3
    assert (await counted(sim.url))["stall"] == 1


async def test_drop_after_chunks(sim_factory):
    sim = await sim_factory(speedup=500)
    await set_faults(sim.url, drop_after_chunks=2)
    got = []
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(sim.url + "/v1/chat/completions", json=STREAM) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(line)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with s.post(sim.url + "/v1/chat/completions", json=CHAT) as r:
                await r.read()
    assert len(got) == 2
    assert (await counted(sim.url))["drop"] == 2
    for _ in range(100):  # the dropped requests' slots are freed
        if sim.engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.num_running == 0


async def test_slow_and_failing_health(sim_factory):
    sim = await sim_factory(speedup=500)
    await set_faults(sim.url, health_delay=5.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        with pytest.raises(TimeoutError):
            async with s.get(sim.url + "/health") as r:
                await r.read()
    await set_faults(sim.url, health_delay=0.0, health_status=503)
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/health") as r:
        assert r.status == 503
    faults = await counted(sim.url)
    assert faults["health_delay"] == 1 and faults["health_status"] == 1
    async with aiohttp.ClientSession() as s:
        async with s.delete(sim.url + "/_sim/faults") as r:
            assert (await r.json())["health_status"] is None
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200


async def test_refuse_connections_then_accept_again(sim_factory):
    sim = await sim_factory(speedup=500)
    port = sim.port
    await set_faults(sim.url, refuse_for=0.6)
    refused = False
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            try:
                async with s.get(sim.url + "/health", headers={"Connection": "close"}) as r:
                    await r.read()
            except aiohttp.ClientConnectorError:
                refused = True
                break
            await asyncio.sleep(0.01)
        assert refused
        for _ in range(300):
            try:
                async with s.get(sim.url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.02)
        else:
            pytest.fail("the simulator did not listen again")
    assert sim.port == port
    assert (await counted(sim.url))["refuse"] == 1
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/_sim/faults") as r:
        assert (await r.json())["refuse_for"] == 0.0


async def test_stop_and_start_listener(sim_factory):
    sim = await sim_factory(speedup=500)
    await sim.stop_listener()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectorError):
            await s.get(sim.url + "/health")
        await sim.start_listener()
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200


async def test_admin_endpoint_validates(sim_factory):
    sim = await sim_factory(speedup=500)
    async with aiohttp.ClientSession() as s:
        for bad in ({"error_rate": 2}, {"error_status": 404}, {"nope": 1}, [1]):
            async with s.post(sim.url + "/_sim/faults", json=bad) as r:
                assert r.status == 400
                err = await r.json()
                assert err["object"] == "error" and err["code"] == 400
        async with s.post(sim.url + "/_sim/faults", data="{", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        merged = await set_faults(sim.url, error_rate=0.25)
        merged = await set_faults(sim.url, hang=True)
        assert merged["error_rate"] == 0.25 and merged["hang"] is True  # partial updates merge
        async with s.get(sim.url + "/_sim/stats") as r:
            stats = await r.json()
        assert set(stats) == {"running", "queued", "requests_total", "completed_total", "aborted_total",
                              "faults_injected", "max_total_tokens", "busy_s", "gpu_wait_s", "gpu_switches",
                              "colocated_with", "drift", "drift_changes", "prompt_tokens_total",
                              "cached_tokens_total", "cache_hit_ratio", "radix_cache", "reserved_tokens",
                              "draft_steps", "adaptive"}
        assert stats["colocated_with"] == [] and stats["gpu_wait_s"] == 0
        assert stats["adaptive"] is None and stats["draft_steps"] == 0  # a baseline server: no adaptive controller


async def test_startup_flags_in_a_subprocess(sim_process_factory):
    proc = await sim_process_factory(speedup=500, error_rate=1.0, error_status=503)
    async with aiohttp.ClientSession() as s:
        async with s.post(proc.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503
            assert json.loads(await r.text())["code"] == 503
    assert proc.terminate() == 0  # SIGTERM stops it gracefully


async def test_sigkill_leaves_nothing_listening(sim_process_factory):
    proc = await sim_process_factory(speedup=500)
    proc.kill()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectorError):
            await s.get(proc.url + "/health")


async def test_speedup_can_change_at_run_time(sim_factory):
    sim = await sim_factory(speedup=5)
    async with aiohttp.ClientSession() as s:
        for bad in ({"speedup": 0}, {"speedup": "x"}, {}):
            async with s.post(sim.url + "/_sim/speedup", json=bad) as r:
                assert r.status == 400
        async with s.post(sim.url + "/_sim/speedup", json={"speedup": 400}) as r:
            assert (await r.json()) == {"speedup": 400.0}
        async with s.get(sim.url + "/server_info") as r:
            assert (await r.json())["simulator_speedup"] == 400.0
        async with s.post(sim.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
