"""The family of servers that are not our simulator (bench/lab/family.py): physics as parameterised, protocol subset."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from bench import figures
from bench.lab.family import MEMBERS, FamilyServer, Physics, predict
from bench.load import LoadSpec, load_prompts, run_closed
from router.loads import parse_figures
from tests.fixtures_family import FAMILY_SPEEDUP

SPEEDUP = FAMILY_SPEEDUP
TOKENS = 96



async def _closed(url: str, c: int, requests: int) -> dict:
    spec = LoadSpec(url=url, prompts=load_prompts("coding"), max_tokens=TOKENS, requests=requests,
                    level_timeout=60.0, timeout=30.0)
    return figures.compute(await run_closed(spec, c), SPEEDUP)


def test_members_differ_as_their_names_say():
    """By their parameters alone (no server): where all-speculative beats all-baseline."""
    def ahead(m, n):
        return predict(m.speculative, n, TOKENS) > predict(m.baseline, n, TOKENS)

    lin, conv, sat = MEMBERS["linear-12"], MEMBERS["convex-10"], MEMBERS["saturating-never"]
    assert ahead(lin, 1) and ahead(lin, 2) and not ahead(lin, 4)
    assert all(ahead(conv, n) for n in (1, 2, 4, 8)) and not ahead(conv, 16)
    assert not any(ahead(sat, n) for n in (1, 2, 4, 8, 16, 32))
    shapes = {m.speculative.shape for m in MEMBERS.values()}
    assert shapes == {"linear", "convex", "saturating"}
    assert {(m.speculative.accept_per, m.speculative.accept_dist) for m in MEMBERS.values()} >= {
        ("step", "fixed"), ("step", "poisson"), ("request", "fixed"), ("request", "poisson")}
    # convex: the speculative server's throughput falls past its peak; saturating: the step cost levels off
    assert predict(conv.speculative, 32, TOKENS) < predict(conv.speculative, 8, TOKENS)
    assert sat.baseline.step_ms(1000) < sat.baseline.a + sat.baseline.b * sat.baseline.c


def test_poisson_accept_mean_is_capped_exactly():
    p = Physics(a=10, b=1, accept=2.6, accept_dist="poisson", max_accept=5)
    assert 2.4 < p.mean_accept() < 2.6  # the cap at 5 takes a little of the mean
    assert p.poisson_table()[-1] == 1.0
    per_request = Physics(a=10, b=1, accept=2.0, accept_per="request", accept_spread=0.5)
    assert per_request.mean_inverse_accept() > 1 / 2.0  # Jensen: slow requests weigh more


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["linear-12", "convex-10"])
async def test_throughput_at_1_and_8_is_what_the_parameters_say(family_pair, name):
    spec, base = await family_pair(name)
    for srv in (spec, base):
        for c, n in ((1, 6), (8, 24)):
            fig = await _closed(srv.url, c, n)
            assert fig["failed"] == 0
            want = predict(srv.physics, c, TOKENS, fig["total_input_tokens"] // fig["completed"])
            assert fig["output_throughput"] == pytest.approx(want, rel=0.12), (srv.name, c)


@pytest.mark.timeout(60)
async def test_loads_queue_and_accept_length_as_the_router_reads_them(family_pair):
    spec, base = await family_pair("issue28")  # speculative max_running 16
    async with aiohttp.ClientSession() as s:
        async def one():
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
            async with s.post(spec.url + "/v1/chat/completions", json=body) as r:
                return await r.json()

        tasks = [asyncio.create_task(one()) for _ in range(20)]
        await asyncio.sleep(0.5)
        async with s.get(spec.url + "/v1/loads?include=core,spec") as r:
            figs = parse_figures(await r.json())
        async with s.get(base.url + "/v1/loads?include=core,spec") as r:
            base_figs = parse_figures(await r.json())
        done = await asyncio.gather(*tasks)
    assert figs is not None and figs.max_running == 16
    assert figs.running == 16 and figs.waiting == 4
    assert figs.accept_length == pytest.approx(spec.physics.mean_accept(), rel=0.15)
    assert base_figs is not None and base_figs.accept_length is None and base_figs.running == 0
    assert all(d["usage"]["completion_tokens"] == 200 and d["usage"]["prompt_tokens"] == 500 for d in done)


@pytest.mark.timeout(30)
async def test_streams_carry_usage_last_and_bad_requests_are_400(family_pair):
    spec, _ = await family_pair("linear-12")
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/completions", {"prompt": "x"})):
            body |= {"max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(spec.url + path, json=body) as r:
                raw = await r.read()
            events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert '"usage":{"prompt_tokens"' in events[-2] and '"completion_tokens":40' in events[-2]
            assert '"finish_reason":"length"' in events[-3]
            text = "".join(e for e in events[:-2])
            assert text.count("tok ") == 40
        async with s.post(spec.url + "/v1/chat/completions", data=b"{}", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 400 and (await r.json())["object"] == "error"
        async with s.post(spec.url + "/v1/chat/completions", json={"messages": [], "max_tokens": -1}) as r:
            assert r.status == 400
        async with s.get(spec.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "default"


@pytest.mark.timeout(30)
async def test_a_client_that_leaves_frees_its_slot():
    srv = FamilyServer(Physics(a=50.0, b=1.0, max_running=1), speedup=1.0)
    await srv.start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": True}
            async with s.post(srv.url + "/v1/chat/completions", json=body) as r:
                await r.content.readline()
            for _ in range(100):
                if not srv.engine.running:
                    break
                await asyncio.sleep(0.02)
        assert not srv.engine.running and not srv.engine.waiting
    finally:
        await srv.close()


def _fig(c: int, tput: float, share: float = 0.5) -> dict:
    return {"concurrency": c, "output_throughput": tput, "completed": 16, "failed": 0, "duration_s": 1.0,
            "speculative_share": share}


def test_judge_picks_one_spillover_threshold_and_the_best_fixed_per_level():
    from types import SimpleNamespace

    from bench.lab.judging import Judge

    ns = SimpleNamespace(levels=[1, 8], thresholds=[1, 4], speedup=5.0)
    j = Judge.__new__(Judge)
    j.ns = ns
    cfgs = {"all-speculative": [_fig(1, 100), _fig(8, 300)], "all-baseline": [_fig(1, 90), _fig(8, 500)],
            "round-robin": [_fig(1, 95), _fig(8, 520)],
            # @4 wins at 8 clients by more than @1 wins at 1: the threshold best over the levels is 4
            "spillover@1": [_fig(1, 100), _fig(8, 400)], "spillover@4": [_fig(1, 99), _fig(8, 600)],
            "balanced": [_fig(1, 100), _fig(8, 580)], "balanced-again": [_fig(1, 98), _fig(8, 580)],
            "adaptive": [_fig(1, 96), _fig(8, 540)]}
    out = {"configs": cfgs}
    j.judge_repeat(out)
    assert out["spillover_best"] == "spillover@4"
    one, eight = out["rows"]
    assert one["best_fixed"] in ("all-speculative", "balanced") and one["ratio"] == pytest.approx(0.96)
    assert one["control"] == pytest.approx(0.98)
    assert eight["best_fixed"] == "spillover" and eight["ratio"] == pytest.approx(0.9)
    # the bar applied to the control (balanced again over the best fixed): 0.98 at 1 client, 580/600 at 8
    assert one["control_vs_best"] == pytest.approx(0.98)
    assert eight["control_vs_best"] == pytest.approx(580 / 600)


def test_judge_summary_counts_adaptive_and_the_control_against_the_bar():
    from bench.lab.judge import control_vs_best, summary

    def rep(ratios, controls, stored=True):
        rows = [{"ratio": r, "best_fixed_tput": 100.0} | ({"control_vs_best": c} if stored else {})
                for r, c in zip(ratios, controls, strict=True)]
        return {"levels": [1, 8], "rows": rows,
                "configs": {"balanced-again": [{"output_throughput": 100.0 * c} for c in controls]}}

    # a file written before rows held the control's figure: computed from the configs
    assert control_vs_best(rep([1.0, 1.0], [0.9, 0.96], stored=False), 0) == pytest.approx(0.9)
    res = {"member": "m", "repeats": [rep([0.96, 0.94], [0.99, 0.949]), rep([0.95, 0.97], [0.95, 1.0])]}
    assert summary(res) == ("m: adaptive >= 0.95 x best fixed in 3 of 4 cells (1 of 2 levels in every repeat); "
                            "the control (balanced again) in 3 of 4.")


def test_a_forced_level_reports_how_far_the_configurations_that_routed_alike_spread():
    """At two clients where adaptive and the best sent nothing behind another, the routed configurations that
    did the same (never the single servers, nor one that queued a request) spread by their max over min; a level
    of one client, or one where adaptive queued, is not forced."""
    from bench.lab.judge import forced_spread, forced_summary

    def fig(tput, behind):
        return {"output_throughput": tput, "behind": behind}

    def rep(adaptive_behind, tputs):
        a, b, s, rr = tputs
        return {"levels": [1, 2], "rows": [{"adaptive_behind": 0, "best_behind": 0},
                                           {"adaptive_behind": adaptive_behind, "best_behind": 0}],
                "configs": {"all-speculative": [fig(10, 0), fig(1, 0)], "all-baseline": [fig(12, 0), fig(1, 0)],
                            "round-robin": [fig(11, 0), fig(rr, 3)], "spillover@1": [fig(10, 0), fig(s, 0)],
                            "balanced": [fig(12, 0), fig(b, 0)], "adaptive": [fig(12, 0), fig(a, adaptive_behind)]}}

    first = rep(0, (28.0, 29.0, 30.0, 50.0))
    assert forced_spread(first, 0) is None  # one client: the choice is free
    names, spread = forced_spread(first, 1)
    assert sorted(names) == ["adaptive", "balanced", "spillover@1"] and spread == pytest.approx(30 / 28)
    assert forced_spread(rep(2, (28.0, 29.0, 30.0, 50.0)), 1) is None  # adaptive queued one: not forced
    line = forced_summary({"repeats": [first, rep(2, (28.0, 29.0, 30.0, 50.0)), rep(0, (29.0, 29.0, 29.0, 9.0))]})
    assert "2 clients (adaptive, balanced, spillover@1): 7.1% / - / 0.0%" in line
    assert forced_summary({"repeats": [rep(2, (28.0, 29.0, 30.0, 50.0))]}) is None


def test_judge_luck_slope_and_the_luck_adjusted_ratio():
    """Repeats whose tok/s move only with luck (a configuration sending the harder prompts to the speculative
    server serves less): the fitted slope is the one the figures were made with, the scatter it leaves is 0, and
    the adjusted ratio compares the configurations at even luck."""
    import math

    from bench.lab.judging import luck_adjusted, luck_slope

    def fig(tput, share, luck):
        return {"output_throughput": tput * math.exp(-0.8 * share * (luck - 1)), "speculative_share": share,
                "luck": luck}

    def rep(k):
        lk = (0.9, 1.0, 1.1)[k]
        # at even luck round-robin serves 100, adaptive 96; adaptive's prompts are the harder in repeat 3
        return {"levels": [4], "spillover_best": "spillover@2", "configs": {
            "all-speculative": [fig(80, 1.0, 1.0)], "all-baseline": [fig(70, 0.0, 1.0)],
            "round-robin": [fig(100, 0.5, 2 - lk)], "spillover@2": [fig(90, 0.3, lk)],
            "balanced": [fig(95, 0.5, lk)], "balanced-again": [fig(95, 0.5, lk)], "adaptive": [fig(96, 0.5, lk)]}}

    res = {"repeats": [rep(k) for k in range(3)]}
    slope, before, after = luck_slope(res)
    assert slope == pytest.approx(-0.8) and before > 0.01 and after == pytest.approx(0.0, abs=1e-9)
    for r in res["repeats"]:
        assert luck_adjusted(r, 0, slope) == pytest.approx(0.96)
    # measured, repeat 3: adaptive's hard prompts (1.1) against round-robin's easy ones (0.9)
    third = res["repeats"][2]["configs"]
    assert third["adaptive"][0]["output_throughput"] / third["round-robin"][0]["output_throughput"] < 0.9
    # one repeat, or a member drawing no acceptance per request: no fit
    assert luck_slope({"repeats": res["repeats"][:1]}) is None
    for r in res["repeats"]:
        for figs in r["configs"].values():
            figs[0]["luck"] = None if figs[0]["speculative_share"] else figs[0]["luck"]
    assert luck_slope(res) is None


def test_a_running_pairs_luck_is_measured_from_what_each_prompt_cost_the_speculative_server():
    """Prompt i's cost is its seconds per output token on the speculative server alone at one client; a level's
    luck is the mean cost of the prompts it sent there over that of all its prompts with a known cost (failed
    requests and prompts past the measured ones left out)."""
    from bench.lab.judging import luck_ratio, prompt_costs
    from bench.load import RequestRecord

    def rec(start, secs, tokens=10, pool="speculative", error=None):
        r = RequestRecord(start=start, end=start + secs, output_tokens=tokens, error=error)
        r.pool = pool
        return r

    # given out of order: the index is the start order
    alone = [rec(2.0, 3.0), rec(0.0, 1.0), rec(1.0, 2.0, tokens=20), rec(3.0, 9.0, error="boom")]
    costs = prompt_costs(alone)
    assert costs == {0: pytest.approx(0.1), 1: pytest.approx(0.1), 2: pytest.approx(0.3)}
    # prompt 2 (the dear one) to the speculative server, 0 and 1 elsewhere; prompt 3's and 4's costs unknown
    level = [rec(0.0, 1.0, pool="baseline"), rec(0.1, 1.0, pool="baseline"), rec(0.2, 1.0),
             rec(0.3, 1.0), rec(0.4, 1.0, pool="baseline")]
    assert luck_ratio(costs, level) == pytest.approx(0.3 / (0.5 / 3), abs=1e-3)
    assert luck_ratio(costs, level[:2]) is None  # nothing known went to the speculative server
    assert luck_ratio(None, level) is None and luck_ratio({}, level) is None


def test_sent_behind_counts_the_requests_started_while_an_earlier_one_ran_on_their_pool():
    """By hand, then against the definition itself (any earlier request of the pool still running) on random
    levels: the count is the same."""
    import random

    from bench.lab.judging import sent_behind
    from bench.load import RequestRecord

    def rec(start, end, pool):
        return RequestRecord(start=start, end=end, pool=pool)

    # s2 starts while s0 (a long one) still runs, though s1 ended; b1 after b0 ended; the unrouted one not counted
    level = [rec(0, 10, "s"), rec(1, 2, "s"), rec(3, 4, "s"), rec(0, 1, "b"), rec(1, 2, "b"), rec(0, 9, None)]
    assert sent_behind(level) == 2
    rng = random.Random(7)
    for _ in range(50):
        recs = []
        for _ in range(rng.randint(0, 30)):
            start = rng.uniform(0, 10)
            recs.append(rec(start, start + rng.uniform(0.1, 3), rng.choice(["s", "b", None])))
        ordered = sorted((r for r in recs if r.pool is not None), key=lambda r: r.start)
        want = sum(any(o.pool == r.pool and r.start < o.end for o in ordered[:i]) for i, r in enumerate(ordered))
        assert sent_behind(recs) == want


def test_judge_and_family_commands_refuse_bad_flags(capsys):
    from bench.lab import familyserve, judge

    assert judge.main(["--levels", "x"]) == 2
    assert judge.main(["--warmup-seconds", "31"]) == 2
    assert familyserve.main(["--member", "nope"]) == 2
    # a running pair: both URLs or neither, bare URLs, never with --member
    assert judge.main(["--speculative", "http://127.0.0.1:9"]) == 2
    assert judge.main(["--speculative", "http://127.0.0.1:9", "--baseline", "b=http://127.0.0.1:9"]) == 2
    assert judge.main(["--speculative", "http://127.0.0.1:9", "--baseline", "http://127.0.0.1:9",
                       "--member", "linear-12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 6 and all(line.startswith(("spec-bench judge: ", "spec-bench family: ")) for line in err)


def test_judge_a_running_pair_end_to_end(tmp_path):
    """`bench judge --speculative URL --baseline URL` judges servers it did not start (here a family pair run
    apart, standing in for `bench engines` or a user's own): every configuration served both levels (balanced's curve needs two), and the
    report names the pair, its luck measured (what each prompt cost the speculative server alone at one client)."""
    from bench import procs
    from bench.lab import judge

    with procs.ProcGroup() as group:
        pair = group.add(procs.start("family", ["bench", "family", "--member", "linear-12", "--speedup", "20"],
                                     lines=2))
        spec, base = pair.urls
        rc = judge.main(["--speculative", spec, "--baseline", base, "--speedup", "20", "--levels", "1,2",
                         "--thresholds", "1", "--repeats", "1", "--cold-runs", "1", "--warmup-seconds", "0",
                         "--min-requests", "4", "--max-tokens", "8", "--out", str(tmp_path), "--name", "mine",
                         "--router-arg=--health-path=/v1/models"])
    assert rc == 0
    res = json.loads((tmp_path / "mine.json").read_text())["results"]
    assert [r["member"] for r in res] == ["mine"] and spec in res[0]["physics"] and base in res[0]["physics"]
    (rep,) = res[0]["repeats"]
    assert set(rep["configs"]) == {"all-speculative", "all-baseline", "round-robin", "spillover@1", "balanced",
                                   "balanced-again", "adaptive"}
    assert all([r["completed"] for r in runs] == [4, 4] and not any(r["failed"] for r in runs)
               for runs in rep["configs"].values())
    assert [r["speculative_share"] for r in rep["configs"]["all-speculative"]] == [1.0, 1.0]
    assert [len(c["runs"]) for c in rep["cold"]] == [1, 1]
    assert [r["luck"] for r in rep["configs"]["all-speculative"]] == [1.0, 1.0]
    assert [r["luck"] for r in rep["configs"]["all-baseline"]] == [None, None]
    assert all(isinstance(r["luck"], float) for r in rep["configs"]["round-robin"])
    # At one client nothing is sent behind another; at two on one server, all but the first request of each client
    # (the other's is in flight then), and adaptive's decisions of each level are counted by reason.
    assert [r["behind"] for r in rep["configs"]["all-speculative"]] == [0, 3]
    assert [sum(r["decisions"].values()) for r in rep["configs"]["adaptive"]] == [4, 4]
    assert all(k.split("/")[0] in ("speculative", "baseline") for r in rep["configs"]["adaptive"] for k in r["decisions"])
    # A cold run's decisions too (a fresh router: all of them are the run's), with what else it saw.
    assert [[sum(run["decisions"].values()) for run in c["seen"]] for c in rep["cold"]] == [[4], [4]]
    assert all(set(run) == {"decisions", "behind", "luck", "speculative_share"} for c in rep["cold"] for run in c["seen"])
    md = (tmp_path / "mine.md").read_text()
    assert "mine: adaptive >= 0.95" in md and "| sent behind another" in md
    # --router-arg reaches the routers: one they refuse stops the judge with its one line (exit 2)
    with procs.ProcGroup() as group:
        spec, base = group.add(procs.start("family", ["bench", "family", "--member", "linear-12"], lines=2)).urls
        assert judge.main(["--speculative", spec, "--baseline", base, "--levels", "1,2", "--repeats", "1",
                           "--out", str(tmp_path), "--router-arg=--no-such-flag"]) == 2
