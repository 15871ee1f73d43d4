"""`spec-bench sweep`: load levels x targets, progress bar, terminal table, JSON + CSV + PNG."""
from __future__ import annotations

import sys
from pathlib import Path

from bench import figures
from bench.cli import ArgError, float_list, parser, run_async, target, unique_targets
from bench.levels import add_load_args, config_from_args, run_sweep, write_outputs
from bench.load import BenchInputError


def main(argv: list[str]) -> int:
    p = parser("sweep",
               "Closed-loop (or open-loop Poisson) concurrency sweep against OpenAI-compatible targets.")
    p.add_argument("--target", type=target, action="append", required=True,
                   help="[NAME=]URL of an OpenAI-compatible server (repeatable; a bare URL is named target)")
    p.add_argument("--request-rate", type=float_list, default=None,
                   help="open-loop Poisson arrivals at these rates (req/s, comma-separated) instead of "
                        "closed-loop concurrency levels")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--name", default="sweep", help="file stem of the outputs (default sweep)")
    add_load_args(p)
    try:
        ns = p.parse_args(argv)
        unique_targets(ns.target)
    except ArgError as exc:
        print(f"spec-bench sweep: {exc}", file=sys.stderr)
        return 2
    cfg = config_from_args(ns, ns.target)
    try:
        results = run_async(run_sweep(cfg))
    except BenchInputError as exc:
        print(f"spec-bench sweep: {exc}", file=sys.stderr)
        return 2
    print(figures.render_table(results))
    paths = write_outputs(ns.out, ns.name, cfg.as_dict(), results, title="spec-bench sweep", plot=not ns.no_plot)
    print("wrote " + ", ".join(str(x) for x in paths))
    if all(f["completed"] == 0 for figs in results.values() for f in figs):
        print("spec-bench sweep: no request succeeded; see the 'failed' column and errors in the JSON",
              file=sys.stderr)
        return 1
    return 0
