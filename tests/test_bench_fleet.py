"""`spec-bench plan --fleet`: how many of N servers should speculate for a trace and a class mix (bench.fleet)."""
from __future__ import annotations

import json

import pytest

from bench import classmix, fleet
from bench.__main__ import main as bench_main
from bench.replay import TraceRequest
from bench.sim import presets, stepcost

pytestmark = pytest.mark.timeout(120)


def _trace(n: int = 40, every_s: float = 2.0, prompt: int = 4096, output: int = 200) -> list[TraceRequest]:
    """n requests, one conversation in two re-sending the previous request's first 4 blocks."""
    out = []
    for i in range(n):
        ids = tuple(range(100 * (i // 2), 100 * (i // 2) + prompt // fleet.BLOCK_TOKENS))
        out.append(TraceRequest(i * every_s * 1000, prompt, output, ids, i + 1))
    return out


def _write(path, reqs):
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in reqs))
    return path


def test_traffic_counts_the_prefix_an_earlier_request_sent():
    t = fleet.traffic_of(_trace(4), span_s=8.0)
    assert t.rate == 0.5 and t.prompts == (4096,) * 4
    assert t.reused == (0, 4095, 0, 4095)  # the second of each pair re-sends it all (one token stays uncached)
    half = fleet.traffic_of(_trace(4), span_s=8.0, token_scale=2.0)
    assert half.prompts == (2048,) * 4 and half.outputs == (100,) * 4


def test_a_server_slows_with_its_rate_and_overloads_past_its_limit():
    box = presets.box("compose")
    prof = stepcost.derive_profile(box, stepcost.BASELINE, 8)
    t = fleet.traffic_of(_trace(), span_s=80.0)
    light, busy = (fleet.load_on(prof, r, t, t.reused) for r in (0.05, 1.0))
    assert not light.overloaded and not busy.overloaded
    assert light.running < busy.running and light.tpot_ms < busy.tpot_ms
    assert light.ttft_share(10_000) == 1.0 and busy.ttft_share(1.0) == 0.0
    # Little's law holds at the fixed point: running = rate x output x time per token
    assert busy.running == pytest.approx(1.0 * t.mean_output * busy.tpot_ms / 1000, rel=0.01)
    assert fleet.load_on(prof, 100.0, t, t.reused).overloaded


def test_targets_keep_servers_apart_and_the_model_error_moves_only_speculation():
    box = presets.box("compose")
    base = stepcost.derive_profile(box, stepcost.BASELINE, 4)
    spec = stepcost.derive_profile(box, stepcost.setting("chain3-good"), 4)
    t = fleet.traffic_of(_trace(), span_s=80.0)  # 0.5 requests/s: a baseline server never runs 25 ms a token
    classes = tuple(classmix.build("interactive=0.3,default=0.7", ["interactive=tpot:25"]))
    blind = fleet.blind(2, 0, base, spec, t, classes, t.reused)
    ours = fleet.evaluate(2, 0, base, spec, t, classes, t.reused)
    assert ours.goodput >= blind.goodput
    one = fleet.evaluate(2, 1, base, spec, t, classes, t.reused)
    assert one.kept == (1, 0) and one.targeted == 1.0, "the speculative server is kept for the targets"
    assert one.attainment == {"interactive": 1.0, "default": 1.0} and blind.attainment["interactive"] == 0.0
    slow = fleet._scaled(spec, 0.5)
    assert slow.step_ms(1) == pytest.approx(1.5 * spec.step_ms(1))
    assert fleet.evaluate(2, 0, base, slow, t, classes, t.reused).goodput == ours.goodput


def test_plan_fleet_prints_every_split_and_its_range(tmp_path, capsys):
    trace = _write(tmp_path / "t.jsonl", _trace())
    out = tmp_path / "plan.json"
    rc = bench_main(["plan", "--preset", "compose", "--fleet", "2", "--fleet-tp", "4", "--trace", str(trace),
                     "--speculative", "chain3-good", "--class-targets", "interactive=tpot:25", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "Fleet: 2 servers of TP4" in text and "(8 GPUs in every row)" in text
    for k in range(3):
        assert f"| {k} of 2 | ours, targets |" in text
    assert "| 0 of 2 | class-blind |" in text and "| 2 of 2 | class-blind |" in text
    doc = json.loads(out.read_text())["fleet"]
    assert [s["speculative"] for s in doc["splits"]] == [0, 1, 2]
    for s in doc["splits"]:
        assert s["low"] <= s["goodput"] <= s["high"]
    winners = doc["winners"]
    line = next(x for x in text.splitlines() if x.startswith("Recommendation"))
    assert ("uncertain: " in line) == (len(winners) > 1)


def test_plan_fleet_on_given_profiles(tmp_path, capsys):
    trace = _write(tmp_path / "t.jsonl", _trace())
    rc = bench_main(["plan", "--preset", "seed", "--fleet", "2", "--trace", str(trace),
                     "--fleet-profiles", "baseline-tp8,eagle3-tp8"])
    text = capsys.readouterr().out
    assert rc == 0 and "running profile eagle3-tp8" in text and "Fleet: 2 servers of TP8" in text


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--preset", "seed", "--fleet", "4", "--trace", "t.jsonl", "--fleet-profiles", "baseline-tp8"], "BASE,SPEC"),
    (["--preset", "seed", "--fleet", "4", "--trace", "t.jsonl", "--fleet-profiles", "baseline-tp8,nope"], "nope"),
    (["--preset", "seed", "--trace", "t.jsonl"], "--fleet N"),
    (["--preset", "seed", "--fleet", "4"], "--trace"),
    (["--fleet", "4", "--trace", "t.jsonl"], "--preset or --shape"),
    (["--preset", "seed", "--fleet", "4", "--fleet-tp", "3", "--trace", "t.jsonl"], "--fleet-tp 3"),
    (["--preset", "seed", "--fleet", "4", "--trace", "t.jsonl", "--class-mix", "a=0.5"], "--class-mix"),
    (["--preset", "seed", "--fleet", "4", "--trace", "t.jsonl", "--speculative", "chainx"], "chainx"),
    (["--preset", "seed", "--fleet", "4", "--trace", "missing.jsonl"], "no such file"),
])
def test_plan_fleet_bad_flags_are_one_line(tmp_path, monkeypatch, capsys, argv, fragment):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "t.jsonl", _trace(4))
    assert bench_main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and err.startswith("spec-bench plan:")
