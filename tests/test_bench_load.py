"""Load generator and sweep CLI against small real HTTP servers: records, failures, bad input."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket

import pytest
from aiohttp import web

from bench import cli, levels, sweep
from bench.load import (
    BenchInputError,
    LoadSpec,
    Prompt,
    _has_text,
    check_reachable,
    load_prompts,
    parse_prompts_jsonl,
    run_closed,
    run_open,
)


def _chunk(delta: dict, finish=None) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


STATE = web.AppKey("state", dict)


def make_app(mode: str = "ok", tokens: int = 5, gap: float = 0.002) -> web.Application:
    """A tiny OpenAI-style streaming server: `ok`, `http500`, `stream_error`, `no_done`, `no_usage`."""
    state = {"requests": 0, "in_flight": 0, "max_in_flight": 0, "bodies": []}

    async def chat(request: web.Request) -> web.StreamResponse:
        state["requests"] += 1
        body = await request.json()
        state["bodies"].append(body)
        if mode == "http500":
            return web.json_response({"object": "error", "message": "boom", "code": 500}, status=500)
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(_chunk({"role": "assistant", "content": ""}))
            n = min(tokens, body["max_tokens"])
            for i in range(n):
                await asyncio.sleep(gap)
                if mode == "stream_error" and i == 2:
                    await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                await resp.write(_chunk({"content": f"t{i} "}))
            await resp.write(_chunk({}, finish="length"))
            if mode != "no_usage":
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            if mode != "no_done":
                await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            state["in_flight"] -= 1

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_get("/v1/models", models)
    app[STATE] = state
    return app


@pytest.fixture
async def fake_factory():
    runners = []

    async def start(**kw):
        app = make_app(**kw)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}", app[STATE]

    yield start
    for r in runners:
        await r.cleanup()


PROMPTS = [Prompt(messages=[{"role": "user", "content": "hi"}]), Prompt(prompt="hello")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_closed_loop_keeps_concurrency_and_counts(fake_factory):
    url, state = await fake_factory(tokens=6)
    spec = LoadSpec(url=url, prompts=PROMPTS, max_tokens=6, requests=12)
    run = await run_closed(spec, concurrency=3)
    assert len(run.records) == 12 and all(r.ok for r in run.records)
    assert state["requests"] == 12
    assert state["max_in_flight"] == 3
    for r in run.records:
        assert r.output_tokens == 6 and r.prompt_tokens == 7 and r.usage_reported
        assert len(r.chunk_times) == 6
        assert r.start < r.start + r.ttft <= r.chunk_times[-1] <= r.end
    body = state["bodies"][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6
    assert run.duration >= max(r.end for r in run.records) - min(r.start for r in run.records) - 1e-9


async def test_closed_loop_fewer_requests_than_clients(fake_factory):
    url, state = await fake_factory()
    run = await run_closed(LoadSpec(url=url, prompts=PROMPTS, requests=2), concurrency=10)
    assert len(run.records) == 2 and state["max_in_flight"] <= 2


async def test_closed_loop_duration_bound(fake_factory):
    url, _ = await fake_factory(tokens=3, gap=0.01)
    run = await run_closed(LoadSpec(url=url, prompts=PROMPTS, duration=0.3), concurrency=2)
    assert run.records and all(r.ok for r in run.records)
    # No request may start after the duration elapsed.
    t0 = min(r.start for r in run.records)
    assert all(r.start - t0 < 0.3 + 0.05 for r in run.records)


async def test_open_loop_sends_all_requests(fake_factory):
    url, state = await fake_factory(tokens=2)
    run = await run_open(LoadSpec(url=url, prompts=PROMPTS, requests=15), rate=200.0)
    assert len(run.records) == 15 and state["requests"] == 15
    assert all(r.ok for r in run.records)


@pytest.mark.parametrize("mode, fragment", [
    ("http500", "HTTP 500: boom"),
    ("stream_error", "engine died"),
    ("no_done", "without [DONE]"),
])
async def test_failures_are_counted_with_reason(fake_factory, mode, fragment):
    url, _ = await fake_factory(mode=mode)
    run = await run_closed(LoadSpec(url=url, prompts=PROMPTS, requests=4), concurrency=2)
    assert len(run.records) == 4
    assert all(not r.ok and fragment in r.error for r in run.records)


async def test_missing_usage_falls_back_to_chunk_count(fake_factory):
    url, _ = await fake_factory(mode="no_usage", tokens=4)
    run = await run_closed(LoadSpec(url=url, prompts=PROMPTS, requests=2), concurrency=1)
    assert all(r.ok and r.output_tokens == 4 and not r.usage_reported for r in run.records)


async def test_unreachable_target_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchInputError, match="unreachable"):
        await check_reachable(url)
    run = await run_closed(LoadSpec(url=url, prompts=PROMPTS, requests=2), concurrency=1)
    assert all("cannot connect" in r.error for r in run.records)


def test_has_text_detection():
    assert _has_text(b'{"choices":[{"delta":{"content":"hi"}}]}')
    assert _has_text(b'{"choices": [{"delta": {"content": "hi"}}]}')
    assert not _has_text(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert not _has_text(b'{"choices":[{"delta":{"content":null}}]}')
    assert not _has_text(b'{"choices":[{"delta":{}, "finish_reason":"stop"}]}')
    assert _has_text(b'{"choices":[{"text":"abc","index":0}]}')
    assert not _has_text(b'{"choices":[{"delta":{"reasoning_content":"x"}}]}')


def test_prompt_files(tmp_path):
    for name in ("coding", "general"):
        ps = load_prompts(name)
        assert len(ps) >= 24
        lengths = [len(json.dumps(p.messages)) for p in ps]
        assert max(lengths) > 4 * min(lengths)
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    ps = load_prompts(str(good))
    assert [p.path for p in ps] == ["/v1/completions", "/v1/chat/completions"]
    with pytest.raises(BenchInputError, match=r"bad.jsonl:2: not valid JSON"):
        parse_prompts_jsonl('{"prompt": "a"}\n{"prompt": \n', "bad.jsonl")
    with pytest.raises(BenchInputError, match="'messages' or 'prompt'"):
        parse_prompts_jsonl('{"text": "a"}\n', "x.jsonl")
    with pytest.raises(BenchInputError, match="no prompts"):
        parse_prompts_jsonl("\n\n", "empty.jsonl")
    with pytest.raises(BenchInputError, match="not a built-in set"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def _run_cli(argv):
    # The CLI owns its event loop; run it off the test's loop.
    return asyncio.to_thread(sweep.main, argv)


async def test_sweep_cli_writes_outputs(fake_factory, tmp_path, capsys):
    url_a, _ = await fake_factory(tokens=4)
    url_b, _ = await fake_factory(tokens=4, gap=0.004)
    rc = await _run_cli(["--target", f"a={url_a}", "--target", f"b={url_b}/v1", "--concurrency", "1,3",
                         "--requests-per-level", "6", "--max-tokens", "4", "--out", str(tmp_path),
                         "--speedup", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "output throughput" in out and "b/a" in out
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [f["concurrency"] for f in data["results"]["a"]] == [1, 3]
    assert data["results"]["b"][1]["completed"] == 6
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 5
    assert (tmp_path / "sweep.png").stat().st_size > 1000


async def test_sweep_cli_failing_target_reports_failures(fake_factory, tmp_path, capsys):
    url, _ = await fake_factory(mode="http500")
    rc = await _run_cli(["--target", f"x={url}", "--concurrency", "2", "--requests-per-level", "4",
                         "--out", str(tmp_path), "--no-plot"])
    cap = capsys.readouterr()
    assert rc == 1
    assert "every request to x failed" in cap.err and "HTTP 500" in cap.err
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["results"]["x"][0]["failed"] == 4 and data["results"]["x"][0]["completed"] == 0


@pytest.mark.parametrize("argv, fragment", [
    (["--target", "nourl"], "[NAME=]http"),
    (["--target", "http://127.0.0.1:1", "--target", "http://127.0.0.1:2"], "unique (name each target NAME=URL)"),
    (["--target", "a=http://127.0.0.1:1", "--request-rate", "1,nan"], "--request-rate"),
    (["--target", "a=http://127.0.0.1:1", "--concurrency", "0"], "positive"),
    (["--target", "a=http://127.0.0.1:1", "--target", "a=http://127.0.0.1:2"], "unique"),
    ([], "--target"),
])
def test_sweep_cli_bad_flags(argv, fragment, capsys):
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and err.count("\n") == 1


async def test_sweep_cli_unreachable_and_bad_prompts(tmp_path, capsys, fake_factory):
    rc = await _run_cli(["--target", f"a=http://127.0.0.1:{free_port()}", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "unreachable" in err and err.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    url, _ = await fake_factory()
    rc = await _run_cli(["--target", f"a={url}", "--prompts", str(bad), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.jsonl:1: not valid JSON" in err


@pytest.mark.parametrize("text, expected", [
    ("a=http://h:1", ("a", "http://h:1")),
    ("a=http://h:1/v1/", ("a", "http://h:1")),
    ("http://h:1/", ("target", "http://h:1")),  # a bare URL (replay's users give one target so)
    ("https://h:1/v1?x=y", ("target", "https://h:1/v1?x=y")),  # `=` inside a bare URL is not a name
    ("a=b=http://h:1", None), ("=http://h:1", None), ("a=ftp://h", None), ("h:1", None),
])
def test_one_target_flag_type_for_every_command(text, expected):
    if expected is None:
        with pytest.raises(argparse.ArgumentTypeError, match=r"\[NAME=\]http"):
            cli.target(text)
    else:
        assert cli.target(text) == expected


def test_level_cap_bounds_every_level():
    # 10 requests on 4 clients: at most 3 rounds of the 5 s timeout, plus a minute
    assert levels.level_cap(10, None, 5.0, 4, None) == 3 * 5.0 + 60
    assert levels.level_cap(None, 30.0, 5.0, 4, None) == 30.0 + 5.0 + 60
    assert levels.level_cap(100, 30.0, 5.0, 4, None) == 30.0 + 5.0 + 60  # the tighter bound wins
    assert levels.level_cap(20, None, 5.0, None, 10.0) == 2.0 + 5.0 + 60


async def test_level_time_limit_counts_cut_requests_as_failed(fake_factory):
    url, _ = await fake_factory(tokens=50, gap=0.05)
    run = await run_closed(LoadSpec(url=url, prompts=PROMPTS, requests=2, level_timeout=0.3), concurrency=2)
    assert len(run.records) == 2
    assert all(r.error == "cancelled: level time limit 0.3s" for r in run.records)


async def test_sweep_cli_open_loop(fake_factory, tmp_path, capsys):
    url, state = await fake_factory(tokens=3)
    rc = await _run_cli(["--target", f"a={url}", "--request-rate", "50,100", "--requests-per-level", "5",
                         "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and state["requests"] == 10
    assert "rate" in out and "50/s" in out and "100/s" in out
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [f["request_rate"] for f in data["results"]["a"]] == [50.0, 100.0]
    assert (tmp_path / "sweep.png").exists()
