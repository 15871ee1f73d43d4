"""`python -m bench.gpu` / `spec-bench gpu`: run | tp | step | plot | report | check. Exit 2 with one line on bad input or no CUDA."""
from __future__ import annotations

import argparse
import json
import sys

from bench.cli import ArgError, fail, parser
from router.cliargs import OneLineParser


def _cuda_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "spec-bench gpu needs PyTorch (pip install 'spec-router[gpu]') and a CUDA GPU; torch is not installed"
    if not torch.cuda.is_available():
        return "spec-bench gpu needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
    return None


def _parser() -> argparse.ArgumentParser:
    ap = parser("gpu", __doc__)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser)
    r = sub.add_parser("run", help="single-GPU micro-benchmarks (issue 32) -> one JSON")
    r.add_argument("--out", required=True)
    r.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every benchmark")
    r.add_argument("--budget-s", type=float, default=280.0, help="stop starting new points after this many seconds")
    t = sub.add_parser("tp", help="tensor-parallel all-reduce and layer-stack benchmarks (issue 33) -> one JSON")
    t.add_argument("--out", required=True)
    t.add_argument("--world", type=int, default=0, help="processes/GPUs (default: every visible GPU)")
    t.add_argument("--links", default="nvlink,nop2p", help="comma list of nvlink (NCCL default) and nop2p")
    t.add_argument("--layers", type=int, default=4, help="Kimi-shaped layers in the stack (fewer if memory says so)")
    t.add_argument("--quick", action="store_true")
    st = sub.add_parser("step", help="full-depth decode step per batch size at one rank's TP shard -> one JSON")
    st.add_argument("--out", required=True)
    st.add_argument("--models", default="kimi-k2.5:bf16,kimi-k2.5:fp8,llama-3.3-70b",
                    help="comma list of MODEL[:bf16|fp8] (fp8: Kimi's routed experts in fp8, weight-only)")
    st.add_argument("--batches", default="1,4,16,64")
    st.add_argument("--ctx", type=int, default=2048, help="cached tokens per request")
    st.add_argument("--tp", type=int, default=8, help="the TP degree whose one rank's shard is timed")
    st.add_argument("--expert-buffers", type=int, default=4, help="routed-expert tensors the layers cycle over")
    st.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (a smoke run)")
    st.add_argument("--reps", type=int, default=20)
    p = sub.add_parser("plot", help="draw a result JSON (single-gpu or tp) as a PNG")
    p.add_argument("json")
    p.add_argument("--out", required=True)
    m = sub.add_parser("report", help="markdown tables of a single-GPU result JSON (docs/SIMULATOR.md quotes them)")
    m.add_argument("json")
    c = sub.add_parser("check", help="schema + physical-sense check of a result JSON; exit 1 on a problem")
    c.add_argument("json")
    return ap


STEP_MODELS = ("kimi-k2.5", "llama-3.3-70b")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        return []


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"spec-bench gpu: cannot read {path}: {exc}") from None


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except ArgError as exc:
        return fail("gpu", exc)
    try:
        if args.cmd == "step":
            models, batches = [x for x in args.models.split(",") if x], _ints(args.batches)
            bad = [x for x in models if x.partition(":")[0] not in STEP_MODELS or x.partition(":")[2] not in
                   ("", "bf16", "fp8")]
            if bad or not batches or min(batches) < 1 or args.ctx < 1 or args.tp < 1 or args.expert_buffers < 1:
                print(f"spec-bench gpu step: --models takes {','.join(STEP_MODELS)} (optionally :bf16 or :fp8), "
                      "--batches positive integers, --ctx/--tp/--expert-buffers >= 1", file=sys.stderr)
                return 2
            if (why := _cuda_problem()) is not None:
                print(why, file=sys.stderr)
                return 2
            from bench.gpu import step

            return step.main(args.out, models, batches, args.ctx, args.tp, args.expert_buffers, args.layers or None,
                             args.reps, "spec-bench gpu " + " ".join(argv))
        if args.cmd in ("run", "tp"):
            if (why := _cuda_problem()) is not None:
                print(why, file=sys.stderr)
                return 2
            if args.cmd == "run":
                from bench.gpu import suite

                return suite.main(args.out, args.quick, args.budget_s)
            from bench.gpu import tp

            links = [x for x in args.links.split(",") if x]
            if any(x not in ("nvlink", "nop2p") for x in links):
                print(f"spec-bench gpu tp: --links takes nvlink and/or nop2p, not {args.links!r}", file=sys.stderr)
                return 2
            return tp.launch(args.out, args.world, links, args.layers, args.quick)
        doc = _load(args.json)
        if args.cmd == "plot":
            from bench.gpu import plot

            plot.draw(doc, args.out)
            print(f"wrote {args.out}")
            return 0
        if args.cmd == "report":
            from bench.gpu import report

            print(report.render(doc))
            return 0
        from bench.gpu import schema

        if doc.get("kind") == "tp":
            probs = schema.validate_tp(doc) + schema.physical_sense_tp(doc)
        else:
            probs = schema.validate(doc) + schema.physical_sense(doc)
        for line in probs:
            print(line)
        print(f"{args.json}: {len(probs)} problem(s)")
        return 1 if probs else 0
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
