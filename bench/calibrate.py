"""`spec-bench calibrate`: sweep each pool directly, model spillover from the two curves, recommend the threshold
(in-flight requests per speculative instance, as the router's spillover compares)."""
from __future__ import annotations

import sys
from pathlib import Path

from bench.calibration import OBJECTIVES, Curve, rec_json, recommend, render
from bench.cli import ArgError, parser, positive, run_async
from bench.levels import add_load_args, config_from_args, run_sweep, write_outputs
from bench.load import BenchInputError


def main(argv: list[str]) -> int:
    p = parser("calibrate",
               "Sweep a speculative and a baseline server directly and recommend the spillover threshold.")
    p.add_argument("--speculative", required=True, metavar="URL", help="one speculative (EAGLE-3) server")
    p.add_argument("--baseline", required=True, metavar="URL", help="one baseline server")
    p.add_argument("--objective", choices=OBJECTIVES, default="throughput",
                   help="maximise combined throughput (default) or minimise median per-request latency")
    p.add_argument("--speculative-instances", type=positive(int), default=1,
                   help="speculative servers the router will front (each like the one measured)")
    p.add_argument("--baseline-instances", type=positive(int), default=1,
                   help="baseline servers the router will front (each like the one measured)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default="calibrate")
    add_load_args(p)
    try:
        ns = p.parse_args(argv)
        targets = []
        for name, url in (("speculative", ns.speculative), ("baseline", ns.baseline)):
            if not url.startswith(("http://", "https://")):
                raise ArgError(f"--{name}: expected http://HOST:PORT, got {url!r}")
            targets.append((name, url.rstrip("/").removesuffix("/v1")))
    except ArgError as exc:
        print(f"spec-bench calibrate: {exc}", file=sys.stderr)
        return 2
    cfg = config_from_args(ns, targets)
    try:
        results = run_async(run_sweep(cfg))
        spec, base = Curve.from_figs(results["speculative"]), Curve.from_figs(results["baseline"])
    except BenchInputError as exc:
        print(f"spec-bench calibrate: {exc}", file=sys.stderr)
        return 2
    levels = sorted(set(spec.levels) & set(base.levels))
    rec = recommend(spec, base, levels, ns.objective, ns.speculative_instances, ns.baseline_instances)
    if ns.speculative_instances > 1 or ns.baseline_instances > 1:
        print(f"modelled deployment: {ns.speculative_instances} speculative + {ns.baseline_instances} baseline "
              "instances; concurrency levels are clients against the whole deployment")
    print(render(rec, spec, base, levels))
    paths = write_outputs(ns.out, ns.name, cfg.as_dict(), results, title="spec-bench calibrate: each pool alone",
                          plot=not ns.no_plot, extra={"recommendation": rec_json(rec)})
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0

