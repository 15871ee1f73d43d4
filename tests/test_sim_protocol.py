"""The simulator speaks SGLang 0.5.23's wire format: every shape checked against SGLang's own models and encoders."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest

from bench.sim.profiles import load_profile

HEX32 = re.compile(r"^[0-9a-f]{32}$")
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "Why is the sky blue?"}]}


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The raw `data:` payloads of an SSE body, in order."""
    body = (await resp.read()).decode()
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def redump(model_cls, raw: str, **kw) -> str:
    """Parse with SGLang's pydantic model and serialise as SGLang does; equal bytes = same shape, no extras."""
    return model_cls.model_validate_json(raw).model_dump_json(**kw)


async def post(url: str, path: str, body: dict | str, content_type: str = "application/json"):
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, str) else json.dumps(body)
        async with s.post(url + path, data=data, headers={"Content-Type": content_type}) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


async def test_chat_non_streaming_matches_sglang_model(sim_factory, sglang_protocol):
    sim = await sim_factory(speedup=500)
    status, ctype, text = await post(sim.url, "/v1/chat/completions", {**CHAT, "max_tokens": 12})
    assert status == 200 and ctype.startswith("application/json")
    assert redump(sglang_protocol.ChatCompletionResponse, text, by_alias=True) == text
    data = json.loads(text)
    assert HEX32.match(data["id"]) and data["model"] == "my-model"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 12
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 12


async def test_chat_stream_chunks_are_sglangs_bytes(sim_factory, sglang_protocol, sglang_sse_utils):
    sim = await sim_factory("eagle3-tp8", speedup=500)
    body = {**CHAT, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first, *middle, finish, usage = chunks
    rid, created = first["id"], first["created"]
    assert HEX32.match(rid)
    assert all(c["id"] == rid and c["created"] == created and c["model"] == "my-model" for c in chunks)
    build = sglang_sse_utils.build_sse_content
    # role chunk, content chunks and finish chunk: the exact bytes SGLang's msgspec encoder writes
    assert f"data: {events[0]}\n\n" == build(rid, created, "my-model", 0, role="assistant", content="")
    for raw, c in zip(events[1:-3], middle, strict=True):
        assert f"data: {raw}\n\n" == build(rid, created, "my-model", 0, content=c["choices"][0]["delta"]["content"])
    assert f"data: {events[-3]}\n\n" == build(rid, created, "my-model", 0, finish_reason="length")
    # the usage chunk goes through pydantic in SGLang
    assert redump(sglang_protocol.ChatCompletionStreamResponse, events[-2]) == events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 40
    for raw in events[:-1]:
        sglang_protocol.ChatCompletionStreamResponse.model_validate_json(raw)
    # EAGLE: some decode steps carry several accepted tokens, so fewer content chunks than tokens
    assert len(middle) < 40
    assert max(len(c["choices"][0]["delta"]["content"].split()) for c in middle) > 1


async def test_completions_shapes(sim_factory, sglang_protocol):
    sim = await sim_factory(speedup=500)
    status, _, text = await post(sim.url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 7})
    assert status == 200
    assert redump(sglang_protocol.CompletionResponse, text, by_alias=True) == text
    body = {"prompt": "Once upon a time", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json=body) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    for raw in events[:-2]:
        assert redump(sglang_protocol.CompletionStreamResponse, raw) == raw
    chunks = [json.loads(e) for e in events[:-2]]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert redump(sglang_protocol.CompletionStreamResponse, events[-2], exclude_none=True) == events[-2]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 7
    whole = json.loads(text)["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


async def test_openai_sdk_async_and_sync(sim_factory):
    sim = await sim_factory("eagle3-tp8", speedup=500)
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    try:
        whole = await client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=30)
        stream = await client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=30,
                                                      stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        comp = await client.completions.create(model="m", prompt="hello", max_tokens=5)
    finally:
        await client.close()
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens == 30
    assert comp.usage.completion_tokens == 5 and comp.choices[0].finish_reason == "length"


async def test_openai_sdk_sync(sim_process_factory):
    # the server runs in its own process, so the blocking client may hold this loop (no threads: CPython
    # 3.11's parser is not safe against pytest rewriting imports in another thread at the same time)
    proc = await sim_process_factory("eagle3-tp8", speedup=500)
    with openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=30)
        streamed = client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=30,
                                                  stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        comp = client.completions.create(model="m", prompt="hello", max_tokens=5, stream=True)
        comp_text = "".join(c.choices[0].text for c in comp if c.choices)
    assert text == whole.choices[0].message.content and whole.usage.completion_tokens == 30
    assert len(comp_text.split()) >= 1


async def test_output_is_deterministic_per_prompt_and_seed(sim_factory):
    a = await sim_factory(speedup=500, seed=1)
    b = await sim_factory(speedup=500, seed=1)
    c = await sim_factory(speedup=500, seed=2)

    async def text(url: str, prompt: str, **extra) -> str:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 20, **extra}
        return json.loads((await post(url, "/v1/chat/completions", body))[2])["choices"][0]["message"]["content"]

    assert await text(a.url, "x") == await text(b.url, "x")
    assert await text(a.url, "x") != await text(c.url, "x")
    assert await text(a.url, "x") != await text(a.url, "y")
    assert await text(a.url, "x", seed=2) == await text(c.url, "x")  # a request's seed wins


async def test_stop_eos_and_ignore_eos(sim_factory):
    profile = load_profile("baseline-tp8").model_copy(update={"natural_output_tokens": (8, 12)})
    sim = await sim_factory(profile, speedup=500)

    async def chat(**extra) -> dict:
        return json.loads((await post(sim.url, "/v1/chat/completions", {**CHAT, **extra}))[2])

    natural = await chat()
    choice = natural["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == profile.eos_token_id
    assert 8 <= natural["usage"]["completion_tokens"] <= 12
    forced = await chat(ignore_eos=True, max_tokens=30)
    assert forced["choices"][0]["finish_reason"] == "length" and forced["usage"]["completion_tokens"] == 30
    assert forced["choices"][0]["message"]["content"].startswith(choice["message"]["content"])
    long_text = forced["choices"][0]["message"]["content"]
    word = long_text.split()[3]
    stopped = await chat(ignore_eos=True, max_tokens=30, stop=[word, "zzz-never"])
    c = stopped["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == word
    assert c["message"]["content"] == long_text[:long_text.find(word)]
    assert stopped["usage"]["completion_tokens"] < 30
    body = {**CHAT, "ignore_eos": True, "max_tokens": 30, "stop": word, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/chat/completions", json=body) as resp:
        events = [json.loads(e) for e in (await sse_events(resp))[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == c["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and events[-1]["choices"][0]["matched_stop"] == word


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_bad_requests_are_sglang_400s(sim_factory, sglang_protocol, path):
    sim = await sim_factory(speedup=500)
    cases = [
        (await post(sim.url, path, json.dumps(CHAT), content_type="text/plain"), "content-type"),
        (await post(sim.url, path, "{not json"), "JSON decode error"),
        (await post(sim.url, path, {"max_tokens": -1}), "body"),
        (await post(sim.url, path, "[1, 2]"), "dictionary"),
    ]
    for (status, ctype, text), needle in cases:
        assert status == 400 and ctype.startswith("application/json")
        assert redump(sglang_protocol.ErrorResponse, text) == text
        err = json.loads(text)
        assert err["object"] == "error" and err["code"] == 400 and needle in err["message"]


async def test_openai_sdk_sees_bad_request(sim_factory):
    sim = await sim_factory(speedup=500)
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=[], max_tokens=3)
    finally:
        await client.close()
    assert info.value.status_code == 400


async def test_queue_full_is_503(sim_factory, sglang_protocol):
    sim = await sim_factory(speedup=2, max_running_requests=1, max_queued_requests=1)
    body = {**CHAT, "max_tokens": 400}
    async with aiohttp.ClientSession() as s:
        busy = [asyncio.create_task(s.post(sim.url + "/v1/chat/completions", json=body)) for _ in range(2)]
        for _ in range(200):
            if sim.engine.num_running == 1 and sim.engine.num_queued == 1:
                break
            await asyncio.sleep(0.01)
        assert (sim.engine.num_running, sim.engine.num_queued) == (1, 1)
        async with s.post(sim.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 503
            text = await resp.text()
        async with s.post(sim.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200  # SGLang reports a scheduler abort inside an open stream
            events = await sse_events(resp)
        for t in busy:
            t.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
    assert redump(sglang_protocol.ErrorResponse, text) == text
    assert json.loads(text)["message"] == "The request queue is full."
    assert json.loads(events[0])["error"]["code"] == 503 and events[-1] == "[DONE]"


async def test_native_endpoints(sim_factory, sglang_protocol):
    base = await sim_factory(speedup=500, model="served-name")
    spec = await sim_factory("eagle3-tp8", speedup=500)
    async with aiohttp.ClientSession() as s:
        async with s.get(base.url + "/v1/models") as r:
            text = await r.text()
        assert redump(sglang_protocol.ModelList, text) == text
        assert json.loads(text)["data"][0]["id"] == "served-name"
        async with s.get(base.url + "/v1/models/served-name") as r:
            card = await r.text()
        assert redump(sglang_protocol.ModelCard, card) == card
        async with s.get(base.url + "/v1/models/other") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with s.get(base.url + "/model_info") as r:
            info = await r.json()
        assert info["served_model_name"] == "served-name" and info["is_generation"] is True
        async with s.get(base.url + "/server_info") as r:
            plain = await r.json()
        async with s.get(spec.url + "/server_info") as r:
            spec_info = await r.json()
        assert "avg_spec_accept_length" not in plain["internal_states"][0]
        assert spec_info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(2.5, abs=0.5)
        assert spec_info["version"] == "0.5.23" and spec_info["speculative_algorithm"] == "EAGLE3"
        async with s.get(spec.url + "/v1/loads") as r:
            loads = await r.json()
        (load,) = loads["loads"]
        assert {"num_running_reqs", "num_waiting_reqs", "max_running_requests", "token_usage"} <= set(load)
        assert load["max_running_requests"] == 48 and "accept_length" in load["speculative"]
        async with s.get(spec.url + "/v1/loads?include=core") as r:
            assert "speculative" not in (await r.json())["loads"][0]
        async with s.get(spec.url + "/v1/loads?include=nope") as r:
            assert r.status == 400
        async with s.get(spec.url + "/v1/loads?format=prometheus") as r:
            assert 'sglang_num_running_reqs{dp_rank="0"} 0' in await r.text()
        for path in ("/health", "/health_generate", "/ready"):
            async with s.get(base.url + path) as r:
                assert r.status == 200 and await r.read() == b""


async def test_health_is_503_during_startup_delay(sim_factory):
    sim = await sim_factory(speedup=500, startup_delay=1.0)
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/health") as r:
            assert r.status == 503
        # a request sent while loading waits for the model, as SGLang's does
        async with s.post(sim.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200


async def test_metrics_names_and_labels(sim_factory):
    sim = await sim_factory("eagle3-tp8", speedup=500, model="served")
    await post(sim.url, "/v1/chat/completions", {**CHAT, "max_tokens": 10})
    await post(sim.url, "/v1/chat/completions", {**CHAT, "max_tokens": 10, "stream": True})
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/metrics") as r:
        text = await r.text()
    sched = 'engine_type="unified",model_name="served",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "spec_accept_length"):
        assert re.search(rf"^sglang:{name}{{{sched}}} ", text, re.M), name
    tok = 'engine_type="unified",is_streaming="{}",model_name="served"'
    for stream in ("true", "false"):
        assert f'sglang:num_requests_total{{{tok.format(stream)}}} 1.0' in text
        assert f'sglang:generation_tokens_total{{{tok.format(stream)}}} 10.0' in text
        assert re.search(rf'^sglang:prompt_tokens_total{{{tok.format(stream)}}} [1-9]', text, re.M)
        assert f'sglang:e2e_request_latency_seconds_count{{{tok.format(stream)}}} 1.0' in text
        assert f'sglang:time_to_first_token_seconds_count{{{tok.format(stream)}}} 1.0' in text
    assert 'sglang:num_aborted_requests_total{engine_type="unified",model_name="served"} 0.0' in text
    assert re.search(r'^sglang:inter_token_latency_seconds_count\{engine_type="unified",model_name="served"\} [1-9]',
                     text, re.M)
    assert 'sim_faults_injected_total{kind="error"} 0.0' in text
    queue = f'sglang:queue_time_seconds_count{{{sched}}} 2.0'
    assert queue in text


async def test_client_disconnect_aborts_and_frees_the_slot(sim_factory):
    sim = await sim_factory(speedup=5, max_running_requests=1)
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(sim.url + "/v1/chat/completions", json=body)
        await resp.content.readline()  # the stream has started
        assert sim.engine.num_running == 1
        resp.close()  # the client goes away mid-stream
    for _ in range(200):
        if sim.engine.aborted_total == 1:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.aborted_total == 1 and sim.engine.num_running == 0
    # the freed slot serves the next request at once, and /metrics counts the abort
    status, _, _ = await post(sim.url, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert status == 200
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/metrics") as r:
        assert 'sglang:num_aborted_requests_total{engine_type="unified",model_name="moonshotai/Kimi-K2.5"} 1.0' \
            in await r.text()


async def test_non_streaming_disconnect_aborts_too(sim_factory):
    sim = await sim_factory(speedup=5, max_running_requests=1)
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(sim.url + "/v1/chat/completions", json=body))
        for _ in range(200):
            if sim.engine.num_running == 1:
                break
            await asyncio.sleep(0.01)
        assert sim.engine.num_running == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for _ in range(200):
        if sim.engine.aborted_total == 1:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.aborted_total == 1 and sim.engine.num_running == 0
