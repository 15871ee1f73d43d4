"""SGLang's --speculative-adaptive in the simulator: the batch-size table, the EMA controller's rule, the config
file, the engine's per-step draft steps, the SGLang protocol it answers with, and its equality with a static
EAGLE-3 server of the same setting where the table allows that setting."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from bench.sim import presets, specadaptive, stepcost
from bench.sim.engine import Engine, build_request
from bench.sim.profiles import Profile, ProfileError, load_profile, load_profile_file
from bench.sim.specadaptive import AdaptiveConfigError, Controller, Slot

# --- the table and the rule (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch,allowed", [(1, [1, 3, 5, 7]), (7, [1, 3, 5, 7]), (8, [0, 1, 3]), (31, [0, 1, 3]),
                                           (32, [0, 1]), (63, [0, 1]), (64, [0]), (500, [0])])
def test_default_table_by_batch_size(batch, allowed):
    assert Controller().allowed(batch) == allowed


def test_initial_steps_are_the_middle_of_the_union_and_slots_without_them_take_their_middle():
    c = Controller()
    assert c.candidate_steps == [0, 1, 3, 5, 7] and c.initial == 3
    assert [c.steps_for(b) for b in (1, 8, 32, 64)] == [3, 3, 1, 0]


def test_ema_rises_past_the_threshold_and_drops_to_zero_then_probes():
    up = Slot(3, specadaptive.DEFAULT_CONFIG["1"])
    for _ in range(14):
        assert not up.update([3])  # warm-up (10) and the first interval
    assert up.update([3]) and up.current == 5  # EMA 2.96 > 3 - 0.5: one candidate up (not past 4.5)
    down = Slot(3, specadaptive.DEFAULT_CONFIG["8"])
    for _ in range(15):
        down.update([0, 0])
    assert down.current == 0  # EMA 0.07 <= 1 - 0.5 and <= 0.5 (the zero candidate's threshold)
    for _ in range(4):
        down.update([0, 0])
    assert down.current == 0
    down.update([0, 0])
    assert down.current == 1  # after an interval at 0 steps it probes the next candidate up
    stay = Slot(3, specadaptive.DEFAULT_CONFIG["1"])
    for _ in range(30):
        stay.update([1, 2])  # 1.5 accepted drafts: above 1 - 0.5 - 0.25, below 2.5
    assert stay.current == 3 and stay.changes == 0


def test_config_file_format_and_errors(tmp_path):
    good = tmp_path / "a.json"
    good.write_text(json.dumps({"ema_alpha": 0.5, "1": {"candidate_steps": [2]}, "16": {"candidate_steps": [0]}}))
    cfg = specadaptive.load_config(good)
    c = Controller(cfg)
    assert c.allowed(15) == [2] and c.allowed(16) == [0] and c.slots[1].ema_alpha == 0.5
    for text, match in [("{", "not valid JSON"), ("[1]", "JSON object"), ('{"x": 1}', "integer-string BS key"),
                        ('{"1": {"candidate_steps": []}}', "non-negative ints"),
                        ('{"1": {"candidate_steps": [-1]}}', "non-negative ints"),
                        ('{"strategy": "throughput_aware", "1": {"candidate_steps": [1]}}', "not simulated"),
                        ('{"strategy": "x", "1": {"candidate_steps": [1]}}', "'ema' or"),
                        ('{"ema_alpha": "a", "1": {"candidate_steps": [1]}}', "ema_alpha")]:
        good.write_text(text)
        with pytest.raises(AdaptiveConfigError, match=match):
            specadaptive.load_config(good)
    with pytest.raises(AdaptiveConfigError, match="not found"):
        specadaptive.load_config(tmp_path / "missing.json")
    with pytest.raises(AdaptiveConfigError, match="no step curve for \\[9\\]"):
        specadaptive.check_profile({"1": {"candidate_steps": [9]}}, load_profile("adaptive-tp8"))
    with pytest.raises(AdaptiveConfigError, match="needs an adaptive profile"):
        specadaptive.check_profile(specadaptive.DEFAULT_CONFIG, load_profile("eagle3-tp8"))


def test_sim_cli_refuses_a_bad_config_with_one_line(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text('{"1": {"candidate_steps": [9]}}')
    for args in (["--profile", "adaptive-tp8", "--speculative-adaptive-config", str(bad)],
                 ["--profile", "eagle3-tp8", "--speculative-adaptive-config", str(tmp_path / "none.json")]):
        r = subprocess.run([sys.executable, "-m", "bench", "sim", *args, "--port", "0"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("spec-bench sim: "), r.stderr


# --- profiles ----------------------------------------------------------------------------------------------------


def test_builtin_adaptive_profiles_are_what_the_step_cost_model_writes():
    for good in (False, True):
        built = stepcost.seed_adaptive_profile(good)
        assert load_profile(built.name) == built
    p = load_profile("adaptive-tp8")
    assert p.speculative_adaptive and p.speculative_eagle_topk == 1 and p.max_running_requests == 48
    assert sorted(p.adaptive_step_points_ms) == list(range(9))
    # the chain's acceptance: 0.7 per token, 2.53 at the nominal 3 steps
    assert p.accept_length_general == pytest.approx(stepcost.chain_accept_length(3, 0.7), abs=1e-3)
    assert load_profile("adaptive-good-tp8").accept_length_general == pytest.approx(3.0, abs=1e-3)
    # sensitivity: the per-token acceptance in hundredths, for adaptive and for a static chain
    assert load_profile("seed.adaptive-a55-tp8").accept_length_general == pytest.approx(
        stepcost.chain_accept_length(3, 0.55), abs=1e-3)
    assert load_profile("seed.chain1-a55-tp8").accept_length_general == pytest.approx(1.55)


def test_zero_steps_still_pays_the_draft_extend_pass():
    p = load_profile("seed.adaptive-tp8")
    base = load_profile("seed.baseline-tp8")
    box = presets.box("seed")
    for n in (1, 8, 32, 48):
        extend = stepcost.draft_forward(box.shape, box.layout(), box.cal, n, n).ms
        # the 0-step curve is the target's decode plus the draft's extend over n tokens, dearer than a baseline
        assert p.adaptive_step_ms(0, n) > base.step_ms(n)
        assert p.adaptive_step_ms(0, n) - base.step_ms(n) == pytest.approx(extend, rel=0.02)
        # the low-end variant (-xk): the extend pass's kernels only, no per-forward fixed cost
        low = load_profile("seed.adaptive-xk-tp8").adaptive_step_ms(0, n)
        assert low - base.step_ms(n) == pytest.approx(extend - box.cal.fixed_ms, rel=0.05, abs=0.01)


def test_adaptive_profile_validation(tmp_path):
    data = load_profile("adaptive-tp8").model_dump(mode="json")
    bad = tmp_path / "p.json"
    for update, match in [({"speculative_eagle_topk": 4}, "topk 1"), ({"adaptive_step_points_ms": {}}, "needs"),
                          ({"adaptive_step_points_ms": {"1": [[1, 5.0]]}}, "2\\+ positive")]:
        bad.write_text(json.dumps(data | update))
        with pytest.raises(ProfileError, match=match):
            load_profile_file(bad)
    bad.write_text(json.dumps(load_profile("eagle3-tp8").model_dump(mode="json")
                              | {"adaptive_step_points_ms": data["adaptive_step_points_ms"]}))
    with pytest.raises(ProfileError, match="only for speculative_adaptive"):
        load_profile_file(bad)
    with pytest.raises(ProfileError, match="does not fit"):
        load_profile("seed.adaptive-tp4")


# --- the engine: steps per decode step, and throughput against a static server ---------------------------------


async def _tokens_per_sim_second(profile: Profile, c: int, adaptive_config: dict | None = None,
                                 max_tokens: int = 200) -> tuple[float, Engine]:
    """c requests at once (23-token prompts, ignore_eos): output tokens per simulated second of GPU time."""
    engine = Engine(profile, speedup=2000.0, adaptive_config=adaptive_config)
    engine.start()
    reqs = [build_request(f"r{i}", f"prompt {i}", 23, profile=profile, seed=0, max_tokens=max_tokens, stop=[],
                          ignore_eos=True, stream=True) for i in range(c)]
    done = asyncio.Event()
    engine.on_finish = lambda _req: engine.completed_total >= c and done.set()
    try:
        for r in reqs:
            engine.submit(r)
        async with asyncio.timeout(60):
            await done.wait()
    finally:
        await engine.close()
    return c * max_tokens / engine.busy_s, engine


@pytest.mark.parametrize("c", [1, 4, 7])
async def test_at_batch_1_to_7_it_equals_the_static_eagle3_server_the_table_lets_it_be(c):
    """The default table allows 1, 3, 5, 7 steps here and the controller holds 3 at acceptance 0.7: the same as
    a static EAGLE-3 server with a 3-step chain (stepcost's `chain3`). Pinned to 1 step by a config, chain1."""
    # no per-request spread: a request's spread is stated at each profile's own step count (the adaptive one's
    # at 3 steps), so a single drawn request would land apart on the two scales; the means are the same chain's
    flat = {"accept_length_spread": 0.0}
    adaptive = load_profile("seed.adaptive-tp8").model_copy(update=flat)
    for config, static in ((None, "seed.chain3-tp8"), ({"1": {"candidate_steps": [1]}}, "seed.chain1-tp8")):
        got, engine = await _tokens_per_sim_second(adaptive, c, config)
        want, _ = await _tokens_per_sim_second(load_profile(static).model_copy(update=flat), c)
        assert got == pytest.approx(want, rel=0.10), (config, static)
        assert engine.adaptive.steps_for(c) == (3 if config is None else 1)


async def test_high_batch_turns_drafting_off_and_pays_more_than_a_baseline():
    adaptive = load_profile("seed.adaptive-tp8").model_copy(update={"max_running_requests": 64})
    got, engine = await _tokens_per_sim_second(adaptive, 64, max_tokens=40)
    base, _ = await _tokens_per_sim_second(load_profile("seed.baseline-tp8"), 64, max_tokens=40)
    assert engine.adaptive.steps_for(64) == 0 and engine.verify_calls_total < engine.steps_total
    assert got < base  # "off" is not free: the draft's extend pass runs every step


# --- through SGLang's protocol ---------------------------------------------------------------------------------


async def _hold(url: str, n: int, session: aiohttp.ClientSession) -> list[asyncio.Task]:
    body = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}

    async def one(i: int) -> None:
        async with session.post(f"{url}/v1/chat/completions", json=body | {"messages": [
                {"role": "user", "content": f"hold {i}"}]}) as r:
            async for _ in r.content:
                pass

    return [asyncio.create_task(one(i)) for i in range(n)]


@pytest.mark.parametrize("running,allowed,expected", [(1, [1, 3, 5, 7], 3), (8, [0, 1, 3], 3), (32, [0, 1], 1),
                                                      (64, [0], 0)])
async def test_server_picks_its_steps_by_running_requests(sim_factory, running, allowed, expected):
    sim = await sim_factory("adaptive-tp8", speedup=50.0, max_running_requests=64)
    async with aiohttp.ClientSession() as s:
        tasks = await _hold(sim.url, running, s)
        try:
            async with asyncio.timeout(60):
                while True:
                    async with s.get(f"{sim.url}/_sim/stats") as r:
                        stats = await r.json()
                    slot = stats["adaptive"][str(specadaptive.Controller().slot_key(running))]
                    if stats["running"] == running and slot["batches"] > 20:
                        break
                    await asyncio.sleep(0.05)
            assert slot["candidate_steps"] == allowed
            assert stats["draft_steps"] == expected == slot["steps"]
            async with s.get(f"{sim.url}/v1/loads") as r:
                loads = (await r.json())["loads"][0]
            assert loads["num_running_reqs"] == running
            spec = loads["speculative"]  # SGLang's shape: both fields, the rate over proposed drafts
            assert set(spec) == {"accept_length", "accept_rate"} and 0 <= spec["accept_rate"] <= 1
            async with s.get(f"{sim.url}/server_info") as r:
                info = await r.json()
            assert info["speculative_adaptive"] is True and info["speculative_eagle_topk"] == 1
            assert info["speculative_num_steps"] == 3 and info["speculative_algorithm"] == "EAGLE3"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
