"""`bench replay --class-mix`: which conversation gets which class (deterministic by seed, whole conversations),
what each class sends (llm-d's x-slo-* headers, OpenAI's service_tier), and goodput judged per class against the
class's own targets, 429s counted apart."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from bench import classmix, replay
from bench.load import RequestRecord
from tests.fixtures_rawbackend import CHAT_EVENTS, json_answer, sse

pytestmark = pytest.mark.timeout(60)

INTERACTIVE = classmix.RequestClass("interactive", 0.3, 5000.0, 30.0)
DEFAULT = classmix.RequestClass("default", 0.5)
FLEX = classmix.RequestClass("flex", 0.2, 30000.0, 100.0, tier="flex")


# ---- flags ----------------------------------------------------------------------------------------

def test_the_default_mix_is_the_documented_one():
    classes = classmix.build(classmix.DEFAULT_MIX)
    assert classes == [INTERACTIVE, DEFAULT, FLEX]
    assert INTERACTIVE.headers(True) == {"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "30"}
    assert DEFAULT.headers(True) == {} and DEFAULT.body(True) == {}
    # flex: the router's default flex tier and its numbers (headers override a tier's numbers there)
    assert FLEX.body(True) == {"service_tier": "flex"}
    assert FLEX.headers(True) == {"x-slo-ttft-ms": "30000", "x-slo-tpot-ms": "100"}
    # --no-send-targets: the same classes, nothing sent
    assert INTERACTIVE.headers(False) == {} and FLEX.body(False) == {}
    # a simulator 8x fast: its router sees the targets in its own (wall) clock
    assert INTERACTIVE.headers(True, speedup=8) == {"x-slo-ttft-ms": "625", "x-slo-tpot-ms": "3.75"}


def test_targets_and_tiers_override_the_defaults():
    classes = classmix.build("interactive=0.5,batch=0.5", ["interactive=tpot:50", "batch=ttft:60000"],
                             ["interactive=priority"])
    assert classes == [classmix.RequestClass("interactive", 0.5, None, 50.0, "priority"),
                       classmix.RequestClass("batch", 0.5, 60000.0, None)]
    assert classmix.build("interactive=1", ["interactive=none"]) == [classmix.RequestClass("interactive", 1.0)]
    assert classmix.build("flex=1", tiers=["flex=none"]) == [classmix.RequestClass("flex", 1.0, 30000.0, 100.0)]


@pytest.mark.parametrize("mix, targets, tiers, says", [
    ("interactive=0.3,default=0.5", [], [], "add up to 0.8, not 1"),
    ("interactive=0.5,interactive=0.5", [], [], "given twice"),
    ("interactive=-0.5,default=1.5", [], [], "between 0 and 1"),
    ("interactive=half,default=0.5", [], [], "must be a number"),
    ("Inter=1", [], [], "lower-case"),
    ("interactive", [], [], "expected CLASS=VALUE"),
    ("interactive=1", ["batch=ttft:5"], [], "'batch' is not in the mix"),
    ("interactive=1", ["interactive=ttft:0"], [], "positive number of ms"),
    ("interactive=1", ["interactive=ttft:5,ttft:6"], [], "each at most once"),
    ("interactive=1", ["interactive=e2e:5"], [], "expected CLASS=ttft:MS,tpot:MS"),
    ("interactive=1", [], ["interactive"], "expected CLASS=TIER"),
    ("interactive=1", [], ["batch=flex"], "'batch' is not in the mix"),
])
def test_bad_mix_flags_are_one_line(mix, targets, tiers, says):
    with pytest.raises(classmix.MixError, match=says):
        classmix.build(mix, targets, tiers)


@pytest.mark.parametrize("argv, says", [
    (["--class-mix", "a=0.5"], "--class-mix: shares add up to 0.5, not 1"),
    (["--class-targets", "interactive=ttft:5"], "--class-targets and --class-tier need --class-mix"),
    (["--class-mix", "default", "--class-targets", "interactive=tpot:x"], "tpot of 'interactive' must be a number"),
])
def test_bad_mix_flags_exit_2_with_one_line(capsys, argv, says):
    rc = replay.main(["--synthetic", "--target", "http://127.0.0.1:9", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err


# ---- assignment -----------------------------------------------------------------------------------

def test_assignment_is_deterministic_and_follows_the_shares():
    classes = [INTERACTIVE, DEFAULT, FLEX]
    first = [classmix.assign(k, 7, classes).name for k in range(20000)]
    assert first == [classmix.assign(k, 7, classes).name for k in range(20000)]
    counts = Counter(first)
    for c in classes:
        assert counts[c.name] / 20000 == pytest.approx(c.share, abs=0.015)
    other = [classmix.assign(k, 8, classes).name for k in range(20000)]
    assert 0.3 < sum(a != b for a, b in zip(first, other, strict=True)) / 20000 < 0.8  # another seed, another draw
    # a class with share 0 is never drawn
    assert {classmix.assign(k, 1, [DEFAULT.__class__("a", 0.0), DEFAULT.__class__("b", 1.0)]).name
            for k in range(500)} == {"b"}


def test_a_conversation_keeps_one_class_across_its_lines():
    # lines of one conversation share their second block id (bench.replay.conversation)
    lines = [replay.TraceRequest(t, 600, 1, (0, conv, 100 + i), i + 1)
             for i, (t, conv) in enumerate([(0, c) for c in range(60)] + [(5000, c) for c in range(60)])]
    wl = replay.trace_workload(lines, "t", limit=None, window=(0.0, None), token_scale=1.0, num_rounds=1)
    of = replay.assign_classes(wl, [INTERACTIVE, DEFAULT, FLEX], seed=3)
    by_conv: dict[int, set[str]] = {}
    for s in wl.sessions:
        by_conv.setdefault(s.trace.hash_ids[1], set()).add(of[s.index].name)
    assert len(by_conv) == 60 and all(len(v) == 1 for v in by_conv.values())
    assert {n for v in by_conv.values() for n in v} == {"interactive", "default", "flex"}
    assert replay.assign_classes(wl, None, seed=3) == {}


# ---- scoring --------------------------------------------------------------------------------------

def rec(ttft_s: float | None, latency_s: float, tokens: int, error: str | None = None) -> RequestRecord:
    r = RequestRecord(start=100.0, end=100.0 + latency_s, ttft=ttft_s, output_tokens=tokens, error=error)
    return r


def test_each_class_is_judged_against_its_own_targets():
    # speedup 10: 0.4 s wall = 4 s TTFT; tpot (latency - ttft) / (tokens - 1)
    records = [
        (rec(0.4, 0.4 + 0.0025 * 10, 11), "interactive"),  # TTFT 4 s, TPOT 25 ms: met
        (rec(0.6, 0.6 + 0.0025 * 10, 11), "interactive"),  # TTFT 6 s: missed
        (rec(0.1, 0.1 + 0.004 * 10, 11), "interactive"),  # TPOT 40 ms: missed
        (rec(0.1, 0.1, 1), "interactive"),  # one token: no TPOT, TTFT met
        (rec(None, 1.0, 0, "HTTP 500: boom"), "interactive"),  # failed
        (rec(9.0, 20.0, 11), "default"),  # no targets: completion counts
        (rec(None, 0.01, 0, "HTTP 429: shed"), "flex"),  # shed: not a failure, not in the attainment
        (rec(None, 0.01, 0, "HTTP 429: shed"), "flex"),
        (rec(0.5, 0.5 + 0.009 * 10, 11), "flex"),  # TTFT 5 s, TPOT 90 ms: met
        (rec(3.1, 3.2, 11), "flex"),  # TTFT 31 s: missed
    ]
    got = classmix.score(records, [INTERACTIVE, DEFAULT, FLEX], speedup=10, duration_s=10.0)
    i, d, f = (got["classes"][n] for n in ("interactive", "default", "flex"))
    assert (i["requests"], i["good"], i["failed"], i["shed"], i["completed"]) == (5, 2, 1, 0, 4)
    assert i["attainment"] == pytest.approx(2 / 5) and i["goodput"] == pytest.approx(0.2)
    assert (d["good"], d["attainment"]) == (1, 1.0)
    assert (f["requests"], f["shed"], f["failed"], f["good"], f["attainment"]) == (4, 2, 0, 1, 0.5)
    assert got["good"] == 4 and got["shed"] == 2 and got["goodput"] == pytest.approx(0.4)
    assert i["ttft_ms"]["p50"] == pytest.approx(2500.0)  # of 4000, 6000, 1000, 1000
    assert i["tpot_ms"]["p90"] == pytest.approx(37.0)  # of 25, 25, 40 (the one-token answer has none)
    with pytest.raises(ValueError, match="not in the mix"):
        classmix.score([(rec(0.1, 0.2, 2), "batch")], [DEFAULT], speedup=1, duration_s=1.0)


def test_a_class_with_only_shed_requests_has_no_attainment():
    got = classmix.score([(rec(None, 0.01, 0, "HTTP 429: x"), "flex")], [FLEX], speedup=1, duration_s=1.0)
    assert got["classes"]["flex"]["attainment"] is None and got["goodput"] == 0.0


# ---- goodput over time (a cold start's warm-up) ---------------------------------------------------

def at(start: float, ttft_s: float | None, latency_s: float, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(start=start, end=start + latency_s, ttft=ttft_s, output_tokens=tokens, error=error)


MET = (0.1, 0.1 + 0.002 * 10, 11)  # speedup 10: TTFT 1 s, TPOT 20 ms: meets interactive
SLOW = (0.9, 0.9 + 0.002 * 10, 11)  # TTFT 9 s: misses interactive


def test_windows_cut_the_requests_in_the_order_sent_and_judge_them_as_the_run_is():
    # 10 requests sent 1 s apart (wall; 10 s at speedup 10), given out of order: windows of 3, 3, 2, 2
    recs = [(at(float(i), *(SLOW if i < 3 else MET)), "interactive") for i in range(10)]
    got = classmix.over_time(list(reversed(recs)), [INTERACTIVE, DEFAULT], speedup=10)
    w = got["windows"]
    assert [(x["first"], x["requests"]) for x in w] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert [x["good"] for x in w] == [0, 3, 2, 2]
    assert [x["attainment"] for x in w] == [{"interactive": 0.0}] + [{"interactive": 1.0}] * 3  # default: no target
    # each window's span: its first start to its last end (target's time), as the run's goodput is computed
    assert w[1]["span_s"] == pytest.approx((5.12 - 3.0) * 10) and w[1]["goodput"] == pytest.approx(3 / 21.2)
    # sent/s: up to the next window's first send; the last window: between its own sends
    assert [x["sent_rate"] for x in w] == pytest.approx([0.1] * 4)
    # the same judge as the whole run: each window's goodput is `score`'s over its requests and span
    assert w[2]["goodput"] == pytest.approx(classmix.score(recs[6:8], [INTERACTIVE, DEFAULT], speedup=10,
                                                           duration_s=w[2]["span_s"])["goodput"])
    assert got["reference_windows"] == 2 and got["reference_goodput"] == pytest.approx(2 / 11.2)
    # window 2 (3 good over 21.2 s) is 21% under the last two's mean: warm from window 3, after 6 requests
    assert (got["warm_from"], got["warmup_requests"]) == (2, 6)
    # a wider band takes window 2 in; the first window (nothing met) never
    assert classmix.over_time(recs, [INTERACTIVE], speedup=10, band=0.25)["warmup_requests"] == 3


def test_a_run_that_never_settles_has_no_warm_up_and_shed_requests_stay_out_of_the_span():
    # the last window alone differs from the mean of the last two by more than 10%: not reached
    recs = [(at(float(i), *(MET if i < 6 else SLOW)), "interactive") for i in range(8)]
    got = classmix.over_time(recs, [INTERACTIVE], speedup=10)
    assert [x["good"] for x in got["windows"]] == [2, 2, 2, 0]
    assert got["warm_from"] is None and got["warmup_requests"] is None
    # a 429 counts in its window's requests and shed, not in its span or attainment
    shed = [(at(0.0, None, 50.0, 0, "HTTP 429: shed"), "flex"), (at(1.0, *MET), "flex"), (at(2.0, *MET), "flex")]
    one = classmix.over_time(shed, [FLEX], speedup=10, windows=1)
    x, = one["windows"]
    assert (x["requests"], x["shed"], x["good"], x["attainment"]) == (3, 1, 2, {"flex": 1.0})
    assert x["span_s"] == pytest.approx((2.12 - 1.0) * 10)
    assert (one["warm_from"], one["warmup_requests"]) == (0, 0)  # one window is its own reference
    # fewer requests than windows: one window each; none at all: nothing to say
    assert len(classmix.over_time(shed[1:], [FLEX], speedup=10)["windows"]) == 2
    assert classmix.over_time([], [FLEX], speedup=10) is None


# ---- end to end: what each class sends, and a 429 counted as shed ---------------------------------

async def _main_in_thread(argv: list[str]) -> int:
    return await asyncio.to_thread(replay.main, argv)


def _flex_is_shed():
    ok, shed = sse(CHAT_EVENTS), json_answer(429, {"error": {"message": "flex shed", "type": "rate_limit"}})

    async def act(c) -> None:
        await (shed if json.loads(c.request.body).get("service_tier") == "flex" else ok)(c)
    return act


@pytest.mark.parametrize("send", [True, False])
async def test_each_class_sends_its_targets_and_429s_are_shed(raw_backend_factory, tmp_path, capsys, send):
    backend = await raw_backend_factory({"/v1/chat/completions": _flex_is_shed()})
    out = tmp_path / "o"
    rc = await _main_in_thread(["--synthetic", "--sessions", "40", "--turns", "1", "--session-rate", "200",
                                "--output-tokens", "1", "--system-prompt-tokens", "5", "--user-tokens", "5",
                                "--class-mix", "default", "--seed", "5", "--target", f"raw={backend.url}",
                                "--out", str(out), "--no-plot", "--send-targets" if send else "--no-send-targets"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    chats = [r for r in backend.requests if r.path == "/v1/chat/completions"]
    assert len(chats) == 40
    expected = Counter(classmix.assign(i, 5, [INTERACTIVE, DEFAULT, FLEX]).name for i in range(40))
    headers = [{k.lower(): v for k, v in r.headers.items()} for r in chats]
    tiers = [json.loads(r.body).get("service_tier") for r in chats]
    slo = sum("x-slo-ttft-ms" in h for h in headers)
    if send:
        assert slo == expected["interactive"] + expected["flex"] and expected["interactive"] > 0 and tiers.count("flex") == expected["flex"] > 0
        assert sorted(h["x-slo-tpot-ms"] for h in headers if "x-slo-ttft-ms" in h) == sorted(
            ["30"] * expected["interactive"] + ["100"] * expected["flex"])
    else:
        assert slo == 0 and tiers.count(None) == 40
    fig = json.loads((out / "replay.json").read_text())["results"]["raw"][0]
    shed = expected["flex"] if send else 0
    assert fig["shed"] == shed and fig["failed"] == fig["not_sent"] == 0 and fig["completed"] == 40 - shed
    assert fig["classes"]["flex"]["shed"] == shed and fig["class_good"] == 40 - shed
    assert {n: c["requests"] for n, c in fig["classes"].items()} == dict(expected)
    data = json.loads((out / "replay.json").read_text())["config"]
    assert data["send_targets"] is send and [c["name"] for c in data["class_mix"]] == ["interactive", "default", "flex"]
    assert "class mix (interactive 30%: targets TTFT 5000 ms, TPOT 30 ms" in text
    # goodput over time: 4 windows of 10 in the order sent, every request in one, the same judge as the run
    w = fig["goodput_over_time"]
    assert [x["requests"] for x in w["windows"]] == [10] * 4 and sum(x["good"] for x in w["windows"]) == 40 - shed
    assert sum(x["shed"] for x in w["windows"]) == shed and set(w["windows"][0]["attainment"]) == {"interactive", "flex"}
    assert "raw slowdown 1: goodput over time, 4 windows of equal count" in text
