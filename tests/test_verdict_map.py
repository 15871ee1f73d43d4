"""The verdict map (docs/BENCH.md): its two summary tables are what bench.verdictmap makes of the committed runs,
and a cell says "uncertain" exactly where the winner changes inside the range the planner's model allows."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import planmodel, verdictmap
from bench.sim import memory, presets, stepcost

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "BENCH.md").read_text(encoding="utf-8").splitlines()


def doc_table(header: str) -> list[str]:
    start = DOC.index(header)
    end = next(i for i in range(start, len(DOC)) if not DOC[i].startswith("|"))
    return DOC[start:end]


@pytest.mark.parametrize("make", [verdictmap.summary_table, verdictmap.map_table], ids=["summary", "map"])
def test_the_docs_tables_are_what_the_runs_and_the_model_give(make):
    table = make()
    assert doc_table(table[0]) == table


def test_a_winner_that_changes_inside_the_range_is_uncertain_and_a_firm_one_is_not():
    # run: adaptive 1.10x; the model's points move it to 0.9x at one end: the baseline wins there
    firm = verdictmap.cell({"baseline": 1.0, "adaptive": 1.5},
                           [{"baseline": 1.0, "adaptive": 2.0}, {"baseline": 1.0, "adaptive": 1.6}])
    assert firm.tied == ("adaptive",) and firm.others == () and firm.span == pytest.approx((1.2, 1.5))
    assert firm.label(verdictmap.SHORT) == "adaptive 1.50x (1.20-1.50x)"
    flips = verdictmap.cell({"baseline": 1.0, "adaptive": 1.1, "eagle3": 1.05},
                            [{"baseline": 1.0, "adaptive": 1.2, "eagle3": 1.0},
                             {"baseline": 1.0, "adaptive": 0.98, "eagle3": 1.0}])
    assert flips.others == ("eagle3",)
    assert flips.label(verdictmap.SHORT) == "uncertain: adaptive 1.10x (0.90-1.10x) or EAGLE-3"
    # inside the noise band of the baseline the baseline wins (plan's rule), so a 2% edge at one end is no win
    edge = verdictmap.cell({"baseline": 1.0, "adaptive": 1.1}, [{"baseline": 1.0, "adaptive": 1.1},
                                                                {"baseline": 1.0, "adaptive": 1.02}])
    assert edge.others == ("baseline",)
    tie = verdictmap.cell({"baseline": 1.0, "eagle3": 0.99}, [{"baseline": 1.0, "eagle3": 1.0}])
    assert tie.label(verdictmap.SHORT, also=("split",)) == "baseline = EAGLE-3 0.99x (0.99-0.99x)"


def test_the_models_range_has_the_nominal_point_first_and_scales_all_but_the_baseline():
    box = presets.box("llama70b-h200-nvlink")
    inp = planmodel.Inputs(box=box, model=stepcost.memory_model(box.shape), hw=memory.Hardware(8, box.gpu.memory_gib),
                           levels=(1, 64), alpha=0.7, model_error=0.1)
    points = planmodel.deployment_ranges(inp, "chain3")
    nominal = planmodel.deployments(inp, "chain3", 0.7)
    assert len(points) == 5 * 3
    for n in planmodel.DEPLOYMENTS:
        for c in (1, 64):
            assert points[0][n][c] == pytest.approx(nominal[n][c] / nominal["baseline"][c])
            xs = [p[n][c] for p in points]
            if n == "baseline":
                assert set(xs) == {1.0}
            else:  # the error's ends at the stated acceptance
                assert min(xs) <= points[0][n][c] * 0.9 + 1e-9 and max(xs) >= points[0][n][c] * 1.1 - 1e-9
    # a lower acceptance cannot make a chain faster; the co-located pair is at least the baseline
    low = planmodel.deployments(inp, "chain3", 0.6)
    assert all(low["eagle3"][c] <= nominal["eagle3"][c] for c in (1, 64))
    assert all(nominal["colocated"][c] >= nominal["baseline"][c] for c in (1, 64))


def test_every_map_row_reads_a_committed_run():
    runs = {r.run for r in verdictmap.MAP}
    assert {run for run, *_ in verdictmap.SUMMARY} <= runs
    for run in runs:
        assert (verdictmap.RUNS / f"demo-{run}.json").is_file(), run
