"""`bench plan` before anything is measured: presets, shape files, memory flags; and measured plans never
recommending a deployment that does not fit."""
from __future__ import annotations

import json
import re

import pytest

from bench import plan, planmodel
from bench.sim import presets


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = plan.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_seed_preset_says_first_that_the_split_and_the_pair_do_not_fit(capsys):
    rc, out, _ = run(capsys, "--preset", "seed")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("memory: the TP4+TP4 split does not fit: 556 GiB of weights on 4 x 95.6 GiB")
    assert "the co-located pair does not fit: two copies of the weights" in lines[0]
    # the expert-coverage reason, with figures
    assert lines[1].startswith("why: a 16-token tree wakes ~110 of 384 experts per layer against 8 for a decode; "
                               "a 3-token chain (2 steps) wakes ~24")
    assert any(ln.startswith("RUN (throughput): c=1") for ln in lines)
    assert any(ln.startswith("RUN (latency") for ln in lines)
    brk = next(ln for ln in lines if ln.startswith("break-even: "))
    assert brk.startswith("break-even: the split beats TP8 baseline at c >= 10 if a TP4 server's step is within "
                          "1.41x of TP8; measure one TP4 server with `spec-bench sweep` to know")
    assert brk.endswith(")") and "(moot here: the TP4+TP4 split does not fit" in brk
    # the tree never wins on the seed box: the model agrees with the measurement
    rows = [ln.split() for ln in lines if ln.strip()[:1].isdigit()]
    assert rows and all("tree" not in r[-2:] for r in rows)


def test_compose_default_fits_everything_and_says_how_many_kv_tokens(capsys):
    rc, out, _ = run(capsys, "--preset", "compose")
    assert rc == 0
    first, why = out.splitlines()[:2]
    assert first.startswith("memory: every deployment fits; TP8 baseline 1.68M;")
    assert "the TP4+TP4 split 617k/633k; the co-located pair 418k/431k KV tokens per server" in first
    assert why.startswith("why: Llama-3.3-70B is dense: every step reads all 141 GB of weights whatever its token")
    assert "co-located pair" in out and "global routing" in out


def test_memory_flags_alone_work_before_anything_is_measured(capsys, tmp_path):
    rc, out, _ = run(capsys, "--gpus", "8", "--gpu-memory-gb", "96", "--model-weights-gb", "605",
                     "--kv-bytes-per-token", "70272", "--json", str(tmp_path / "p.json"))
    assert rc == 0
    assert out.splitlines()[0].startswith("memory: the TP4+TP4 split does not fit: 605 GiB of weights on 4 x 96.0")
    assert "no step model without a preset or --shape" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["memory"]["split"]["fits"] is False and data["memory"]["tp-baseline"]["fits"] is True
    # a GQA model splits its KV heads over the ranks: 8x the tokens of the same bytes kept whole
    rc, out, _ = run(capsys, "--gpus", "8", "--gpu-memory-gb", "96", "--model-weights-gb", "131.4",
                     "--kv-bytes-per-token", "327680", "--kv-heads", "8", "--mem-fraction-static", "0.85")
    assert rc == 0 and out.startswith("memory: every deployment fits")


@pytest.mark.parametrize("argv, msg", [
    ([], "give compare/demo JSON files, or --preset"),
    (["--gpus", "8"], "plan needs --gpu-memory-gb --model-weights-gb --kv-bytes-per-token"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "seed", "--shape", "x.yaml"], "alternatives"),
    (["--preset", "seed", "--mem-fraction-static", "1.5"], "between 0 and 1"),
    (["--preset", "seed", "--interconnect", "infiniband"], "invalid choice"),
    (["--preset", "seed", "--gpus", "0"], "must be > 0"),
])
def test_bad_flags_one_line_exit_2(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and msg in err and err.count("\n") == 1 and out == ""


def test_a_bad_shape_file_gets_one_line_and_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: mine\nlayers: many\n")
    rc, out, err = run(capsys, "--shape", str(bad))
    assert rc == 2 and out == ""
    assert err.startswith(f"spec-bench plan: invalid shape file {bad}: layers:") and err.count("\n") == 1
    rc, _, err = run(capsys, "--shape", str(tmp_path / "none.yaml"))
    assert rc == 2 and "shape file not found" in err


def test_a_shape_file_plans_like_its_preset(capsys, tmp_path):
    f = tmp_path / "llama.json"
    f.write_text(json.dumps(presets.LLAMA_70B.model_dump(mode="json")))
    rc, out, _ = run(capsys, "--shape", str(f), "--gpu", "rtxpro6000", "--interconnect", "pcie")
    rc2, out2, _ = run(capsys, "--preset", "compose")
    assert rc == rc2 == 0
    strip = [ln for ln in out.splitlines() if not ln.startswith("predicted by")]
    strip2 = [ln for ln in out2.splitlines() if not ln.startswith("predicted by")]
    assert strip == strip2


@pytest.mark.parametrize("shape, preset", [("LLAMA_70B", "llama70b-h200-nvlink"), ("KIMI_K25", "kimi-k25-h200-nvlink")])
def test_a_shape_file_on_a_hopper_gpu_takes_the_hopper_calibration(capsys, tmp_path, shape, preset):
    # the H200 presets' measured calibration by model class (dense / MoE), not the seed box's: the same plan
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(getattr(presets, shape).model_dump(mode="json")))
    rc, out, _ = run(capsys, "--shape", str(f), "--gpu", "h200", "--interconnect", "nvlink")
    rc2, out2, _ = run(capsys, "--preset", preset)
    assert rc == rc2 == 0
    strip = [ln for ln in out.splitlines() if not ln.startswith("predicted by")]
    assert strip == [ln for ln in out2.splitlines() if not ln.startswith("predicted by")]


def test_the_calibration_follows_the_gpu_and_the_model_class():
    moe, dense = presets.KIMI_K25, presets.LLAMA_70B
    assert presets.calibration(presets.H200, moe) == presets.HOPPER_MOE_CAL
    assert presets.calibration(presets.H200, dense) == presets.HOPPER_DENSE_CAL
    assert presets.calibration(presets.RTX_PRO_6000, moe) == presets.calibration(presets.RTX_PRO_6000, dense) \
        == presets.SEED_CAL
    assert presets.HOPPER_MOE_CAL != presets.HOPPER_DENSE_CAL != presets.SEED_CAL
    for box in presets.BOXES.values():
        assert box.cal == presets.calibration(box.gpu, box.shape), box.name


def test_tp4_step_ratio_and_interconnect_are_inputs(capsys):
    _, pcie, _ = run(capsys, "--preset", "compose")
    _, measured, _ = run(capsys, "--preset", "compose", "--tp4-step-ratio", "3.0")
    assert "predicted TP4 step / TP8 step = 3.00x (--tp4-step-ratio)" in measured
    assert "break-even: the split beats TP8 baseline nowhere at the predicted ratio; at c=1, its best level, only if " \
           "a TP4 server's step is within 1.51x of TP8" in measured
    assert "(the step-cost model over pcie" in pcie
    _, nv, _ = run(capsys, "--preset", "compose", "--interconnect", "nvlink")
    assert "(the step-cost model over nvlink" in nv


def test_adaptive_table_and_its_choice():
    assert [planmodel.adaptive_steps(n) for n in (1, 7, 8, 31, 32, 63, 64, 200)] == [
        (1, 3, 5, 7), (1, 3, 5, 7), (0, 1, 3), (0, 1, 3), (0, 1), (0, 1), (0,), (0,)]
    box = presets.box("seed")
    from bench.sim import memory, stepcost
    adv = planmodel.advise(planmodel.Inputs(box=box, model=stepcost.memory_model(box.shape),
                                            hw=memory.Hardware(8, box.gpu.memory_gib), levels=(1, 10, 40)))
    assert adv.adaptive_choice[1] in (1, 3, 5, 7) and adv.adaptive_choice[10] in (0, 1, 3)
    assert adv.adaptive_choice[40] in (0, 1)
    # adaptive is the best of what its table allows, so never below the chains the table contains at that batch
    assert adv.tput["adaptive"][1] >= adv.tput["chain1"][1] - 1e-9
    assert adv.tput["adaptive"][10] >= max(adv.tput["chain1"][10], adv.tput["chain3"][10]) - 1e-9


def figs(points: dict[int, float]) -> list[dict]:
    return [{"concurrency": c, "output_throughput": t, "median_e2e_latency_ms": 1000.0, "completed": 4}
            for c, t in points.items()]


def test_measured_plan_never_recommends_a_deployment_that_does_not_fit(capsys, tmp_path):
    # a split that "wins" at c=10 in a (simulated) measurement, on the seed's box where it cannot hold Kimi K2.5
    data = {"config": {"deployment": "split"}, "configs": ["all-baseline", "all-speculative", "balanced"],
            "results": {"all-baseline": figs({1: 50.0, 10: 300.0}), "all-speculative": figs({1: 45.0, 10: 200.0}),
                        "balanced": figs({1: 60.0, 10: 600.0}), "tp8": figs({1: 90.0, 10: 450.0})},
            "references": {"tp8": {"profile": "baseline-tp8", "url": None, "gpus": 8}},
            "gpus": {"all-baseline": 8, "all-speculative": 8, "balanced": 8, "tp8": 8}}
    f = tmp_path / "c.json"
    f.write_text(json.dumps(data))
    rc, out, _ = run(capsys, str(f))
    assert rc == 0 and out.startswith("Beats tp8 [8 GPUs]: split + balanced at c=10")  # without the memory fit
    rc, out, _ = run(capsys, str(f), "--preset", "seed")
    assert rc == 0 and out.startswith("memory: the TP4+TP4 split does not fit")
    measured = out.split("measured (compare/demo JSON):\n", 1)[1]
    assert measured.startswith("RUN tp8 [8 GPUs]: nothing measured here beats it at any load")
    assert "NOT RECOMMENDED, does not fit your GPUs: split + balanced (the TP4+TP4 split does not fit" in measured
    # with the compose default it fits, and the measured win stands
    rc, out, _ = run(capsys, str(f), "--preset", "compose")
    assert "measured (compare/demo JSON):\nBeats tp8 [8 GPUs]: split + balanced at c=10" in out


def test_a_shape_without_a_draft_plans_the_baseline_only(capsys, tmp_path):
    data = presets.LLAMA_70B.model_dump(mode="json")
    data.pop("draft")
    f = tmp_path / "nodraft.json"
    f.write_text(json.dumps(data))
    rc, out, _ = run(capsys, "--shape", str(f))
    assert rc == 0
    assert out.splitlines()[1].startswith("why: Llama-3.3-70B has no draft head in this shape")
    assert "RUN (throughput): c=1-250: baseline" in out and "tree tok/s" not in out


def test_the_settings_are_defined_where_they_first_appear_and_counts_agree_in_number(capsys):
    # A newcomer meets `chain1` in the table's header: the line before it says what tree and chainN are.
    rc, out, _ = run(capsys, "--preset", "compose")
    assert rc == 0
    lines = out.splitlines()
    first = next(i for i, ln in enumerate(lines) if "chain1" in ln)
    assert lines[first - 1].strip().startswith("(tree = EAGLE-3's draft tree, topk 4, 2 steps, 16 draft tokens")
    assert "chainN = a topk-1 chain of N draft steps" in lines[first - 1]
    adaptive = next(ln for ln in lines if ln.startswith("  adaptive = "))
    assert "1 steps" not in adaptive and ": 1 step," in adaptive and ": 3 steps," in adaptive


def _advise(preset: str, **kw) -> planmodel.Advice:
    from bench.sim import memory, stepcost
    box = presets.box(preset)
    return planmodel.advise(planmodel.Inputs(box=box, model=stepcost.memory_model(box.shape),
                                             hw=memory.Hardware(8, box.gpu.memory_gib), **kw))


def test_every_winner_inside_the_acceptance_band_is_named_and_a_stable_one_alone():
    # The band's ends, each planned on its own with no range, must both be among the choices at the stated
    # acceptance; where all three agree and the model's error is 0, the level names one setting.
    mid = _advise("kimi-k25-h200-nvlink", model_error=0.0)
    ends = [_advise("kimi-k25-h200-nvlink", alpha=a, alpha_band=0.0, model_error=0.0) for a in (0.6, 0.8)]
    for c in mid.inputs.levels:
        winners = {mid.best_tput[c]} | {e.best_tput[c] for e in ends}
        assert winners <= set(mid.tput_choices[c]), c
        assert mid.tput_choices[c][0] == mid.best_tput[c]
    none = _advise("kimi-k25-h200-nvlink", alpha_band=0.0, model_error=0.0)
    assert all(len(ch) == 1 for ch in none.tput_choices.values())
    for c, (lo, hi) in none.tput_range.items():
        assert lo == hi == pytest.approx(none.tput[none.best_tput[c]][c] / none.tput["baseline"][c])


def test_the_models_error_scales_the_speedup_and_can_bring_the_baseline_back():
    e = 0.15
    adv = _advise("seed", alpha_band=0.0, model_error=e)
    for c in adv.inputs.levels:
        name = adv.best_tput[c]
        if name == "baseline":
            continue
        ratio = adv.tput[name][c] / adv.tput["baseline"][c]
        assert adv.tput_range[c] == pytest.approx((ratio * (1 - e), ratio * (1 + e)))
        # a speedup that error can push under the noise band leaves the baseline as a possible winner
        assert ("baseline" in adv.tput_choices[c]) == (ratio * (1 - e) < 1 + planmodel.NOISE), c


def test_plan_says_uncertain_where_the_winner_changes_and_carries_each_range(capsys, tmp_path):
    rc, out, _ = run(capsys, "--preset", "kimi-k25-h200-nvlink", "--json", str(tmp_path / "p.json"))
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("RUN (throughput): "))
    bands = dict(b.split(": ", 1) for b in line.removeprefix("RUN (throughput): ").split("; "))
    assert bands["c=1"].startswith("adaptive ") and bands["c=1"].endswith("x")  # one winner, with its range
    assert bands["c=10"].startswith("uncertain: chain4 ") and bands["c=10"].endswith(" or chain3")
    assert "chain acceptance 0.6-0.8 around the stated 0.7" in out and "x 0.85-1.15" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["run_throughput_choices"]["10"] == ["chain4", "chain3"]
    lo, hi = data["run_throughput_range"]["1"]
    assert f"adaptive {lo:.2f}-{hi:.2f}x" == bands["c=1"]
    # a measured acceptance and no model error: one setting per level again
    rc, out, _ = run(capsys, "--preset", "kimi-k25-h200-nvlink", "--chain-alpha-band", "0", "--model-error", "0")
    line = next(ln for ln in out.splitlines() if ln.startswith("RUN (throughput): "))
    assert rc == 0 and "uncertain" not in line


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "seed", "--model-error", "1.5"], "--model-error must be below 1"),
    (["--preset", "seed", "--chain-alpha-band", "-0.1"], "must be >= 0"),
    (["--preset", "seed", "--chain-alpha-band", "1"], "--chain-alpha-band must be below 1"),
])
def test_bad_range_flags_one_line_exit_2(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and msg in err and err.count("\n") == 1 and out == ""


def _bands(line: str) -> dict[tuple[int, ...], str]:
    """`c=1: X; c=2-5: Y` -> {(1,): X, (2, 5): Y} (a band's first and last level)."""
    out = {}
    for band in line.split("; "):
        head, text = band.split(": ", 1)
        out[tuple(int(x) for x in head.removeprefix("c=").split("-"))] = text
    return out


@pytest.mark.parametrize("preset", sorted(presets.BOXES) + sorted(presets.ALIASES))
def test_every_preset_plans_with_ranges_and_says_uncertain_where_the_winner_flips(capsys, preset):
    rc, out, _ = run(capsys, "--preset", preset)
    assert rc == 0
    adv = _advise(preset)
    lines = out.splitlines()
    for prefix, choices in (("RUN (throughput): ", adv.tput_choices), ("RUN (latency, ", adv.latency_choices)):
        line = next(ln for ln in lines if ln.startswith(prefix))
        bands = _bands(line.split("): ", 1)[1])
        levels = list(adv.inputs.levels)
        covered = []
        for span, text in bands.items():
            inside = levels[levels.index(span[0]):levels.index(span[-1]) + 1]
            covered += inside
            ch = choices[inside[0]]
            assert all(choices[c] == ch for c in inside), (preset, span)
            assert text.startswith("uncertain: ") == (len(ch) > 1), (preset, span, text)
            for name in ch:
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (preset, name, text)
            if ch[0] != "baseline":  # the first-named setting carries its range
                assert re.search(rf"{re.escape(ch[0])} \d+\.\d\d(-\d+\.\d\d)?x", text), (preset, text)
        assert covered == levels, preset
    assert "the model's held-out error" in out
