"""The router in front of real llama.cpp engines (llama-cpp-python's OpenAI server, Gemma 3 270M on CPU): answers
identical through the router and direct, usage handling, disconnects, a killed engine, /v1/loads absent, and
`bench sweep` / `bench calibrate` against them. Skipped without the `engine` extra (docs/ENGINES.md)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import openai
import pytest

from bench.lab.engines import HEALTH_PATH, MODEL_NAME
from tests.fixtures_router import poll

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
# temperature 0 is greedy in llama.cpp; the seed makes any sampling that remains repeatable.
GREEDY = {"temperature": 0.0, "seed": 7, "max_tokens": 24}
POOLS = ("speculative", "baseline")


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def normal(obj: dict) -> dict:
    """A response without what differs between any two calls (id, created)."""
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


async def engine_router(router_factory, pair, **settings):
    return await router_factory([pair.speculative.url], [pair.baseline.url], health_path=HEALTH_PATH, **settings)


@pytest.mark.parametrize("pool", POOLS)
async def test_non_streaming_answer_identical_through_router_and_direct(engine_pair, router_factory, pool):
    engine = getattr(engine_pair, pool)
    router = await engine_router(router_factory, engine_pair)
    async with client(engine.url) as c:
        direct = await c.chat.completions.create(model=MODEL_NAME, messages=PROMPT, **GREEDY)
    async with client(router.url) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=PROMPT, extra_headers={"X-Router-Pool": pool}, **GREEDY)
    routed = raw.parse()
    assert raw.headers["X-Router-Backend"] == engine.url and raw.headers["X-Router-Pool"] == pool
    assert normal(routed.model_dump()) == normal(direct.model_dump())
    assert routed.choices[0].message.content and routed.usage.completion_tokens > 0
    # A whole answer carries usage: the router counts its tokens as it does SGLang's.
    assert router.metric("router_completion_tokens_total", pool=pool) == routed.usage.completion_tokens


async def stream_chunks(url: str, headers: dict | None = None, **extra) -> list[dict]:
    async with client(url) as c:
        stream = await c.chat.completions.create(model=MODEL_NAME, messages=PROMPT, stream=True,
                                                 extra_headers=headers, **{**GREEDY, **extra})
        return [normal(chunk.model_dump()) async for chunk in stream]


@pytest.mark.parametrize("pool", POOLS)
async def test_streaming_answer_identical_through_router_and_direct(engine_pair, router_factory, pool):
    engine = getattr(engine_pair, pool)
    router = await engine_router(router_factory, engine_pair)
    direct = await stream_chunks(engine.url)
    routed = await stream_chunks(router.url, {"X-Router-Pool": pool})
    assert len(direct) > 3 and routed == direct
    # llama-cpp-python ignores stream_options: the usage chunk the router asks for never comes, so the router
    # forwards the stream untouched and counts no tokens for it (docs/ENGINES.md).
    assert all(c.get("usage") is None for c in routed)
    assert router.metric("router_completion_tokens_total", pool=pool) == 0
    assert router.metric("router_requests_total", pool=pool, backend=engine.url, code="200") == 1


async def test_client_asking_for_usage_gets_exactly_what_the_engine_sends(engine_pair, router_factory):
    router = await engine_router(router_factory, engine_pair)
    want = {"stream_options": {"include_usage": True}}
    direct = await stream_chunks(engine_pair.baseline.url, **want)
    routed = await stream_chunks(router.url, {"X-Router-Pool": "baseline"}, **want)
    assert routed == direct and all(c.get("usage") is None for c in routed)


async def test_client_disconnect_frees_the_engine(engine_pair, router_factory):
    """A client that leaves mid-stream: the router closes the upstream request and the engine itself reports
    the disconnect and stops generating; the next request gets the engine at once."""
    engine = engine_pair.baseline
    router = await engine_router(router_factory, engine_pair)
    before = engine.disconnects()
    long = {"model": MODEL_NAME, "messages": PROMPT, "max_tokens": 1500, "min_tokens": 1500,
            "temperature": 0.0, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=long,
                          headers={"X-Router-Pool": "baseline"}) as r:
            assert r.status == 200
            got = 0
            async for _ in r.content.iter_any():
                got += 1
                if got >= 3:
                    break
        # leaving the block closes the connection mid-stream
    assert await poll(lambda: engine.disconnects() > before, 30), engine.log_text()[-2000:]
    assert await router.wait_idle(10) == {engine_pair.speculative.url: 0, engine.url: 0}
    # The engine's one generation slot is free: a short request on it completes (it would queue behind the
    # 1500 forced tokens otherwise, far beyond this test's timeout on a shared 2-core machine).
    async with client(router.url) as c:
        short = await c.chat.completions.create(
            model=MODEL_NAME, messages=PROMPT, extra_headers={"X-Router-Pool": "baseline"}, **GREEDY)
    assert short.usage.completion_tokens > 0


async def test_killed_engine_fails_over_to_the_other_pool(engine_pair, engine_factory, router_factory):
    spec = engine_factory(speculative=True)
    router = await router_factory([spec.url], [engine_pair.baseline.url], health_path=HEALTH_PATH,
                                  health_interval=0.2)
    async with client(router.url) as c:
        ok = await c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=PROMPT, **GREEDY)
        assert ok.headers["X-Router-Pool"] == "speculative"
        spec.kill()
        # Before any probe notices: the refused connect is retried on the baseline pool, the client sees a 200.
        raws = [await c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=PROMPT, **GREEDY)
                for _ in range(3)]
    assert [r.headers["X-Router-Pool"] for r in raws] == ["baseline"] * 3
    assert all(r.parse().choices[0].message.content for r in raws)
    assert await poll(lambda: not router.state.pools.backends[0].healthy, 5)


async def test_engine_killed_mid_stream_ends_the_stream_with_an_error_event(engine_pair, engine_factory,
                                                                         router_factory):
    spec = engine_factory(speculative=False)
    router = await router_factory([spec.url], [engine_pair.baseline.url], health_path=HEALTH_PATH)
    body = {"model": MODEL_NAME, "messages": PROMPT, "max_tokens": 1500, "min_tokens": 1500,
            "temperature": 0.0, "stream": True}
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/chat/completions", json=body,
                          headers={"X-Router-Pool": "speculative"}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 3:
                        spec.kill()
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])
    assert err["error"]["code"] == "backend_disconnected"
    assert len(events) < 1000  # cut short, not the whole answer
    assert await router.wait_idle() == {spec.url: 0, engine_pair.baseline.url: 0}


async def test_load_signal_backend_without_v1_loads_keeps_routing_on_local_counts(engine_pair, router_factory):
    """llama-cpp-python has no /v1/loads: with load_signal backend the poll finds nothing and each replica
    routes on its own in-flight counts, as load_signal local does."""
    router = await engine_router(router_factory, engine_pair, load_signal="backend", load_interval=0.2)
    await asyncio.sleep(0.6)  # a few poll rounds, every one a 404
    async with client(router.url) as c:
        r = await c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=PROMPT, **GREEDY)
    assert r.headers["X-Router-Pool"] == "speculative"
    for pool in POOLS:
        url = getattr(engine_pair, pool).url
        assert router.registry.get_sample_value("router_backend_reported_load", {"pool": pool, "backend": url}) == -1
    async with aiohttp.ClientSession() as s, s.get(router.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL_NAME]


def run_bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, timeout=timeout)


LOAD = ["--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens", "16", "--no-plot", "--timeout", "60"]


def test_bench_sweep_against_real_engines(engine_pair, tmp_path):
    res = run_bench("sweep", "--target", f"speculative={engine_pair.speculative.url}",
                    "--target", f"baseline={engine_pair.baseline.url}", *LOAD, "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    data = json.loads((tmp_path / "sweep.json").read_text())
    for name in POOLS:
        levels = data["results"][name]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            assert lv["completed"] == 2 and lv["failed"] == 0
            assert lv["output_throughput"] > 0
    print(res.stdout)


def test_bench_calibrate_against_real_engines(engine_pair, tmp_path):
    res = run_bench("calibrate", "--speculative", engine_pair.speculative.url, "--baseline",
                    engine_pair.baseline.url, *LOAD, "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "calibrate.json").read_text())["recommendation"]
    assert isinstance(rec["threshold"], int) and rec["threshold"] >= 0
    assert "threshold" in res.stdout
    print(res.stdout)


async def test_bench_engines_cli_starts_both_and_stops_on_sigterm(engine_model):
    from bench.procs import start

    p = start("engines", ["bench", "engines"], wait_s=120, lines=2)
    try:
        async with aiohttp.ClientSession() as s:
            for url in p.urls:
                async with s.get(url + HEALTH_PATH) as r:
                    assert r.status == 200
                async with s.get(url + "/v1/models") as r:
                    assert [m["id"] for m in (await r.json())["data"]] == [MODEL_NAME]
    finally:
        rc = p.stop(grace=30)
    assert rc == 0
    async with aiohttp.ClientSession() as s:
        for url in p.urls:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with s.get(url + HEALTH_PATH):
                    pass


async def test_router_with_default_settings_serves_both_engines(engine_pair):
    """`spec-router serve` with nothing but the two URLs: llama-cpp-python has no /health, so the probes fall
    back to /v1/models (logged once per engine) and both pools answer, streamed and not."""
    from bench.procs import start

    urls = {"speculative": engine_pair.speculative.url, "baseline": engine_pair.baseline.url}
    p = start("router", ["router", "serve", "--speculative", urls["speculative"], "--baseline", urls["baseline"],
                         "--port", "0"])
    try:
        async with aiohttp.ClientSession() as s:
            deadline = asyncio.get_running_loop().time() + 20
            while True:  # the first probe round runs at start-up; bounded all the same
                async with s.get(p.url + "/ready") as r:
                    body = await r.json()
                if r.status == 200 and all(body["backends"].values()):
                    break
                assert asyncio.get_running_loop().time() < deadline, f"engines never healthy: {body}"
                await asyncio.sleep(0.2)
        assert {u: b["last_probe"] for u, b in body["probes"].items()} == {
            u: "GET /v1/models -> 200" for u in urls.values()}
        for pool, engine_url in urls.items():
            async with client(p.url) as c:
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL_NAME, messages=PROMPT, extra_headers={"X-Router-Pool": pool}, **GREEDY)
            assert raw.headers["X-Router-Backend"] == engine_url
            assert raw.parse().choices[0].message.content
            assert len(await stream_chunks(p.url, {"X-Router-Pool": pool})) > 3
    finally:
        rc = p.stop(grace=15)
    log = "".join(p._stderr)
    assert rc == 0, log
    for pool, engine_url in urls.items():
        assert log.count(f"backend {engine_url} ({pool}) answers GET /health with 404: probing GET /v1/models "
                         "instead") == 1, log
    assert "WARNING" not in log, log


async def test_default_router_never_cuts_a_stream_on_an_engine_with_its_own_defaults(engine_factory, router_factory):
    """llama-cpp-python as it ships (interrupt_requests true) ends a running stream early, with [DONE], when any
    other request arrives, and the router's /v1/models fallback probe is such a request. Probing every 0.2 s with
    the default health_path, a streamed answer through the router must still equal the direct one."""
    engine = engine_factory(speculative=False, interrupt_requests=True)
    # Direct first: once the router probes, any stream it does not carry itself is cut (docs/ENGINES.md).
    direct = await stream_chunks(engine.url, max_tokens=48)
    router = await router_factory([], [engine.url])
    assert router.state.pools.backends[0].last_probe == "GET /v1/models -> 200"
    routed = await stream_chunks(router.url, max_tokens=48)
    assert len(direct) > 20 and routed == direct


async def router_state(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/router/state") as r:
        assert r.status == 200
        return await r.json()


async def test_adaptive_infers_that_the_engine_runs_one_request_at_a_time(engine_pair, router_factory):
    """llama-cpp-python's server has no /v1/loads and runs one request at a time. Pairs of streams sent together
    to one engine: the second's first token comes only after the first ended, so nothing ran beside it, and after
    QUEUE_WITNESSES such requests `adaptive` prices a second request there as a wait (router.queuelimit). The
    engine no pair was sent to stays unknown."""
    from router.tuning import DEFAULT

    QUEUE_WITNESSES = DEFAULT.queue_witnesses

    router = await engine_router(router_factory, engine_pair, policy="adaptive")
    pin = {"X-Router-Pool": "baseline"}
    for _ in range(QUEUE_WITNESSES):
        pair = await asyncio.gather(*(stream_chunks(router.url, pin, max_tokens=4) for _ in range(2)))
        assert all(len(chunks) > 1 for chunks in pair)
    backends = {b["pool"]: b for b in (await router_state(router.url))["model"]["backends"]}
    assert (backends["baseline"]["max_running"], backends["baseline"]["max_running_from"]) == (1, "inferred")
    assert backends["baseline"]["running_seen"] == 1 and backends["baseline"]["queue_witnesses"] >= QUEUE_WITNESSES
    assert (backends["speculative"]["max_running"], backends["speculative"]["max_running_from"]) == (None, None)
    assert backends["speculative"]["running_seen"] is None  # no stream of it has had a first token
    # ... yet, streams seen, a second request on it is priced as a wait until it is seen running two
    assert backends["speculative"]["priced_max_running"] == 1 and backends["baseline"]["priced_max_running"] == 1
    assert await router.wait_idle() == {engine_pair.speculative.url: 0, engine_pair.baseline.url: 0}
