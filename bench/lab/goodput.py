"""`spec-bench goodput`: SLO goodput on Kimi's trace with a class mix (bench.classmix), per deployment of the same
simulated GPUs: a fleet of TP8 Kimi servers on the seed's box class behind smg `cache_aware` (all baseline, all
SGLang adaptive speculation) or behind our router (speculative + baseline servers, targets sent or not), and the
compose default (Llama-3.3-70B on one seed box: the TP4+TP4 split behind our router, TP8 servers alone). Every
deployment and load level runs on freshly started simulators (cold prefix caches), one after another."""
from __future__ import annotations

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

from bench import classmix, cli, figures, procs
from bench.cli import ArgError, NotServing
from bench.lab import peers

TRACE = Path("../shared/data/mooncake/conversation_trace_first_30min.jsonl")
KIMI, LLAMA = "kimi-k2.5-sim", "llama-3.3-70b-sim"  # one served name per group: smg routes by model name
GROUPS = ("kimi", "compose")
OURS, DIRECT, SMG = "ours", "direct", "smg:cache_aware"
# Our router as the compose files run it (prefixcompare's too: a command imports no other command).
OURS_FLAGS = ["--load-signal", "backend", "--load-interval", "0.5"]


@dataclass
class Deployment:
    name: str
    group: str  # kimi | compose
    gpus: int
    speculative: list[tuple[str, str]]  # (profile, KV kind in bench.sim.memory's fit) per server
    baseline: list[tuple[str, str]] = field(default_factory=list)
    router: str = DIRECT  # ours | smg:cache_aware | direct (one server, no router)
    send_targets: bool = False

    @property
    def servers(self) -> str:
        count: dict[str, int] = {}
        for p, _ in self.speculative + self.baseline:
            count[p] = count.get(p, 0) + 1
        return " + ".join(f"{n} x {p}" for p, n in count.items())


def deployments(ns) -> list[Deployment]:
    """The rows, in the order they run and print."""
    out = []
    if "kimi" in ns.groups:
        n, s = ns.boxes, ns.speculative_servers
        if not 0 < s < n:
            raise ArgError(f"--speculative-servers must be between 1 and --boxes - 1 ({n - 1}), got {s}")
        g = 8 * n
        base, adaptive, spec = ("baseline-tp8", "tp-baseline"), ("adaptive-tp8", "tp-adaptive"), (ns.kimi_spec, "tp-eagle3")
        out += [Deployment(f"kimi-{n}x-baseline+smg", "kimi", g, [], [base] * n, SMG),
                Deployment(f"kimi-{n}x-adaptive+smg", "kimi", g, [adaptive] * n, [], SMG),
                Deployment(f"kimi-{s}spec+{n - s}base+ours-targets", "kimi", g, [spec] * s, [base] * (n - s), OURS, True),
                Deployment(f"kimi-{s}spec+{n - s}base+ours", "kimi", g, [spec] * s, [base] * (n - s), OURS, False)]
    if "compose" in ns.groups:
        pre, (spec, adaptive) = "compose", ("chain3-good", "adaptive-good")  # bench.deployments' default drafter
        split_s, split_b = (f"{pre}.{spec}-tp4", "split0"), (f"{pre}.baseline-tp4", "split1")
        out += [Deployment("llama-split+ours-targets", "compose", 8, [split_s], [split_b], OURS, True),
                Deployment("llama-split+ours", "compose", 8, [split_s], [split_b], OURS, False),
                Deployment("llama-tp8-baseline", "compose", 8, [], [(f"{pre}.baseline-tp8", "tp-baseline")]),
                Deployment("llama-tp8-eagle3", "compose", 8, [(f"{pre}.{spec}-tp8", "tp-eagle3")], []),
                Deployment("llama-tp8-adaptive", "compose", 8, [(f"{pre}.{adaptive}-tp8", "tp-adaptive")], [])]
    if ns.only:
        out = [d for d in out if any(o in d.name for o in ns.only)]
    return out


def kv_budgets(group: str) -> dict[str, int]:
    """Each server kind's KV tokens from bench.sim.memory (SGLang 0.5.23's default mem_fraction_static)."""
    from bench.sim import memory, presets, stepcost

    if group == "kimi":
        fits = memory.fit_all(memory.KIMI_K25, memory.SEED_BOX)
    else:
        box = presets.box("compose")
        fits = memory.fit_all(stepcost.memory_model(box.shape), memory.Hardware(box.gpus, box.gpu.memory_gib))
    out = {k: f.servers[0].max_total_num_tokens for k, f in fits.items() if f.fits and k != memory.SPLIT}
    if fits[memory.SPLIT].fits:
        out["split0"], out["split1"] = (s.max_total_num_tokens for s in fits[memory.SPLIT].servers)
    return out


def build_parser() -> cli.Parser:
    p = cli.parser("goodput", "SLO goodput on Kimi's trace with a class mix, per deployment of the same simulated "
                              "GPUs (fresh simulators for every row and level).")
    p.add_argument("--trace", type=Path, default=TRACE, help=f"Mooncake JSONL (default {TRACE})")
    p.add_argument("--groups", type=lambda t: [x for x in t.split(",") if x], default=list(GROUPS),
                   help="kimi (a fleet of TP8 Kimi K2.5 servers on seed boxes), compose (Llama-3.3-70B on one "
                        "seed box) (default both)")
    p.add_argument("--only", type=lambda t: [x for x in t.split(",") if x], default=[],
                   help="run only the deployments whose name contains one of these (comma-separated)")
    p.add_argument("--boxes", type=cli.positive(int), default=4, help="seed boxes (TP8 Kimi servers) of the fleet")
    p.add_argument("--speculative-servers", type=cli.positive(int), default=2,
                   help="speculative servers of the fleet behind our router (default 2 of 4)")
    p.add_argument("--kimi-spec", default="eagle3-tp8",
                   help="profile of the fleet's speculative servers behind our router (default eagle3-tp8: the "
                        "seed's EAGLE-3 tree)")
    p.add_argument("--kimi-sample", type=cli.int_list, default=[4], metavar="M[,M...]",
                   help="one conversation in M for the fleet, one level per value (default 4)")
    p.add_argument("--compose-sample", type=cli.int_list, default=[20], metavar="M[,M...]",
                   help="one conversation in M for the one box, one level per value (default 20)")
    p.add_argument("--window-end", type=cli.positive(float), default=600.0, help="trace seconds (default 600)")
    p.add_argument("--token-scale", type=cli.positive(float), default=1.0,
                   help="scale every prompt and output (and the KV budgets) by this (default 1)")
    p.add_argument("--kimi-speedup", type=cli.positive(float), default=8.0, help="simulator clocks, fleet (default 8)")
    p.add_argument("--compose-speedup", type=cli.positive(float), default=20.0,
                   help="simulator clocks, one box (default 20)")
    p.add_argument("--class-mix", default="default", help="as `spec-bench replay --class-mix` (default: its default)")
    p.add_argument("--class-targets", action="append", default=[], help="as `spec-bench replay` (repeatable)")
    p.add_argument("--class-tier", action="append", default=[], help="as `spec-bench replay` (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="the class draw's seed (default 0)")
    p.add_argument("--policy", default="adaptive", help="our router's policy (default adaptive, the compose default)")
    p.add_argument("--router-flag", action="append", default=[], metavar="FLAG",
                   help="one more flag for our router's command line, e.g. --router-flag=--threshold=2 (repeatable)")
    p.add_argument("--timeout", type=cli.positive(float), default=300.0, help="per-request timeout, wall s")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default="goodput", help="file stem of the outputs (default goodput)")
    return p


SAMPLE_RE = re.compile(r"^(router_slo_\w+)\{([^}]*)\}\s+(\S+)$", re.M)


async def slo_metrics(url: str) -> dict:
    """Our router's own account of the targets it saw (router_slo_*): requests by tier and outcome, targets met and
    missed by tier and kind, and the predicted-over-measured ratio's histogram by kind and pool."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in SAMPLE_RE.findall(text):
        if name.endswith("_created"):
            continue
        key = ",".join(f"{k}={v}" for k, v in re.findall(r'(\w+)="([^"]*)"', labels))
        out.setdefault(name, {})[key] = float(value)
    return out


def replay_cmd(ns, dep: Deployment, sample: int, speedup: float, model: str, url: str, out: Path, stem: str) -> list[str]:
    cmd = [sys.executable, "-m", "bench", "replay", "--trace", str(ns.trace), "--target", f"{dep.name}={url}",
           "--speedup", f"{speedup:g}", "--window-end", f"{ns.window_end:g}", "--sample-conversations", str(sample),
           "--token-scale", f"{ns.token_scale:g}", "--model", model, "--timeout", f"{ns.timeout:g}",
           "--class-mix", ns.class_mix, "--seed", str(ns.seed),
           "--send-targets" if dep.send_targets else "--no-send-targets", "--out", str(out), "--name", stem,
           "--no-plot"]
    for t in ns.class_targets:
        cmd += ["--class-targets", t]
    for t in ns.class_tier:
        cmd += ["--class-tier", t]
    return cmd


def run_one(dep: Deployment, sample: int, ns, tmp: Path) -> dict:
    speedup = ns.kimi_speedup if dep.group == "kimi" else ns.compose_speedup
    model = KIMI if dep.group == "kimi" else LLAMA
    row = {"deployment": dep.name, "group": dep.group, "gpus": dep.gpus, "servers": dep.servers, "router": dep.router,
           "send_targets": dep.send_targets, "sample_conversations": sample, "speedup": speedup,
           "loadavg_before": procs.loadavg()}
    stem = f"{dep.name}-m{sample}".replace("+", "_")
    t0 = time.monotonic()
    if dep.router == SMG and peers.version(peers.parse(SMG)[0]) is None:
        return {**row, "skipped": "smg is not installed (pip install 'spec-router[peers]')", "wall_s": 0.0}
    kv = kv_budgets(dep.group)
    with procs.ProcGroup() as group:
        try:
            def sim(profile: str, kind: str, i: int) -> str:
                tokens = max(1000, round(kv[kind] * ns.token_scale))
                return group.add(procs.start_sim(profile, speedup, extra=[
                    "--enable-cache-report", "--model", model, "--seed", str(i), "--max-total-tokens", str(tokens)])).url
            spec = [sim(p, k, i) for i, (p, k) in enumerate(dep.speculative)]
            base = [sim(p, k, len(spec) + i) for i, (p, k) in enumerate(dep.baseline)]
            log = tmp / f"{stem}.router.log"
            if dep.router == OURS:
                url = group.add(procs.start_router(spec, base, ns.policy,
                                                   extra=list(OURS_FLAGS) + list(ns.router_flag))).url
            elif dep.router == SMG:
                peer, policy = peers.parse(SMG)
                r = group.add(peers.start(peer, policy, spec + base, log))
                cli.run_async(cli.wait_serving(r.url, model=model, within=60.0, proc=r.proc, log=log))
                url = r.url
            else:
                url = (spec + base)[0]
            if dep.router == OURS:
                cli.run_async(cli.wait_serving(url, model=model, within=60.0))
        except (peers.PeerError, NotServing, procs.ProcError) as exc:
            print(f"goodput: {dep.name}: skipped: {exc}", file=sys.stderr)
            return {**row, "skipped": str(exc), "wall_s": round(time.monotonic() - t0, 1), "loadavg_after": procs.loadavg()}
        before = cli.run_async(procs.sim_stats(spec + base))
        with open(tmp / f"{stem}.replay.log", "w", encoding="utf-8") as out:
            rc = subprocess.run(replay_cmd(ns, dep, sample, speedup, model, url, tmp, stem), stdout=out,
                                stderr=subprocess.STDOUT, check=False).returncode
        after = cli.run_async(procs.sim_stats(spec + base))
        if dep.router == OURS:
            row["router_slo"] = cli.run_async(slo_metrics(url))
    result = tmp / f"{stem}.json"
    if rc not in (0, 1) or not result.exists():
        tail = (tmp / f"{stem}.replay.log").read_text(errors="replace").strip().splitlines()[-1:]
        return {**row, "skipped": f"replay exited {rc}: {' '.join(tail)[:300]}", "wall_s": round(time.monotonic() - t0, 1)}
    data = json.loads(result.read_text())
    fig = data["results"][dep.name][0]
    served = [a["requests_total"] - b["requests_total"] for a, b in zip(after, before, strict=True)]
    keep = ("completed", "failed", "not_sent", "shed", "class_goodput", "class_good", "request_rate", "duration_s",
            "output_throughput", "request_throughput", "cache_hit_ratio", "classes", "unattributed_failed",
            "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")
    row.update({k: fig.get(k) for k in keep})
    row.update(description=data["config"]["description"], served_speculative=sum(served[:len(spec)]),
               served_baseline=sum(served[len(spec):]), wall_s=round(time.monotonic() - t0, 1),
               loadavg_after=procs.loadavg())
    print(f"goodput: {dep.name} M={sample}: goodput {row['class_goodput']:.3f}/s, {row['completed']} ok, "
          f"{row['failed'] + row['not_sent']} failed, {row['shed']} shed ({row['wall_s']:.0f} s, load "
          f"{row['loadavg_after'].split()[0]})", file=sys.stderr)
    return row


# ---- output -------------------------------------------------------------------------------------------

def _n(v, digits=0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def render(rows: list[dict], config: dict) -> str:
    out = [f"goodput: {config['trace']} seconds 0..{config['window_end']:g}, one conversation in M; token scale "
           f"{config['token_scale']:g}; figures in the simulators' time; every row on fresh simulators",
           f"class mix: {config['classes_text']}",
           "goodput = requests meeting their class's targets per second (a class without targets: completed); "
           "met = that over the class's requests less its 429s (shed, not failures); latencies of all completed "
           "requests, ms", ""]
    names = [c["name"] for c in config["class_mix"]]
    grid = [["deployment", "GPUs", "router", "targets sent", "M", "offered/s", "goodput/s"] + [f"{n} met" for n in names]
            + ["shed", "failed", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "out tok/s", "spec/base served"]]
    for r in rows:
        head = [r["deployment"], str(r["gpus"]), r["router"], "yes" if r["send_targets"] else "no",
                str(r["sample_conversations"])]
        if "skipped" in r:
            grid.append(head + ["skipped: " + r["skipped"][:70]] + [""] * (len(grid[0]) - len(head) - 1))
            continue
        cells = []
        for n in names:
            c = r["classes"][n]
            cells.append("-" if c["attainment"] is None else f"{100 * c['attainment']:.0f}%")
        grid.append(head + [_n(r["request_rate"], 2), _n(r["class_goodput"], 3)] + cells + [
            str(r["shed"]), str(r["failed"] + r["not_sent"]), _n(r["median_ttft_ms"]), _n(r["p90_ttft_ms"]),
            _n(r["p99_ttft_ms"]), _n(r["median_tpot_ms"]), _n(r["p90_tpot_ms"]), _n(r["p99_tpot_ms"]),
            _n(r["output_throughput"], 1), f"{r['served_speculative']}/{r['served_baseline']}"])
    out += figures.grid(grid)
    out += ["", "servers: " + "; ".join(dict.fromkeys(f"{r['deployment']}: {r['servers']}" for r in rows))]
    out += [line for r in rows if r.get("router_slo") for line in [slo_line(r)] if line]
    return "\n".join(out)


def slo_line(r: dict) -> str:
    """What our router counted of the targets (by tier: met / missed / shed / unmeasured) and how far its
    predictions were from what it measured (mean predicted/measured by kind and pool)."""
    m = r["router_slo"]
    by_tier: dict[str, list[str]] = {}
    for key, v in sorted(m.get("router_slo_requests_total", {}).items()):
        labels = dict(kv.split("=", 1) for kv in key.split(","))
        if v:
            by_tier.setdefault(labels["tier"], []).append(f"{labels['result']} {v:.0f}")
    sums, counts = m.get("router_slo_prediction_ratio_sum", {}), m.get("router_slo_prediction_ratio_count", {})
    ratios = [f"{k.replace('kind=', '').replace(',pool=', ' ')} {sums[k] / counts[k]:.2f}"
              for k in sorted(sums) if counts.get(k)]
    if not by_tier and not ratios:
        return ""
    return (f"{r['deployment']} M={r['sample_conversations']}: the router counted "
            + ("; ".join(f"{t}: {', '.join(v)}" for t, v in by_tier.items()) or "no request with targets")
            + (f"; mean predicted/measured: {', '.join(ratios)}" if ratios else ""))


CSV_FIELDS = ["deployment", "group", "gpus", "servers", "router", "send_targets", "sample_conversations", "speedup",
              "request_rate", "class_goodput", "class_good", "completed", "failed", "not_sent", "shed",
              "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
              "output_throughput", "cache_hit_ratio", "served_speculative", "served_baseline", "attainment",
              "wall_s", "loadavg_before", "loadavg_after", "skipped"]


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            att = " ".join(f"{n}:{_n(c['attainment'], 4)}" for n, c in (r.get("classes") or {}).items())
            w.writerow(figures._clean({**r, "attainment": att}))


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        bad = [g for g in ns.groups if g not in GROUPS]
        if bad or not ns.groups:
            raise ArgError(f"--groups: expected some of {','.join(GROUPS)}, got {','.join(ns.groups) or 'nothing'}")
        if not ns.trace.is_file():
            raise ArgError(f"{ns.trace}: no such file")
        classes = classmix.build(classmix.DEFAULT_MIX if ns.class_mix == "default" else ns.class_mix,
                                 ns.class_targets, ns.class_tier)
        deps = deployments(ns)
        if not deps:
            raise ArgError("--only matches no deployment")
    except (ArgError, classmix.MixError) as exc:
        return cli.fail("goodput", exc)
    config = {"trace": str(ns.trace), "window_end": ns.window_end, "token_scale": ns.token_scale,
              "kimi_sample": ns.kimi_sample, "compose_sample": ns.compose_sample, "kimi_speedup": ns.kimi_speedup,
              "compose_speedup": ns.compose_speedup, "seed": ns.seed, "policy": ns.policy,
              "ours_flags": OURS_FLAGS + list(ns.router_flag), "boxes": ns.boxes,
              "class_mix": [{"name": c.name, "share": c.share, "ttft_ms": c.ttft_ms, "tpot_ms": c.tpot_ms,
                             "tier": c.tier} for c in classes],
              "classes_text": "; ".join(f"{c.name} {100 * c.share:.0f}%: {c.targets}"
                                        + (f", service_tier {c.tier}" if c.tier else "") for c in classes),
              "kv_tokens": {g: kv_budgets(g) for g in ns.groups},
              "peers": {n: peers.version(p) for n, p in peers.PEERS.items()}, "cpus": os.cpu_count(),
              "loadavg_start": procs.loadavg()}
    rows: list[dict] = []
    ns.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="goodput-") as t:
            for dep in deps:
                for sample in (ns.kimi_sample if dep.group == "kimi" else ns.compose_sample):
                    rows.append(run_one(dep, sample, ns, Path(t)))
    except KeyboardInterrupt:
        print("spec-bench goodput: interrupted", file=sys.stderr)
        return 130
    config["loadavg_end"] = procs.loadavg()
    rows.sort(key=lambda r: (r["group"], r["sample_conversations"]))  # one load level's rows together
    text = render(rows, config)
    print(text)
    figures.write_run(ns.out, ns.name, config, rows, text, write_csv)
    ran = [r for r in rows if "skipped" not in r]
    return 0 if ran and all(r["completed"] for r in ran) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
