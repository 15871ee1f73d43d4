"""How good the router's latency predictions are (bench.predictions): predicted/measured percentiles per pool, over
all requests, the warm-up (the first N of each pool, in start order) and the rest, the warm-up the data shows; and
`spec-bench replay` keeping the X-Router-Predicted-* answer headers of each request."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench import predictions, replay
from bench.predictions import Predicted
from tests.fixtures_rawbackend import CHAT_EVENTS

pytestmark = pytest.mark.timeout(60)


def req(start: float, pool: str, ratio_ttft: float | None, ratio_tpot: float | None = None) -> Predicted:
    """A request measured at TTFT 0.2 s and TPOT 0.01 s, predicted at these ratios of them."""
    return Predicted(start, pool, None if ratio_ttft is None else 200.0 * ratio_ttft,
                     None if ratio_tpot is None else 10.0 * ratio_tpot, 0.2, 0.01)


def test_percentiles_per_pool_split_at_each_pools_own_warm_up_in_start_order():
    # speculative: 4 cold requests 4x over, then 6 within 1.1x; baseline: 3 requests at 0.5x; given out of order
    items = [req(10 + i, "speculative", 1.1 if i % 2 else 1 / 1.1, 1.0) for i in range(6)]
    items += [req(i, "speculative", 4.0, 2.0) for i in range(4)]
    items += [req(0.5 + i, "baseline", 0.5) for i in range(3)]
    out = predictions.summarize(reversed(items), warmup=4)
    rows = {(r["pool"], r["kind"]): r for r in out["rows"]}
    assert list(rows) == [("baseline", "ttft"), ("speculative", "ttft"), ("speculative", "tpot"), ("all", "ttft"),
                          ("all", "tpot")]  # no TPOT predicted on the baseline: no row
    s = rows[("speculative", "ttft")]
    assert s["all"]["n"] == 10 and s["warmup"]["n"] == 4 and s["after"]["n"] == 6
    assert s["warmup"]["p50"] == pytest.approx(4.0) and s["warmup"]["median_abs_log"] == pytest.approx(math.log(4))
    assert s["after"]["p10"] == pytest.approx(1 / 1.1) and s["after"]["p90"] == pytest.approx(1.1)
    assert s["after"]["median_abs_log"] == pytest.approx(math.log(1.1)) and s["after"]["within_1_25"] == 1.0
    assert s["all"]["within_1_25"] == pytest.approx(0.6)
    assert s["settled_after"] == 4  # windows of 4: [4x x4] misses, then [1.1x x4], [1.1x x2] keep to the rule
    assert rows[("speculative", "tpot")]["after"]["p50"] == pytest.approx(1.0)
    b = rows[("baseline", "ttft")]
    assert b["all"]["p50"] == pytest.approx(0.5) and b["after"]["n"] == 0 and b["after"]["p50"] is None
    assert b["settled_after"] is None  # 2x under throughout: never within the rule
    # every pool together, in start order (0 s, 0.5 s, 1 s, 1.5 s): speculative and baseline in turn
    a = rows[("all", "ttft")]
    assert a["all"]["n"] == 13 and predictions.ratios(items)["all"]["ttft"][:4] == pytest.approx([4, 0.5, 4, 0.5])


def test_settled_after_needs_every_later_window_within_the_rule():
    good, bad = 1.1, 2.0
    assert predictions.settled_after([bad] * 3 + [good] * 6, 3) == 3
    assert predictions.settled_after([good] * 3 + [bad] * 3 + [good] * 3, 3) == 6  # a relapse restarts it
    assert predictions.settled_after([good] * 6 + [bad] * 3, 3) is None  # the last window misses
    assert predictions.settled_after([good] * 5, 2) == 0
    assert predictions.settled_after([], 3) is None


def test_unmeasured_or_unpredicted_requests_count_nowhere():
    items = [Predicted(0, "baseline", None, 5.0, 0.1, None),  # TPOT predicted, one token: nothing measured
             Predicted(1, None, 100.0, None, 0.1, 0.01)]  # no pool header: pool "-"
    out = predictions.summarize(items)
    assert [(r["pool"], r["kind"], r["all"]["n"]) for r in out["rows"]] == [("-", "ttft", 1), ("all", "ttft", 1)]
    assert out["rows"][0]["all"]["p50"] == pytest.approx(1.0)
    assert predictions.summarize([Predicted(0, "baseline", None, None, 0.1, 0.01)]) is None


@pytest.mark.parametrize("value, ms", [("12.5", 12.5), (None, None), ("", None), ("x", None), ("nan", None),
                                       ("-1", None), ("0", None), ("inf", None)])
def test_header_values(value, ms):
    assert predictions.parse_ms(value) == ms


def _predicting_router(ttft_ms: str, tpot_ms: str):
    """An answer carrying the router's prediction headers for a request with targets (as router.headers sends
    them), none for one without."""
    async def act(c) -> None:
        h = {k.lower() for k in c.request.headers}
        extra = (f"X-Router-Pool: speculative\r\nX-Router-Predicted-TTFT-Ms: {ttft_ms}\r\n"
                 f"X-Router-Predicted-TPOT-Ms: {tpot_ms}\r\n") if "x-slo-ttft-ms" in h else ""
        await c.write(("HTTP/1.1 200 X\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                       f"Transfer-Encoding: chunked\r\n{extra}\r\n").encode())
        await c.write_chunked(CHAT_EVENTS)
        await c.write(b"0\r\n\r\n")
    return act


async def test_replay_keeps_each_requests_predictions_and_reports_them(raw_backend_factory, tmp_path, capsys):
    backend = await raw_backend_factory({"/v1/chat/completions": _predicting_router("40.5", "2.25")})
    out = tmp_path / "o"
    rc = await asyncio.to_thread(replay.main, [
        "--synthetic", "--sessions", "30", "--turns", "1", "--session-rate", "200", "--output-tokens", "1",
        "--system-prompt-tokens", "5", "--user-tokens", "5", "--class-mix", "default", "--seed", "5",
        "--target", f"raw={backend.url}", "--out", str(out), "--no-plot", "--prediction-warmup", "3"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    fig = json.loads((out / "replay.json").read_text())["results"]["raw"][0]
    targeted = fig["classes"]["interactive"]["requests"] + fig["classes"]["flex"]["requests"]
    rows = fig["predicted_requests"]
    assert len(rows) == targeted > 3 and fig["completed"] == 30
    assert {(r[1], r[2], r[3]) for r in rows} == {("speculative", 40.5, 2.25)}
    assert all(r[4] > 0 and 0 <= r[6] < 30 for r in rows)  # the TTFT the client measured (ms), the load it met
    starts = [r[0] for r in rows]
    assert starts == sorted(starts) and starts[0] == 0
    pred = {(r["pool"], r["kind"]): r for r in fig["predictions"]["rows"]}
    assert fig["predictions"]["warmup_requests"] == 3
    s = pred[("speculative", "ttft")]
    assert s["all"]["n"] == targeted and s["warmup"]["n"] == 3 and s["after"]["n"] == targeted - 3
    assert s["all"]["p50"] == pytest.approx(40.5 / sorted(r[4] for r in rows)[len(rows) // 2], rel=0.5)
    assert ("speculative", "tpot") not in pred  # one token each: no TPOT measured
    assert "predictions: the router's X-Router-Predicted-* headers" in text and "first 3: n" in text


def test_the_table_renders_again_from_a_replay_json_at_another_warm_up(tmp_path, capsys):
    rows = [[i * 0.1, "speculative", 800.0 if i < 4 else 220.0, None, 200.0, None] for i in range(10)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": {"t": [{"slowdown": 1, "predicted_requests": rows}]}}))
    assert predictions.main([str(path), "--warmup", "4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "speculative" in x).split()
    # all: n 10, mean, p10, p50, p90; first 4 at 4x; the rest at 1.1x; settled after the first window of 4
    assert line[4:6] == ["10", f"{(4 * 4 + 6 * 1.1) / 10:.2f}"] and line[10:12] == ["4", "4.00"]
    assert line[16:19] == ["6", "1.10", "1.10"] and line[-4:] == ["4", "4.00", "1.10", "1.10"]
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"results": {"t": [{"slowdown": 1}]}}))
    assert predictions.main([str(empty)]) == 1
    bad = tmp_path / "b.json"
    bad.write_text("[1]")
    assert predictions.main([str(bad)]) == 2
    assert predictions.main([str(path), "--warmup", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "no request carried a prediction" in err[0] and "not a replay JSON" in err[1]


def test_tpot_by_the_load_each_request_came_in_with():
    items = [Predicted(i, "speculative", None, 4.0, 0.1, 0.002, ahead) for i, ahead in enumerate([0, 1, 2, 7, 7, 7])]
    items.append(Predicted(9, "speculative", None, 4.0, 0.1, 0.002, None))  # no count: left out
    rows = predictions.by_load(items, skip=1)  # the first (ahead 0) is the warm-up
    assert [(r["ahead"], r["n"]) for r in rows] == [("1-2", 2), ("6-9", 3)]
    assert rows[1]["ratio_p50"] == pytest.approx(2.0) and rows[1]["measured_mean_ms"] == pytest.approx(2.0)
    assert rows[1]["predicted_p50_ms"] == pytest.approx(4.0)
    text = "\n".join(predictions.render_by_load("t", rows, 1))
    assert "in flight ahead" in text and "after each pool's first 1" in text
