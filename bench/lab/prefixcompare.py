"""`spec-bench prefixcompare`: cache-aware routing side by side on the replayed Mooncake trace: our router and the
routers users would run instead (smg, vllm-router), each in front of its own fresh simulated servers, the same
trace slice at the same load, one after another in one run."""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import cli, figures, procs
from bench.cli import ArgError, NotServing
from bench.lab import peers

TRACE = Path("../shared/data/mooncake/conversation_trace_first_30min.jsonl")
MODEL = "kimi-k2.5-sim"  # one served name on every simulator: smg and vllm-router route by model name
# The KV the weights of Kimi K2.5 leave one TP8 server at SGLang 0.5.23's default mem_fraction_static
# (bench.sim.memory.fit_all): on 8 x H200 (the default here: room for the trace's conversations between their
# turns, a median 120 s apart) and on the seed box (8 x RTX PRO 6000 96 GB: about 12 of the trace's prompts, so
# little survives to the next turn whatever routes). The step costs stay the seed profiles' either way.
KV_H200 = 815281
KV_SEED = 158585
POOL_PROFILE = "baseline-tp8"
# Every simulated server gets --kv-tokens (a co-located pair twice that, shared half and half), so cache
# pressure is the same in every deployment. (The Kimi fit says neither two-pool deployment fits the seed box's
# memory at all: those rows are the simulator's profiles with this KV, not Kimi on that box.)
# Two pools: the speculative drafter that wins at low load (eagle3-good) so there is a speculation trade-off.
SPLIT = ("eagle3-good-tp4", "baseline-tp4")  # one box of 8 GPUs as two TP4 servers
COLOCATED = ("eagle3-good-tp8", "baseline-tp8")  # one box of 8 GPUs, both TP8 servers time-sharing it
OURS, OURS_NO_PREFIX, OURS_NO_CROSS = "ours", "ours-no-prefix", "ours-no-cross"
POOL_ROUTERS = [OURS, OURS_NO_PREFIX, "smg:cache_aware", "smg:round_robin", "vllm-router:cache_aware"]
TWO_POOL_ROUTERS = [OURS, OURS_NO_CROSS, "smg:cache_aware"]
DEPLOYMENTS = ("pool", "split", "colocated")
# Our router as the compose files run it (docs/BENCH.md "The compose default").
OURS_FLAGS = ["--load-signal", "backend", "--load-interval", "0.5"]


class CompareError(Exception):
    """A user-caused problem (bad flag, missing trace): one line, exit 2."""


@dataclass
class Deployment:
    name: str  # pool-4, split-x2, ...
    kind: str  # pool | split | colocated
    gpus: int
    instances: int
    slowdown: float
    routers: list[str]
    sample: int = 1


@dataclass
class Backends:
    speculative: list[str] = field(default_factory=list)
    baseline: list[str] = field(default_factory=list)

    @property
    def all(self) -> list[str]:
        return self.speculative + self.baseline


def router_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        if n not in (OURS, OURS_NO_PREFIX, OURS_NO_CROSS):
            try:
                peers.parse(n)
            except peers.PeerError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of routers")
    return names


def deployments_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in DEPLOYMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(DEPLOYMENTS)}, got {text!r}")
    return names


def build_parser() -> cli.Parser:
    p = cli.parser("prefixcompare", "Our cache-aware router vs smg / vllm-router on the replayed Mooncake trace: "
                                    "each router in front of its own fresh simulators, the same slice, the same load.")
    p.add_argument("--trace", type=Path, default=TRACE, help=f"Mooncake JSONL (default {TRACE})")
    p.add_argument("--deployments", type=deployments_arg, default=list(DEPLOYMENTS),
                   help="pool (N x baseline-tp8), split (eagle3-good-tp4 + baseline-tp4 per box), colocated "
                        "(eagle3-good-tp8 + baseline-tp8 time-sharing a box) (default: all three)")
    p.add_argument("--instances", type=cli.int_list, default=[4, 8], help="pool sizes (default 4,8)")
    p.add_argument("--slowdown", type=cli.float_list, default=None, metavar="F[,F...]",
                   help="trace slowdown per pool size, in --instances order (default 5/N: with one conversation in 2, about 2/3 "
                        "of the pool's capacity at token scale 1)")
    p.add_argument("--boxes", type=cli.positive(int), default=2, help="8-GPU boxes of a two-pool deployment "
                                                                      "(default 2: 2 speculative + 2 baseline)")
    p.add_argument("--two-pool-slowdown", type=cli.positive(float), default=1.25,
                   help="trace slowdown of the two-pool deployments (default 1.25)")
    p.add_argument("--two-pool-sample-conversations", type=cli.positive(int), default=4, metavar="M",
                   help="one conversation in M on the two-pool deployments (default 4: with the slowdown, about "
                        "2/3 of two boxes' capacity)")
    p.add_argument("--pool-routers", type=router_arg, default=POOL_ROUTERS,
                   help=f"routers on a pool (default {','.join(POOL_ROUTERS)})")
    p.add_argument("--two-pool-routers", type=router_arg, default=TWO_POOL_ROUTERS,
                   help=f"routers on two pools (default {','.join(TWO_POOL_ROUTERS)}; a peer sees every backend "
                        "as one pool)")
    p.add_argument("--router-flag", action="append", default=[], metavar="FLAG",
                   help="one more flag for our router's command line, e.g. --router-flag=--threshold=2 (repeatable)")
    p.add_argument("--kv-tokens", type=cli.positive(int), default=KV_H200,
                   help=f"KV tokens of every simulated server (default {KV_H200}: Kimi K2.5 TP8 on 8 x H200; "
                        f"{KV_SEED} on the seed box)")
    p.add_argument("--policy", default="adaptive", help="our router's policy (default adaptive, the compose default)")
    p.add_argument("--window-start", type=float, default=0.0, help="trace seconds to skip (default 0)")
    p.add_argument("--window-end", type=cli.positive(float), default=600.0, help="trace seconds to stop at "
                                                                                 "(default 600)")
    p.add_argument("--sample-conversations", type=cli.positive(int), default=2, metavar="M",
                   help="keep one conversation in M on a pool (default 2: whole conversations, so their prefix "
                        "reuse is kept, over twice the trace time at the same request rate)")
    p.add_argument("--limit", type=cli.positive(int), help="at most N requests of the window")
    p.add_argument("--token-scale", type=cli.positive(float), default=1.0,
                   help="scale every prompt, output and the simulators' KV by this (default 1)")
    p.add_argument("--speedup", type=cli.positive(float), default=8.0, help="simulators' clock speedup (default 8)")
    p.add_argument("--timeout", type=cli.positive(float), default=120.0, help="per-request timeout, wall s")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default="prefixcompare", help="file stem of the outputs (default prefixcompare)")
    return p


def plan(ns) -> list[Deployment]:
    out = []
    if "pool" in ns.deployments:
        slow = ns.slowdown or [5.0 / n for n in ns.instances]
        if len(slow) != len(ns.instances):
            raise CompareError(f"--slowdown has {len(slow)} values for {len(ns.instances)} --instances")
        for n, s in zip(ns.instances, slow, strict=True):
            out.append(Deployment(f"pool-{n}", "pool", 8 * n, n, s, list(ns.pool_routers), ns.sample_conversations))
    for kind in ("split", "colocated"):
        if kind in ns.deployments:
            out.append(Deployment(f"{kind}-x{ns.boxes}", kind, 8 * ns.boxes, 2 * ns.boxes, ns.two_pool_slowdown,
                                  list(ns.two_pool_routers), ns.two_pool_sample_conversations))
    return out


# ---- one run: fresh simulators, one router, the replay ------------------------------------------------

def start_backends(group: procs.ProcGroup, dep: Deployment, ns) -> Backends:
    kv = lambda tokens: ["--max-total-tokens", str(max(1000, round(tokens * ns.token_scale)))]  # noqa: E731
    common = ["--enable-cache-report", "--model", MODEL]
    b = Backends()
    for i in range(dep.instances if dep.kind == "pool" else ns.boxes):
        seed = ["--seed", str(i)]
        if dep.kind == "pool":
            b.baseline.append(group.add(procs.start_sim(POOL_PROFILE, ns.speedup, extra=common + seed + kv(ns.kv_tokens))).url)
        elif dep.kind == "split":
            spec, base = SPLIT
            b.speculative.append(group.add(procs.start_sim(spec, ns.speedup, extra=common + seed + kv(ns.kv_tokens))).url)
            b.baseline.append(group.add(procs.start_sim(base, ns.speedup, extra=common + seed + kv(ns.kv_tokens))).url)
        else:
            spec, base = COLOCATED
            p, su, bu = procs.start_colocated(spec, base, ns.speedup, 0.5, extra=common + seed + kv(2 * ns.kv_tokens))
            group.add(p)
            b.speculative.append(su)
            b.baseline.append(bu)
    return b


def start_router(group: procs.ProcGroup, which: str, b: Backends, ns, log: Path) -> tuple[procs.Proc, str]:
    """(the router's Proc, a label with its version)."""
    if which in (OURS, OURS_NO_PREFIX, OURS_NO_CROSS):
        extra = list(OURS_FLAGS) + list(ns.router_flag)
        if which == OURS_NO_PREFIX:
            extra += ["--prefix-routing", "false"]
        # "ours" is the router with every prefix rule on, cross-pool affinity included (off by default)
        extra += ["--prefix-cross-pool", "false" if which == OURS_NO_CROSS else "true"]
        p = group.add(procs.start_router(b.speculative, b.baseline, ns.policy, extra=extra))
        return p, f"spec-router {ns.policy}" + {OURS: "", OURS_NO_PREFIX: ", prefix_routing off",
                                                 OURS_NO_CROSS: ", prefix_cross_pool off"}[which]
    peer, policy = peers.parse(which)
    p = group.add(peers.start(peer, policy, b.all, log))
    return p, f"{peer.name} {peers.version(peer)} {policy}"


DECISION_RE = re.compile(r'^router_prefix_decisions_total\{([^}]*)\}\s+(\S+)$', re.M)


async def our_decisions(url: str) -> dict[str, int]:
    """router_prefix_decisions_total summed by reason (our router only)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    out: dict[str, int] = {}
    for labels, v in DECISION_RE.findall(text):
        m = re.search(r'reason="([^"]*)"', labels)
        if m and float(v):
            out[m.group(1)] = out.get(m.group(1), 0) + int(float(v))
    return out


def replay_cmd(ns, dep: Deployment, name: str, url: str, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "bench", "replay", "--trace", str(ns.trace), "--target", f"{name}={url}",
           "--speedup", f"{ns.speedup:g}", "--mooncake-slowdown-factor", f"{dep.slowdown:g}",
           "--window-start", f"{ns.window_start:g}", "--window-end", f"{ns.window_end:g}",
           "--sample-conversations", str(dep.sample), "--token-scale", f"{ns.token_scale:g}",
           "--model", MODEL, "--timeout", f"{ns.timeout:g}", "--out", str(out), "--name", name, "--no-plot"]
    if ns.limit:
        cmd += ["--limit", str(ns.limit)]
    return cmd


def run_one(dep: Deployment, which: str, ns, tmp: Path) -> dict:
    row = {"deployment": dep.name, "kind": dep.kind, "gpus": dep.gpus, "instances": dep.instances,
           "slowdown": dep.slowdown, "sample_conversations": dep.sample, "router": which, "loadavg_before": procs.loadavg()}
    t0 = time.monotonic()
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{dep.name}-{which}")
    if which not in (OURS, OURS_NO_PREFIX, OURS_NO_CROSS) and peers.version(peers.parse(which)[0]) is None:
        reason = f"{peers.parse(which)[0].name} is not installed (pip install 'spec-router[peers]')"
        print(f"prefixcompare: {dep.name} {which}: skipped: {reason}", file=sys.stderr)
        return {**row, "skipped": reason, "wall_s": 0.0, "loadavg_after": procs.loadavg()}
    with procs.ProcGroup() as group:
        try:
            b = start_backends(group, dep, ns)
            router, label = start_router(group, which, b, ns, tmp / f"{stem}.log")
            cli.run_async(cli.wait_serving(router.url, model=MODEL, within=60.0, proc=router.proc,
                                           log=tmp / f"{stem}.log"))
        except (peers.PeerError, NotServing, procs.ProcError) as exc:
            row.update(skipped=str(exc), wall_s=round(time.monotonic() - t0, 1), loadavg_after=procs.loadavg())
            print(f"prefixcompare: {dep.name} {which}: skipped: {exc}", file=sys.stderr)
            return row
        row["label"] = label
        before = cli.run_async(procs.sim_stats(b.all))  # the readiness ping, and anything else before the replay
        ours = which in (OURS, OURS_NO_PREFIX, OURS_NO_CROSS)
        decided = cli.run_async(our_decisions(router.url)) if ours else {}
        with open(tmp / f"{stem}.replay.log", "w", encoding="utf-8") as log:
            rc = subprocess.run(replay_cmd(ns, dep, stem, router.url, tmp), stdout=log, stderr=subprocess.STDOUT,
                                check=False).returncode
        after = cli.run_async(procs.sim_stats(b.all))
        if ours:
            row["decisions"] = {k: v - decided.get(k, 0) for k, v in cli.run_async(our_decisions(router.url)).items()
                                if v - decided.get(k, 0)}
    result = tmp / f"{stem}.json"
    if rc not in (0, 1) or not result.exists():
        tail = (tmp / f"{stem}.replay.log").read_text(errors="replace").strip().splitlines()[-1:]
        row.update(skipped=f"replay exited {rc}: {' '.join(tail)[:300]}", wall_s=round(time.monotonic() - t0, 1))
        return row
    fig = json.loads(result.read_text())["results"][stem][0]
    served = [a["requests_total"] - b_["requests_total"] for a, b_ in zip(after, before, strict=True)]
    prompt = sum(a["prompt_tokens_total"] - b_["prompt_tokens_total"] for a, b_ in zip(after, before, strict=True))
    cached = sum(a["cached_tokens_total"] - b_["cached_tokens_total"] for a, b_ in zip(after, before, strict=True))
    mean = sum(served) / len(served) if served else 0
    row.update(
        completed=fig["completed"], failed=fig["failed"] + fig["not_sent"], cache_hit_ratio=fig["cache_hit_ratio"],
        server_cache_hit_ratio=cached / prompt if prompt else None,
        mean_ttft_ms=fig["mean_ttft_ms"], p90_ttft_ms=fig["p90_ttft_ms"], p99_ttft_ms=fig["p99_ttft_ms"],
        median_ttft_ms=fig["median_ttft_ms"], p90_e2e_latency_ms=fig["p90_e2e_latency_ms"],
        mean_e2e_latency_ms=fig["mean_e2e_latency_ms"], output_throughput=fig["output_throughput"],
        request_throughput=fig["request_throughput"], request_rate=fig["request_rate"],
        served_per_backend=served, imbalance=(max(served) / mean) if mean else None,
        pool_served={"speculative": sum(served[:len(b.speculative)]), "baseline": sum(served[len(b.speculative):])},
        wall_s=round(time.monotonic() - t0, 1), loadavg_after=procs.loadavg())
    print(f"prefixcompare: {dep.name} {which}: hit {_pct(row['cache_hit_ratio'])}, TTFT mean "
          f"{_n(row['mean_ttft_ms'])} ms p90 {_n(row['p90_ttft_ms'])} ms, {row['completed']} ok "
          f"{row['failed']} failed ({row['wall_s']:.0f} s, load {row['loadavg_after'].split()[0]})", file=sys.stderr)
    return row


# ---- output -------------------------------------------------------------------------------------------

def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _n(v, digits=0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def render(rows: list[dict], config: dict) -> str:
    out = [f"prefixcompare: {config['workload']}", f"simulators at speedup {config['speedup']:g}; token scale "
           f"{config['token_scale']:g}; figures in the simulators' time; cache hit = usage cached_tokens / "
           "prompt_tokens over the replay's answers (server = the simulators' own counters)", ""]
    grid = [["deployment", "GPUs", "instances", "M", "slowdown", "router", "ok", "failed", "cache hit", "server hit",
             "TTFT mean", "TTFT p90", "TTFT p99", "E2E p90", "out tok/s", "req/s", "max/mean served", "pools"]]
    for r in rows:
        if "skipped" in r:
            grid.append([r["deployment"], str(r["gpus"]), str(r["instances"]), str(r["sample_conversations"]),
                         f"{r['slowdown']:g}", r["router"], "skipped: " + r["skipped"][:60]] + [""] * 11)
            continue
        ps = r["pool_served"]
        pools = "-" if r["kind"] == "pool" else f"spec {ps['speculative']} / base {ps['baseline']}"
        grid.append([r["deployment"], str(r["gpus"]), str(r["instances"]), str(r["sample_conversations"]),
                     f"{r['slowdown']:g}", r["router"], str(r["completed"]), str(r["failed"]), _pct(r["cache_hit_ratio"]),
                     _pct(r["server_cache_hit_ratio"]), _n(r["mean_ttft_ms"]), _n(r["p90_ttft_ms"]),
                     _n(r["p99_ttft_ms"]), _n(r["p90_e2e_latency_ms"]), _n(r["output_throughput"], 1),
                     _n(r["request_throughput"], 3), _n(r["imbalance"], 2), pools])
    out += figures.grid(grid)
    out += ["", "latencies in ms; max/mean served: the busiest backend's requests over the mean (1 = even)"]
    for r in rows:
        if r.get("decisions"):
            out.append(f"{r['deployment']} {r['router']} decisions: " + ", ".join(
                f"{k} {v}" for k, v in sorted(r["decisions"].items())))
    return "\n".join(out)


CSV_FIELDS = ["deployment", "kind", "gpus", "instances", "sample_conversations", "slowdown", "router", "label", "completed", "failed",
              "cache_hit_ratio", "server_cache_hit_ratio", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms",
              "p99_ttft_ms", "mean_e2e_latency_ms", "p90_e2e_latency_ms", "output_throughput", "request_throughput",
              "imbalance", "wall_s", "loadavg_before", "loadavg_after", "skipped"]


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(figures._clean(r))


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        if not ns.trace.is_file():
            raise CompareError(f"{ns.trace}: no such file")
        if not ns.window_start >= 0:
            raise CompareError(f"--window-start must be >= 0, got {ns.window_start:g}")
        if ns.window_end <= ns.window_start:
            raise CompareError(f"--window-end {ns.window_end:g} must be after --window-start {ns.window_start:g}")
        deps = plan(ns)
    except (ArgError, CompareError) as exc:
        return cli.fail("prefixcompare", exc)
    workload = (f"{ns.trace} seconds {ns.window_start:g}..{ns.window_end:g}"
                + (f", at most {ns.limit} requests" if ns.limit else "")
                + "; one conversation in M (column 'M': whole conversations, second block id % M == 0)")
    config = {"workload": workload, "trace": str(ns.trace), "window": [ns.window_start, ns.window_end],
              "sample_conversations": ns.sample_conversations,
              "two_pool_sample_conversations": ns.two_pool_sample_conversations, "limit": ns.limit, "token_scale": ns.token_scale,
              "speedup": ns.speedup, "policy": ns.policy, "ours_flags": OURS_FLAGS + list(ns.router_flag), "model": MODEL,
              "pool_profile": POOL_PROFILE, "kv_tokens": ns.kv_tokens, "split": SPLIT, "colocated": COLOCATED,
              "peers": {n: peers.version(p) for n, p in peers.PEERS.items()}, "cpus": os.cpu_count(),
              "loadavg_start": procs.loadavg()}
    rows: list[dict] = []
    ns.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="prefixcompare-") as t:
            for dep in deps:
                for which in dep.routers:
                    rows.append(run_one(dep, which, ns, Path(t)))
    except KeyboardInterrupt:
        print("spec-bench prefixcompare: interrupted", file=sys.stderr)
        return 130
    config["loadavg_end"] = procs.loadavg()
    text = render(rows, config)
    print(text)
    figures.write_run(ns.out, ns.name, config, rows, text, write_csv)
    ran = [r for r in rows if "skipped" not in r]
    if not ran or any(r["completed"] == 0 for r in ran):
        print("spec-bench prefixcompare: a router completed no request; see the table", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
