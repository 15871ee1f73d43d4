"""`python -m bench replay`: a request trace (Mooncake JSONL) or a synthetic multi-turn workload, open loop at
its own arrival times, against OpenAI-compatible URLs; bench_serving's figures plus prefix-cache hit ratio,
goodput and the share each router pool served; with a class mix (bench.classmix), each class's latency targets
sent with its requests and its goodput judged against them."""
from __future__ import annotations

import argparse
import asyncio
import csv
import functools
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench import classmix, cli, figures, predictions
from bench.load import (
    BenchInputError,
    LevelRun,
    RequestRecord,
    _session,
    cancelled,
    check_reachable,
    stream_one,
    wait_bounded,
)
from bench.trace import (  # noqa: F401  (replay's names, as its users import them)
    BLOCK_TOKENS,
    Session,
    TraceRequest,
    Workload,
    conversation,
    load_trace,
    parse_trace,
    trace_workload,
)

# plain English words (no code markers: the simulator would take a prompt with code words as a coding prompt)
VOCAB = (
    "able above across after again against air almost along also always among animal answer around ask away "
    "back ball bank base bear beat beauty become bed before began begin behind believe below best better "
    "between big bird black blue boat body book both bottom box boy bring brother brown build busy call came "
    "care carry case cat cause center certain chair chance change child choose church circle city clean clear "
    "close cloud coast cold color come common cook corn corner cost country course cover cross crowd cry dark "
    "day deal dear deep desert dinner dog door down draw dream dress drink drive dry during early earth east "
    "easy eat edge egg end enjoy enough even evening ever every eye face fact fair fall family farm fast father "
    "field fill final find fine fire first fish five floor flower fly follow food foot forest form four free "
    "fresh friend front fruit full game garden gave girl give glad glass gold gone good grass gray great green "
    "ground group grow guess hair half hand happy hard hat head hear heart heat heavy help here high hill hold "
    "home hope horse hot hour house hundred hunt idea inside island just keep kind king know lake land large "
    "last late laugh lead learn leave left letter light like line lion listen little live long look lost loud "
    "love low made main make many map mark market matter meet middle might mile milk mind minute moon more "
    "morning mother mountain move music name near need never new next night north note nothing notice number "
    "ocean often old open other over own page paint pair paper park part party pass past pay people picture "
    "place plain plan plant play point poor pretty pull push quick quiet rain reach read ready real red rest "
    "rich ride right ring river road rock roof room rose round row run safe sail salt same sand save say school "
    "sea season seat second see seed sell send serve seven shade shape share sheep shine ship shore short show "
    "side sign silver simple sing sister sit six sky sleep slow small smile snow soft soil song soon sound south "
    "space speak spring square stand star start station stay step stone stop store storm story street strong "
    "summer sun sure sweet swim table tail talk tall teach team tell ten test thank thick thin think third "
    "three through throw tie tiny together told took top touch town track trade train travel tree trip true "
    "try turn twenty two under until upon valley very village visit voice wait walk wall want warm wash watch "
    "water wave way wear weather week welcome well west wheel white whole wide wild wind window winter wish "
    "woman wonder wood word work world write yard year yellow young"
).split()
STORY_SUFFIX = "Tell me a story based on this context."  # bench_serving's mooncake prompt ends with this


# ---- the workload ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8192)
def words(seed: str, n: int) -> tuple[str, ...]:
    """n deterministic words for `seed`; a longer run for the same seed starts with the shorter one."""
    return tuple(random.Random(seed).choices(VOCAB, k=n))


def block_words(hash_id: int, n: int) -> tuple[str, ...]:
    """The text of one hash block: its id, then words drawn from the id (equal ids, equal text, equal tokens)."""
    return (str(hash_id),) + words(f"block {hash_id}", n - 1) if n > 0 else ()


def trace_content(req: TraceRequest, token_scale: float) -> str:
    """The prompt of one trace line: its blocks' text, input_length tokens in all (in the simulator's tokenizer:
    one word is one token), both scaled by `token_scale`."""
    block = max(1, round(BLOCK_TOKENS * token_scale))
    total = max(1, round(req.input_length * token_scale))
    k = min(len(req.hash_ids), -(-total // block))
    parts = [" ".join(block_words(h, block)) for h in req.hash_ids[:k - 1]]
    parts.append(" ".join(block_words(req.hash_ids[k - 1], total - block * (k - 1))))
    return " ".join(parts)


SYNTHETIC_DEFAULTS = {"sessions": 32, "turns": 4, "session_rate": 0.5, "system_prompt_tokens": 2000,
                      "user_tokens": 200, "output_tokens": 200, "think_time_s": 5.0}


def synthetic_workload(params: dict, seed: int, token_scale: float) -> Workload:
    """Sessions arriving as a Poisson process; each shares one system prompt and grows turn by turn."""
    rng = random.Random(seed)
    at, sessions = 0.0, []
    for i in range(params["sessions"]):
        sessions.append(Session(at=at, turns=params["turns"], index=i))
        at += rng.expovariate(params["session_rate"])
    p = params
    desc = (f"synthetic multi-turn: {p['sessions']} sessions at {p['session_rate']:g}/s (Poisson), {p['turns']} turns "
            f"each, a shared {p['system_prompt_tokens']}-token system prompt, {p['user_tokens']} new user tokens and "
            f"{p['output_tokens']} output tokens a turn, think time {p['think_time_s']:g}s (exponential mean)")
    return Workload("synthetic", sessions, desc, token_scale, params=dict(params))


# ---- running it -----------------------------------------------------------------------------------

@dataclass
class Sent:
    """One request of a run and what it was."""

    record: RequestRecord
    session: int
    turn: int
    klass: str | None = None  # the request's class in a class mix
    # the router's X-Router-Predicted-TTFT-Ms / -TPOT-Ms answer headers (None: not sent; bench.predictions)
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None


def _body(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool, extra: dict | None = None) -> bytes:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return json.dumps(body).encode()


class _WithHeaders:
    """The aiohttp session of one request with a class's headers added to its post (stream_one sends only
    Content-Type), keeping the router's prediction headers of its answer (stream_one keeps only the pool)."""

    def __init__(self, http, headers: dict[str, str]) -> None:
        self._http, self._headers = http, headers
        self.predicted: tuple[float | None, float | None] = (None, None)

    def post(self, url, *, headers: dict | None = None, **kw):
        return _Answer(self._http.post(url, headers={**(headers or {}), **self._headers}, **kw), self)


class _Answer:
    """session.post's context manager, noting the answer's prediction headers as it opens."""

    def __init__(self, cm, sink: _WithHeaders) -> None:
        self._cm, self._sink = cm, sink

    async def __aenter__(self):
        resp = await self._cm.__aenter__()
        h = resp.headers
        self._sink.predicted = (predictions.parse_ms(h.get(predictions.TTFT_HEADER)),
                                predictions.parse_ms(h.get(predictions.TPOT_HEADER)))
        return resp

    async def __aexit__(self, *exc):
        return await self._cm.__aexit__(*exc)


def mix_key(sess: Session) -> int:
    """What keeps one class: a trace line's conversation, a synthetic session."""
    return conversation(sess.trace) if sess.trace is not None else sess.index


def assign_classes(wl: Workload, classes: list[classmix.RequestClass] | None,
                   seed: int) -> dict[int, classmix.RequestClass]:
    """Session index -> its class (empty without a mix)."""
    if not classes:
        return {}
    return {s.index: classmix.assign(mix_key(s), seed, classes) for s in wl.sessions}


class Progress:
    """One self-rewriting stderr line on a terminal; a line per finished level otherwise."""

    # TODO(i27): shared helper (bench/sweep.py's ProgressBar, reduced)
    def __init__(self, label: str, expected: int, stream=None) -> None:
        self.label, self.expected = label, expected
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.sent = self.done = 0
        self._last = 0.0

    def update(self) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last < 0.2 and self.done != self.expected:
            return
        self._last = now
        self.stream.write(f"\r{self.label}: {self.sent}/{self.expected} sent, {self.done} done   ")
        self.stream.flush()

    def end(self, summary: str) -> None:
        if self.tty:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(f"{self.label}: {summary}\n")
        self.stream.flush()


async def run_level(url: str, wl: Workload, *, model: str, speedup: float, slowdown: float, request_timeout: float,
                    ignore_eos: bool, level_cap: float, progress: Progress | None = None,
                    classes: dict[int, classmix.RequestClass] | None = None, send_targets: bool = True) -> list[Sent]:
    """Every session at its arrival time (workload time x slowdown / speedup on the wall clock); with `classes`
    (session index -> class), each request carries its class's targets when `send_targets`."""
    sent: list[Sent] = []
    classes = classes or {}
    p = wl.params
    scale = wl.token_scale
    url = url.rstrip("/")

    async def one(session, messages: list[dict], max_tokens: int, s: int, turn: int,
                  text: list[str] | None = None) -> RequestRecord:
        if progress:
            progress.sent += 1
            progress.update()
        c = classes.get(s)
        extra = c.body(send_targets) if c else {}
        http = _WithHeaders(session, c.headers(send_targets, speedup) if c else {})
        rec = await stream_one(http, url, "/v1/chat/completions",
                               _body(model, messages, max_tokens, ignore_eos, extra), request_timeout, text=text)
        sent.append(Sent(rec, s, turn, c.name if c else None, *http.predicted))
        if progress:
            progress.done += 1
            progress.update()
        return rec

    async def trace_session(http, sess: Session) -> None:
        # bench_serving's mooncake rounds: "Round i: <blocks> Tell me a story...", each round's prompt carries the
        # earlier rounds with a placeholder reply ("story" x output_length); all rounds go out at the arrival
        req = sess.trace
        base = f"{trace_content(req, scale)} {STORY_SUFFIX}"
        out = max(1, round(req.output_length * scale))
        history: list[dict] = []
        jobs = []
        for i in range(sess.turns):
            history.append({"role": "user", "content": f"Round {i + 1}: {base}"})
            jobs.append(one(http, list(history), out, sess.index, i))
            history.append({"role": "assistant", "content": " ".join(["story"] * out)})
        await asyncio.gather(*jobs)

    async def synthetic_session(http, sess: Session, rng: random.Random) -> None:
        system = " ".join(words("system prompt", max(1, round(p["system_prompt_tokens"] * scale))))
        history = [{"role": "system", "content": system}]
        out = max(1, round(p["output_tokens"] * scale))
        for turn in range(sess.turns):
            user = " ".join(words(f"session {sess.index} turn {turn}", max(1, round(p["user_tokens"] * scale))))
            history.append({"role": "user", "content": user})
            text: list[str] = []
            rec = await one(http, list(history), out, sess.index, turn, text)
            if not rec.ok:
                return  # a conversation whose turn failed ends there (its later turns are never sent)
            history.append({"role": "assistant", "content": "".join(text)})
            if turn + 1 < sess.turns:
                await asyncio.sleep(rng.expovariate(1.0 / p["think_time_s"]) / speedup if p["think_time_s"] else 0)

    async def start_session(http, sess: Session, t0: float) -> None:
        delay = t0 + (sess.at - wl.sessions[0].at) * slowdown / speedup - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sess.trace is not None:
            await trace_session(http, sess)
        else:
            await synthetic_session(http, sess, random.Random(f"think {sess.index}"))

    async with _session(0) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(start_session(http, s, t0)) for s in wl.sessions]
        if await wait_bounded(tasks, level_cap):
            # what never came back counts as failed, never dropped (a cut session's later turns too)
            sent.extend(Sent(rec, -1, -1) for rec in cancelled(wl.requests - len(sent), level_cap))
    return sent


# ---- figures --------------------------------------------------------------------------------------

def level_figures(sent: list[Sent], wl: Workload, *, speedup: float, slowdown: float,
                  slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                  classes: list[classmix.RequestClass] | None = None,
                  prediction_warmup: int = predictions.WARMUP_REQUESTS) -> dict:
    # a 429 to a sheddable request is counted apart (`shed`), not as a failure, and is in no other figure
    records = [s.record for s in sent if not (classes and classmix.is_shed(s.record))]
    run = LevelRun(records=records, duration=(max(r.end for r in records) - min(r.start for r in records))
                   if records else 0.0)
    span = wl.span_s * slowdown
    run.request_rate = (len(wl.sessions) - 1) / span if span > 0 else None  # offered sessions/s (target's time)
    fig = figures.compute(run, speedup)
    fig.pop("steady_output_throughput", None)
    fig.pop("steady_window_s", None)
    fig.pop("speculative_share", None)
    ok = [r for r in records if r.ok]
    k = float(speedup)
    fig["slowdown"] = slowdown
    fig["token_scale"] = wl.token_scale
    fig["requests"] = wl.requests
    fig["not_sent"] = max(0, wl.requests - len(sent))  # a shed request was sent (and is counted apart)
    reported = [r for r in ok if r.cached_tokens is not None]
    fig["cache_reported"] = len(reported)
    fig["cached_tokens"] = sum(r.cached_tokens for r in reported) if reported else None
    fig["cache_hit_ratio"] = (fig["cached_tokens"] / sum(r.prompt_tokens for r in reported)
                              if reported and sum(r.prompt_tokens for r in reported) else None)
    good = 0
    for r in ok:
        t = figures.tpot(r.latency, r.ttft, r.output_tokens)
        if slo_ttft_ms is not None and r.ttft * k * 1000 > slo_ttft_ms:
            continue
        if slo_tpot_ms is not None and t is not None and t * k * 1000 > slo_tpot_ms:
            continue
        good += 1
    fig["slo_ttft_ms"], fig["slo_tpot_ms"] = slo_ttft_ms, slo_tpot_ms
    if slo_ttft_ms is None and slo_tpot_ms is None:
        fig["good_requests"] = fig["request_goodput"] = None
    else:
        fig["good_requests"] = good
        fig["request_goodput"] = good / fig["duration_s"] if fig["duration_s"] > 0 else 0.0
    pools = Counter(r.pool for r in ok if r.pool)
    fig["pool_share"] = {p: n / len(ok) for p, n in sorted(pools.items())} if pools else None
    if classes:
        mix = classmix.score([(s.record, s.klass) for s in sent if s.klass is not None], classes,
                             speedup=speedup, duration_s=fig["duration_s"])
        fig["class_goodput"], fig["class_good"], fig["shed"] = mix["goodput"], mix["good"], mix["shed"]
        fig["classes"] = mix["classes"]
        fig["goodput_over_time"] = classmix.over_time([(s.record, s.klass) for s in sent if s.klass is not None],
                                                      classes, speedup=speedup)
        fig["unattributed_failed"] = sum(1 for s in sent if s.klass is None)  # cut at the level's cap
    predicted = prediction_records(sent)
    fig["predictions"] = predictions.summarize(predicted, prediction_warmup)
    if predicted:
        # per request, in start order: start s, pool, predicted TTFT and TPOT ms, measured TTFT and TPOT ms (wall
        # clock), requests in flight on its pool as it started (the client's count, itself not included)
        t0 = min(p.start for p in predicted)
        fig["predicted_requests"] = [[round(p.start - t0, 4), p.pool, p.ttft_ms, p.tpot_ms,
                                      None if p.ttft_s is None else round(p.ttft_s * 1000, 3),
                                      None if p.tpot_s is None else round(p.tpot_s * 1000, 4), p.ahead]
                                     for p in sorted(predicted, key=lambda p: p.start)]
    return fig


def prediction_records(sent: list[Sent]) -> list[predictions.Predicted]:
    """The finished requests the router answered with a prediction, with what the client measured of them."""
    out = []
    for s in sent:
        r = s.record
        if not r.ok or r.ttft is None or (s.predicted_ttft_ms is None and s.predicted_tpot_ms is None):
            continue
        # what the client saw running on its pool as it started (with or without targets): the load it went into
        ahead = sum(1 for o in sent if o.record.pool == r.pool and o.record is not r
                    and o.record.start <= r.start < o.record.end)
        out.append(predictions.Predicted(r.start, r.pool, s.predicted_ttft_ms, s.predicted_tpot_ms, r.ttft,
                                         figures.tpot(r.latency, r.ttft, r.output_tokens), ahead))
    return out


def _f(v, digits=1, scale=1.0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v * scale:,.{digits}f}"


def scale_note(token_scale: float) -> str:
    if token_scale == 1.0:
        return "token scale 1 (the trace's own prompt and output lengths)"
    return (f"TOKEN SCALE {token_scale:g}: every prompt, block and output is {token_scale:g}x the trace's length "
            "(not the real traffic's size)")


def render(results: dict[str, list[dict]], wl: Workload) -> str:
    rows = [["target", "slowdown", "offered/s", "ok", "failed", "req/s", "out tok/s", "in tok/s", "cache hit",
             "goodput/s", "pools"]]
    lat = [["target", "slowdown"] + [f"{m} {s}" for m in ("TTFT", "TPOT", "ITL", "E2E")
                                     for s in ("mean", "p50", "p90", "p99")]]
    for name, figs in results.items():
        for f in figs:
            hit = "not reported" if f["cache_hit_ratio"] is None else f"{100 * f['cache_hit_ratio']:.1f}%"
            pools = ("-" if not f["pool_share"] else
                     " ".join(f"{p} {100 * s:.0f}%" for p, s in f["pool_share"].items()))
            rows.append([name, f"{f['slowdown']:g}", _f(f["request_rate"], 2), str(f["completed"]),
                         str(f["failed"] + f["not_sent"]), _f(f["request_throughput"], 2),
                         _f(f["output_throughput"]), _f(f["total_input_tokens"] / f["duration_s"]
                                                       if f["duration_s"] else None, 0),
                         hit, _f(f["request_goodput"], 2), pools])
            row = [name, f"{f['slowdown']:g}"]
            for m in ("ttft", "tpot", "itl", "e2e_latency"):
                for s in ("mean", "median", "p90", "p99"):
                    row.append(_f(f[f"{s}_{m}_ms"], 0))
            lat.append(row)
    out = [f"replay: {wl.description}", scale_note(wl.token_scale),
           "figures in the target's time (bench_serving's formulas); cache hit = usage cached_tokens / prompt_tokens",
           ""]
    out += figures.grid(rows) + ["", "latency (ms)"] + figures.grid(lat)
    out += render_classes(results)
    out += predictions.render(results)
    return "\n".join(out)


def render_classes(results: dict[str, list[dict]]) -> list[str]:
    """The class mix's table: goodput judged against each class's own targets, whatever the target did with them."""
    figs = [(name, f) for name, fs in results.items() for f in fs if f.get("classes")]
    if not figs:
        return []
    names = list(figs[0][1]["classes"])
    rows = [["target", "slowdown", "goodput/s", "shed (429)"] + [f"{n} met" for n in names]
            + ["TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "out tok/s"]]
    for name, f in figs:
        row = [name, f"{f['slowdown']:g}", _f(f["class_goodput"], 3), str(f["shed"])]
        for n in names:
            c = f["classes"][n]
            att = "-" if c["attainment"] is None else f"{100 * c['attainment']:.0f}%"
            row.append(f"{att} ({c['good']}/{c['requests'] - c['shed']})")
        row += [_f(f[f"{s}_{m}_ms"], 0) for m in ("ttft", "tpot") for s in ("median", "p90", "p99")]
        row.append(_f(f["output_throughput"]))
        rows.append(row)
    c0 = figs[0][1]["classes"]
    legend = "; ".join(f"{n} {100 * c['share']:.0f}%: targets {classmix.RequestClass(n, 0, c['ttft_target_ms'], c['tpot_target_ms']).targets}"
                       + (f", service_tier {c['tier']}" if c["tier"] else "") for n, c in c0.items())
    return ["", f"class mix ({legend}); goodput = requests meeting their class's targets per second (no targets: "
                "completed); met = that over the class's requests less its 429s; latencies (ms) exclude 429s"] \
        + figures.grid(rows) + [line for name, f in figs for line in render_over_time(name, f)]


def render_over_time(name: str, f: dict) -> list[str]:
    """Goodput per window of requests in the order sent (a cold target's warm-up), and where it settles."""
    w = f.get("goodput_over_time")
    if not w:
        return []
    names = list(w["windows"][0]["attainment"])
    rows = [["window", "requests", "sent/s", "goodput/s", "shed"] + [f"{n} met" for n in names]]
    for i, x in enumerate(w["windows"]):
        rows.append([f"{i + 1}{' *' if w['warm_from'] is not None and i >= w['warm_from'] else ''}",
                     f"{x['first'] + 1}-{x['first'] + x['requests']}", _f(x["sent_rate"], 3), _f(x["goodput"], 3),
                     str(x["shed"])] + ["-" if x["attainment"][n] is None else f"{100 * x['attainment'][n]:.0f}%"
                                        for n in names])
    n, ref = len(w["windows"]), w["reference_goodput"]
    said = (f"{w['warmup_requests']} requests (windows marked *)" if w["warm_from"] is not None
            else "not reached in this run")
    return ["", f"{name} slowdown {f['slowdown']:g}: goodput over time, {n} windows of equal count in the order sent "
                f"(goodput over each window's own span, met = attainment); warm-up = the requests before the first "
                f"window from which every window's goodput stays within {100 * w['band']:.0f}% of the last "
                f"{w['reference_windows']} windows' mean ({ref:.3f}/s): {said}"] \
        + figures.grid(rows)


CSV_EXTRA = ["slowdown", "token_scale", "requests", "not_sent", "cache_reported", "cached_tokens", "cache_hit_ratio",
             "slo_ttft_ms", "slo_tpot_ms", "good_requests", "request_goodput", "pool_share", "class_goodput", "shed",
             "class_attainment"]


def write_csv(path: Path, results: dict[str, list[dict]]) -> None:
    fields = ["target"] + [f for f in figures.CSV_FIELDS if f not in ("target", "gpus", "steady_output_throughput",
                                                                      "steady_window_s")] + CSV_EXTRA
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for name, figs in results.items():
            for f in figs:
                row = {**f, "target": name}
                if f.get("pool_share"):
                    row["pool_share"] = " ".join(f"{p}:{s:.4f}" for p, s in f["pool_share"].items())
                if f.get("classes"):
                    row["class_attainment"] = " ".join(f"{n}:{_f(c['attainment'], 4)}"
                                                       for n, c in f["classes"].items())
                w.writerow(figures._clean(row))


# ---- the command ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("replay", "Replay a Mooncake trace (or a synthetic multi-turn workload) open loop against "
                             "OpenAI-compatible targets (a router, SGLang, a simulator).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake JSONL (timestamp, input_length, output_length, hash_ids)")
    src.add_argument("--synthetic", action="store_true", help="no file: synthetic multi-turn sessions (below)")
    p.add_argument("--target", type=cli.target, action="append", required=True,
                   help="[NAME=]URL of an OpenAI-compatible server or router (repeatable; a bare URL is named target)")
    p.add_argument("--mooncake-slowdown-factor", type=cli.float_list, default=[1.0], metavar="F[,F...]",
                   help="stretch the arrival times by F (2 = half the rate); several = several load levels "
                        "(bench_serving's flag)")
    p.add_argument("--mooncake-num-rounds", type=cli.positive(int), default=1,
                   help="rounds per trace session, sent together as bench_serving does (default 1)")
    p.add_argument("--limit", type=cli.positive(int), help="replay only the first N sessions (after the window)")
    p.add_argument("--window-start", type=cli.nonneg, default=0.0, help="trace seconds to skip (default 0)")
    p.add_argument("--window-end", type=cli.positive(float), help="trace seconds to stop at (default: the end)")
    p.add_argument("--sample-conversations", type=cli.positive(int), default=1, metavar="M",
                   help="keep one conversation in M (lines whose second block id %% M == 0): 1/M of the rate with "
                        "each kept conversation's prefix reuse intact (not a bench_serving flag)")
    p.add_argument("--token-scale", type=cli.positive(float), default=1.0,
                   help="shrink every prompt, block and output by this factor (small machines); every "
                        "report says so")
    p.add_argument("--slo-ttft", type=cli.positive(float), metavar="MS", help="goodput: TTFT at most MS")
    p.add_argument("--slo-tpot", type=cli.positive(float), metavar="MS", help="goodput: TPOT at most MS")
    m = p.add_argument_group(
        "class mix (latency targets per request; goodput judged per class)",
        f"Each conversation (a trace line's second block id; a synthetic session) draws one class, seeded by --seed. "
        f"Default with --class-mix default: {classmix.DEFAULT_MIX}; interactive targets TTFT "
        f"{classmix.DEFAULT_TARGETS['interactive'][0]:g} ms and TPOT {classmix.DEFAULT_TARGETS['interactive'][1]:g} ms "
        f"(sent as {classmix.TTFT_HEADER} / {classmix.TPOT_HEADER}), default: no target and nothing sent, flex: "
        f"service_tier 'flex' in the body and targets TTFT "
        f"{classmix.DEFAULT_TARGETS['flex'][0]:g} ms and TPOT {classmix.DEFAULT_TARGETS['flex'][1]:g} ms (the "
        "router's default flex tier) in the headers; a 429 is counted apart as shed, not as a failure. The headers "
        "carry the targets divided by --speedup (the target's clock; a tier's own numbers are not scaled).")
    m.add_argument("--class-mix", metavar="CLASS=SHARE,...",
                   help="shares of the conversations per class, adding up to 1 ('default': the default mix above)")
    m.add_argument("--class-targets", action="append", default=[], metavar="CLASS=ttft:MS,tpot:MS",
                   help="a class's targets (either may be left out; CLASS=none: no target); repeatable")
    m.add_argument("--class-tier", action="append", default=[], metavar="CLASS=TIER",
                   help="send service_tier TIER in the body of CLASS's requests (CLASS=none: send none); repeatable")
    m.add_argument("--send-targets", action=argparse.BooleanOptionalAction, default=True,
                   help="send each class's targets (headers, service_tier) to the target; --no-send-targets judges "
                        "the same mix against a target that never sees them (default: send)")
    m.add_argument("--prediction-warmup", type=cli.positive(int), default=predictions.WARMUP_REQUESTS, metavar="N",
                   help="the router's latency predictions (X-Router-Predicted-* headers) are reported per pool over "
                        "all requests, the first N and the rest (default %(default)s)")
    p.add_argument("--model", default="default", help="value of the 'model' field sent")
    p.add_argument("--speedup", type=cli.positive(float), default=1.0,
                   help="the targets' clocks run K times faster (simulator --speedup): arrivals come K times "
                        "faster and figures are reported in the target's time")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let the server stop at EOS (default: ignore_eos, so outputs are the trace's lengths)")
    p.add_argument("--timeout", type=cli.positive(float), default=600.0, help="per-request timeout (s, wall)")
    p.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("synthetic multi-turn workload (with --synthetic; defaults in brackets)")
    d = SYNTHETIC_DEFAULTS
    s.add_argument("--sessions", type=cli.positive(int), default=d["sessions"], help=f"conversations [{d['sessions']}]")
    s.add_argument("--turns", type=cli.positive(int), default=d["turns"], help=f"turns per conversation [{d['turns']}]")
    s.add_argument("--session-rate", type=cli.positive(float), default=d["session_rate"],
                   help=f"new conversations per second, Poisson [{d['session_rate']:g}]")
    s.add_argument("--system-prompt-tokens", type=cli.positive(int), default=d["system_prompt_tokens"],
                   help=f"one system prompt all conversations share [{d['system_prompt_tokens']}]")
    s.add_argument("--user-tokens", type=cli.positive(int), default=d["user_tokens"],
                   help=f"new user tokens per turn [{d['user_tokens']}]")
    s.add_argument("--output-tokens", type=cli.positive(int), default=d["output_tokens"],
                   help=f"output tokens per turn [{d['output_tokens']}]")
    s.add_argument("--think-time", dest="think_time_s", type=cli.nonneg, default=d["think_time_s"],
                   help=f"mean seconds between a reply and the next turn, exponential [{d['think_time_s']:g}]")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default="replay", help="file stem of the outputs (default replay)")
    p.add_argument("--no-plot", action="store_true")
    return p


def workload_from_args(ns: argparse.Namespace) -> Workload:
    if ns.synthetic:
        params = {k: getattr(ns, k) for k in SYNTHETIC_DEFAULTS}
        return synthetic_workload(params, ns.seed, ns.token_scale)
    if ns.window_end is not None and ns.window_end <= ns.window_start:
        raise BenchInputError(f"--window-end {ns.window_end:g} must be after --window-start {ns.window_start:g}")
    reqs = load_trace(ns.trace)
    return trace_workload(reqs, str(ns.trace), limit=ns.limit, window=(ns.window_start, ns.window_end),
                          token_scale=ns.token_scale, num_rounds=ns.mooncake_num_rounds,
                          sample=ns.sample_conversations)


def classes_from_args(ns: argparse.Namespace) -> list[classmix.RequestClass] | None:
    if ns.class_mix is None:
        if ns.class_targets or ns.class_tier:
            raise BenchInputError("--class-targets and --class-tier need --class-mix")
        return None
    mix = classmix.DEFAULT_MIX if ns.class_mix == "default" else ns.class_mix
    try:
        return classmix.build(mix, ns.class_targets, ns.class_tier)
    except classmix.MixError as exc:
        raise BenchInputError(str(exc)) from None


async def replay(ns: argparse.Namespace, wl: Workload,
                 classes: list[classmix.RequestClass] | None = None) -> dict[str, list[dict]]:
    for _, url in ns.target:
        await check_reachable(url)
    results: dict[str, list[dict]] = {name: [] for name, _ in ns.target}
    levels = ns.mooncake_slowdown_factor
    of = assign_classes(wl, classes, ns.seed)
    for slowdown in levels:
        for name, url in ns.target:
            think = wl.params.get("think_time_s", 0.0) * wl.params.get("turns", 1) * 3
            cap = (wl.span_s * slowdown + think) / ns.speedup + ns.timeout + 60.0
            bar = Progress(f"{name} slowdown {slowdown:g}", wl.requests)
            sent = await run_level(url, wl, model=ns.model, speedup=ns.speedup, slowdown=slowdown,
                                   request_timeout=ns.timeout, ignore_eos=not ns.disable_ignore_eos, level_cap=cap,
                                   progress=bar, classes=of, send_targets=ns.send_targets)
            fig = level_figures(sent, wl, speedup=ns.speedup, slowdown=slowdown, slo_ttft_ms=ns.slo_ttft,
                                slo_tpot_ms=ns.slo_tpot, classes=classes, prediction_warmup=ns.prediction_warmup)
            results[name].append(fig)
            hit = "not reported" if fig["cache_hit_ratio"] is None else f"{100 * fig['cache_hit_ratio']:.1f}%"
            mix = f", goodput {fig['class_goodput']:.3f}/s, {fig['shed']} shed" if classes else ""
            bar.end(f"{fig['output_throughput']:.1f} tok/s, TTFT p50 {fig['median_ttft_ms']:.0f} ms, cache hit "
                    f"{hit}, {fig['completed']} ok, {fig['failed'] + fig['not_sent']} failed{mix}")
    return results


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        cli.unique_targets(ns.target)
    except cli.ArgError as exc:
        print(f"spec-bench replay: {exc}", file=sys.stderr)
        return 2
    try:
        classes = classes_from_args(ns)
        wl = workload_from_args(ns)
        print(f"replay: {wl.description}; {wl.requests} requests; {scale_note(wl.token_scale)}", file=sys.stderr)
        results = cli.run_async(replay(ns, wl, classes))
    except BenchInputError as exc:
        print(f"spec-bench replay: {exc}", file=sys.stderr)
        return 2
    print(render(results, wl))
    ns.out.mkdir(parents=True, exist_ok=True)
    paths = [ns.out / f"{ns.name}.json", ns.out / f"{ns.name}.csv"]
    config = {"workload": wl.kind, "description": wl.description, "trace": str(ns.trace) if ns.trace else None,
              "targets": dict(ns.target), "mooncake_slowdown_factor": ns.mooncake_slowdown_factor,
              "mooncake_num_rounds": ns.mooncake_num_rounds, "limit": ns.limit,
              "sample_conversations": ns.sample_conversations,
              "window": [ns.window_start, ns.window_end], "token_scale": ns.token_scale,
              "token_scale_note": scale_note(ns.token_scale), "speedup": ns.speedup, "model": ns.model,
              "ignore_eos": not ns.disable_ignore_eos, "slo_ttft_ms": ns.slo_ttft, "slo_tpot_ms": ns.slo_tpot,
              "synthetic": wl.params or None, "requests": wl.requests,
              "class_mix": [{"name": c.name, "share": c.share, "ttft_ms": c.ttft_ms, "tpot_ms": c.tpot_ms,
                             "tier": c.tier} for c in classes] if classes else None,
              "send_targets": ns.send_targets if classes else None, "seed": ns.seed,
              "prediction_warmup": ns.prediction_warmup}
    figures.write_json(paths[0], {"config": config, "results": results})
    write_csv(paths[1], results)
    if not ns.no_plot and all(f["request_rate"] for figs in results.values() for f in figs):
        try:
            paths.append(figures.plot(ns.out / f"{ns.name}.png", results,
                                      title=f"spec-bench replay ({scale_note(ns.token_scale)})"))
        except ModuleNotFoundError:
            print("spec-bench replay: no plot (matplotlib is not installed: pip install 'spec-router[bench]')",
                  file=sys.stderr)
    print("wrote " + ", ".join(str(x) for x in paths))
    if all(f["completed"] == 0 for figs in results.values() for f in figs):
        print("spec-bench replay: no request succeeded; see the 'failed' column and errors in the JSON", file=sys.stderr)
        return 1
    return 0
