"""`spec-bench demo`: the deployments a user chooses between on the same 8 simulated GPUs (TP8 baseline
alone, the TP4+TP4 split with the router, the co-located pair with the router, TP8 EAGLE-3 alone, TP8 with
SGLang's --speculative-adaptive), a short sweep of each, and which wins where, in about a minute. Deployments
whose weights do not fit the GPUs (bench.sim.memory) are named and, with --preset, not run."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import breakeven, equal, figures, procs
from bench.calibration import Curve, default_hysteresis, global_threshold, model_curve
from bench.cli import ArgError, NotServing, int_list, parser, positive, run_async, wait_serving
from bench.cli import profile as _profile
from bench.deployments import (
    COLOCATED,
    DEFAULT_DRAFTER,
    DEFAULT_PRESET,
    DRAFTER_TEXT,
    FITTED,
    SPLIT,
    TP8_ADAPTIVE,
    TP8_BASE,
    TP8_SPEC,
    profiles,
    where_it_does_not_fit,
)
from bench.levels import SweepConfig, run_sweep, write_outputs
from bench.load import BenchInputError
from bench.sim.profiles import ProfileError


def main(argv: list[str]) -> int:
    p = parser("demo",
               "On the same 8 simulated GPUs: TP8 baseline alone, TP4+TP4 split with the router (balanced), the "
               "co-located TP8 pair with the router (global), TP8 EAGLE-3 alone, TP8 adaptive speculation "
               "(SGLang --speculative-adaptive); which wins where, and which do not fit.")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER,
                   help=f"speculative profile family: eagle3 (the seed's tree) or eagle3-good (the better drafter, "
                        f"default {DEFAULT_DRAFTER}); with --preset {FITTED}, any DRAFTER with DRAFTER-tp8 and "
                        "DRAFTER-tp4 profiles")
    p.add_argument("--baseline", default="baseline", help="baseline profile family (default baseline)")
    p.add_argument("--split-profile", default=None, metavar="PROFILE",
                   help="the split's speculative TP4 profile, a name or a .json file (default DRAFTER-tp4)")
    p.add_argument("--adaptive-profile", default=None, metavar="PROFILE",
                   help="the TP8 adaptive-speculation server's profile (default adaptive-tp8, adaptive-good-tp8 "
                        "for eagle3-good, PRESET.adaptive[-good]-tp8 with --preset)")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help="profiles from the step-cost model for this box (bench.sim.presets: "
                   "compose (the default: Llama-3.3-70B on 8x RTX PRO 6000), seed (Kimi K2.5 on the same box), "
                   "kimi-k25-h200-nvlink, llama70b-h200-nvlink, ...): PRESET.baseline-tpN, "
                   "PRESET.tree-tpN (--drafter eagle3) or PRESET.chain3-good-tpN (eagle3-good), "
                   "PRESET.adaptive[-good]-tp8; deployments that do not fit its GPUs are not run. "
                   f"{FITTED}: the built-in profiles fitted to the seed's measured rows (Kimi K2.5), where the "
                   "deployments that do not fit run and are shown, never compared against")
    p.add_argument("--speculative-cap", type=positive(int), default=None, metavar="N",
                   help="--max-running-requests of the TP8 EAGLE-3 and adaptive servers (default: SGLang's 48 "
                        "for a speculative server)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=positive(int), default=256)
    p.add_argument("--speedup", type=positive(float), default=10.0)
    p.add_argument("--out", type=Path, default=Path("bench-out/demo"))
    try:
        ns = p.parse_args(argv)
    except ArgError as exc:
        print(f"spec-bench demo: {exc}", file=sys.stderr)
        return 2
    try:
        prof, unfit = profiles(ns)
    except ArgError as exc:
        print(f"spec-bench demo: {exc}", file=sys.stderr)
        return 2
    # with a preset a deployment that does not fit is not run (its TP4 profiles cannot even be derived)
    skip = set(unfit) if ns.preset != FITTED else set()
    need = [k for k in prof if not (k in ("spec4", "base4") and "split" in skip)]
    try:
        for k in need:
            _profile(prof[k])
        curves = {k: model_curve(prof[k], ns.max_tokens) for k in need if k != "adaptive"}
    except ProfileError as exc:
        print(f"spec-bench demo: {exc}", file=sys.stderr)
        return 2
    g_threshold = global_threshold(Curve.from_setting(curves["spec8"]), Curve.from_setting(curves["base8"]))
    hysteresis = default_hysteresis(g_threshold)
    try:
        with procs.ProcGroup() as group:
            urls, gpus, colocated = _start(ns, group, prof, curves, g_threshold, hysteresis, skip)

            def fit_note(kind: str) -> str:
                if kind not in unfit:
                    return ""
                return (f"\n  {'':<17} NOT RUN: {unfit[kind]}" if kind in skip else
                        f"\n  {'':<17} DOES NOT FIT the model these profiles describe ({unfit[kind]}): shown as "
                        "if it did, never recommended")
            drafter = DRAFTER_TEXT[ns.drafter] if ns.preset != FITTED else f"the {ns.drafter}-tpN profiles"
            print(f"{_box_text(ns)}; drafter: {drafter}")
            if ns.preset != FITTED and not unfit and _on_default_box(ns.preset) and (
                    elsewhere := where_it_does_not_fit()):
                print(elsewhere)
            print(f"same {equal.gpus_label(gpus[TP8_BASE])}, simulated (clocks {ns.speedup:g}x fast, figures in "
                  f"simulated time), five deployments:\n"
                  f"  {TP8_BASE:<17} {prof['base8']} alone\n"
                  f"  {SPLIT:<17} {prof['spec4']} + {prof['base4']} (GPUs 0-3 and 4-7), router balanced on the "
                  "profiles' model curves" + fit_note("split") + "\n"
                  f"  {COLOCATED:<17} {prof['spec8']} + {prof['base8']} "
                  + ("time-sharing GPUs 0-7 (half the KV each)" if colocated else
                     "NOT co-located (this build has no co-located simulator: 16 GPUs)")
                  + f", router global, threshold {g_threshold} in flight, hysteresis {hysteresis}"
                  + fit_note("colocated") + "\n"
                  f"  {TP8_SPEC:<17} {prof['spec8']} alone"
                  + (f" (--max-running-requests {ns.speculative_cap})" if ns.speculative_cap else "") + "\n"
                  f"  {TP8_ADAPTIVE:<17} {prof['adaptive']} alone (SGLang --speculative-adaptive, default table"
                  + (f", --max-running-requests {ns.speculative_cap}" if ns.speculative_cap else "") + ")\n"
                  f"concurrency {','.join(map(str, ns.concurrency))}, max_tokens {ns.max_tokens}\n", flush=True)
            cfg = SweepConfig(targets=list(urls.items()), concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                              speedup=ns.speedup, rounds=2, min_requests=8)
            results = run_async(run_sweep(cfg))
    except (BenchInputError, procs.ProcError, ProfileError, NotServing) as exc:
        print(f"spec-bench demo: {exc}", file=sys.stderr)
        return 2
    # A deployment that does not fit is never what another is compared against: only those that fit are judged.
    configs = [n for n, kind in ((SPLIT, "split"), (COLOCATED, "colocated")) if kind not in unfit]
    refs = [TP8_BASE, TP8_SPEC, TP8_ADAPTIVE]
    rows = equal.judge(results, configs, refs, gpus)
    lines = equal.verdict_lines(rows, configs, refs, gpus)
    if not configs:
        lines.insert(0, "no router deployment fits these GPUs (why: above): the TP8 servers are compared among "
                        "themselves")
    ref_profiles = {TP8_BASE: prof["base8"], TP8_SPEC: prof["spec8"], TP8_ADAPTIVE: prof["adaptive"]}
    extra = {"configs": configs, "kinds": {SPLIT: "split", COLOCATED: "colocated"},
             "references": {n: {"profile": ref_profiles[n], "url": None, "gpus": gpus[n]} for n in refs},
             "gpus": gpus, "equal_hardware": rows, "equal_hardware_text": lines, "unfit": unfit,
             "global_threshold": g_threshold, "hysteresis": hysteresis, "profiles": prof}
    # What to run comes first: when the router's deployments do not pay, the demo says so before any table.
    try:
        print(breakeven.render(breakeven.make_plan([{"config": cfg.as_dict(), "results": results, **extra}],
                                                   unfit=unfit)).splitlines()[0])
    except BenchInputError as exc:
        print(f"recommendation: none ({exc})")
    print(*lines, sep="\n")
    print()
    print(figures.render_table(results, gpus=gpus))
    print()
    if configs:
        print(equal.render_text(rows, configs, refs, gpus))
    title = (f"spec-bench demo: the same {equal.gpus_label(gpus[TP8_BASE])} (simulated), five deployments ({ns.drafter}"
             f", {ns.preset})")
    shown_unfit = [n for n, kind in ((SPLIT, "split"), (COLOCATED, "colocated")) if kind in unfit and n in results]
    if shown_unfit:  # the picture alone must not offer them either
        title += f"\n{' and '.join(shown_unfit)}: do not fit this model on these GPUs (shown, never recommended)"
    paths = write_outputs(ns.out, "demo", cfg.as_dict(), results, title=title, extra=extra, gpus=gpus)
    print(f"\nplot: {paths[-1]}\ndata: {paths[0]}, {paths[1]}")
    print(next_step(paths[0]))
    return 0


def _box_text(ns) -> str:
    """The model and box the profiles describe, said first."""
    if ns.preset == FITTED:
        return f"{FITTED} profiles (the seed's measured rows): Kimi K2.5 on 8x RTX PRO 6000 over PCIe"
    from bench.sim import presets

    return f"preset {ns.preset}: {presets.box(ns.preset).description}"


def _on_default_box(preset: str) -> bool:
    from bench.sim import presets

    return presets.box(preset).name == presets.box(DEFAULT_PRESET).name


def next_step(data: Path) -> str:
    """The `bench plan` line to paste, spelled the way the user's shell reaches this environment: `spec-bench`
    when the one on PATH is this environment's, else this interpreter by path (scripts/demo.sh's .venv)."""
    exe = Path(sys.executable)
    on_path = shutil.which("spec-bench")
    if on_path and os.path.realpath(Path(on_path).parent) == os.path.realpath(exe.parent):
        return f"next, what to run on these GPUs by load:\n  spec-bench plan {shlex.quote(str(data))}"
    rel = os.path.relpath(exe)
    python = exe if rel.startswith("..") else Path(rel)
    shown = str(python) if python.is_absolute() or "/" in str(python) else f"./{python}"
    line = f"next, what to run on these GPUs by load:\n  {shlex.quote(shown)} -m bench plan {shlex.quote(str(data))}"
    if sys.prefix != sys.base_prefix and (exe.parent / "spec-bench").exists():  # a venv not on PATH
        venv = os.path.relpath(sys.prefix)
        venv = sys.prefix if venv.startswith("..") else venv
        line += (f"\n  (spec-bench is installed in {venv}, not on your PATH; `source {shlex.quote(venv)}/bin/activate` "
                 "puts it there)")
    return line


def _start(ns, group: procs.ProcGroup, prof: dict, curves: dict, g_threshold: int,
           hysteresis: int, skip: set[str] = frozenset()) -> tuple[dict[str, str], dict[str, int], bool]:
    """All simulators at once (each takes a second or two to come up), then the routers; `skip`: deployment
    kinds ("split", "colocated") not run."""
    cap = ["--max-running-requests", str(ns.speculative_cap)] if ns.speculative_cap else None
    jobs = {
        TP8_BASE: lambda: procs.start_sim(prof["base8"], ns.speedup, TP8_BASE),
        TP8_SPEC: lambda: procs.start_sim(prof["spec8"], ns.speedup, TP8_SPEC, cap),
        TP8_ADAPTIVE: lambda: procs.start_sim(prof["adaptive"], ns.speedup, TP8_ADAPTIVE, cap),
    }
    if "split" not in skip:
        jobs["spec4"] = lambda: procs.start_sim(prof["spec4"], ns.speedup, "split speculative")
        jobs["base4"] = lambda: procs.start_sim(prof["base4"], ns.speedup, "split baseline")
    if "colocated" not in skip:
        jobs["pair"] = lambda: procs.start_colocated(prof["spec8"], prof["base8"], ns.speedup)
    started: dict = {}
    errors = []
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        for k, fut in futures.items():
            try:
                started[k] = fut.result()
            except procs.ProcError as exc:
                errors.append(exc)
    for v in started.values():
        group.add(v[0] if isinstance(v, tuple) else v)
    if errors:
        raise errors[0]
    g8 = equal.profile_gpus(prof["base8"])
    gpus = {TP8_BASE: g8, TP8_SPEC: equal.profile_gpus(prof["spec8"]),
            TP8_ADAPTIVE: equal.profile_gpus(prof["adaptive"])}
    urls = {TP8_BASE: started[TP8_BASE].url}
    routers = []
    if "split" not in skip:
        split = group.add(procs.start_router([started["spec4"].url], [started["base4"].url], "balanced", None,
                                             extra=["--speculative-curve", curves["spec4"], "--baseline-curve",
                                                    curves["base4"]]))
        routers.append(split)
        urls[SPLIT] = split.url
        gpus[SPLIT] = equal.profile_gpus(prof["spec4"]) + equal.profile_gpus(prof["base4"])
    if "colocated" not in skip:
        _, pair_spec, pair_base = started["pair"]
        pair = group.add(procs.start_router([pair_spec], [pair_base], "global", g_threshold,
                                            extra=["--hysteresis", str(hysteresis)]))
        routers.append(pair)
        urls[COLOCATED] = pair.url
        gpus[COLOCATED] = max(g8, equal.profile_gpus(prof["spec8"]))
    for r in routers:
        run_async(wait_serving(r.url))
    urls |= {TP8_SPEC: started[TP8_SPEC].url, TP8_ADAPTIVE: started[TP8_ADAPTIVE].url}
    return urls, gpus, True
