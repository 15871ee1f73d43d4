"""`spec-bench plan`: break-even from measured curves. Which deployment of the same GPUs to run at which
load, and what single-stream speedup the speculative server would need for the router's deployments to win."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import calibration, equal, figures, planmodel
from bench.cli import ArgError, int_list, parser, positive
from bench.load import BenchInputError
from bench.sim import memory, presets, stepcost
from bench.sim.stepcost import ShapeError

SINGLE = ("all-baseline", "all-speculative")


@dataclass
class Candidate:
    """One router configuration of one measured deployment (split or co-located pair)."""

    name: str
    kind: str  # "split" | "colocated" | "alone" (another reference: one server on the same GPUs)
    gpus: int | None
    figs: list[dict]
    spec: calibration.Curve | None = None  # the pair's speculative server alone
    base: calibration.Curve | None = None  # the pair's baseline server alone
    pair: str = ""  # the measured pair it runs on (several router configurations share one)
    file_refs: dict[str, list[dict]] = field(default_factory=dict)  # the references measured in its own run


@dataclass
class Plan:
    reference: str
    reference_gpus: int | None
    levels: list[int]
    candidates: list[Candidate]
    ratios: dict[str, dict[int, float]]  # candidate -> level -> its throughput / the reference's
    wins: dict[str, list[int]]  # candidate -> levels where it beats the reference beyond the noise band
    best: dict[int, str]  # level -> the deployment to run there (the reference unless a candidate beats it)
    # pair label ("split eagle3-tp4" ...) -> level -> speedup needed; its kind; its measured speedup today
    needed: dict[str, dict[int, float | None]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    today: dict[str, float] = field(default_factory=dict)
    unfit: dict[str, str] = field(default_factory=dict)  # candidate -> why it does not fit (never recommended)


def needed_scale(kind: str, spec: calibration.Curve, base: calibration.Curve, ref_tput: float, c: int) -> float | None:
    """The smallest factor s on the speculative server's whole curve for which the pair reaches the
    reference's throughput at c in-flight requests (0 if the baseline alone does; None if no s can).
    split: the best placement, max over k of s*S(k) + B(c-k). colocated (global): one server serves all,
    max(s*S(c), B(c)); the interleaving cost while both run is left out, so this is a lower bound."""
    if base.throughput(c) >= ref_tput:
        return 0.0
    if kind == "colocated":
        s_c = spec.throughput(c)
        return ref_tput / s_c if s_c > 0 else None
    best = None
    for k in range(1, c + 1):
        s_k = spec.throughput(k)
        if s_k > 0:
            need = (ref_tput - base.throughput(c - k)) / s_k
            best = need if best is None else min(best, need)
    return best


def single_stream(spec: calibration.Curve, base: calibration.Curve) -> float:
    """Speculative over baseline at one request (the speedup a single-stream benchmark shows)."""
    b = base.throughput(1)
    return spec.throughput(1) / b if b else float("inf")


def make_plan(files: list[dict], against: str | None = None, noise: float = equal.NOISE,
              unfit: dict[str, str] | None = None) -> Plan:
    """Raises BenchInputError (one line) when the files hold no usable reference or candidate. `unfit`: deployment
    kinds ("split", "colocated") that do not fit the user's GPUs (bench.sim.memory), never recommended."""
    unfit = unfit or {}
    refs: dict[str, tuple[list[dict], int | None, dict]] = {}
    cands: list[Candidate] = []
    others: list[Candidate] = []  # the references themselves: deployments of the same GPUs too
    for data in files:
        results, gpus = data["results"], data.get("gpus") or {}
        own_refs = {name: results[name] for name in (data.get("references") or {})}
        for name, meta in (data.get("references") or {}).items():
            if name not in refs:
                refs[name] = (results[name], gpus.get(name), meta or {})
                others.append(Candidate(name, "alone", gpus.get(name), results[name], file_refs=own_refs))
        cfg = data.get("config") or {}
        kind = cfg.get("deployment") or ("colocated" if cfg.get("colocated") else "split")
        # Files of different drafters side by side: name each pair by its speculative server.
        label = f"{kind} {Path(str(cfg['speculative'])).stem}" if cfg.get("speculative") else kind
        spec = base = None
        if all(n in results for n in SINGLE):
            spec = calibration.Curve.from_figs(results["all-speculative"])
            base = calibration.Curve.from_figs(results["all-baseline"])
        configs = data.get("configs") or [n for n in results if n not in (data.get("references") or {})]
        kinds = data.get("kinds") or {}  # a demo run: several deployments in one file, each named already
        for n in configs:
            if n in SINGLE:
                continue
            cands.append(Candidate(n if n in kinds else f"{label} + {n}", kinds.get(n, kind), gpus.get(n),
                                   results[n], spec, base, pair=n if n in kinds else label, file_refs=own_refs))
    if not refs:
        raise BenchInputError("no reference deployment in these files: run `python -m bench compare ... "
                              "--reference tp8=profile:baseline-tp8` (or URL@GPUS) first")
    if not cands and len(refs) < 2:
        raise BenchInputError("no router configuration in these files to judge against the reference")
    if against is None:
        plain = [n for n, (_, _, m) in refs.items() if _not_speculative(m.get("profile"))]
        against = plain[0] if plain else next(iter(refs))
    if against not in refs:
        raise BenchInputError(f"--against {against}: no such reference; the files have {', '.join(refs)}")
    # The other references are deployments of the same GPUs too (TP8 EAGLE-3 alone may win at low load).
    cands += [c for c in others if c.name != against]
    ref_figs, ref_gpus, _ = refs[against]
    ref = {f["concurrency"]: f for f in ref_figs if f.get("completed")}
    levels = sorted(ref)
    ratios, wins, best_at = {}, {}, {}
    for cand in cands:
        mine = {f["concurrency"]: f for f in cand.figs if f.get("completed")}
        # Against the reference as measured in the candidate's own run when it has one: runs made at other
        # times on a shared machine differ by more than the noise band.
        theirs = {f["concurrency"]: f for f in cand.file_refs.get(against, ref_figs) if f.get("completed")}
        ratios[cand.name] = {c: figures.tput(mine[c]) / figures.tput(theirs[c])
                             for c in levels if c in mine and c in theirs and figures.tput(theirs[c])}
        wins[cand.name] = [] if cand.kind in unfit else [c for c, r in ratios[cand.name].items() if r >= 1 + noise]
    usable = {c.name for c in cands if c.kind not in unfit}
    for c in levels:
        top = max(((r[c], n) for n, r in ratios.items() if c in r and n in usable), default=None)
        best_at[c] = top[1] if top and top[0] >= 1 + noise else against
    plan = Plan(against, ref_gpus, levels, cands, ratios, wins, best_at)
    plan.unfit = {c.name: unfit[c.kind] for c in cands if c.kind in unfit}
    for cand in cands:
        if cand.spec is None or cand.base is None or cand.pair in plan.needed:
            continue
        today = single_stream(cand.spec, cand.base)
        plan.today[cand.pair], plan.kinds[cand.pair] = today, cand.kind
        plan.needed[cand.pair] = {}
        theirs = {f["concurrency"]: f for f in cand.file_refs.get(against, ref_figs) if f.get("completed")}
        for c in levels:
            if c not in theirs:
                continue
            s = needed_scale(cand.kind, cand.spec, cand.base, figures.tput(theirs[c]), c)
            plan.needed[cand.pair][c] = None if s is None else max(s * today, 0.0)
    return plan


def _not_speculative(profile: str | None) -> bool:
    if not profile:
        return False
    from bench.cli import profile as load
    from bench.sim.profiles import ProfileError

    try:
        prof = load(profile)
    except ProfileError:
        return False
    return not prof.speculative


def render(plan: Plan) -> str:
    ref = f"{plan.reference} [{equal.gpus_label(plan.reference_gpus)}]"
    winners = [n for n, w in plan.wins.items() if w]
    lines = []
    if not winners:
        top = max(plan.candidates, key=lambda c: max(plan.ratios[c.name].values(), default=0.0))
        r = plan.ratios[top.name]
        span = equal.span(list(r.values())) if r else "-"
        lines.append(f"RUN {ref}: nothing measured here beats it at any load "
                     f"(the closest, {top.name}, reaches {span} of its throughput).")
    else:
        where = "; ".join(f"{n} at c={_levels(plan.wins[n])}" for n in winners)
        rest = [c for c in plan.levels if plan.best[c] == plan.reference]
        lines.append(f"Beats {ref}: {where}" + (f"; at c={_levels(rest)} run {plan.reference}." if rest else "."))
    lines.append("")
    lines.append(f"throughput of each candidate / {plan.reference} (beats it at >= {1 + equal.NOISE:.2f}x):")
    rows = [["conc"] + [f"{c.name} [{equal.gpus_label(c.gpus)}]" for c in plan.candidates] + ["run"]]
    for lv in plan.levels:
        rows.append([str(lv)] + [f"{plan.ratios[c.name][lv]:.2f}x" if lv in plan.ratios[c.name] else "-"
                                 for c in plan.candidates] + [plan.best[lv]])
    lines += figures.grid(rows)
    if plan.unfit:
        lines.append("NOT RECOMMENDED, does not fit your GPUs: " + "; ".join(
            f"{n} ({why})" for n, why in plan.unfit.items()))
    unequal = [c for c in plan.candidates if c.gpus != plan.reference_gpus]
    if unequal:
        lines.append("UNEQUAL HARDWARE: " + ", ".join(f"{c.name} uses {equal.gpus_label(c.gpus)}" for c in unequal)
                     + f", {plan.reference} uses {equal.gpus_label(plan.reference_gpus)}")
    for pair, need in plan.needed.items():
        kind = plan.kinds[pair]
        lines.append("")
        lines.append(f"break-even, {pair} pair: the single-stream speedup (speculative over its own baseline "
                     f"server, at 1 request; today {plan.today[pair]:.2f}x) it would need to match "
                     f"{plan.reference} at each load:")
        cells = [f"c={c} " + ("unreachable" if v is None else "its baseline alone matches" if v == 0 else f"{v:.2f}x")
                 for c, v in need.items()]
        lines.append("  " + ", ".join(cells))
        reach = [c for c, v in need.items() if v is not None and v <= plan.today[pair]]
        lines.append(f"  with today's drafter it matches {plan.reference} at " +
                     (f"c={_levels(reach)}" if reach else "no load measured") +
                     ("; model: the speculative server's measured curve scaled by one factor at every load, "
                      + ("placed as well as possible between the two servers" if kind == "split" else
                         "one server serving everything (global), interleaving cost left out")) + ".")
    return "\n".join(lines)


def _levels(levels: list[int]) -> str:
    return ",".join(str(c) for c in levels)


def plan_json(plan: Plan) -> dict:
    return {"reference": plan.reference, "reference_gpus": plan.reference_gpus, "levels": plan.levels,
            "ratios": {n: {str(c): r for c, r in v.items()} for n, v in plan.ratios.items()},
            "wins": plan.wins, "run": {str(c): n for c, n in plan.best.items()},
            "needed_single_stream_speedup": {k: {str(c): v for c, v in n.items()} for k, n in plan.needed.items()},
            "single_stream_speedup_today": plan.today, "pair_kinds": plan.kinds}


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
    try:
        ns = p.parse_args(argv)
        inputs = advise_inputs(ns)
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
    except (ArgError, BenchInputError, ShapeError, memory.MemoryFitError) as exc:
        print(f"bench plan: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as exc:
        print(f"bench plan: not a compare/demo JSON: {type(exc).__name__} {exc}", file=sys.stderr)
        return 2
    parts = []
    if advice is not None:
        parts.append(planmodel.render(advice))
    if plan is not None:
        parts.append(("measured (compare/demo JSON):\n" if advice is not None else "") + render(plan))
    print("\n\n".join(parts))
    if ns.json is not None:
        out = plan_json(plan) if plan is not None else {}
        if advice is not None:
            out = {**out, "model": planmodel.advice_json(advice)} if plan is not None else planmodel.advice_json(advice)
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
    g.add_argument("--levels", type=int_list, help="concurrency levels (default 1,2,5,10,30,70,100,250)")
    g.add_argument("--max-tokens", type=positive(int), default=512, help="output tokens per request (default 512)")
    g.add_argument("--prompt-tokens", type=positive(float), default=23.0, help="prompt tokens (default 23)")


def nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


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
                           gpus=8, link=link, cal=presets.SEED_CAL, description=f"{shape.name} (shape file)")
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
    return planmodel.Inputs(box=box, model=model, hw=hw, max_tokens=ns.max_tokens, prompt_tokens=ns.prompt_tokens,
                            tp4_step_ratio=ns.tp4_step_ratio, **kw)
