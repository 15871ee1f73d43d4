"""The judge on a virtual clock (bench/lab/routesim.py): the clock, the engines' physics on it, the verdicts."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.lab import judge as judge_cmd
from bench.lab import routesim
from bench.lab.family import MEMBERS, predict
from tests.fixtures_policy import policy_of

TOKENS = 96


def test_the_clock_jumps_to_the_next_timer_and_the_router_counts_on_it():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(100.0)
        await asyncio.gather(asyncio.sleep(5.0), asyncio.sleep(7.0))
        from router import pools
        return loop.time() - t0, pools.clock()

    took, pools_clock = routesim.run_virtual(main())
    assert took == pytest.approx(107.0)
    assert pools_clock == pytest.approx(107.0)  # the in-flight integral reads the same clock


def test_a_task_that_waits_for_nothing_scheduled_fails_instead_of_hanging():
    async def main():
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="nothing scheduled"):
        routesim.run_virtual(main())


@pytest.mark.parametrize("name", ["linear-12", "convex-10"])
def test_one_server_alone_serves_what_its_parameters_say_and_the_same_twice(name):
    """Members drawing acceptance per step, one server alone at 1 and 8 clients: the family's own prediction
    (the same check tests/test_bench_family.py makes over HTTP, here without the host's timing)."""
    m = MEMBERS[name]
    bench = routesim.Bench(m, TOKENS, seed=1)

    def alone(spec: bool):
        return routesim.run_virtual(bench.run(policy_of("spillover", threshold=10 ** 6), [(1, 32), (8, 64)],
                                              pools=(spec, not spec)))

    for spec, p in ((True, m.speculative), (False, m.baseline)):
        got = alone(spec)
        assert [x.share for x in got] == [1.0 if spec else 0.0] * 2
        for x in got:
            assert x.tok_s == pytest.approx(predict(p, x.clients, TOKENS), rel=0.12), (spec, x)
        assert [x.tok_s for x in alone(spec)] == [x.tok_s for x in got]  # no host: the same run, the same figure


def test_the_verdict_tells_a_wrong_policy_from_a_right_one():
    """saturating-never: the speculative server is never ahead. A policy pinned to it falls below the bar at one
    client; one pinned to the baseline holds it there."""
    m = MEMBERS["saturating-never"]
    wrong = routesim.judge(m, [1], min_requests=32, warmup_s=0, cold_runs=1,
                           make=lambda: policy_of("spillover", threshold=10 ** 6))
    right = routesim.judge(m, [1], min_requests=32, warmup_s=0, cold_runs=1, make=lambda: policy_of("spillover",
                                                                                                 threshold=0))
    (w,), (r,) = wrong["rows"], right["rows"]
    assert w["share"] == 1.0 and w["ratio"] < 0.9 and w["cold_reached_at"] is None
    assert r["share"] == 0.0 and r["ratio"] >= routesim.BAR and r["cold_reached_at"] == 0
    assert w["best"] in ("all-baseline", "balanced", "spillover")


def test_adaptive_from_cold_on_the_issue_pair_light_and_saturated():
    """The router's adaptive policy (built as `spec-router serve` builds it) from a cold start, no warm-up: at one
    client it keeps to the faster speculative server, at 32 it sends the baseline most of the traffic."""
    got = routesim.judge(MEMBERS["issue28"], [1, 32], warmup_s=0, cold_runs=1)
    light, busy = got["rows"]
    assert light["share"] > 0.85 and light["ratio"] >= routesim.BAR
    assert 0.25 < busy["share"] < 0.5 and busy["ratio"] >= routesim.BAR


def test_judge_virtual_command(tmp_path, capsys):
    rc = judge_cmd.main(["--virtual", "1", "--member", "linear-12", "--levels", "1,4", "--min-requests", "16",
                         "--cold-runs", "1", "--out", str(tmp_path), "--name", "v"])
    assert rc == 0
    doc = json.loads((tmp_path / "v.json").read_text())
    (res,) = doc["results"]
    assert res["member"] == "linear-12" and [row["clients"] for row in res["seeds"][0]["rows"]] == [1, 4]
    out = capsys.readouterr().out
    assert "**linear-12** (1 seeds; virtual clock)" in out and "of 2 cells at 0.95" in out
    assert (tmp_path / "v.md").read_text().startswith("```\npython -m bench judge --virtual 1")


@pytest.mark.parametrize("argv", [["--virtual", "-1"], ["--virtual", "2", "--speculative", "http://127.0.0.1:1",
                                                        "--baseline", "http://127.0.0.1:2"]])
def test_judge_virtual_bad_flags(argv, capsys):
    assert judge_cmd.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spec-bench judge: ")
