"""Every failure branch of the hot path, driven black-box: HTTP into the router, misbehaving raw backends behind it.

These tests know nothing of the router's modules, only its HTTP answers, headers and /metrics, so they hold
across a rewrite of the proxy. Each docstring names the deliberately broken line it was seen to catch.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from tests.fixtures_rawbackend import (
    RawBackend,
    hang,
    headers_then,
    json_answer,
    reset_before_headers,
    sse,
    sse_body,
)
from tests.fixtures_router import poll

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**BODY, "stream": True}
WITH_USAGE = {**STREAM, "stream_options": {"include_usage": True}}
# Only the first probe round: a backend a test breaks afterwards is still "up" when the request comes.
# A long probe timeout: on a busy machine a 1 s probe of a healthy backend can time out, and with one
# round that backend would stay down for the whole test.
# A connect timeout only as short as a test needs: 0.3 s where a blackholed connect must time out, and 5 s
# wherever a connect must succeed (a 2-core CI machine can stall the loop past 0.3 s; a 504 then is a flake).
ONE_PROBE = {"health_interval": 60.0, "health_timeout": 10.0, "first_byte_timeout": 5.0, "connect_timeout": 5.0}


def _probe(kind: str, short: float) -> dict:
    """ONE_PROBE, with a `short` connect timeout for the blackhole kind."""
    return {**ONE_PROBE, "connect_timeout": short} if kind == "connect_timeout" else ONE_PROBE


async def all_up(router, within: float = 10.0) -> None:
    """Until /ready reports every backend healthy (bounded)."""
    async def ready() -> bool:
        async with aiohttp.ClientSession() as s, s.get(router.url + "/ready") as r:
            return r.status == 200 and all((await r.json())["backends"].values())

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await ready():
        assert loop.time() < deadline, "backends never all healthy"
        await asyncio.sleep(0.05)


async def post(router_url: str, body: dict) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s, \
            s.post(router_url + CHAT, json=body) as r:
        return r.status, dict(r.headers), await r.read()


def error_code(raw: bytes) -> str:
    return json.loads(raw)["error"]["code"]


def chunk(content: str | None = None, *, finish: str | None = None, usage: dict | None = None,
          choices: bool = True) -> dict:
    ev: dict = {"id": "r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": content} if content else {},
                             "finish_reason": finish}] if choices else []}
    if usage is not None:
        ev["usage"] = usage
    return ev


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
# A usage-only chunk, as SGLang sends it last when include_usage is on.
USAGE_ONLY = chunk(usage=USAGE, choices=False)


# ---------------------------------------------------------------- SSE events split across reads

@pytest.mark.parametrize("final_blank_line", [True, False])
@pytest.mark.parametrize("piece", [1, 7])
async def test_split_stream_reaches_the_client_byte_for_byte(raw_backend_factory, router_factory, piece,
                                                             final_blank_line):
    """Events written 1 or 7 bytes at a time (every event split across reads), the last one possibly without
    its blank line. Catches: `split_events(buf + chunk)` -> `split_events(chunk)` (the carried-over partial event
    lost) and deleting the `if buf: out.write(...)` after the read loop (trailing bytes dropped)."""
    events = [chunk("Hel"), chunk("lo, "), chunk("world"), chunk(finish="stop"), USAGE_ONLY, "[DONE]"]
    body = sse_body(*events, final_blank_line=final_blank_line)
    b = await raw_backend_factory({CHAT: sse(body, piece=piece)})
    router = await router_factory([b.url], [])
    status, headers, got = await post(router.url, WITH_USAGE)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert got == body  # the client asked for usage: nothing to strip, every byte as the backend sent it
    # Not asked for: exactly the usage-only event goes, everything else is unchanged.
    status, _, got = await post(router.url, STREAM)
    usage_event = sse_body(USAGE_ONLY)
    assert status == 200 and usage_event in body
    assert got == body.replace(usage_event, b"")
    assert router.metric("router_prompt_tokens_total", pool="speculative") == 2 * USAGE["prompt_tokens"]
    assert router.metric("router_completion_tokens_total", pool="speculative") == 2 * USAGE["completion_tokens"]


async def test_split_stream_through_the_openai_sdk(raw_backend_factory, router_factory):
    """The real client reassembles the same text from a 1-byte-piece stream (the SDK parses every event)."""
    body = sse_body(chunk("Hel"), chunk("lo"), chunk(finish="stop"), USAGE_ONLY, "[DONE]")
    b = await raw_backend_factory({CHAT: sse(body, piece=1)})
    router = await router_factory([b.url], [])
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model="m", messages=BODY["messages"], stream=True)
        parts = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == "Hello"
    assert all(c.usage is None for c in parts)  # the usage-only chunk was not asked for
    assert [c.choices[0].finish_reason for c in parts][-1] == "stop"


async def test_usage_event_that_also_carries_choices_is_kept(raw_backend_factory, router_factory):
    """A chunk with both `choices` and `usage` (continuous usage stats) is content: never stripped.
    Catches: `if strip and not obj.get("choices")` -> `if strip` in the usage scan."""
    with_choices = chunk("tail", usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})
    body = sse_body(chunk("head"), with_choices, USAGE_ONLY, "[DONE]")
    b = await raw_backend_factory({CHAT: sse(body, piece=7)})
    router = await router_factory([b.url], [])
    status, _, got = await post(router.url, STREAM)
    assert status == 200
    assert got == sse_body(chunk("head"), with_choices, "[DONE]")
    # The last usage seen is the one counted.
    assert router.metric("router_prompt_tokens_total", pool="speculative") == USAGE["prompt_tokens"]


# ---------------------------------------------------------------- retry budget, both paths

def _failing(kind: str):
    if kind in ("502", "503"):
        return json_answer(int(kind), {"error": {"message": f"status {kind} from the backend", "code": kind}})
    if kind == "reset":
        return reset_before_headers()
    return None  # refused / blackhole: the listener itself is broken after the first probe


async def _break(b: RawBackend, kind: str) -> None:
    if kind == "refused":
        await b.stop_listening()
    elif kind == "connect_timeout":
        await b.blackhole()


# (status the client gets, OpenAI error code or None for a passed-through backend body, attempts metric kind)
OUTCOME = {"503": (503, "503", None), "502": (502, "502", None), "reset": (502, "backend_disconnected", "disconnect"),
           "refused": (502, "backend_unreachable", "connect"), "connect_timeout": (504, "upstream_timeout",
                                                                                   "connect_timeout")}


def _attempts(router, backends: list[RawBackend], kind: str) -> int:
    metric_kind = OUTCOME[kind][2]
    if metric_kind in ("connect", "connect_timeout"):  # nothing reached the backend: count the router's failures
        return int(sum(router.metric("router_upstream_errors_total", backend=b.url, kind=metric_kind)
                       for b in backends))
    return sum(b.chat_hits() for b in backends)


@pytest.mark.parametrize("retries", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["503", "502", "reset", "refused", "connect_timeout"])
async def test_retry_budget_when_every_backend_fails(raw_backend_factory, router_factory, kind, retries):
    """Four failing backends (more than any budget): exactly 1 + `retries` attempts, then the last failure is
    the client's answer. Catches `attempts >= retries` -> `attempts > retries` (one retry too many) and
    `attempts + 1 >= retries` (one too few), in the exception path and in the 502/503 path."""
    fail = _failing(kind)
    backends = [await raw_backend_factory({CHAT: fail} if fail else {}) for _ in range(4)]
    router = await router_factory([b.url for b in backends], [], retries=retries, **_probe(kind, 0.3))
    for b in backends:
        await _break(b, kind)
    status, headers, raw = await post(router.url, BODY)
    want_status, want_code, _ = OUTCOME[kind]
    assert (status, error_code(raw)) == (want_status, want_code)
    assert _attempts(router, backends, kind) == 1 + retries
    assert sum(router.metric("router_retries_total", pool=p) for p in ("speculative", "baseline")) == retries
    assert headers["X-Router-Backend"] in {b.url for b in backends}
    assert await router.wait_idle() == {b.url: 0 for b in backends}


@pytest.mark.parametrize("retries", [0, 1, 3])
@pytest.mark.parametrize("kind", ["503", "reset", "refused", "connect_timeout"])
async def test_one_failing_backend_and_a_retry_target(raw_backend_factory, router_factory, kind, retries):
    """A failing speculative backend and a good baseline one: with `retries` 0 the failure is the answer,
    with 1 or more the good backend answers. Catches the same off-by-one lines, and a retry that ignores the
    budget (`retries` 0 must never retry)."""
    fail = _failing(kind)
    bad = await raw_backend_factory({CHAT: fail} if fail else {})
    good = await raw_backend_factory()
    router = await router_factory([bad.url], [good.url], retries=retries, **_probe(kind, 1.0))  # its retry connects
    await _break(bad, kind)
    status, headers, raw = await post(router.url, STREAM)
    if retries == 0:
        assert (status, error_code(raw)) == OUTCOME[kind][:2]
        assert good.chat_hits() == 0
    else:
        assert status == 200 and headers["X-Router-Backend"] == good.url and headers["X-Router-Pool"] == "baseline"
        assert raw.endswith(b"data: [DONE]\n\n")
        assert good.chat_hits() == 1
        assert router.metric("router_retries_total", pool="baseline") == 1
    assert _attempts(router, [bad], kind) == 1


@pytest.mark.parametrize("status", [502, 503])
@pytest.mark.parametrize("retries", [1, 3])
async def test_5xx_with_no_alternative_backend_passes_through(raw_backend_factory, router_factory, status, retries):
    """The only backend answers 502/503 and no other one exists: its answer goes to the client unchanged,
    after one attempt. Catches closing the 5xx response before knowing a retry target exists (the client then
    gets a 502 `backend_disconnected` or an empty body instead of the backend's answer)."""
    answer = {"error": {"message": "the server is overloaded", "type": "x", "code": status}}
    b = await raw_backend_factory({CHAT: json_answer(status, answer)})
    router = await router_factory([b.url], [], retries=retries, **ONE_PROBE)
    got_status, headers, raw = await post(router.url, BODY)
    assert got_status == status and json.loads(raw) == answer
    assert headers["X-Router-Backend"] == b.url
    assert b.chat_hits() == 1
    assert router.metric("router_requests_total", pool="speculative", backend=b.url, code=str(status)) == 1


# ---------------------------------------------------------------- failures after the headers

@pytest.mark.parametrize("end", ["close", "reset"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("retries", [0, 1])
async def test_dies_after_headers_before_first_byte(raw_backend_factory, router_factory, stream, end, retries):
    """Headers came, then the connection ended before any body byte. The client has received nothing, so
    with a retry left another backend answers; without one it is a 502 `backend_disconnected`, never a 500.
    Catches: `read_chunk` / `read_body` catching only `ConnectionError` (a 500 `internal_error`), and the retry
    after headers ignoring the budget (`retries` 0 must answer 502)."""
    bad = await raw_backend_factory({CHAT: headers_then(end, stream=stream)})
    good = await raw_backend_factory()
    router = await router_factory([bad.url], [good.url], retries=retries, **ONE_PROBE)
    status, headers, raw = await post(router.url, STREAM if stream else BODY)
    if retries:
        assert (status, headers["X-Router-Backend"]) == (200, good.url)
        assert good.chat_hits() == 1
    else:
        assert (status, error_code(raw)) == (502, "backend_disconnected")
        assert headers["X-Router-Backend"] == bad.url
        assert good.chat_hits() == 0
        assert router.metric("router_requests_total", pool="speculative", backend=bad.url, code="502") == 1
    assert router.metric("router_upstream_errors_total", backend=bad.url, kind="disconnect") == 1
    assert await router.wait_idle() == {bad.url: 0, good.url: 0}


async def test_malformed_answer_is_502_not_500_and_not_retried(raw_backend_factory, router_factory):
    """A backend that answers garbage instead of a status line: a transport error no retry may repeat
    (the request was delivered). Catches the last `return UpstreamError(...)` of the error mapping turned into
    a plain `RouterError` (a 500), and making it retryable (the good backend would answer)."""

    async def garbage(c):
        await c.write(b"NOT HTTP AT ALL\r\n\r\n")

    bad = await raw_backend_factory({CHAT: garbage})
    good = await raw_backend_factory()
    router = await router_factory([bad.url], [good.url], retries=3, **ONE_PROBE)
    status, _, raw = await post(router.url, BODY)
    assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_error"
    assert good.chat_hits() == 0


async def test_hang_before_headers_is_504_and_not_retried(raw_backend_factory, router_factory):
    """No headers within first_byte_timeout: 504, and the request is not sent again (the backend has it).
    Catches treating the first-byte timeout as retryable (the good backend would answer 200)."""
    bad = await raw_backend_factory({CHAT: hang()})
    good = await raw_backend_factory()
    router = await router_factory([bad.url], [good.url], retries=3, **{**ONE_PROBE, "first_byte_timeout": 0.4})
    status, _, raw = await post(router.url, STREAM)
    assert (status, error_code(raw)) == (504, "upstream_timeout")
    assert (bad.chat_hits(), good.chat_hits()) == (1, 0)
    assert router.metric("router_upstream_errors_total", backend=bad.url, kind="first_byte_timeout") == 1


# ---------------------------------------------------------------- /v1/models

MODELS_A = {"object": "list", "data": [{"id": "alpha", "object": "model"}, {"id": "beta", "object": "model"}]}
MODELS_B = {"object": "list", "data": [{"id": "beta", "object": "model", "owned_by": "second"},
                                       {"id": "gamma", "object": "model"}]}
# A failing backend whose body looks like a model list: its ids must never be listed.
TRAP = {"object": "list", "data": [{"id": "from-a-500", "object": "model"}]}


def _reset_models():
    async def act(c):
        c.reset()
    return act


BROKEN_MODELS = {"status_500": lambda: json_answer(500, TRAP), "not_json": lambda: json_answer(200, b"{not json"),
                 "reset": _reset_models, "hang": hang, "not_a_list": lambda: json_answer(200, {"data": "alpha"})}


async def test_models_merges_answering_backends_and_skips_failing_ones(raw_backend_factory, router_factory):
    """Two good backends (ids merged, first seen wins) and one backend per failure kind.
    Catches: dropping `if resp.status != 200: return []` (the 500's trap id listed), dropping ValueError from
    the `except` (a 500 from the router on the bad JSON), and dropping the per-fetch timeout (the hang)."""
    good_a = await raw_backend_factory({"/v1/models": json_answer(200, MODELS_A)})
    good_b = await raw_backend_factory({"/v1/models": json_answer(200, MODELS_B)})
    bad = [await raw_backend_factory({"/v1/models": make()}) for make in BROKEN_MODELS.values()]
    # health_timeout also bounds each backend's /v1/models fetch (the hanging one takes that long).
    router = await router_factory([good_a.url, *(b.url for b in bad)], [good_b.url], health_timeout=2.0)
    await all_up(router)
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        ids = sorted(m.id for m in (await client.models.list()).data)
    assert ids == ["alpha", "beta", "gamma"]
    # Every failing backend was asked (aiohttp itself repeats a GET once when a pooled connection is reset).
    assert all(b.hits["/v1/models"] >= 1 for b in bad)


async def test_models_is_503_when_no_backend_answers(raw_backend_factory, router_factory):
    """Every backend fails its model list: 503 `no_healthy_backend`, not 500 and not an empty list.
    Catches replacing the `if not seen: raise NoHealthyBackend` with an empty 200 list."""
    bad = [await raw_backend_factory({"/v1/models": make()}) for make in BROKEN_MODELS.values()]
    router = await router_factory([b.url for b in bad], [], health_timeout=2.0)
    await all_up(router)
    async with aiohttp.ClientSession() as s, s.get(router.url + "/v1/models") as r:
        status, raw = r.status, await r.read()
    assert (status, error_code(raw)) == (503, "no_healthy_backend")
    assert all(b.hits["/v1/models"] >= 1 for b in bad)  # every one was asked


# ---------------------------------------------------------------- backend-reported load (/v1/loads)

def loads_doc(running: int) -> dict:
    return {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0}]}


LOADS = "/v1/loads"
POLLING = {"load_signal": "backend", "load_interval": 0.05, "health_timeout": 2.0, "threshold": 4}


async def _after_polls(b: RawBackend, n: int = 2) -> None:
    """Until `n` more polls reached `b`: the first of them has been answered and used (polls do not overlap)."""
    start = b.hits[LOADS]
    assert await poll(lambda: b.hits[LOADS] >= start + n, 10)


FAILING_LOADS = {"status_500": lambda: json_answer(500, loads_doc(50)), "not_json": lambda: json_answer(200, b"nope"),
                 "bad_doc": lambda: json_answer(200, {"loads": [{"num_running_reqs": "0"}]}),
                 "reset": _reset_models, "hang": hang}


@pytest.mark.parametrize("failure", list(FAILING_LOADS))
async def test_failing_loads_poll_forgets_the_last_figure(raw_backend_factory, router_factory, failure):
    """A backend reporting 50 running pushes requests over the threshold (4) to the baseline pool; once its
    /v1/loads fails, the router forgets the figure and routes on its own count (0): speculative again.
    Catches: keeping the previous figure on a failed poll (`load = None` in the `except` removed), and reading
    a non-200 answer (dropping `if resp.status == 200`: the 500's body says 50 running)."""
    spec = await raw_backend_factory({LOADS: json_answer(200, loads_doc(50))})
    base = await raw_backend_factory()
    router = await router_factory([spec.url], [base.url], **POLLING)
    await all_up(router)
    await _after_polls(spec)
    _, headers, _ = await post(router.url, BODY)
    assert headers["X-Router-Pool"] == "baseline"
    assert router.metric("router_backend_reported_load", pool="speculative", backend=spec.url) == 50
    spec.routes[LOADS] = FAILING_LOADS[failure]()
    await _after_polls(spec)
    _, headers, _ = await post(router.url, BODY)
    assert headers["X-Router-Pool"] == "speculative"
    assert router.metric("router_backend_reported_load", pool="speculative", backend=spec.url) == -1


async def test_reported_load_never_hides_our_own_in_flight_requests(raw_backend_factory, router_factory):
    """The backend reports 0 running (a stale or lagging figure) while this router holds 4 requests on it:
    the estimate is floored at the router's own count, so with threshold 4 the next request spills over.
    Catches `max(self._inflight, reported + ...)` -> `reported + ...` (the estimate drops to 0, speculative)."""
    spec = await raw_backend_factory({LOADS: json_answer(200, loads_doc(0)), CHAT: hang()})
    base = await raw_backend_factory()
    router = await router_factory([spec.url], [base.url], **POLLING)
    await all_up(router)
    held = [asyncio.create_task(post(router.url, BODY)) for _ in range(4)]
    try:
        assert await poll(lambda: spec.chat_hits() == 4, 10)
        await _after_polls(spec)  # a report of 0 taken while our 4 were in flight
        status, headers, _ = await post(router.url, BODY)
        assert status == 200 and headers["X-Router-Pool"] == "baseline"
        assert spec.chat_hits() == 4
    finally:
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    assert await router.wait_idle() == {spec.url: 0, base.url: 0}
