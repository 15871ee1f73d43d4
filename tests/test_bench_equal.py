"""Equal hardware: reference parsing, GPU counts, per-level verdicts by hand, and compare with references
end to end on simulators."""
from __future__ import annotations

import argparse
import csv
import json

import pytest

from bench import calibration, compare, equal

FAST = 50.0


def fig(c: int, tput: float, e2e_ms: float, completed: int = 4) -> dict:
    return {"concurrency": c, "output_throughput": tput, "median_e2e_latency_ms": e2e_ms, "completed": completed,
            "failed": 0}


@pytest.mark.parametrize("text, want", [
    ("tp8=profile:baseline-tp8", equal.Reference("tp8", None, profile="baseline-tp8")),
    ("tp8=profile:baseline-tp8@4", equal.Reference("tp8", 4, profile="baseline-tp8")),
    ("mine=http://127.0.0.1:9/v1/", equal.Reference("mine", None, url="http://127.0.0.1:9")),
    ("mine=http://10.0.0.1:30000@8", equal.Reference("mine", 8, url="http://10.0.0.1:30000")),
])
def test_parse_reference(text, want):
    assert equal.parse_reference(text) == want


@pytest.mark.parametrize("text", ["tp8", "=profile:x", "a=ftp://x", "a=http://x@0", "a=http://x@eight",
                                  "a=profile:"])
def test_parse_reference_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        equal.parse_reference(text)


def test_resolve_gpus_from_profile_flag_or_error():
    refs = [equal.parse_reference("a=profile:baseline-tp8"), equal.parse_reference("b=profile:baseline-tp4"),
            equal.parse_reference("c=http://127.0.0.1:1@2"), equal.parse_reference("d=http://127.0.0.1:1")]
    assert [r.gpus for r in equal.resolve_gpus(refs, 8)] == [8, 4, 2, 8]
    with pytest.raises(ValueError, match="say how many GPUs"):
        equal.resolve_gpus(refs, None)


def test_adaptive_speculation_is_a_reference_of_the_same_8_gpus():
    refs = [equal.parse_reference("tp8-adaptive=profile:adaptive-tp8"),
            equal.parse_reference("nv=profile:kimi-k25-h200-nvlink.adaptive-good-tp8")]
    assert [r.gpus for r in equal.resolve_gpus(refs, None)] == [8, 8]


def test_judge_by_hand():
    results = {"balanced": [fig(1, 50, 2000), fig(10, 500, 3000)],
               "tp8": [fig(1, 100, 1000), fig(10, 400, 4000)]}
    gpus = {"balanced": 8, "tp8": 8}
    rows = equal.judge(results, ["balanced"], ["tp8"], gpus)
    p0, p1 = rows[0]["pairs"][0], rows[1]["pairs"][0]
    assert (p0["throughput_ratio"], p0["latency_ratio"]) == (0.5, 2.0)
    assert (p1["throughput_ratio"], p1["latency_ratio"]) == (1.25, 0.75)
    assert rows[0]["throughput_winner"] == "tp8" and rows[0]["throughput_margin"] == ["balanced", 2.0]
    assert rows[1]["throughput_winner"] == "balanced" and rows[1]["latency_margin"] == ["tp8", 4000 / 3000]
    lines = equal.verdict_lines(rows, ["balanced"], ["tp8"], gpus)
    assert lines[0] == ("verdict: throughput winner by load: tp8 at c=1; balanced at c=10 "
                        "(every deployment here uses 8 GPUs)")
    assert lines[1].startswith("c=1: throughput: tp8 [8 GPUs] wins, 2.00x of balanced")
    md = equal.render_markdown(results, rows, ["balanced"], ["tp8"], gpus)
    assert "| balanced [8 GPUs] | tp8 [8 GPUs] | balanced / tp8 |" in md and "| 1 | 50.0 | 100.0 | 0.50x |" in md


def test_one_winner_everywhere_says_by_how_much():
    results = {"split": [fig(1, 50, 2000), fig(10, 300, 3000)], "tp8": [fig(1, 100, 1000), fig(10, 400, 2500)]}
    gpus = {"split": 8, "tp8": 8}
    rows = equal.judge(results, ["split"], ["tp8"], gpus)
    assert equal.headline(rows, ["split"], ["tp8"], gpus) == (
        "verdict: tp8 wins on throughput at every level measured (c=1,10); the best router configuration "
        "reaches 0.50-0.75x of its throughput there (every deployment here uses 8 GPUs)")


def test_a_level_within_the_noise_band_is_a_tie():
    results = {"global": [fig(1, 91.9, 1000), fig(10, 300, 3000)], "tp8": [fig(1, 91.8, 1000), fig(10, 450, 2500)]}
    gpus = {"global": 8, "tp8": 8}
    rows = equal.judge(results, ["global"], ["tp8"], gpus)
    assert rows[0]["throughput_winner"] == "global"  # by 0.1%: not a win
    lines = equal.verdict_lines(rows, ["global"], ["tp8"], gpus)
    assert lines[0] == ("verdict: tp8 wins on throughput at the one other level (c=10); ties within the 3% noise band: "
                        "global and tp8 at c=1; the best router configuration reaches 0.67x of its throughput there "
                        "(every deployment here uses 8 GPUs)")
    assert lines[1].startswith("c=1: throughput: global and tp8 tie (1.00x, within the 3% noise band)")
    rows = equal.judge({"global": [fig(1, 91.9, 1000)], "tp8": [fig(1, 91.8, 1000)]}, ["global"], ["tp8"], gpus)
    assert equal.headline(rows, ["global"], ["tp8"], gpus) == (
        "verdict: no deployment wins on throughput by more than the 3% noise band at any level: global and tp8 "
        "at c=1 (every deployment here uses 8 GPUs)")


def test_a_winning_reference_says_which_other_reference_ties_it():
    """tp8-adaptive wins over the router's best by 1.33x, but tp8-baseline is within the noise band of it (the
    plan, which needs a 3% win over the baseline, names the baseline there): the level's line says so."""
    results = {"global": [fig(1, 75, 1000), fig(4, 300, 1000)], "base": [fig(1, 98, 1000), fig(4, 310, 1000)],
               "adaptive": [fig(1, 100, 1000), fig(4, 400, 1000)]}
    gpus = {"global": 8, "base": 8, "adaptive": 8}
    rows = equal.judge(results, ["global"], ["base", "adaptive"], gpus)
    lines = equal.verdict_lines(rows, ["global"], ["base", "adaptive"], gpus)
    assert lines[1].startswith("c=1: throughput: adaptive [8 GPUs] wins, 1.33x of global (base within the 3% noise "
                               "band of it); median latency:")
    assert lines[2].startswith("c=4: throughput: adaptive [8 GPUs] wins, 1.33x of global; median latency:")


def test_unequal_hardware_is_said_in_the_same_line():
    results = {"split": [fig(1, 150, 900)], "tp8": [fig(1, 100, 1000)]}
    gpus = {"split": 16, "tp8": 8}
    rows = equal.judge(results, ["split"], ["tp8"], gpus)
    lines = equal.verdict_lines(rows, ["split"], ["tp8"], gpus)
    assert all("UNEQUAL HARDWARE: split 16 GPUs, tp8 8 GPUs" in line for line in lines)
    assert "UNEQUAL HARDWARE" in equal.render_markdown(results, rows, ["split"], ["tp8"], gpus).splitlines()[0]


def test_global_threshold_where_the_curves_cross():
    spec = calibration.Curve([1, 10, 30], [100.0, 400.0, 500.0], [1000.0, 2000.0, 3000.0])
    base = calibration.Curve([1, 10, 30], [80.0, 380.0, 700.0], [1000.0, 2000.0, 3000.0])
    # spec - base: +20 at 10, -200 at 30; straight lines cross at 10 + 20/220 * 20 = 11.8
    assert compare.global_threshold(spec, base) == 11
    slower = calibration.Curve([1, 10, 30], [70.0, 300.0, 400.0], [1.0, 1.0, 1.0])
    assert compare.global_threshold(slower, base) == 0
    always = calibration.Curve([1, 10, 30], [100.0, 400.0, 800.0], [1.0, 1.0, 1.0])
    assert compare.global_threshold(always, base) == 30
    assert [compare.default_hysteresis(t) for t in (0, 1, 11, 40)] == [0, 1, 2, 10]


def test_compare_with_references_end_to_end(tmp_path, capsys):
    # A split of two TP4 simulators against a TP8 simulator several times faster per step and a TP8 one far
    # slower: the fast one must win the verdict, the slow one never. The gaps are wide, and the clock slow
    # enough, that HTTP and router overhead on a busy machine cannot reorder them.
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    fast.write_text(json.dumps({"name": "fast", "decode_a_ms": 2.0, "decode_b_ms": 0.1, "tp_size": 8}))
    slow.write_text(json.dumps({"name": "slow", "decode_a_ms": 300.0, "decode_b_ms": 5.0, "tp_size": 8}))
    rc = compare.main(["--speculative-profile", "eagle3-tp4", "--baseline-profile", "baseline-tp4",
                       "--reference", f"tp8=profile:{fast}", "--reference", f"slow=profile:{slow}",
                       "--configs", "balanced", "--concurrency", "1,2", "--requests-per-level", "3",
                       "--max-tokens", "16", "--speedup", "10", "--out", str(tmp_path), "--name", "eq"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    data = json.loads((tmp_path / "eq.json").read_text())
    assert list(data["results"]) == ["all-baseline", "all-speculative", "balanced", "tp8", "slow"]
    assert data["gpus"] == {"all-baseline": 8, "all-speculative": 8, "balanced": 8, "tp8": 8, "slow": 8}
    for row in data["equal_hardware"]:
        assert row["throughput_winner"] == "tp8"
        ratios = {(p["config"], p["reference"]): p["throughput_ratio"] for p in row["pairs"]}
        assert ratios[("balanced", "tp8")] < 1.0 < ratios[("balanced", "slow")]
        assert row["latency_winner"] != "slow"
    assert data["equal_hardware_text"][0].startswith("verdict: tp8 wins on throughput at every level measured")
    text = (tmp_path / "eq.txt").read_text()
    assert text.splitlines()[2] == data["equal_hardware_text"][0]  # the verdict comes first
    assert "GPUs per column:" in text and "(equal hardware)" in text
    md = (tmp_path / "eq.md").read_text()
    assert "| balanced [8 GPUs] |" in md and "tp8 [8 GPUs]" in md and "balanced / tp8" in md
    with (tmp_path / "eq.csv").open() as fh:
        assert {(r["target"], r["gpus"]) for r in csv.DictReader(fh)} >= {("tp8", "8"), ("balanced", "8")}
    assert (tmp_path / "eq.png").exists()
    (tmp_path / "eq.md").unlink()
    assert compare.main(["--from-json", str(tmp_path / "eq.json")]) == 0
    assert (tmp_path / "eq.md").read_text() == md


@pytest.mark.parametrize("argv, fragment", [
    (["--reference", "x"], "expected NAME="),
    (["--reference", "mine=http://127.0.0.1:1"], "say how many GPUs"),
    (["--reference", "spillover=profile:baseline-tp8"], "differ from the configuration names"),
    (["--configs", "fastest"], "unknown configuration"),
    (["--speculative", "http://127.0.0.1:1", "--baseline", "http://127.0.0.1:2",
      "--reference", "r=profile:baseline-tp8"], "--gpus"),
    (["--reference", "r=profile:no-such-profile"], "no-such-profile"),
    (["--kv-share", "1.5"], "--kv-share"),
])
def test_compare_reference_bad_flags(argv, fragment, capsys):
    assert compare.main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err
