"""The engine model, profiles, the fit and the sim CLI: behaviour without HTTP where possible."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.sim import fit as fitmod
from bench.sim.engine import Engine, QueueFull, build_request, is_coding
from bench.sim.profiles import ProfileError, builtin_names, load_profile, load_profile_file

REPO = Path(__file__).resolve().parents[1]
SEED_CSV = REPO / "bench" / "data" / "seed_benchmark.csv"  # a copy of shared/data/seed_benchmark.csv
TABLE = "concurrency,eagle3_tok_s,baseline_tok_s\n" + "\n".join(
    f"{c},{e},{b}" for c, e, b in [(1, 77.5, 92.6), (2, 125.1, 159.7), (5, 183.2, 292.5), (10, 239.6, 457.2),
                                   (30, 299.5, 711.0), (70, 337.7, 784.2), (100, 338.8, 761.6),
                                   (250, 340.9, 772.1)])


def req(profile, prompt="hello", **kw):
    args = {"max_tokens": 64, "stop": [], "ignore_eos": True, "stream": True, **kw}
    return build_request("r", prompt, 5, profile=profile, seed=0, **args)


def test_builtin_profiles_load_and_eagle_is_capped_at_48():
    assert {"baseline-tp8", "eagle3-tp8", "baseline-tp4", "eagle3-tp4", "eagle3-good-tp8", "eagle3-good-tp4"} <= set(
        builtin_names())
    for name in builtin_names():
        p = load_profile(name)
        assert p.step_ms(1) > 0 and p.step_ms(p.max_running_requests + 10) >= p.step_ms(p.max_running_requests)
    assert load_profile("eagle3-tp8").max_running_requests == 48
    assert load_profile("eagle3-tp8").max_accept == 3


def test_good_drafter_beats_baseline_only_at_low_concurrency():
    good, base = load_profile("eagle3-good-tp8"), load_profile("baseline-tp8")
    thr = {c: (fitmod.predict(good, c, 512, 23), fitmod.predict(base, c, 512, 23)) for c in (1, 2, 30, 100)}
    assert thr[1][0] > thr[1][1] and thr[2][0] > thr[2][1]
    assert thr[30][0] < thr[30][1] and thr[100][0] < thr[100][1]


def test_profile_errors_are_one_line(tmp_path):
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="not found"):
        load_profile_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile_file(bad)
    bad.write_text(json.dumps({"decode_a_ms": -1, "decode_b_ms": 1}))
    with pytest.raises(ProfileError, match="decode_a_ms"):
        load_profile_file(bad)
    spec = load_profile("eagle3-tp8").model_dump()
    bad.write_text(json.dumps({**spec, "accept_length_general": 3.5}))
    with pytest.raises(ProfileError, match="num_steps"):
        load_profile_file(bad)


def test_output_is_decided_by_prompt_and_seed():
    p = load_profile("baseline-tp8")
    a, b = req(p), req(p)
    assert a.text == b.text and a.tokens == b.tokens
    assert req(p, prompt="other").text != a.text
    assert req(p, max_tokens=10).text == "".join(a.tokens[:10])  # a shorter output is a prefix


def test_coding_prompts_accept_more_tokens():
    p = load_profile("eagle3-tp8")
    assert is_coding("Write a Python function that reverses a list")
    assert not is_coding("Why is the sky blue?")
    assert req(p, prompt="Write a Python function").accept_rate > req(p, prompt="Why is the sky blue?").accept_rate


async def test_engine_batches_up_to_the_cap_and_queues_the_rest():
    p = load_profile("eagle3-tp8")
    engine = Engine(p, speedup=1000.0, max_queued_requests=10)
    engine.start()
    try:
        reqs = [build_request(f"r{i}", f"p{i}", 5, profile=p, seed=0, max_tokens=30, stop=[], ignore_eos=True,
                              stream=True) for i in range(58)]
        for r in reqs:
            engine.submit(r)
        with pytest.raises(QueueFull):
            engine.submit(build_request("x", "x", 5, profile=p, seed=0, max_tokens=1, stop=[], ignore_eos=True,
                                        stream=True))
        await asyncio.sleep(0)
        peak = 0
        for r in reqs:
            while True:
                piece, finished = await r.outbox.get()
                peak = max(peak, engine.num_running)
                if finished:
                    break
        for r in reqs:
            assert r.state == "finished" and r.generated == 30
        assert peak <= 48
        assert engine.completed_total == 58 and engine.num_running == 0 and engine.num_queued == 0
        # EAGLE: between 1 and num_steps+1 tokens per step, about the profile's mean on average
        assert 2.2 < engine.avg_accept_length() < 2.8
    finally:
        await engine.close()


async def test_abort_frees_the_slot_at_once():
    p = load_profile("baseline-tp8")
    engine = Engine(p, speedup=10.0, max_running_requests=1)
    engine.start()
    try:
        first, second = (build_request(n, n, 5, profile=p, seed=0, max_tokens=5000, stop=[], ignore_eos=True,
                                       stream=True) for n in ("a", "b"))
        engine.submit(first)
        engine.submit(second)
        await first.outbox.get()
        assert engine.num_running == 1 and engine.num_queued == 1
        assert engine.abort(first) and not engine.abort(first)
        assert engine.aborted_total == 1 and engine.num_running == 0
        await second.outbox.get()  # the queued request got the slot
        assert second.state == "running"
    finally:
        await engine.close()


def test_fit_reproduces_the_seed_table_and_is_deterministic(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("# comment lines are skipped\n" + TABLE + "\n")
    outs = []
    for i in range(2):
        out = tmp_path / f"p{i}.json"
        assert fitmod.main(["--csv", str(csv), "--column", "eagle3_tok_s", "--speculative", "--accept-length", "2.5",
                            "--name", "fitted", "--out", str(out)]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1]
    prof = load_profile_file(tmp_path / "p0.json")
    assert prof.speculative and prof.max_running_requests == 48
    for c, v in fitmod.read_table(csv, "eagle3_tok_s"):
        assert abs(fitmod.predict(prof, c, 512, 23) / v - 1) < 0.06


def test_points_shape_reproduces_every_row(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text(TABLE)
    out = tmp_path / "b.json"
    assert fitmod.main(["--csv", str(csv), "--column", "baseline_tok_s", "--shape", "points", "--out", str(out)]) == 0
    prof = load_profile_file(out)
    assert prof.step_points_ms[0][0] == 1 and prof.step_points_ms[-1][0] == prof.max_running_requests
    for c, v in fitmod.read_table(csv, "baseline_tok_s"):
        assert abs(fitmod.predict(prof, c, 512, 23) / v - 1) < 0.02
    # beyond the last point the step keeps growing along the last segment
    n = prof.max_running_requests
    assert prof.step_ms(2 * n) > prof.step_ms(n)


def test_shipped_profiles_match_the_seed_table():
    rows = TABLE.splitlines()[1:]
    for name, col in (("eagle3-tp8", 1), ("baseline-tp8", 2)):
        prof = load_profile(name)
        for row in rows:
            c, v = int(row.split(",")[0]), float(row.split(",")[col])
            assert abs(fitmod.predict(prof, c, 512, 23) / v - 1) < 0.02, (name, c)


def test_fit_cli_on_the_shared_table(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "bench", "fit", "--csv", str(SEED_CSV), "--column", "baseline_tok_s",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "concurrency  measured  model  error" in r.stdout
    assert load_profile_file(out).name == "b"


@pytest.mark.parametrize("argv, needle", [
    (["fit", "--csv", "/nonexistent.csv", "--column", "x", "--out", "/tmp/x.json"], "cannot read"),
    (["fit", "--csv", "{csv}", "--column", "nope", "--out", "/tmp/x.json"], "no column"),
    (["fit", "--csv", "{csv}"], "required"),
    (["sim", "--profile", "nope", "--port", "0"], "unknown profile"),
    (["sim", "--profile-file", "/nonexistent.json", "--port", "0"], "not found"),
    (["sim", "--error-rate", "2", "--port", "0"], "--error-rate"),
    (["sim", "--speedup", "0", "--port", "0"], "speedup"),
    (["sim", "--port", "70000"], "--port"),
    (["sim", "--bogus"], "unrecognized"),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    from bench.__main__ import main

    csv = tmp_path / "t.csv"
    csv.write_text(TABLE)
    argv = [a.replace("{csv}", str(csv)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_cli_port_in_use_is_exit_2_in_a_real_process():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "bench", "sim", "--port", str(port)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot listen" in r.stderr


def test_tp4_profiles_are_derived_from_the_tp8_fits():
    from bench.sim.profiles import tp4_estimate

    for tp4, tp8 in (("baseline-tp4", "baseline-tp8"), ("eagle3-tp4", "eagle3-tp8"),
                     ("eagle3-good-tp4", "eagle3-good-tp8")):
        shipped = load_profile(tp4)
        assert shipped == tp4_estimate(load_profile(tp8), tp4, shipped.description), tp4
        assert shipped.tp_size == 4 and "ESTIMATE" in shipped.description


def test_decode_step_grows_with_the_kv_the_batch_holds():
    p = load_profile("baseline-tp8")
    engine = Engine(p)
    short = [build_request(f"s{i}", f"s{i}", 100, profile=p, seed=0, max_tokens=10, stop=[], ignore_eos=True,
                           stream=True) for i in range(8)]
    long = [build_request(f"l{i}", f"l{i}", 30_000, profile=p, seed=0, max_tokens=10, stop=[], ignore_eos=True,
                          stream=True) for i in range(8)]
    assert engine.step_ms(short) == pytest.approx(p.step_ms(8) + p.kv_ms_per_ktoken * 0.8)
    # eight 30k-token contexts: attention reads 240k tokens each step, a quarter more than the batch-size curve
    assert engine.step_ms(long) == pytest.approx(p.step_ms(8) + p.kv_ms_per_ktoken * 240)
    assert engine.step_ms(long) > 1.2 * engine.step_ms(short)


async def test_a_long_prompt_is_prefilled_in_chunks_that_delay_the_running_batch():
    p = load_profile("baseline-tp8")
    engine = Engine(p, speedup=1000.0)
    engine.start()
    try:
        running = build_request("a", "a", 20, profile=p, seed=0, max_tokens=500, stop=[], ignore_eos=True,
                                stream=True)
        engine.submit(running)
        await running.outbox.get()
        await running.outbox.get()  # decoding now
        long = build_request("b", "b", 30_000, profile=p, seed=0, max_tokens=1, stop=[], ignore_eos=True,
                             stream=True)
        seen = {}
        # the long request finishes with its first token: snapshot the engine in that very step
        engine.on_finish = lambda req: seen.setdefault(req.rid, (engine.steps_total, engine.busy_s, running.generated))
        steps, busy, generated = engine.steps_total, engine.busy_s, running.generated
        engine.submit(long)
        await long.outbox.get()
        steps_then, busy_then, generated_then = seen["b"]
        chunks = -(-30_000 // p.chunked_prefill_size)  # 4 chunks of at most 8192 tokens
        # the step in flight when it arrived (already counted in busy_s), then one step per chunk; its first
        # token came with the last chunk
        assert steps_then - steps == 1 + chunks
        # the running request kept decoding meanwhile (its token of that last step comes just after) ...
        assert generated_then - generated == chunks
        decode = sum(p.step_ms(1) + p.kv_ms_per_ktoken * (20 + generated + 1 + i) / 1000 for i in range(chunks))
        # attention: every token of the prompt attends to all before it, chunk by chunk: 30000*30001/2 pairs
        prefill = (chunks * p.prefill_base_ms + 30_000 * p.prefill_ms_per_token
                   + p.prefill_attention_ms_per_mpair * 30_000 * 30_001 / 2 / 1e6)
        # ... but each of those steps also carried a chunk of the prefill (simulated seconds)
        assert busy_then - busy == pytest.approx((decode + prefill) / 1000, rel=1e-6)
    finally:
        await engine.close()


def test_each_request_draws_its_own_accept_length_around_its_class_mean():
    from bench.sim.engine import request_accept_length

    p = load_profile("eagle3-tp8")
    engine = Engine(p)
    general = [build_request(f"g{i}", f"Why is the sky blue? {i}", 5, profile=p, seed=0, max_tokens=5, stop=[],
                             ignore_eos=True, stream=True) for i in range(400)]
    coding = [build_request(f"c{i}", f"Write a Python function {i}", 5, profile=p, seed=0, max_tokens=5, stop=[],
                            ignore_eos=True, stream=True) for i in range(400)]

    def lengths(reqs):
        return [request_accept_length(p, engine.mean_accept_length(r.coding), r.accept_z) for r in reqs]

    g, c = lengths(general), lengths(coding)
    assert len(set(g)) > 50 and min(g) >= 1.0 and max(c) <= 3.0
    assert sum(g) / len(g) == pytest.approx(2.5, abs=0.05)
    assert sum(c) / len(c) == pytest.approx(2.61, abs=0.06)  # a little below: clipped at num_steps + 1
    sd = (sum((x - 2.5) ** 2 for x in g) / len(g)) ** 0.5
    assert sd == pytest.approx(p.accept_length_spread, rel=0.2)
    # the same prompt and seed always draw the same length
    assert general[0].accept_z == build_request("x", general[0].prompt_text, 5, profile=p, seed=0, max_tokens=5,
                                                stop=[], ignore_eos=True, stream=True).accept_z


async def test_long_contexts_slow_a_loaded_server_down():
    """Closed loop at 32 clients: 16k-token prompts make every decode step read more KV than 23-token ones."""
    p = load_profile("baseline-tp8")

    async def tokens_per_sim_second(prompt_tokens: int) -> float:
        engine = Engine(p, speedup=1000.0)
        engine.start()
        try:
            reqs = [build_request(f"r{i}", f"p{i}", prompt_tokens, profile=p, seed=0, max_tokens=200, stop=[],
                                  ignore_eos=True, stream=True) for i in range(32)]
            for r in reqs:
                engine.submit(r)
            for r in reqs:
                while not (await r.outbox.get())[1]:
                    pass
            return 32 * 200 / engine.busy_s
        finally:
            await engine.close()

    short, long = await tokens_per_sim_second(23), await tokens_per_sim_second(16_000)
    assert long < 0.9 * short
