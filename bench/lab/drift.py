"""`spec-bench drift`: the speculative server's acceptance drops mid-run; who follows it (tok/s, spec share)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from bench import procs
from bench.calibration import model_curve
from bench.cli import ArgError, NotServing, parser, run_async, wait_serving
from bench.cli import profile as _profile
from bench.load import BenchInputError, LoadSpec, load_prompts, run_closed
from bench.sim.profiles import ProfileError

# adaptive learns alone; balanced is given the curves of before the change (what a calibration run left in
# .env) or of after it (the best a person re-running calibrate at once could do).
CONFIGS = ("adaptive", "balanced-pre", "balanced-post")


def build_parser() -> argparse.ArgumentParser:
    p = parser("drift", __doc__)
    p.add_argument("--speculative-profile", default="eagle3-tp8",
                   help="simulator profile of the speculative server, a name or a .json file (default eagle3-tp8)")
    p.add_argument("--baseline-profile", default="baseline-tp8",
                   help="simulator profile of the baseline server, a name or a .json file (default baseline-tp8)")
    p.add_argument("--speedup", type=float, default=20.0, help="simulated seconds per wall second (default 20)")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (default 32)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--prompts", default="coding", help="coding | general | FILE.jsonl (default coding)")
    p.add_argument("--before", type=float, default=120.0, help="simulated seconds before the change (default 120)")
    p.add_argument("--after", type=float, default=180.0, help="simulated seconds after it (default 180)")
    p.add_argument("--accept-after", type=float, default=1.6, help="mean accept length after the change")
    p.add_argument("--window", type=float, default=10.0, help="simulated seconds per reported window")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default="drift", help="file stem of the outputs (default drift)")
    p.add_argument("--no-plot", action="store_true", help="write JSON and text only, no PNG")
    return p


def _tokens_by_pool(text: str) -> dict[str, float]:
    out = {"speculative": 0.0, "baseline": 0.0}
    for line in text.splitlines():
        if line.startswith("router_completion_tokens_total{"):
            labels, _, value = line.rpartition(" ")
            for pool in out:
                if f'pool="{pool}"' in labels:
                    out[pool] = float(value)
    return out


async def _drive(ns, router_url: str, spec_url: str) -> list[dict]:
    """Closed-loop load for before+after simulated seconds; the change at `before`; a sample per window."""
    total_wall = (ns.before + ns.after) / ns.speedup
    window_wall = ns.window / ns.speedup
    spec = LoadSpec(url=router_url, prompts=load_prompts(ns.prompts), model="default", max_tokens=ns.max_tokens,
                    requests=None, duration=total_wall, timeout=600.0, extra_body={"ignore_eos": True},
                    level_timeout=total_wall + 60.0)
    samples: list[dict] = []
    async with aiohttp.ClientSession() as s:

        async def tokens() -> dict[str, float]:
            async with s.get(router_url + "/metrics") as r:
                return _tokens_by_pool(await r.text())

        async def sampler() -> None:
            t0 = time.perf_counter()
            last, last_t = await tokens(), t0
            drifted = False
            while True:
                await asyncio.sleep(window_wall)
                now = time.perf_counter()
                if not drifted and (now - t0) * ns.speedup >= ns.before:
                    async with s.post(spec_url + "/_sim/drift", json={"accept_length": ns.accept_after}) as r:
                        if r.status != 200:
                            raise BenchInputError(f"the simulator refused the drift call: HTTP {r.status}")
                    drifted = True
                cur = await tokens()
                dt = (now - last_t) * ns.speedup
                d = {p: cur[p] - last[p] for p in cur}
                tot = sum(d.values())
                samples.append({"t": round((now - t0) * ns.speedup, 1), "tok_s": tot / dt if dt > 0 else 0.0,
                                "spec_share": d["speculative"] / tot if tot > 0 else 0.0, "drifted": drifted})
                last, last_t = cur, now

        task = asyncio.create_task(sampler())
        try:
            await run_closed(spec, ns.concurrency)
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
    return samples


def summarize(ns, runs: dict[str, list[dict]]) -> dict:
    """Mean tok/s before the change, right after it and once settled; when adaptive recovered."""
    out: dict = {}
    for name, samples in runs.items():
        pre = [s["tok_s"] for s in samples if not s["drifted"] and s["t"] > ns.before / 2]
        post = [s["tok_s"] for s in samples if s["drifted"] and s["t"] > ns.before + 60]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        out[name] = {"pre_tok_s": round(mean(pre), 1), "post_tok_s": round(mean(post), 1),
                     "post_spec_share": round(mean([s["spec_share"] for s in samples
                                                    if s["drifted"] and s["t"] > ns.before + 60]), 3)}
    ref = out.get("balanced-post", {}).get("post_tok_s")
    if ref and "adaptive" in runs:
        # Recovered: from this window on, the mean of every later window stays at or above 0.95x the reference.
        after = [s for s in runs["adaptive"] if s["drifted"]]
        rec = None
        for i, s in enumerate(after):
            rest = [x["tok_s"] for x in after[i:]]
            if rest and sum(rest) / len(rest) >= 0.95 * ref and all(
                    sum(rest[j:j + 3]) / len(rest[j:j + 3]) >= 0.9 * ref for j in range(len(rest))):
                rec = round(s["t"] - ns.before, 1)
                break
        out["adaptive"]["recovered_after_s"] = rec
        for name in out:
            out[name]["post_vs_balanced_post"] = round(out[name]["post_tok_s"] / ref, 3)
    return out


def render(ns, runs: dict[str, list[dict]], summary: dict) -> str:
    names = list(runs)
    lines = [f"drift: {ns.speculative_profile} vs {ns.baseline_profile} (one instance each, same GPU count as "
             f"their profiles), c={ns.concurrency}, {ns.prompts} prompts, max_tokens {ns.max_tokens}, accept "
             f"length -> {ns.accept_after:g} at t={ns.before:g} s (simulated seconds; speedup {ns.speedup:g})", ""]
    head = ["t (s)"] + [f"{n} tok/s" for n in names] + [f"{n} spec%" for n in names]
    rows = [head]
    for i in range(min(len(runs[n]) for n in names)):
        row = [f"{runs[names[0]][i]['t']:g}"]
        row += [f"{runs[n][i]['tok_s']:.0f}" for n in names]
        row += [f"{100 * runs[n][i]['spec_share']:.0f}" for n in names]
        rows.append(row)
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("")
    for n, s in summary.items():
        lines.append(f"{n}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    return "\n".join(lines)


def plot(path: Path, runs: dict[str, list[dict]], before: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, samples in runs.items():
        a1.plot([s["t"] for s in samples], [s["tok_s"] for s in samples], label=name)
        a2.plot([s["t"] for s in samples], [100 * s["spec_share"] for s in samples], label=name)
    for ax in (a1, a2):
        ax.axvline(before, color="grey", linestyle="--")
        ax.grid(alpha=0.3)
    a1.set_title("Output throughput")
    a2.set_title("Tokens served by the speculative pool")
    a1.set_ylabel("output tok/s")
    a2.set_ylabel("speculative share of tokens (%)")
    a2.set_xlabel("simulated seconds (dashed: acceptance drops)")
    a1.legend(title="router")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run(ns) -> int:
    configs = [c.strip() for c in ns.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        raise ArgError(f"unknown configuration {bad[0] if bad else '(none)'}; choose from {','.join(CONFIGS)}")
    prof = _profile(ns.speculative_profile)
    if not prof.speculative:
        raise ArgError(f"--speculative-profile {ns.speculative_profile} is not a speculative profile")
    accept_pre = prof.accept_length_coding if ns.prompts == "coding" else prof.accept_length_general
    pre = model_curve(ns.speculative_profile, ns.max_tokens, accept_pre)
    post = model_curve(ns.speculative_profile, ns.max_tokens, ns.accept_after)
    base = model_curve(ns.baseline_profile, ns.max_tokens)
    runs: dict[str, list[dict]] = {}
    for name in configs:
        # Fresh servers per configuration: each sees the same change at the same simulated time.
        with procs.ProcGroup() as group:
            spec_url = group.add(procs.start_sim(ns.speculative_profile, ns.speedup, "speculative sim")).url
            base_url = group.add(procs.start_sim(ns.baseline_profile, ns.speedup, "baseline sim")).url
            extra = {"adaptive": [], "balanced-pre": ["--speculative-curve", pre, "--baseline-curve", base],
                     "balanced-post": ["--speculative-curve", post, "--baseline-curve", base]}[name]
            # Every router polls /v1/loads (only adaptive uses the figures: the accept length among them).
            extra += ["--load-signal", "backend", "--load-interval", f"{max(0.05, 5.0 / ns.speedup):g}"]
            policy = "adaptive" if name == "adaptive" else "balanced"
            r = group.add(procs.start_router([spec_url], [base_url], policy, None, extra=extra))
            run_async(wait_serving(r.url))
            print(f"{name}: running {ns.before + ns.after:g} simulated seconds", file=sys.stderr)
            runs[name] = asyncio.run(_drive(ns, r.url, spec_url))
    summary = summarize(ns, runs)
    text = render(ns, runs, summary)
    print(text)
    ns.out.mkdir(parents=True, exist_ok=True)
    data = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()},
            "curves": {"speculative_pre": pre, "speculative_post": post, "baseline": base},
            "runs": runs, "summary": summary}
    (ns.out / f"{ns.name}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (ns.out / f"{ns.name}.txt").write_text(text + "\n", encoding="utf-8")
    wrote = [ns.out / f"{ns.name}.json", ns.out / f"{ns.name}.txt"]
    if not ns.no_plot:
        try:
            wrote.append(plot(ns.out / f"{ns.name}.png", runs, ns.before))
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in wrote))
    return 0


def main(argv: list[str]) -> int:
    try:
        ns = build_parser().parse_args(argv)
        if ns.speedup <= 0 or ns.concurrency < 1 or ns.window <= 0 or ns.before <= 0 or ns.after <= 0:
            raise ArgError("--speedup, --concurrency, --window, --before and --after must be positive")
        return run(ns)
    except (ArgError, BenchInputError, procs.ProcError, ProfileError, NotServing, ValueError) as exc:
        print(f"spec-bench drift: {exc}", file=sys.stderr)
        return 2
