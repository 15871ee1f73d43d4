"""`spec-bench plan`: which deployment of the same GPUs to run at which load, from measured curves (through
bench.breakeven) and/or before anything is measured (through bench.planmodel): the command, its flags and output."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from bench import classmix, figures, planmodel, trace
from bench import fleet as fleet_mod
from bench.breakeven import make_plan, plan_json, render
from bench.cli import ArgError, int_list, nonneg, parser, positive
from bench.cli import profile as cli_profile
from bench.load import BenchInputError
from bench.sim import memory, presets, stepcost
from bench.sim.profiles import ProfileError
from bench.sim.stepcost import ShapeError


def main(argv: list[str]) -> int:
    p = parser("plan",
               "Say which deployment of the same GPUs to run at which load: from compare (or demo) JSON files with "
               "references, and/or before anything is measured from a preset, a model shape file or memory flags "
               "(memory fit of every deployment, the step-cost model's best speculative setting per load, the "
               "TP4 split's break-even).")
    p.add_argument("files", nargs="*", type=Path, metavar="FILE.json", help="compare or demo JSON outputs")
    p.add_argument("--against", default=None, metavar="NAME",
                   help="the reference to beat (default: the first non-speculative profile reference)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the plan as JSON")
    advise_args(p)
    fleet_args(p)
    try:
        ns = p.parse_args(argv)
        inputs = advise_inputs(ns)
        fleet = fleet_inputs(ns, inputs)
        if not ns.files and inputs is None:
            raise ArgError("give compare/demo JSON files, or --preset, --shape or the memory flags (--gpus "
                           "--gpu-memory-gb --model-weights-gb --kv-bytes-per-token) to plan before measuring")
        files = []
        for f in ns.files:
            try:
                files.append(json.loads(f.read_text(encoding="utf-8")))
            except (OSError, ValueError) as exc:
                raise ArgError(f"cannot read {f}: {type(exc).__name__} {exc}") from None
        advice = planmodel.advise(inputs) if inputs is not None else None
        plan = None
        if files:
            unfit = {} if advice is None else {
                kind: advice.fits[name].reason for kind, name in (("split", memory.SPLIT),
                                                                  ("colocated", memory.COLOCATED))
                if not advice.fits[name].fits}
            plan = make_plan(files, ns.against, unfit=unfit)
    except (ArgError, BenchInputError, ShapeError, memory.MemoryFitError, classmix.MixError) as exc:
        print(f"spec-bench plan: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as exc:
        print(f"spec-bench plan: not a compare/demo JSON: {type(exc).__name__} {exc}", file=sys.stderr)
        return 2
    parts = []
    if advice is not None:
        parts.append(planmodel.render(advice))
    if fleet is not None:
        parts.append(fleet_mod.render_fleet(fleet, inputs.box.name))
    if plan is not None:
        parts.append(("measured (compare/demo JSON):\n" if advice is not None else "") + render(plan))
    print("\n\n".join(parts))
    if ns.json is not None:
        out = plan_json(plan) if plan is not None else {}
        if advice is not None:
            out = {**out, "model": planmodel.advice_json(advice)} if plan is not None else planmodel.advice_json(advice)
        if fleet is not None:
            out = {**out, "fleet": fleet_mod.fleet_json(fleet)}
        figures.write_json(ns.json, out)
    return 0


def advise_args(p) -> None:
    g = p.add_argument_group("before anything is measured (sizes in GiB, 2^30 bytes: nvidia-smi's MiB / 1024)")
    g.add_argument("--preset", metavar="NAME", help="a model on a box: " + ", ".join(
        sorted(presets.BOXES) + sorted(presets.ALIASES)) + " (seed = the seed's box, compose = Llama-3.3-70B on it)")
    g.add_argument("--shape", type=Path, metavar="FILE", help="your model's shape (YAML/JSON, the fields of "
                                                               "bench.sim.stepcost.ModelShape; docs/SIMULATOR.md)")
    g.add_argument("--gpu", choices=sorted(presets.GPUS), help="the GPU of a --shape file (default rtxpro6000)")
    g.add_argument("--gpus", type=positive(int), help="GPUs of the box (default: the preset's, 8)")
    g.add_argument("--gpu-memory-gb", type=positive(float), help="memory of one GPU, GiB")
    g.add_argument("--model-weights-gb", type=positive(float), help="the model's weights, all GPUs together, GiB")
    g.add_argument("--draft-weights-gb", type=nonneg, help="the EAGLE-3 draft's weights, GiB (default 0)")
    g.add_argument("--kv-bytes-per-token", type=positive(float),
                   help="KV cache bytes of one token, all layers, unsharded (Llama-3.3-70B: 327680)")
    g.add_argument("--kv-heads", type=positive(int), help="GQA KV heads (the cache splits over up to this many "
                                                          "TP ranks); omitted: MLA, every rank holds the whole cache")
    g.add_argument("--mem-fraction-static", type=positive(float),
                   help="SGLang's --mem-fraction-static (default: SGLang 0.5.23's rule for each server's TP size)")
    g.add_argument("--interconnect", choices=sorted(presets.LINKS), help="the TP all-reduce link (default: the "
                                                                         "preset's; pcie for a --shape file)")
    g.add_argument("--tp4-step-ratio", type=positive(float), metavar="X",
                   help="a TP4 server's step over a TP8 server's, if you measured it (default: the model's)")
    g.add_argument("--accept-length", type=positive(float), help="the seed tree's accept length (default 2.5, "
                                                                  "measured)")
    g.add_argument("--chain-alpha", type=positive(float), help="per-token acceptance of a topk-1 chain (default "
                                                                "0.7, an assumption; plan also shows 0.55 and 0.8)")
    g.add_argument("--chain-alpha-band", type=nonneg, metavar="D",
                   help="each recommendation's range: chain acceptance this much either side of --chain-alpha "
                        f"(default {planmodel.ALPHA_BAND:g}; 0 if you measured it)")
    g.add_argument("--model-error", type=nonneg, metavar="E",
                   help="each recommendation's range: every speculative setting's speedup x (1 +- E), the step-cost "
                        f"model's held-out error (default {planmodel.MODEL_ERROR:g}; docs/SIMULATOR.md)")
    g.add_argument("--levels", type=int_list, help="concurrency levels (default 1,2,5,10,30,70,100,250)")
    g.add_argument("--max-tokens", type=positive(int), default=512, help="output tokens per request (default 512)")
    g.add_argument("--prompt-tokens", type=positive(float), default=23.0, help="prompt tokens (default 23)")


MEMORY_FLAGS = ("gpus", "gpu_memory_gb", "model_weights_gb", "draft_weights_gb", "kv_bytes_per_token", "kv_heads",
                "mem_fraction_static")


def advise_inputs(ns) -> planmodel.Inputs | None:
    """The planning inputs the flags describe; None when none of them is given."""
    if ns.preset and ns.shape:
        raise ArgError("--preset and --shape are alternatives: give one")
    if ns.mem_fraction_static is not None and not 0 < ns.mem_fraction_static < 1:
        raise ArgError("--mem-fraction-static must be between 0 and 1")
    if ns.chain_alpha is not None and not 0 < ns.chain_alpha < 1:
        raise ArgError("--chain-alpha must be between 0 and 1")
    if ns.chain_alpha_band is not None and not ns.chain_alpha_band < 1:
        raise ArgError("--chain-alpha-band must be below 1")
    if ns.model_error is not None and not ns.model_error < 1:
        raise ArgError("--model-error must be below 1 (0.15 is 15%)")
    given = any(getattr(ns, k) is not None for k in MEMORY_FLAGS + ("interconnect", "tp4_step_ratio", "gpu"))
    if not (ns.preset or ns.shape or given):
        return None
    box = None
    if ns.preset:
        box = presets.box(ns.preset)
    elif ns.shape:
        shape = stepcost.load_shape_file(ns.shape)
        gpu = presets.GPUS[ns.gpu or "rtxpro6000"]
        link = presets.LINKS[ns.interconnect or "pcie"]
        box = stepcost.Box(name=f"{ns.shape.stem}-{ns.gpu or 'rtxpro6000'}-{link.name}", shape=shape, gpu=gpu,
                           gpus=8, link=link, cal=presets.calibration(gpu, shape),
                           description=f"{shape.name} (shape file)")
    if box is not None:
        if ns.interconnect:
            box = replace(box, link=presets.LINKS[ns.interconnect], name=f"{box.name}@{ns.interconnect}")
        if ns.gpus:
            box = replace(box, gpus=ns.gpus)
        if ns.gpu_memory_gb:
            box = replace(box, gpu=box.gpu.model_copy(update={"memory_gib": ns.gpu_memory_gb}))
        model = stepcost.memory_model(box.shape)
        gpus, mem = box.gpus, box.gpu.memory_gib
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("gpus", "gpu_memory_gb", "model_weights_gb",
                                                         "kv_bytes_per_token") if getattr(ns, k) is None]
        if missing:
            raise ArgError(f"without --preset or --shape, plan needs {' '.join(missing)}")
        model = memory.ModelMemory("your model", weights_gib=ns.model_weights_gb,
                                   kv_bytes_per_token=ns.kv_bytes_per_token, layers=1, kv_heads=ns.kv_heads,
                                   draft_weights_gib=0.0, draft_layers=0, mla=ns.kv_heads is None)
        gpus, mem = ns.gpus, ns.gpu_memory_gb
    update = {k: v for k, v in (("weights_gib", ns.model_weights_gb), ("draft_weights_gib", ns.draft_weights_gb),
                                ("kv_bytes_per_token", ns.kv_bytes_per_token)) if v is not None}
    if ns.kv_heads is not None:
        update.update(kv_heads=ns.kv_heads, mla=False)
    model = replace(model, **update)
    hw = memory.Hardware(gpus, mem, ns.mem_fraction_static)
    kw = {}
    if ns.levels:
        kw["levels"] = tuple(ns.levels)
    if ns.accept_length is not None:
        kw["tree_accept"] = ns.accept_length
    if ns.chain_alpha is not None:
        kw["alpha"] = ns.chain_alpha
    if ns.chain_alpha_band is not None:
        kw["alpha_band"] = ns.chain_alpha_band
    if ns.model_error is not None:
        kw["model_error"] = ns.model_error
    return planmodel.Inputs(box=box, model=model, hw=hw, max_tokens=ns.max_tokens, prompt_tokens=ns.prompt_tokens,
                            tp4_step_ratio=ns.tp4_step_ratio, **kw)


def fleet_args(p) -> None:
    g = p.add_argument_group("the fleet question: how many of N servers should speculate, for a trace and a class "
                             "mix (with --preset or --shape)")
    g.add_argument("--fleet", type=positive(int), metavar="N", help="servers of the box's class (each on --fleet-tp "
                                                                     "GPUs; default the box's, one server a box)")
    g.add_argument("--fleet-tp", type=positive(int), metavar="TP", help="GPUs per server (default: the box's GPUs)")
    g.add_argument("--trace", type=Path, metavar="FILE", help="the traffic: a Mooncake trace (JSONL), as replay reads "
                                                              "it")
    g.add_argument("--sample-conversations", type=positive(int), default=1, metavar="M",
                   help="keep one conversation in M, as replay does (default 1)")
    g.add_argument("--window-end", type=positive(float), metavar="S", help="trace seconds to keep (default all)")
    g.add_argument("--slowdown", type=positive(float), default=1.0, metavar="F",
                   help="stretch the arrivals by F, as replay's --mooncake-slowdown-factor (default 1)")
    g.add_argument("--token-scale", type=positive(float), default=1.0, help="shrink every prompt and output by this "
                                                                           "factor, as replay does (default 1)")
    g.add_argument("--class-mix", default=classmix.DEFAULT_MIX, metavar="CLASS=SHARE,...",
                   help=f"the classes' shares, as replay's (default {classmix.DEFAULT_MIX})")
    g.add_argument("--class-targets", action="append", default=[], metavar="CLASS=ttft:MS,tpot:MS",
                   help="a class's targets, as replay's (repeatable; default interactive TTFT 5000 ms, TPOT 30 ms)")
    g.add_argument("--speculative", default="chain3", metavar="SETTING",
                   help="what the speculative servers run: tree, chainK, chainK-good (default chain3 at "
                        "--chain-alpha)")
    g.add_argument("--fleet-profiles", metavar="BASE,SPEC",
                   help="plan on these server profiles instead of the step-cost model's (simulator profile names "
                        "or `spec-bench fit` files, baseline then speculative): your measured servers, or the "
                        "simulator's; the range then keeps only the model's error and the cache")


def fleet_inputs(ns, inputs: planmodel.Inputs | None) -> fleet_mod.FleetAdvice | None:
    """The fleet question's answer, when --fleet is given (it needs a box and a trace)."""
    if ns.fleet is None:
        if ns.trace is not None:
            raise ArgError("--trace plans a fleet: give --fleet N too")
        return None
    if inputs is None or inputs.box is None:
        raise ArgError("--fleet needs a box: --preset or --shape")
    if ns.trace is None:
        raise ArgError("--fleet needs --trace FILE (a Mooncake trace)")
    box = inputs.box
    classes = tuple(classmix.build(ns.class_mix, ns.class_targets))
    reqs = trace.load_trace(ns.trace)
    wl = trace.trace_workload(reqs, str(ns.trace), limit=None, window=(0.0, ns.window_end),
                               token_scale=ns.token_scale, num_rounds=1, sample=ns.sample_conversations)
    traffic = fleet_mod.traffic_of([s.trace for s in wl.sessions], wl.span_s * ns.slowdown, ns.token_scale,
                                   wl.description)
    stepcost.setting(ns.speculative)  # an unknown setting: one line (ShapeError)
    given = None
    if ns.fleet_profiles is not None:
        names = [n.strip() for n in ns.fleet_profiles.split(",")]
        if len(names) != 2 or not all(names):
            raise ArgError("--fleet-profiles takes BASE,SPEC: two profile names or files")
        try:
            given = (cli_profile(names[0]), cli_profile(names[1]))
        except ProfileError as exc:
            raise ArgError(f"--fleet-profiles: {exc}") from None
    tp = ns.fleet_tp or (given[0].tp_size if given else box.gpus)
    if tp > box.gpus or box.gpus % tp:
        raise ArgError(f"--fleet-tp {tp} must divide the box's {box.gpus} GPUs")
    return fleet_mod.advise_fleet(box, ns.fleet, tp, traffic, classes, setting=ns.speculative,
                                  alpha=inputs.alpha, alpha_band=inputs.alpha_band, model_error=inputs.model_error,
                                  tree_accept=inputs.tree_accept, profiles=given)
