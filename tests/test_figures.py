"""Figure computations against hand-computed values; tables, CSV/JSON and the plot."""
from __future__ import annotations

import json
import math

import pytest

from bench import figures
from bench.load import LevelRun, RequestRecord, _level


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert figures.percentile(xs, 50) == pytest.approx(2.5)
    assert figures.percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7 between 3 and 4
    assert figures.percentile(xs, 99) == pytest.approx(3.97)
    assert figures.percentile(xs, 0) == 1.0 and figures.percentile(xs, 100) == 4.0
    assert figures.percentile([7.0], 95) == 7.0
    assert math.isnan(figures.percentile([], 50))
    s = figures.summarize([10.0, 20.0, 30.0, 40.0, 50.0])
    assert s == {"mean": 30.0, "median": 30.0, "p90": pytest.approx(46.0), "p95": pytest.approx(48.0),
                 "p99": pytest.approx(49.6)}


def test_tpot_and_itl():
    assert figures.tpot(latency=1.0, ttft=0.2, output_tokens=5) == pytest.approx(0.2)
    assert figures.tpot(latency=1.0, ttft=0.2, output_tokens=1) is None
    assert figures.itls([0.1, 0.2, 0.4]) == pytest.approx([0.1, 0.2])
    assert figures.itls([0.3]) == []


def _run() -> LevelRun:
    a = RequestRecord(start=0.0, end=0.5, ttft=0.1, chunk_times=[0.1, 0.2, 0.4], output_tokens=3,
                      prompt_tokens=10, usage_reported=True)
    # A speculative stream: 4 tokens in 2 chunks.
    b = RequestRecord(start=0.1, end=1.1, ttft=0.3, chunk_times=[0.4, 0.5], output_tokens=4,
                      prompt_tokens=20, usage_reported=True)
    bad = RequestRecord(start=0.2, end=0.3, error="HTTP 503: The request queue is full.")
    run = _level([a, b, bad], concurrency=2)
    run.accept_length = 2.5
    return run


def test_compute_hand_values():
    run = _run()
    assert run.duration == pytest.approx(1.1)
    f = figures.compute(run)
    assert f["completed"] == 2 and f["failed"] == 1
    assert f["errors"] == {"HTTP 503: The request queue is full.": 1}
    assert f["total_output_tokens"] == 7 and f["total_input_tokens"] == 30
    assert f["output_throughput"] == pytest.approx(7 / 1.1)
    assert f["request_throughput"] == pytest.approx(2 / 1.1)
    assert f["total_token_throughput"] == pytest.approx(37 / 1.1)
    assert f["mean_ttft_ms"] == pytest.approx(200.0) and f["median_ttft_ms"] == pytest.approx(200.0)
    assert f["p90_ttft_ms"] == pytest.approx(280.0)
    # TPOT: a (0.5-0.1)/2 = 0.2, b (1.0-0.3)/3 = 0.2333
    assert f["mean_tpot_ms"] == pytest.approx((200.0 + 700.0 / 3) / 2)
    # ITL: gaps 0.1, 0.2 (a) and 0.1 (b)
    assert f["mean_itl_ms"] == pytest.approx(400.0 / 3)
    assert f["median_itl_ms"] == pytest.approx(100.0)
    assert f["p99_itl_ms"] == pytest.approx(198.0)
    assert f["mean_e2e_latency_ms"] == pytest.approx(750.0)
    assert f["p95_e2e_latency_ms"] == pytest.approx(975.0)
    assert f["mean_concurrency"] == pytest.approx(1.5 / 1.1)
    assert f["accept_length"] == 2.5 and f["concurrency"] == 2


def test_compute_speedup_scales_to_target_time():
    plain, fast = figures.compute(_run()), figures.compute(_run(), speedup=4.0)
    assert fast["output_throughput"] == pytest.approx(plain["output_throughput"] / 4)
    assert fast["request_throughput"] == pytest.approx(plain["request_throughput"] / 4)
    for key in ("median_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "median_e2e_latency_ms"):
        assert fast[key] == pytest.approx(plain[key] * 4)
    assert fast["mean_concurrency"] == pytest.approx(plain["mean_concurrency"])


def test_all_failed_level_has_no_latency_but_counts():
    run = _level([RequestRecord(start=0.0, end=0.1, error="cannot connect")], concurrency=1)
    f = figures.compute(run)
    assert f["completed"] == 0 and f["failed"] == 1 and f["output_throughput"] == 0.0
    assert math.isnan(f["median_ttft_ms"])


def test_table_csv_json_plot(tmp_path):
    f1 = figures.compute(_run())
    f2 = dict(f1, output_throughput=f1["output_throughput"] * 2)
    results = {"spec": [f1], "base": [f2]}
    table = figures.render_table(results)
    assert "output throughput (tok/s)" in table and "base/spec" in table and "2.00x" in table
    assert "failed requests" in table
    md = figures.render_markdown(results)
    assert md.splitlines()[0].startswith("| concurrency | spec tok/s | base tok/s")
    figures.write_csv(tmp_path / "x.csv", results)
    lines = (tmp_path / "x.csv").read_text().splitlines()
    assert lines[0].startswith("target,concurrency") and len(lines) == 3
    nan_run = figures.compute(_level([RequestRecord(start=0, end=1, error="x")], concurrency=1))
    figures.write_json(tmp_path / "x.json", {"results": {"a": [nan_run]}})
    assert json.loads((tmp_path / "x.json").read_text())["results"]["a"][0]["median_ttft_ms"] is None
    png = figures.plot(tmp_path / "x.png", {"spec": [f1, dict(f1, concurrency=10)]}, title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_steady_throughput_excludes_the_drain():
    a = RequestRecord(start=0.0, end=4.0, ttft=1.0, chunk_times=[1.0, 2.0, 3.0, 4.0], output_tokens=4)
    b = RequestRecord(start=0.0, end=2.0, ttft=1.0, chunk_times=[1.0, 2.0], output_tokens=2)
    # b's client sends again at t=2 (the last send); a 2-token chunk at t=3
    c = RequestRecord(start=2.0, end=6.0, ttft=1.0, chunk_times=[3.0, 6.0], output_tokens=4)
    f = figures.compute(_level([a, b, c], concurrency=2))
    assert f["output_throughput"] == pytest.approx(10 / 6)
    # window [0, 2]: a's first two chunks and both of b's -> 4 tokens in 2 s
    assert f["steady_output_throughput"] == pytest.approx(2.0) and f["steady_window_s"] == pytest.approx(2.0)
    assert figures.tput(f) == f["output_throughput"]
    # all requests sent at once: no steady window, the whole run counts
    g = figures.compute(_level([a, b], concurrency=2))
    assert g["steady_output_throughput"] == pytest.approx(g["output_throughput"])
    assert figures.tput({"output_throughput": 5.0}) == 5.0
