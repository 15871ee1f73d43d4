"""The router's latency predictions against what the client measured, on the compose split behind our router with
targets sent (1 x compose.chain3-good-tp4 + 1 x compose.baseline-tp4, `spec-bench goodput`'s llama-split+ours-targets
row): fresh simulators and a cold router, started as bench/lab/goodput.py starts them, then `spec-bench replay` of
Kimi's trace with the default class mix; its text (with the predictions table) goes to OUT.txt, its JSON (per
request: predicted and measured) to OUT.json.

usage: nice -n 10 .venv/bin/python -m bench.lab.predictionrun OUT.txt [M] [WINDOW_END_S] [SPEEDUP]
       (defaults: M 10, window 600 s, speedup 20; env WARMUP=N requests, default 50; TRACE=the Mooncake JSONL)"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from bench import cli, procs
from bench.lab import goodput


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    sample = int(argv[1]) if len(argv) > 1 else 10
    window = float(argv[2]) if len(argv) > 2 else 600.0
    speedup = float(argv[3]) if len(argv) > 3 else 20.0
    ns = SimpleNamespace(groups=["compose"], only=["llama-split+ours-targets"], trace=Path(os.environ.get("TRACE", goodput.TRACE)), window_end=window,
                         token_scale=1.0, timeout=300.0, class_mix="default", class_targets=[], class_tier=[], seed=0,
                         policy="adaptive", router_flag=[])
    dep, = goodput.deployments(ns)
    kv = goodput.kv_budgets(dep.group)
    with procs.ProcGroup() as group, tempfile.TemporaryDirectory(prefix="prediction-") as tmp:
        def sim(profile: str, kind: str, i: int) -> str:
            return group.add(procs.start_sim(profile, speedup, extra=[
                "--enable-cache-report", "--model", goodput.LLAMA, "--seed", str(i),
                "--max-total-tokens", str(kv[kind])])).url
        spec = [sim(p, k, i) for i, (p, k) in enumerate(dep.speculative)]
        base = [sim(p, k, len(spec) + i) for i, (p, k) in enumerate(dep.baseline)]
        url = group.add(procs.start_router(spec, base, ns.policy, extra=list(goodput.OURS_FLAGS))).url
        cli.run_async(cli.wait_serving(url, model=goodput.LLAMA, within=60.0))
        cmd = goodput.replay_cmd(ns, dep, sample, speedup, goodput.LLAMA, url, Path(tmp), "replay")
        cmd += ["--prediction-warmup", os.environ.get("WARMUP", "50")]
        rc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        out.with_suffix(".txt").write_text(
            f"# {' '.join(['python -m bench.lab.predictionrun', *argv])}: servers {dep.servers}, router {ns.policy} "
            f"{' '.join(goodput.OURS_FLAGS)}, targets sent; one conversation in {sample} of "
            f"{ns.trace} seconds 0..{window:g}, clocks {speedup:g}x\n" + rc.stdout, encoding="utf-8")
        src = Path(tmp) / "replay.json"
        if src.exists():
            out.with_suffix(".json").write_text(src.read_text(), encoding="utf-8")
    print(rc.stdout)
    return rc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
