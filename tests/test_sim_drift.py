"""Drift: the speculative server's acceptance changed at run time (POST /_sim/drift), engine and HTTP."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from bench.sim.engine import Engine, build_request
from bench.sim.profiles import load_profile


async def run_requests(engine: Engine, prompt: str, n: int = 8, max_tokens: int = 60) -> float:
    """Run n requests to the end; the accept length the engine reports afterwards (its recent steps)."""
    reqs = [build_request(f"r{i}", f"{prompt} {i}", 5, profile=engine.profile, seed=0, max_tokens=max_tokens,
                          stop=[], ignore_eos=True, stream=True) for i in range(n)]
    for r in reqs:
        engine.submit(r)
    for r in reqs:
        while not (await r.outbox.get())[1]:
            pass
    return engine.avg_accept_length()


async def test_drift_changes_the_accept_length_from_then_on():
    engine = Engine(load_profile("eagle3-tp8"), speedup=2000.0)
    engine.start()
    try:
        chat = "Why is the sky blue?"
        assert 2.3 < await run_requests(engine, chat) < 2.7  # the profile's general 2.5
        assert engine.set_drift({"accept_length": 1.6})["accept_length_coding"] == 1.6
        assert 1.45 < await run_requests(engine, "Write a Python function") < 1.75  # every class
        engine.set_drift({"accept_length": None, "prompt_mix": "coding"})
        assert engine.mean_accept_length(coding=False) == 2.61  # chat prompts now accept like code
        engine.set_drift({"prompt_mix": "chat"})
        assert engine.mean_accept_length(coding=True) == 2.5
        assert engine.drift_changes == 3
    finally:
        await engine.close()


async def test_drift_reaches_requests_already_running():
    engine = Engine(load_profile("eagle3-tp8"), speedup=2000.0)
    engine.start()
    try:
        r = build_request("a", "hello", 5, profile=engine.profile, seed=0, max_tokens=5000, stop=[],
                          ignore_eos=True, stream=True)
        engine.submit(r)
        await r.outbox.get()
        before = r.accept_rate
        engine.set_drift({"accept_length": 1.0})
        assert before > 0.5 and r.accept_rate == 0.0
        generated, steps = r.generated, engine.steps_total
        for _ in range(30):  # one outbox item per step from here on
            await r.outbox.get()
        assert r.generated - generated == engine.steps_total - steps  # one token per step: nothing accepted
    finally:
        await engine.close()


@pytest.mark.parametrize("update, needle", [
    ({"accept_length": 3.5}, "from 1 to 3"),
    ({"accept_length": 0.5}, "from 1 to 3"),
    ({"accept_length": "2"}, "from 1 to 3"),
    ({"prompt_mix": "poetry"}, "prompt_mix"),
    ({"speed": 2}, "unknown drift field"),
])
def test_bad_drift_is_refused_and_changes_nothing(update, needle):
    engine = Engine(load_profile("eagle3-tp8"))
    with pytest.raises(ValueError, match=needle):
        engine.set_drift(update)
    assert engine.drift()["accept_length"] is None and engine.drift_changes == 0


async def test_drift_admin_endpoint(sim_factory):
    spec = await sim_factory("eagle3-tp8", speedup=1000)
    base = await sim_factory("baseline-tp8", speedup=1000)
    chat = {"model": "m", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 200}
    async with aiohttp.ClientSession() as s:
        async with s.get(spec.url + "/_sim/drift") as r:
            assert await r.json() == {"accept_length": None, "prompt_mix": None, "accept_length_general": 2.5,
                                      "accept_length_coding": 2.61}
        async with s.post(spec.url + "/_sim/drift", json={"accept_length": 1.6}) as r:
            assert r.status == 200 and (await r.json())["accept_length"] == 1.6
        async with s.post(spec.url + "/_sim/drift", json={"prompt_mix": "coding"}) as r:
            body = await r.json()
            assert body["accept_length"] == 1.6 and body["prompt_mix"] == "coding"  # partial updates merge
        async def one() -> None:
            async with s.post(spec.url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200

        await asyncio.gather(*(one() for _ in range(12)))
        async with s.get(spec.url + "/v1/loads") as r:
            length = (await r.json())["loads"][0]["speculative"]["accept_length"]
            # what SGLang reports follows the drift (2.5 before it; each request's own length spreads around 1.6)
            assert 1.1 < length < 2.0
        async with s.get(spec.url + "/_sim/stats") as r:
            stats = await r.json()
            assert stats["drift_changes"] == 2
            assert stats["drift"] == {"accept_length": 1.6, "prompt_mix": "coding"}
        for bad in ({"accept_length": 9}, {}, [1], {"nope": 1}):
            async with s.post(spec.url + "/_sim/drift", json=bad) as r:
                assert r.status == 400 and (await r.json())["object"] == "error"
        async with s.post(spec.url + "/_sim/drift", data="{", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        async with s.delete(spec.url + "/_sim/drift") as r:
            assert (await r.json())["accept_length"] is None
        # a baseline server has no acceptance to change
        async with s.post(base.url + "/_sim/drift", json={"accept_length": 2.0}) as r:
            assert r.status == 400 and "does not speculate" in (await r.json())["message"]
