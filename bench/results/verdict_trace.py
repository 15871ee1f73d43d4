"""The verdict map on Kimi's trace (issue 26, item 4): the deployments of the same 8 simulated GPUs that fit, each
with its KV budget from bench.sim.memory, replayed with `bench replay` (every server --enable-cache-report).

    .venv/bin/python bench/results/verdict_trace.py CASE [--preset P] [--drafter eagle3|eagle3-good] \
        [--levels 1,0.25] [--speedup 30] [--sample 20] [--window-end 900] [--out DIR]

Profiles as `bench demo` picks them (bench.deployments.profiles): built-in fitted ones (Kimi K2.5 on 8 x RTX PRO 6000) or a
preset's step-cost profiles. The split's router is `balanced` on the profiles' model curves for 23-token prompts
and 256 output tokens (the demo's), the co-located pair's `global` at the threshold those curves give: both are
curves for another workload, stated in the report; the TP8 servers need no curve.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import deployments as demo  # noqa: E402
from bench import procs  # noqa: E402
from bench.calibration import Curve, default_hysteresis, global_threshold, model_curve  # noqa: E402
from bench.cli import run_async, wait_serving  # noqa: E402
from bench.sim import memory, presets, stepcost  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--preset")
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--levels", default="1,0.25")
    ap.add_argument("--speedup", type=float, default=30.0)
    ap.add_argument("--sample", type=int, default=20)
    ap.add_argument("--window-end", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "verdict")
    args = ap.parse_args()
    ns = argparse.Namespace(preset=args.preset, drafter=args.drafter, baseline="baseline", split_profile=None,
                            adaptive_profile=None)
    prof, unfit = demo.profiles(ns)
    if args.preset:
        box = presets.box(args.preset)
        fits = memory.fit_all(stepcost.memory_model(box.shape), memory.Hardware(box.gpus, box.gpu.memory_gib))
    else:
        fits = memory.fit_all(memory.KIMI_K25, memory.SEED_BOX)
    kv = {k: [s.max_total_num_tokens for s in f.servers] for k, f in fits.items() if f.fits}
    log = [f"case {args.case}: profiles {prof}", f"does not fit: {unfit or 'none'}", f"KV budgets: {kv}",
           f"load average at start: {Path('/proc/loadavg').read_text().strip()}"]
    t0 = time.monotonic()
    texts, merged = [], None
    # fresh servers for every level: a prefix cache warmed by the level before would serve the next one's prompts
    for level in args.levels.split(","):
        stem = f"trace-{args.case}-s{level}"
        text, rc = run_level(args, prof, unfit, kv, level, stem, log)
        texts.append(text)
        if rc:
            print(text)
            return rc
        part = json.loads((args.out / f"{stem}.json").read_text())
        if merged is None:
            merged = part
        else:
            for name, figs in part["results"].items():
                merged["results"][name] += figs
        for ext in ("json", "csv"):
            (args.out / f"{stem}.{ext}").unlink(missing_ok=True)
    merged["levels_note"] = "each level on freshly started servers (cold prefix caches)"
    (args.out / f"trace-{args.case}.json").write_text(json.dumps(merged, indent=1))
    log.append(f"load average at end: {Path('/proc/loadavg').read_text().strip()}; wall {time.monotonic() - t0:.0f} s")
    text = "\n".join(log) + "\n\n" + "\n\n".join(texts)
    (args.out / f"trace-{args.case}.txt").write_text(text)
    print(text)
    return 0


def run_level(args, prof: dict, unfit: dict, kv: dict, level: str, stem: str, log: list[str]) -> tuple[str, int]:
    k = args.speedup
    common = ["--enable-cache-report"]
    with procs.ProcGroup() as group:
        targets = {}
        for name, p, kind in ((demo.TP8_BASE, prof["base8"], memory.TP_BASELINE),
                              (demo.TP8_SPEC, prof["spec8"], memory.TP_EAGLE3),
                              (demo.TP8_ADAPTIVE, prof["adaptive"], memory.TP_ADAPTIVE)):
            targets[name] = group.add(procs.start_sim(p, k, name, common + [
                "--max-total-tokens", str(kv[kind][0])])).url
        curves = {key: model_curve(prof[key], 256) for key in ("spec8", "base8")}
        if "split" not in unfit:
            spec4 = group.add(procs.start_sim(prof["spec4"], k, "split spec", common + [
                "--max-total-tokens", str(kv["split"][0])]))
            base4 = group.add(procs.start_sim(prof["base4"], k, "split base", common + [
                "--max-total-tokens", str(kv["split"][1])]))
            r = group.add(procs.start_router([spec4.url], [base4.url], "balanced", None, extra=[
                "--speculative-curve", model_curve(prof["spec4"], 256),
                "--baseline-curve", model_curve(prof["base4"], 256)]))
            run_async(wait_serving(r.url))
            targets[demo.SPLIT] = r.url
        if "colocated" not in unfit:
            g = global_threshold(Curve.from_setting(curves["spec8"]), Curve.from_setting(curves["base8"]))
            total = sum(kv["colocated"])
            pair, a, b = procs.start_colocated(prof["spec8"], prof["base8"], k, kv_share=kv["colocated"][0] / total,
                                               extra=common + ["--max-total-tokens", str(total)])
            group.add(pair)
            r = group.add(procs.start_router([a], [b], "global", g, extra=["--hysteresis", str(default_hysteresis(g))]))
            run_async(wait_serving(r.url))
            targets[demo.COLOCATED] = r.url
            log.append(f"co-located global threshold {g}")
        cmd = [sys.executable, "-m", "bench", "replay", "--trace",
               str(ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace_first_30min.jsonl"),
               "--sample-conversations", str(args.sample), "--window-end", str(args.window_end), "--speedup", f"{k:g}",
               "--mooncake-slowdown-factor", level, "--slo-ttft", "5000", "--slo-tpot", "100",
               "--out", str(args.out), "--name", stem, "--no-plot"]
        for name, url in targets.items():
            cmd += ["--target", f"{name}={url}"]
        log.append(f"command (slowdown {level}, fresh servers): " + " ".join(cmd[1:]))
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return out.stdout + out.stderr[-3000:], out.returncode


if __name__ == "__main__":
    raise SystemExit(main())
