"""The endpoint picker's own cost, without the network: `python -m bench.pickercost`.

For each backend count (`--backends 16,256`, half speculative, half baseline, all up) it builds the picker's
decision core as `spec-router epp` builds it (router.app.build_pools, router.epp.decide.Decider, the metrics;
prefix affinity on) and sends it `--requests` chat requests with `--inflight` of them open at once (the oldest
ends when a new one starts), their prompts from `--conversations` shared system prompts with their own questions.
Timed per request, in microseconds (p50/p99):
- `decide`: Decider.decide (parse, prefix lookup, the policy, the lease), and `end`: the lease's end as the
  picker ends it (status, usage, Pick.end: the pools, figures and policy told);
- `exchange_stream` / `exchange_none`: the whole of router.epp.server.Exchange for one request, protobuf in and out
  (request headers + body, response headers, then the response body with its usage for epp_response_body stream,
  or the stream's end for none): what the picker's Python does per request besides gRPC itself.
Memory (tracemalloc, bytes still held): per backend, the marginal cost from the smaller backend count to the
larger one (pools, health, outlier and prefix state, metric series); per open request, an Exchange that has
decided and holds its lease (request body, pick, lease), measured over `--inflight` of them."""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.cli import ArgError, parser

CHAT_ANSWER = {"id": "x", "object": "chat.completion", "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 40},
                            "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 700, "completion_tokens": 40, "total_tokens": 740}}


def _settings(n: int, policy: str):
    from router.settings import load_settings

    urls = [f"http://10.{i // 250}.{i % 250}.1:8000" for i in range(n)]
    half = max(1, n // 2)
    return load_settings(None, {"speculative": ",".join(urls[:half]), "baseline": ",".join(urls[half:]),
                                "policy": policy, "epp_port": 0}, environ={})


def build(n: int, policy: str):
    """(Decider, Pools, the metric gauges bound to them) over n backends, all up, as `spec-router epp` builds
    them."""
    from router.app import build_pools
    from router.epp.decide import Decider
    from router.exporter import bind
    from router.metrics import Metrics

    s = _settings(n, policy)
    pools = build_pools(s)
    metrics = Metrics(CollectorRegistry())
    gauges = bind(metrics, pools)
    for b in pools.backends:
        b.healthy = True
    decider = Decider(pools, block_bytes=s.prefix_block_bytes, endpoints=s.epp_endpoints,
                      max_per_backend=s.max_connections_per_backend, metrics=metrics)
    return decider, pools, gauges


def bodies(requests: int, conversations: int) -> list[bytes]:
    """Chat bodies: `conversations` system prompts of ~2 KB, each request its own question (prefix affinity sees
    shared prefixes and new tails)."""
    systems = [f"You are assistant {c}. " + " ".join(f"rule {c}.{k}: answer briefly and cite sources."
                                                     for k in range(50)) for c in range(conversations)]
    return [json.dumps({"model": "m", "max_tokens": 64, "messages": [
        {"role": "system", "content": systems[i % conversations]},
        {"role": "user", "content": f"question {i}: what is {i} times {i % 97}?"}]}).encode()
        for i in range(requests)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def time_core(decider, reqs: list[bytes], inflight: int) -> dict:
    """Decider.decide and the lease's end, each timed, with `inflight` requests open."""
    from router.epp.decide import Pick, Request

    decide_us, end_us = [], []
    open_: list[Pick] = []
    clock = time.perf_counter_ns
    for body in reqs:
        t0 = clock()
        pick = decider.decide(Request(body))
        t1 = clock()
        assert isinstance(pick, Pick), pick
        decide_us.append((t1 - t0) / 1e3)
        open_.append(pick)
        if len(open_) > inflight:
            done = open_.pop(0)
            t0 = clock()
            done.answered(200)
            done.sent()
            u = done.usage
            u.prompt, u.completion, u.seen = 700, 40, True
            done.end(True)
            end_us.append((clock() - t0) / 1e3)
    for p in open_:
        p.end(True)
    return {"decide_p50_us": _pct(decide_us, 0.5), "decide_p99_us": _pct(decide_us, 0.99),
            "end_p50_us": _pct(end_us, 0.5), "end_p99_us": _pct(end_us, 0.99)}


def _messages(body: bytes):
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    mode = processing_mode_pb2.ProcessingMode

    def headers(pairs, **kw):
        return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]), **kw)

    def request_headers(response_body):
        return pb.ProcessingRequest(
            request_headers=headers([(":method", "POST"), (":path", "/v1/chat/completions"),
                                     ("content-type", "application/json")]),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=mode.FULL_DUPLEX_STREAMED,
                                                     response_body_mode=response_body))

    req_body = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    resp_headers = pb.ProcessingRequest(response_headers=headers([(":status", "200"),
                                                                  ("content-type", "application/json")]))
    resp_body = pb.ProcessingRequest(response_body=pb.HttpBody(body=json.dumps(CHAT_ANSWER).encode(),
                                                               end_of_stream=True))
    return {"stream": (request_headers(mode.FULL_DUPLEX_STREAMED), req_body, resp_headers, resp_body),
            "none": (request_headers(mode.NONE), req_body, resp_headers)}


def time_exchange(decider, reqs: list[bytes], inflight: int, response_body: str) -> dict:
    """One router.epp.server.Exchange per request, fed what Envoy sends (parsed protobuf messages), timed from
    the request headers to the lease's end; `inflight` open at once."""
    from router.epp.server import Exchange

    msgs = [_messages(b)[response_body] for b in reqs]
    us: list[float] = []
    open_: list[tuple[Exchange, tuple, float]] = []
    clock = time.perf_counter_ns
    for m in msgs:
        t0 = clock()
        ex = Exchange(decider, 1 << 20, response_body)
        ex.handle(m[0])
        out = ex.handle(m[1])
        spent = clock() - t0
        assert out and out[0].HasField("request_headers"), out
        open_.append((ex, m, spent))
        if len(open_) > inflight:
            ex, m, spent = open_.pop(0)
            t0 = clock()
            for rest in m[2:]:
                ex.handle(rest)
            ex.closed()
            assert ex.pick.ended
            us.append((spent + clock() - t0) / 1e3)
    for ex, _, _ in open_:
        ex.closed()
    return {"p50_us": _pct(us, 0.5), "p99_us": _pct(us, 0.99)}


def retained(fn) -> tuple[int, object]:
    """Bytes tracemalloc sees still held after fn() (what it returns kept alive), and that result."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    kept = fn()
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before, kept


def per_open_request(decider, reqs: list[bytes], n: int) -> float:
    """Bytes held per open request: n Exchanges that decided and hold their leases."""
    from router.epp.server import Exchange

    msgs = [_messages(b)["stream"] for b in reqs[:n]]

    def open_n():
        out = []
        for m in msgs:
            ex = Exchange(decider, 1 << 20)
            ex.handle(m[0])
            ex.handle(m[1])
            out.append(ex)
        return out

    tracemalloc.start()
    try:
        size, held = retained(open_n)
    finally:
        tracemalloc.stop()
    for ex in held:
        ex.closed()
    return size / n


def per_backend(counts: list[int], policy: str) -> dict:
    """Bytes held by the picker's state at each backend count, and per backend between the two ends."""
    out = {}
    tracemalloc.start()
    try:
        build(4, policy)  # imports and one-off tables first: not any backend's
        for n in counts:
            size, kept = retained(lambda n=n: build(n, policy))
            out[n] = size
            del kept
    finally:
        tracemalloc.stop()
    lo, hi = min(counts), max(counts)
    return {"bytes_at": out, "bytes_per_backend": round((out[hi] - out[lo]) / (hi - lo)) if hi > lo else None}


def run(ns: argparse.Namespace) -> dict:
    reqs = bodies(ns.requests, ns.conversations)
    result: dict = {"config": {k: getattr(ns, k) for k in ("backends", "requests", "inflight", "conversations",
                                                           "policy")}, "python": sys.version.split()[0],
                    "at": {}}
    for n in ns.backends:
        row: dict = {}
        decider, _, _gauges = build(n, ns.policy)
        time_core(decider, reqs[: min(2000, len(reqs))], ns.inflight)  # warm: the prefix index fills
        row["core"] = time_core(decider, reqs, ns.inflight)
        for mode in ("stream", "none"):
            decider, _, _gauges = build(n, ns.policy)
            time_exchange(decider, reqs[: min(2000, len(reqs))], ns.inflight, mode)
            row[f"exchange_{mode}"] = time_exchange(decider, reqs, ns.inflight, mode)
        row["bytes_per_open_request"] = round(per_open_request(decider, reqs, ns.inflight))
        result["at"][n] = row
    result["memory"] = per_backend(ns.backends, ns.policy)
    return result


def render(r: dict) -> str:
    c = r["config"]
    lines = [f"picker cost without the network: {c['requests']:,} requests, {c['inflight']} open at once, "
             f"{c['conversations']} shared system prompts, policy {c['policy']}, prefix affinity on, "
             f"Python {r['python']}", "",
             "| backends | decide p50 (p99) us | lease end p50 (p99) us | Exchange, body streamed p50 (p99) us "
             "| Exchange, no body p50 (p99) us | bytes per open request | state bytes |",
             "|---|---|---|---|---|---|---|"]
    for n, row in r["at"].items():
        core, st, no = row["core"], row["exchange_stream"], row["exchange_none"]
        lines.append(f"| {n} | {core['decide_p50_us']} ({core['decide_p99_us']}) | {core['end_p50_us']} "
                     f"({core['end_p99_us']}) | {st['p50_us']} ({st['p99_us']}) | {no['p50_us']} ({no['p99_us']}) "
                     f"| {row['bytes_per_open_request']:,} | {r['memory']['bytes_at'][n]:,} |")
    per = r["memory"]["bytes_per_backend"]
    if per is not None:
        lines += ["", f"state per backend (marginal, {min(r['at'])} -> {max(r['at'])} backends): {per:,} bytes"]
    return "\n".join(lines)


def _counts(text: str) -> list[int]:
    try:
        got = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not got or got[0] < 2:
        raise argparse.ArgumentTypeError("backend counts must be >= 2")
    return got


def build_parser() -> argparse.ArgumentParser:
    p = parser("pickercost", "The endpoint picker's own time per decision and memory, without the network.")
    p.prog = "python -m bench.pickercost"
    p.add_argument("--backends", type=_counts, default=[16, 256], help="comma list of backend counts (16,256)")
    p.add_argument("--requests", type=int, default=20_000, help="requests timed per count (default 20000)")
    p.add_argument("--inflight", type=int, default=64, help="requests open at once (default 64)")
    p.add_argument("--conversations", type=int, default=64, help="shared system prompts (default 64)")
    p.add_argument("--policy", default="spillover", help="routing policy (default spillover)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the figures as JSON here")
    return p


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
    except ArgError as exc:
        print(f"python -m bench.pickercost: {exc}", file=sys.stderr)
        return 2
    if min(ns.requests, ns.inflight, ns.conversations) < 1 or ns.requests <= ns.inflight:
        print("python -m bench.pickercost: --requests, --inflight, --conversations must be >= 1 and --requests > "
              "--inflight", file=sys.stderr)
        return 2
    from router.settings import ConfigError

    try:
        result = run(ns)
    except ConfigError as exc:
        print(f"python -m bench.pickercost: {exc}", file=sys.stderr)
        return 2
    text = render(result)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
