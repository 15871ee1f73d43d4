"""`bench replay`: the Mooncake trace and synthetic sessions, open loop against a simulator (and the router);
bad input is one line naming the file and line, exit 2."""
from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from bench import replay
from bench.sim.engine import tokenize

pytestmark = pytest.mark.timeout(120)

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / "conversation_trace_first_30min.jsonl"
GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = replay.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("line, says", [
    ("{not json", "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5}', "missing field 'hash_ids'"),
    ('{"timestamp": 0, "output_length": 5, "hash_ids": [1, 2]}', "missing field 'input_length'"),
    ('{"timestamp": -5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "'timestamp' must be >= 0"),
    ('{"timestamp": 0, "input_length": 600, "output_length": -1, "hash_ids": [1, 2]}', "'output_length' must be >= 0"),
    ('{"timestamp": 0, "input_length": "600", "output_length": 5, "hash_ids": [1, 2]}', "must be an integer"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, -2]}', "non-negative integers"),
    ('{"timestamp": 0, "input_length": 6000, "output_length": 5, "hash_ids": [1, 2]}', "cannot hold input_length"),
])
def test_a_bad_trace_line_is_one_line_naming_file_and_line(tmp_path, capsys, line, says):
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    rc, out, err = run_main(["--trace", str(path), "--target", "http://127.0.0.1:9"], capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and f"{path}:3:" in err and says in err, err


@pytest.mark.parametrize("argv, says", [
    (["--trace", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl: no such file"),
    (["--synthetic", "--token-scale", "0"], "--token-scale"),
    (["--synthetic", "--mooncake-slowdown-factor", "1,-2"], "--mooncake-slowdown-factor"),
    (["--synthetic", "--sessions", "0"], "--sessions"),
    (["--synthetic", "--think-time", "nan"], "--think-time"),
    (["--synthetic", "--mooncake-slowdown-factor", "inf"], "--mooncake-slowdown-factor"),
    (["--synthetic", "--target", "http://127.0.0.1:8", "--target", "http://127.0.0.1:9"],
     "target names must be unique"),
    (["--synthetic", "--target", "127.0.0.1:8"], "expected [NAME=]http://HOST:PORT"),
    (["--trace", "x.jsonl", "--synthetic"], "not allowed with"),
    (["--target", "http://127.0.0.1:9"], "one of the arguments --trace --synthetic is required"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, says):
    rc, out, err = run_main(argv if "--target" in argv else [*argv, "--target", "http://127.0.0.1:9"], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err


def test_an_empty_window_and_an_unreachable_target_are_one_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n")
    rc, _, err = run_main(["--trace", str(path), "--window-start", "5", "--target", "http://127.0.0.1:9"], capsys)
    assert rc == 2 and "no request in the window" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run_main(["--trace", str(path), "--target", "http://127.0.0.1:9"], capsys)
    assert rc == 2 and "unreachable" in err.splitlines()[-1]


def test_equal_hash_ids_give_equal_text_and_tokens():
    a = replay.TraceRequest(0, 1024, 1, (7, 8), 1)
    b = replay.TraceRequest(0, 1500, 1, (7, 8, 9), 2)
    ta, tb = tokenize(replay.trace_content(a, 1.0)), tokenize(replay.trace_content(b, 1.0))
    assert len(ta) == 1024 and len(tb) == 1500 and tb[:1024] == ta
    c = replay.TraceRequest(0, 700, 1, (7, 5), 3)  # same first block, a different second one
    tc = tokenize(replay.trace_content(c, 1.0))
    assert tc[:512] == ta[:512] and tc[512] != ta[512]
    # --token-scale shrinks blocks and prompts alike, so sharing is kept
    assert len(tokenize(replay.trace_content(b, 0.1))) == 150


async def _main_in_thread(argv: list[str]) -> int:
    # replay runs its own event loop; the in-process servers keep serving on this one
    return await asyncio.to_thread(replay.main, argv)


async def test_synthetic_sessions_reuse_their_history(sim_factory, tmp_path, capsys):
    sim = await sim_factory(speedup=100, enable_cache_report=True)
    out = tmp_path / "o"
    rc = await _main_in_thread(["--synthetic", "--sessions", "4", "--turns", "3", "--session-rate", "2",
                                "--think-time", "0.5", "--system-prompt-tokens", "300", "--user-tokens", "20",
                                "--output-tokens", "10", "--target", f"sim={sim.url}", "--speedup", "100",
                                "--slo-ttft", "100000", "--out", str(out), "--no-plot"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    assert "synthetic multi-turn: 4 sessions" in text and "token scale 1" in text
    data = json.loads((out / "replay.json").read_text())
    fig = data["results"]["sim"][0]
    assert fig["completed"] == 12 and fig["failed"] == 0 and fig["good_requests"] == 12
    # each later turn finds its whole history (system prompt, earlier turns, the replies it got back); the first
    # turns of sessions 2-4 find the shared system prompt
    assert fig["cache_hit_ratio"] > 0.75
    assert data["config"]["synthetic"]["turns"] == 3 and (out / "replay.csv").read_text().count("\n") == 2
    assert "sim slowdown 1:" in err  # the progress line


@pytest.mark.skipif(not TRACE.is_file(), reason=f"Kimi's Mooncake trace is not at {TRACE} (../shared/data/mooncake/)")
async def test_the_trace_through_the_router_reports_cache_hits_and_pool_shares(sim_factory, router_factory,
                                                                             tmp_path, capsys):
    spec = await sim_factory("eagle3-tp8", speedup=100, enable_cache_report=True)
    base = await sim_factory(speedup=100, enable_cache_report=True)
    router = await router_factory(speculative=[spec.url], baseline=[base.url])
    plain = await sim_factory(speedup=100)  # no --enable-cache-report: SGLang sends no cached_tokens
    out = tmp_path / "o"
    rc = await _main_in_thread(["--trace", str(TRACE), "--limit", "30", "--token-scale", "0.05", "--target",
                                f"router={router.url}", "--target", f"plain={plain.url}", "--speedup", "100",
                                "--mooncake-slowdown-factor", "1,2", "--out", str(out)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    assert "TOKEN SCALE 0.05" in text and "not reported" in text
    data = json.loads((out / "replay.json").read_text())
    assert data["config"]["token_scale_note"].startswith("TOKEN SCALE 0.05")
    for fig in data["results"]["router"]:
        assert fig["completed"] == 30 and fig["cache_hit_ratio"] > 0  # block 0 is every prompt's system prompt
        assert set(fig["pool_share"]) <= {"speculative", "baseline"}
        assert sum(fig["pool_share"].values()) == pytest.approx(1.0)
    assert all(f["cache_hit_ratio"] is None and f["pool_share"] is None for f in data["results"]["plain"])
    assert [f["slowdown"] for f in data["results"]["plain"]] == [1.0, 2.0]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "replay.png").stat().st_size > 0


def test_sampling_conversations_keeps_whole_conversations():
    lines = [replay.TraceRequest(t, 600, 1, ids, i) for i, (t, ids) in enumerate(
        [(0, (0, 20)), (0, (0, 21)), (1000, (0, 20, 5)), (2000, (0, 40)), (3000, (0, 21, 6))], 1)]
    wl = replay.trace_workload(lines, "t", limit=None, window=(0.0, None), token_scale=1.0, num_rounds=1, sample=20)
    assert [s.trace.line for s in wl.sessions] == [1, 3, 4] and "one conversation in 20" in wl.description
    assert [s.at for s in wl.sessions] == [0.0, 1.0, 2.0]
