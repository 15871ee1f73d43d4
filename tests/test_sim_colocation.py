"""Co-location: two simulated servers time-sharing one set of simulated GPUs (engine model, CLI, process)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from bench import procs
from bench.sim.engine import Engine, build_request
from bench.sim.gpu import Gpu
from bench.sim.profiles import load_profile

SPEEDUP = 200.0
MAX_TOKENS = 32


class ClosedLoop:
    """`clients` closed-loop clients on one engine; a finished request is replaced at once (in the callback).

    Throughput is measured on the engine's own schedule (the deadlines of its steps, in simulated time), so
    a loaded machine that makes the loop late does not change it: late steps run back to back and keep
    their scheduled times.
    """

    def __init__(self, engine: Engine, clients: int, warmup: int, measure: int) -> None:
        self.engine, self.clients = engine, clients
        self.marks = (warmup, warmup + measure)
        self.done = 0
        self.times: dict[int, float] = {}
        self.finished = asyncio.Event()
        self._n = 0
        engine.on_finish = self._on_finish

    def _submit(self) -> None:
        self._n += 1
        p = self.engine.profile
        self.engine.submit(build_request(f"r{self._n}", f"prompt {self._n}", 23, profile=p, seed=0,
                                         max_tokens=MAX_TOKENS, stop=[], ignore_eos=True, stream=True))

    def start(self) -> None:
        for _ in range(self.clients):
            self._submit()

    def _on_finish(self, req) -> None:
        self.done += 1
        if self.done in self.marks:
            self.times[self.done] = self.engine.deadline  # the end of the step that finished it
        if self.done >= self.marks[1]:
            self.finished.set()
        self._submit()

    def throughput(self) -> float:
        """Output tokens per simulated second between the two marks."""
        a, b = self.marks
        return (b - a) * MAX_TOKENS / ((self.times[b] - self.times[a]) * self.engine.speedup)


async def run(loads: list[tuple[str, int]], shared: bool, switch_ms: float = 0.5) -> tuple[list[ClosedLoop], Gpu | None]:
    """One engine per (profile, clients); clients 0 = idle. Returns once every busy engine is measured."""
    gpu = Gpu(switch_ms) if shared else None
    loops = []
    for name, clients in loads:
        engine = Engine(load_profile(name), speedup=SPEEDUP, gpu=gpu)
        # about 6 batch waves measured after 2 of warm-up (at least 24 requests each)
        wave = max(clients, 4)
        loops.append(ClosedLoop(engine, clients, warmup=2 * wave, measure=6 * wave))
    for loop in loops:
        loop.engine.start()
    try:
        for loop in loops:
            loop.start()
        await asyncio.wait_for(asyncio.gather(*(lp.finished.wait() for lp in loops if lp.clients)), 120)
    finally:
        for loop in loops:
            await loop.engine.close()
    return loops, gpu


@pytest.mark.parametrize("profile, other", [("eagle3-tp8", "baseline-tp8"), ("baseline-tp8", "eagle3-tp8")])
@pytest.mark.parametrize("clients", [1, 10, 70])
async def test_each_server_alone_runs_as_a_single_server(profile, other, clients):
    (alone,), _ = await run([(profile, clients)], shared=False)
    (paired, idle), gpu = await run([(profile, clients), (other, 0)], shared=True)
    solo, colocated = alone.throughput(), paired.throughput()
    assert colocated == pytest.approx(solo, rel=0.10), (solo, colocated)
    assert idle.engine.busy_s == 0 and paired.engine.gpu_wait_s == 0 and gpu.switches == 0


async def test_both_busy_steps_interleave_and_each_waits_for_the_other():
    loads = [("eagle3-tp8", 10), ("baseline-tp8", 10)]
    alone = [(await run([load], shared=False))[0][0].throughput() for load in loads]
    (spec, base), gpu = await run(loads, shared=True, switch_ms=0.5)
    shared = [spec.throughput(), base.throughput()]
    # one step at a time: while both are busy each server's step period is its own step plus the other's
    # (plus two context switches), so each keeps about step_self / (step_self + step_other) of its speed
    s_spec, s_base = load_profile("eagle3-tp8").step_ms(10), load_profile("baseline-tp8").step_ms(10)
    period = s_spec + s_base + 2 * 0.5
    expected = [s_spec / period, s_base / period]
    for got, solo, want in zip(shared, alone, expected, strict=True):
        assert got / solo == pytest.approx(want, abs=0.08), (got, solo, want)
    assert spec.engine.gpu_wait_s > 0 and base.engine.gpu_wait_s > 0 and gpu.switches > 10
    # the GPUs never ran two steps at once: both servers' GPU time fits in the elapsed simulated time
    elapsed = max(spec.engine.deadline, base.engine.deadline) * SPEEDUP - min(
        lp.engine.deadline * SPEEDUP - lp.engine.busy_s - lp.engine.gpu_wait_s for lp in (spec, base))
    assert spec.engine.busy_s + base.engine.busy_s <= elapsed * 1.001


def test_kv_share_halves_each_servers_capacity_and_limits_its_batch():
    p = load_profile("baseline-tp8")
    engine = Engine(p, max_total_tokens=1000)
    for i in range(5):  # 23 prompt + 300 output tokens each: three fit in 1000
        engine.submit(build_request(f"r{i}", f"p{i}", 23, profile=p, seed=0, max_tokens=300, stop=[],
                                    ignore_eos=True, stream=True))
    assert len(engine._admit()) == 3 and engine.reserved_tokens == 3 * 323


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def test_colocated_process_serves_two_ports_on_one_clock():
    proc, url_a, url_b = procs.start_colocated("eagle3-tp8", "baseline-tp8", 100.0, kv_share=0.25)
    try:
        assert proc.urls == [url_a, url_b] and url_a != url_b
        a, b = _get(url_a + "/server_info"), _get(url_b + "/server_info")
        assert a["speculative_algorithm"] == "EAGLE3" and b["speculative_algorithm"] is None
        assert a["max_total_tokens"] == 250_000 and b["max_total_tokens"] == 750_000
        assert _get(url_a + "/_sim/stats")["colocated_with"] == [url_b]
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        for url in (url_a, url_b):
            assert _post(url + "/v1/chat/completions", chat)["usage"]["completion_tokens"] == 8
        # one clock: a speedup change on either server applies to both
        _post(url_b + "/_sim/speedup", {"speedup": 40})
        assert _get(url_a + "/server_info")["simulator_speedup"] == 40
    finally:
        assert proc.stop() == 0


async def test_colocated_pair_interleaves_over_http():
    """Both servers busy through their HTTP APIs: each waits for the other's steps (counted in /_sim/stats)."""
    proc, url_a, url_b = procs.start_colocated("eagle3-tp8", "baseline-tp8", 10.0)
    try:
        def chat(tokens: int) -> dict:
            return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}

        async with aiohttp.ClientSession() as s:
            async def post(url: str, tokens: int) -> int:
                async with s.post(url + "/v1/chat/completions", json=chat(tokens)) as r:
                    return (await r.json())["usage"]["completion_tokens"]

            async def stats(url: str) -> dict:
                async with s.get(url + "/_sim/stats") as r:
                    return await r.json()

            # long streams on A, running once their first chunk is here; then short requests on B
            streams = [await s.post(url_a + "/v1/chat/completions", json={**chat(1500), "stream": True})
                       for _ in range(3)]
            for r in streams:
                assert (await r.content.readline()).startswith(b"data: ")
            assert await asyncio.gather(*(post(url_b, 30) for _ in range(3))) == [30, 30, 30]
            a, b = await stats(url_a), await stats(url_b)
            assert a["running"] == 3  # still busy: B's requests ran next to them
            assert a["gpu_switches"] > 0 and a["gpu_wait_s"] > 0 and b["gpu_wait_s"] > 0
            for r in streams:
                r.close()
    finally:
        proc.stop()


async def test_closing_one_engine_releases_a_peer_waiting_for_its_turn():
    gpu = Gpu(0.5)
    p = load_profile("baseline-tp8")
    a, b = Engine(p, speedup=1.0, gpu=gpu), Engine(p, speedup=1.0, gpu=gpu)
    a.submit(build_request("a", "a", 5, profile=p, seed=0, max_tokens=5, stop=[], ignore_eos=True, stream=True))
    gpu.ready(a, 0.0)  # a became ready long ago and has work, but its loop never runs
    waiting = asyncio.ensure_future(gpu.wait_turn(b, 1.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    await a.close()  # aborts a's request: b may go on
    await asyncio.wait_for(waiting, 5)
