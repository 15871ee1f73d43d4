"""`spec-bench goodput`: the class mix's goodput per deployment, each row on its own fresh simulators (real processes:
simulators, smg, our router), end to end on a small trace; bad flags are one line and exit 2."""
from __future__ import annotations

import json

import pytest

from bench.lab import goodput, peers
from tests.test_bench_prefixcompare import tiny_trace

pytestmark = pytest.mark.timeout(300)


def test_the_fleet_rows_run_end_to_end_and_judge_every_class(tmp_path, capsys):
    if peers.version(peers.PEERS["smg"]) is None:
        pytest.skip("smg is not installed (pip install 'spec-router[peers]')")
    trace = tmp_path / "trace.jsonl"
    tiny_trace(trace, conversations=8)
    rc = goodput.main(["--trace", str(trace), "--groups", "kimi,compose", "--boxes", "2", "--speculative-servers", "1",
                       "--only", "kimi,tp8-baseline", "--kimi-sample", "1", "--compose-sample", "1",
                       "--window-end", "60", "--kimi-speedup", "20", "--compose-speedup", "20",
                       "--token-scale", "0.2", "--class-mix", "interactive=0.5,default=0.25,flex=0.25",
                       "--class-targets", "interactive=ttft:600000", "--out", str(tmp_path / "o"), "--name", "t"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads((tmp_path / "o" / "t.json").read_text())
    rows = doc["rows"]
    assert [(r["deployment"], r["router"], r["send_targets"]) for r in rows] == [
        ("llama-tp8-baseline", "direct", False),
        ("kimi-2x-baseline+smg", "smg:cache_aware", False), ("kimi-2x-adaptive+smg", "smg:cache_aware", False),
        ("kimi-1spec+1base+ours-targets", "ours", True), ("kimi-1spec+1base+ours", "ours", False)]
    for r in rows:
        assert "skipped" not in r, r
        assert r["completed"] == 16 and r["failed"] == 0 and r["shed"] == 0, r
        assert sum(c["requests"] for c in r["classes"].values()) == 16
        # a 10-minute TTFT target and no TPOT target: every completed request meets its class's targets
        assert r["class_good"] == 16 and r["classes"]["interactive"]["attainment"] == 1.0
        assert r["served_speculative"] + r["served_baseline"] == 16
    # the same draw in every row (seed 0): class counts are equal
    assert len({tuple(c["requests"] for c in r["classes"].values()) for r in rows}) == 1
    assert rows[3]["served_speculative"] > 0 and rows[3]["served_baseline"] > 0
    # our router saw the targets only where they were sent: interactive by headers (tier "none"), flex by tier
    counted = {tier: sum(v for k, v in rows[3]["router_slo"]["router_slo_requests_total"].items()
                         if f"tier={tier}" in k.split(",")) for tier in ("none", "flex")}
    classes = rows[3]["classes"]
    assert counted == {"none": classes["interactive"]["requests"], "flex": classes["flex"]["requests"]}
    assert not sum(rows[4]["router_slo"].get("router_slo_requests_total", {}).values())
    assert "kimi-1spec+1base+ours-targets M=1: the router counted" in (tmp_path / "o" / "t.txt").read_text()
    assert doc["config"]["class_mix"][0] == {"name": "interactive", "share": 0.5, "ttft_ms": 600000.0,
                                             "tpot_ms": None, "tier": None}
    text = (tmp_path / "o" / "t.txt").read_text()
    assert "interactive met" in text and "smg:cache_aware" in text and "2 x baseline-tp8" in text


@pytest.mark.parametrize("argv, says", [
    (["--groups", "kimi,gpt"], "--groups: expected some of kimi,compose"),
    (["--boxes", "2", "--speculative-servers", "2"], "--speculative-servers must be between 1 and"),
    (["--class-mix", "interactive=0.2"], "shares add up to 0.2, not 1"),
    (["--only", "nothing-by-this-name"], "--only matches no deployment"),
    (["--trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl: no such file"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, says):
    trace = tmp_path / "trace.jsonl"
    tiny_trace(trace)
    rc = goodput.main(["--trace", str(trace), *argv] if "--trace" not in argv else argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err
