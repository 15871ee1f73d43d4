"""`bench plan` and bench.breakeven: break-even from measured curves, checked on hand-computed cases."""
from __future__ import annotations

import json

import pytest

from bench import breakeven, calibration, plan


def figs(points: dict[int, float]) -> list[dict]:
    return [{"concurrency": c, "output_throughput": t, "median_e2e_latency_ms": 1000.0, "completed": 4}
            for c, t in points.items()]


def compare_json(kind: str, spec: dict, base: dict, routed: dict, tp8: dict, gpus: int = 8) -> dict:
    results = {"all-baseline": figs(base), "all-speculative": figs(spec), "balanced": figs(routed),
               "tp8": figs(tp8)}
    return {"config": {"deployment": kind}, "results": results,
            "configs": ["all-baseline", "all-speculative", "balanced"],
            "references": {"tp8": {"profile": "baseline-tp8", "url": None, "gpus": 8}},
            "gpus": {"all-baseline": gpus, "all-speculative": gpus, "balanced": gpus, "tp8": 8}}


# The split: TP4 pools, speculative slower than its baseline at one stream.
SPLIT = compare_json("split", spec={1: 45.0, 2: 80.0, 10: 150.0}, base={1: 50.0, 2: 95.0, 10: 250.0},
                     routed={1: 50.0, 2: 130.0, 10: 330.0}, tp8={1: 90.0, 2: 160.0, 10: 450.0})


def test_nothing_beats_tp8_says_so_first():
    p = breakeven.make_plan([SPLIT])
    assert p.reference == "tp8" and p.wins == {"split + balanced": []}
    assert all(p.best[c] == "tp8" for c in (1, 2, 10))
    first = breakeven.render(p).splitlines()[0]
    assert first == ("RUN tp8 [8 GPUs]: nothing measured here beats it at any load "
                     "(the closest, split + balanced, reaches 0.56-0.81x of its throughput).")


def test_needed_speedup_by_hand():
    p = breakeven.make_plan([SPLIT])
    assert p.today["split"] == pytest.approx(45 / 50)
    need = p.needed["split"]
    # c=1: the speculative server alone must reach 90: s = 90/45 = 2, i.e. 2 x 0.9 = 1.8x over its baseline.
    assert need[1] == pytest.approx(1.8)
    # c=2: k=1: (160-50)/45 = 2.444; k=2: 160/80 = 2.0 -> s = 2.0 -> 1.8x
    assert need[2] == pytest.approx(1.8)
    # c=10, k requests on the speculative server, curves linear between levels:
    #   S(k) = 80 + 70(k-2)/8 for k >= 2, B(m) = 95 + 155(m-2)/8 for m >= 2, B(1) = 50
    #   k=2: (450 - 211.25)/80 = 2.984; k=7: (450 - 114.375)/123.75 = 2.712; k=8: (450 - 95)/132.5 = 2.679;
    #   k=9: (450 - 50)/141.25 = 2.832; k=10: 450/150 = 3.0 -> k=8 is best
    assert need[10] == pytest.approx((450 - 95) / 132.5 * 0.9)
    text = breakeven.render(p)
    assert "today 0.90x" in text and "c=1 1.80x" in text and "matches tp8 at no load measured" in text


def test_colocated_needs_the_speculative_server_alone_to_match():
    spec, base, ref = calibration.Curve([1, 10], [80.0, 300.0], [1, 1]), calibration.Curve([1, 10], [90.0, 450.0], [1, 1]), 90.0
    assert breakeven.needed_scale("colocated", spec, base, ref, 1) == 0.0  # its baseline half already matches
    assert breakeven.needed_scale("colocated", spec, base, 120.0, 1) == pytest.approx(1.5)
    assert breakeven.needed_scale("colocated", spec, base, 600.0, 10) == pytest.approx(2.0)
    assert breakeven.needed_scale("split", calibration.Curve([1], [0.0], [1]), base, 600.0, 1) is None


def test_a_candidate_that_wins_somewhere():
    colo = compare_json("colocated", spec={1: 120.0, 2: 170.0, 10: 300.0}, base={1: 88.0, 2: 155.0, 10: 440.0},
                        routed={1: 120.0, 2: 163.0, 10: 440.0}, tp8={1: 90.0, 2: 160.0, 10: 450.0})
    p = breakeven.make_plan([SPLIT, colo])
    assert p.wins == {"split + balanced": [], "colocated + balanced": [1]}  # 163/160 at c=2 is within noise
    assert p.best == {1: "colocated + balanced", 2: "tp8", 10: "tp8"}
    assert breakeven.render(p).splitlines()[0] == "Beats tp8 [8 GPUs]: colocated + balanced at c=1; at c=2,10 run tp8."
    # the speculative server alone must reach 90 at c=1: 90/120 of today's, i.e. 90/88 over its baseline
    assert p.needed["colocated"][1] == pytest.approx(90 / 88)


def test_unequal_hardware_is_flagged():
    p = breakeven.make_plan([compare_json("split", {1: 1.0}, {1: 1.0}, {1: 100.0}, {1: 90.0}, gpus=16)])
    assert "UNEQUAL HARDWARE: split + balanced uses 16 GPUs, tp8 uses 8 GPUs" in breakeven.render(p)


def test_cli(tmp_path, capsys):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(SPLIT))
    assert plan.main([str(f), "--json", str(tmp_path / "p.json")]) == 0
    assert capsys.readouterr().out.startswith("RUN tp8")
    assert json.loads((tmp_path / "p.json").read_text())["run"] == {"1": "tp8", "2": "tp8", "10": "tp8"}
    no_ref = dict(SPLIT, references={})
    f.write_text(json.dumps(no_ref))
    assert plan.main([str(f)]) == 2
    assert "no reference deployment" in capsys.readouterr().err
    f.write_text(json.dumps(SPLIT))
    assert plan.main([str(f), "--against", "nope"]) == 2
    assert plan.main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "no such reference" in err and "cannot read" in err


def test_each_candidate_is_judged_against_its_own_runs_reference_and_other_references_count():
    # The same TP8 baseline measured in two runs reads 450 and 400 at c=10; the co-located pair (440, its
    # own run read 450) must not "beat" the other run's 400. A TP8 EAGLE-3 reference faster at c=1 wins there.
    colo = compare_json("colocated", spec={1: 80.0, 2: 150.0, 10: 250.0}, base={1: 90.0, 2: 160.0, 10: 440.0},
                        routed={1: 90.0, 2: 160.0, 10: 440.0}, tp8={1: 90.0, 2: 160.0, 10: 450.0})
    split = compare_json("split", spec={1: 45.0, 2: 80.0, 10: 150.0}, base={1: 50.0, 2: 95.0, 10: 250.0},
                         routed={1: 50.0, 2: 130.0, 10: 330.0}, tp8={1: 90.0, 2: 160.0, 10: 400.0})
    split["references"]["tp8-eagle3"] = {"profile": "eagle3-good-tp8", "url": None, "gpus": 8}
    split["results"]["tp8-eagle3"] = figs({1: 140.0, 2: 200.0, 10: 380.0})
    split["gpus"]["tp8-eagle3"] = 8
    p = breakeven.make_plan([split, colo])
    assert p.reference == "tp8"  # the non-speculative profile reference, not the EAGLE-3 one
    assert p.ratios["colocated + balanced"][10] == pytest.approx(440 / 450)
    assert p.ratios["tp8-eagle3"][1] == pytest.approx(140 / 90)
    assert p.best == {1: "tp8-eagle3", 2: "tp8-eagle3", 10: "tp8"}
    assert breakeven.render(p).splitlines()[0] == "Beats tp8 [8 GPUs]: tp8-eagle3 at c=1,2; at c=10 run tp8."
