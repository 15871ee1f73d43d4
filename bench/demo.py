"""`python -m bench demo`: two simulated backends + the router + a short sweep, in under a minute."""
from __future__ import annotations

import sys
from pathlib import Path

from bench import calibrate, figures, procs
from bench.compare import wait_routing
from bench.load import BenchInputError
from bench.sim import fit
from bench.sim.profiles import ProfileError, load_profile, load_profile_file
from bench.sweep import ArgError, SweepConfig, int_list, parser, positive, run_async, run_sweep, write_outputs

# Mean prompt length of the built-in prompt sets, in the simulator's tokens (what its profile fit assumes).
PROMPT_TOKENS = 23
CURVE_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def model_curve(profile: str, max_tokens: int) -> str:
    """The closed-loop throughput curve the profile's engine model predicts, as the router's CURVE setting.

    On real servers `python -m bench calibrate` measures this curve; the demo takes it from the model so it
    stays under a minute."""
    prof = load_profile_file(profile) if profile.endswith(".json") else load_profile(profile)
    return ",".join(f"{c}:{fit.predict(prof, c, max_tokens, PROMPT_TOKENS):.1f}" for c in CURVE_LEVELS)


def main(argv: list[str]) -> int:
    p = parser("python -m bench demo",
               "Start a speculative and a baseline simulator and the router (spillover), sweep all three.")
    p.add_argument("--speculative-profile", default="eagle3-tp8")
    p.add_argument("--baseline-profile", default="baseline-tp8")
    p.add_argument("--policy", choices=("balanced", "spillover"), default="balanced",
                   help="router policy (default balanced, on the profiles' model curves)")
    p.add_argument("--threshold", type=int, default=4, help="spillover threshold (default 4)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=positive(int), default=128)
    p.add_argument("--speedup", type=positive(float), default=10.0)
    p.add_argument("--out", type=Path, default=Path("bench-out/demo"))
    try:
        ns = p.parse_args(argv)
        if ns.threshold < 0:
            raise ArgError("--threshold must be >= 0")
    except ArgError as exc:
        print(f"bench demo: {exc}", file=sys.stderr)
        return 2
    try:
        with procs.ProcGroup() as group:
            spec = group.add(procs.start_sim(ns.speculative_profile, ns.speedup, "speculative sim"))
            base = group.add(procs.start_sim(ns.baseline_profile, ns.speedup, "baseline sim"))
            if ns.policy == "balanced":
                curves = [model_curve(ns.speculative_profile, ns.max_tokens), model_curve(ns.baseline_profile, ns.max_tokens)]
                router = group.add(procs.start_router([spec.url], [base.url], "balanced", None, extra=[
                    "--speculative-curve", curves[0], "--baseline-curve", curves[1]]))
                policy = "balanced, on the profiles' model curves"
            else:
                router = group.add(procs.start_router([spec.url], [base.url], "spillover", ns.threshold))
                policy = f"spillover, threshold {ns.threshold}"
            run_async(wait_routing(router.url, "default"))
            print(f"speculative sim ({ns.speculative_profile}) {spec.url}\nbaseline sim ({ns.baseline_profile}) "
                  f"{base.url}\nrouter ({policy}) {router.url}\n"
                  f"sweeping concurrency {','.join(map(str, ns.concurrency))}, max_tokens {ns.max_tokens}; "
                  f"simulator clocks run {ns.speedup:g}x fast, figures are in simulated time\n", flush=True)
            cfg = SweepConfig(targets=[("router", router.url), ("speculative", spec.url), ("baseline", base.url)],
                              concurrency=ns.concurrency, max_tokens=ns.max_tokens, speedup=ns.speedup,
                              rounds=2, min_requests=8)
            results = run_async(run_sweep(cfg))
    except (BenchInputError, procs.ProcError, ProfileError) as exc:
        print(f"bench demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench demo: interrupted", file=sys.stderr)
        return 130
    print(figures.render_table(results))
    paths = write_outputs(ns.out, "demo", cfg.as_dict(), results,
                          title=f"bench demo: router ({policy}) vs each pool alone")
    spec_c, base_c = calibrate.Curve.from_figs(results["speculative"]), calibrate.Curve.from_figs(results["baseline"])
    rec = calibrate.recommend(spec_c, base_c, ns.concurrency)
    print()
    print(*rec.notes, sep="\n")
    print(f"calibrate's model, from these two pool curves, would pick threshold {rec.threshold}; "
          "`python -m bench compare` measures it against the alternatives.")
    print(f"plot: {paths[-1]}\ndata: {paths[0]}, {paths[1]}")
    return 0
