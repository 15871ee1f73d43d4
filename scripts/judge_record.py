"""Recording (issue 28): one member pair, adaptive and fixed configurations at some levels after the judge's warm-up;
per run the tok/s, the speculative share, the luck (the speculative requests' mean steps per token over the
level's) and the decisions in order (S speculative, b baseline); then what adaptive learned.

nice -n 10 .venv/bin/python scripts/judge_record.py --member prefill-long --levels 2,4,8 --configs round-robin,adaptive
"""
from __future__ import annotations

import argparse
import time

from bench import figures, procs
from bench.cli import int_list, run_async
from bench.lab.judging import Judge
from bench.load import LoadSpec, run_closed
from bench.streams import learned_state

POOL_KEYS = ("alpha_s", "beta_s", "samples", "spread", "tok_s_alone", "tok_s_saturated", "prefill_s",
             "prefill_samples")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--member", default="prefill-long")
    ap.add_argument("--levels", type=int_list, default=int_list("2,8,16"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="the prompt order's offset seed")
    ap.add_argument("--configs", default="round-robin,adaptive", help="round-robin, adaptive, spillover@T")
    a = ap.parse_args()
    ns = argparse.Namespace(speedup=5.0, levels=[1, 2, 4, 8, 16, 32], warmup_levels=None, warmup_seconds=30.0,
                            min_requests=32, rounds=2, max_tokens=96, seed=0, thresholds=[1, 2, 4, 8])
    j = Judge(ns)
    j.load_seed, j.member_name = a.seed, a.member
    with procs.ProcGroup() as g:
        pair = g.add(procs.start("family", ["bench", "family", "--member", a.member, "--speedup", "5", "--seed", "0"],
                                 lines=2))
        j.spec_url, j.base_url = pair.urls
        urls = {}
        for name in a.configs.split(","):
            if name == "adaptive":
                urls[name] = j.adaptive(g)
            elif name.startswith("spillover@"):
                urls[name] = j.router(g, "spillover", True, True, int(name.split("@")[1]))
            else:
                urls[name] = j.router(g, name, True, True)
        if "adaptive" in urls:
            print("warmup", j.warm_up(urls["adaptive"]), flush=True)
        for rnd in range(a.rounds):
            for c in a.levels:
                for name, url in urls.items():
                    if name == "adaptive":
                        time.sleep(1.0)
                    spec = LoadSpec(url=url, prompts=j.prompts, max_tokens=96, requests=max(32, 2 * c), timeout=60.0,
                                    level_timeout=300.0, seed=a.seed)
                    run = run_async(run_closed(spec, c))
                    fig = figures.compute(run, 5.0)
                    seq = "".join("S" if r.pool == "speculative" else "b" for r in sorted(run.records, key=lambda r: r.start))
                    print(f"r{rnd} c={c} {name:12s} {fig['output_throughput']:.1f} tok/s share "
                          f"{fig['speculative_share']:.2f} luck {j.luck(spec, run.records)} {seq}", flush=True)
            if "adaptive" in urls:
                st = run_async(learned_state(urls["adaptive"]))
                for pool, d in (st or {}).get("pools", {}).items():
                    print(pool, {k: d.get(k) for k in POOL_KEYS}, flush=True)


if __name__ == "__main__":
    main()
