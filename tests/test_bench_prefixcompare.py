"""`bench prefixcompare`: our router and smg side by side on a small trace, each in front of its own fresh
simulators, real processes end to end; bad flags are one line and exit 2."""
from __future__ import annotations

import json

import pytest

from bench.lab import peers, prefixcompare

pytestmark = pytest.mark.timeout(240)


def tiny_trace(path, conversations: int = 6, turns: int = 2) -> None:
    """Conversations of `turns` lines each, a turn's blocks extending the previous turn's (Mooncake's shape)."""
    lines, next_id = [], 1
    for c in range(conversations):
        ids = [0]
        for t in range(turns):
            ids = ids + [next_id, next_id + 1]
            next_id += 2
            ts = 400 * c + 1500 * t
            lines.append(json.dumps({"timestamp": ts, "input_length": 512 * len(ids) - 100, "output_length": 20,
                                     "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def test_the_side_by_side_runs_end_to_end_and_writes_its_figures(tmp_path, capsys):
    if peers.version(peers.PEERS["smg"]) is None:
        pytest.skip("smg is not installed (pip install 'spec-router[peers]')")
    trace = tmp_path / "trace.jsonl"
    tiny_trace(trace)
    rc = prefixcompare.main([
        "--trace", str(trace), "--deployments", "pool,colocated", "--instances", "2", "--boxes", "1",
        "--pool-routers", "ours,smg:cache_aware", "--two-pool-routers", "ours,smg:cache_aware",
        "--window-end", "60", "--sample-conversations", "1", "--two-pool-sample-conversations", "1",
        "--slowdown", "1", "--two-pool-slowdown", "1", "--speedup", "20", "--token-scale", "0.2",
        "--out", str(tmp_path / "out"), "--name", "t"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads((tmp_path / "out" / "t.json").read_text())
    rows = doc["rows"]
    assert [(r["deployment"], r["router"]) for r in rows] == [
        ("pool-2", "ours"), ("pool-2", "smg:cache_aware"), ("colocated-x1", "ours"), ("colocated-x1", "smg:cache_aware")]
    for r in rows:
        assert "skipped" not in r, r
        assert r["completed"] == 12 and r["failed"] == 0, r
        # the second turn of each conversation finds its first turn's prefix somewhere: every router got hits
        assert r["cache_hit_ratio"] is not None and r["cache_hit_ratio"] > 0, r
        assert sum(r["served_per_backend"]) == 12 and r["gpus"] in (16, 8)
    assert sum(rows[0]["decisions"].values()) == 12 and "decisions" not in rows[1]
    assert rows[1]["label"].startswith("smg 1.13")
    text = (tmp_path / "out" / "t.txt").read_text()
    assert "smg:cache_aware" in text and "TTFT p99" in text and (tmp_path / "out" / "t.csv").exists()
    assert doc["config"]["peers"]["smg"]


@pytest.mark.parametrize("argv, says", [
    (["--pool-routers", "ours,nginx:cache_aware"], "expected PEER:POLICY"),
    (["--pool-routers", "smg:fastest"], "policy 'fastest' is not one of"),
    (["--deployments", "pool,triple"], "--deployments"),
    (["--instances", "4,8", "--slowdown", "1"], "--slowdown has 1 values for 2 --instances"),
    (["--window-start", "50", "--window-end", "10"], "must be after --window-start"),
    (["--trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl: no such file"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, says):
    trace = tmp_path / "trace.jsonl"
    tiny_trace(trace)
    rc = prefixcompare.main(["--trace", str(trace), *argv] if "--trace" not in argv else argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err


def test_a_peer_that_is_not_installed_is_a_skipped_row_not_a_crash(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "version", lambda peer: None)
    trace = tmp_path / "trace.jsonl"
    tiny_trace(trace, conversations=1, turns=1)
    rc = prefixcompare.main(["--trace", str(trace), "--deployments", "pool", "--instances", "1",
                             "--pool-routers", "vllm-router:cache_aware", "--out", str(tmp_path), "--name", "s"])
    out, err = capsys.readouterr()
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert rc == 1 and "not installed" in row["skipped"] and "skipped: vllm-router is not installed" in out
