"""What to run before anything is measured: the memory fit of each deployment and, from the step-cost model,
which speculative setting wins where, and the TP4 split's break-even (pure: inputs in, words and rows out)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from bench.sim import memory, specadaptive, stepcost
from bench.sim.fit import kv_ms, predict
from bench.sim.stepcost import Box, Speculative

# SGLang's --speculative-adaptive default table (python/sglang/srt/speculative/adaptive_spec_params.py), from the
# simulator's port of it: batch-size band -> the draft step counts it may choose (0: off, the draft still extends).
_KEYS = sorted(int(k) for k in specadaptive.DEFAULT_CONFIG)
ADAPTIVE_TABLE = tuple((lo, (_KEYS[i + 1] - 1) if i + 1 < len(_KEYS) else 10**9,
                        tuple(specadaptive.DEFAULT_CONFIG[str(lo)]["candidate_steps"])) for i, lo in enumerate(_KEYS))
DEFAULT_LEVELS = (1, 2, 5, 10, 30, 70, 100, 250)
NOISE = 0.03  # a setting must beat the baseline by this much to be recommended (the bench's noise band)
# How far a recommendation's inputs may be off: a drafter's per-token acceptance is rarely known closer than this
# either side of the stated one, and the step-cost model missed published rows by about this much where nothing
# was fitted to the row (docs/SIMULATOR.md "Held-out evidence": a speedup -14%, a decode speed -16%).
ALPHA_BAND = 0.1
MODEL_ERROR = 0.15
ALPHA_LIMITS = (0.01, 0.99)  # a chain's acceptance stays a probability at the band's ends


def adaptive_steps(batch: int) -> tuple[int, ...]:
    for lo, hi, steps in ADAPTIVE_TABLE:
        if lo <= batch <= hi:
            return steps
    return (0,)


@dataclass
class Inputs:
    box: Box | None  # None: memory flags only (no step model)
    model: memory.ModelMemory
    hw: memory.Hardware
    levels: tuple[int, ...] = DEFAULT_LEVELS
    max_tokens: int = 512
    prompt_tokens: float = 23.0
    tree_accept: float = stepcost.SEED_TREE_ACCEPT
    alpha: float = stepcost.CHAIN_ALPHA
    alpha_range: tuple[float, float] = stepcost.CHAIN_ALPHA_RANGE
    chains: tuple[int, ...] = (1, 2, 3, 4)
    tp4_step_ratio: float | None = None  # measured by the user; None: the model's
    alpha_band: float = ALPHA_BAND  # the recommendation's range: acceptance alpha +- this
    model_error: float = MODEL_ERROR  # ... and every speculative setting's speedup x (1 +- this)
    spec_cap: int = stepcost.EAGLE_DEFAULT_MAX_RUNNING  # a speculative server's running requests (SGLang's default)


@dataclass
class Advice:
    inputs: Inputs
    fits: dict[str, memory.DeploymentFit]
    why: str = ""
    tput: dict[str, dict[int, float]] = field(default_factory=dict)  # setting -> level -> tok/s (TP, all GPUs)
    tpot: dict[str, dict[int, float]] = field(default_factory=dict)  # setting -> level -> ms per output token
    adaptive_choice: dict[int, int] = field(default_factory=dict)  # level -> draft steps adaptive runs
    best_tput: dict[int, str] = field(default_factory=dict)
    best_latency: dict[int, str] = field(default_factory=dict)
    alpha_sweep: dict[float, dict[int, str]] = field(default_factory=dict)  # chain alpha -> level -> winner
    split: dict[int, float] = field(default_factory=dict)  # level -> split throughput (model's TP4 ratio)
    colocated: dict[int, float] = field(default_factory=dict)
    tp4_ratio: float | None = None
    tp4_ratio_source: str = ""
    breakeven: dict[int, float] = field(default_factory=dict)  # level -> the TP4/TP8 step ratio the split needs
    # inside the inputs' range (alpha_band, model_error): every winner per level, the nominal one first, and the
    # nominal winner's figure over the baseline's (throughput ratio; baseline ms per token / its own), low and high
    tput_choices: dict[int, tuple[str, ...]] = field(default_factory=dict)
    tput_range: dict[int, tuple[float, float]] = field(default_factory=dict)
    latency_choices: dict[int, tuple[str, ...]] = field(default_factory=dict)
    latency_range: dict[int, tuple[float, float]] = field(default_factory=dict)


def _settings(inp: Inputs, alpha: float) -> dict[str, Speculative]:
    out = {"baseline": stepcost.BASELINE, "tree": stepcost.tree(accept_length=inp.tree_accept)}
    for k in inp.chains:
        out[f"chain{k}"] = stepcost.chain(k, stepcost.chain_accept_length(k, alpha))
    return out


def _curve(box: Box, spec: Speculative, inp: Inputs, tp: int) -> tuple[dict[int, float], dict[int, float]]:
    prof = stepcost.derive_profile(box, spec, tp, prompt_tokens=inp.prompt_tokens, max_total_num_tokens=1_000_000,
                                   cap=inp.spec_cap if spec.draft else None)
    tput, tpot = {}, {}
    length = prof.accept_length_general if prof.speculative else 1.0
    for c in inp.levels:
        tput[c] = predict(prof, c, inp.max_tokens, inp.prompt_tokens)
        n = min(c, prof.max_running_requests)
        tpot[c] = (prof.step_ms(n) + kv_ms(prof, n, inp.max_tokens, inp.prompt_tokens)) / length
    return tput, tpot


def _adaptive(box: Box, inp: Inputs, alpha: float, tp: int) -> tuple[dict[int, float], dict[int, float], dict]:
    """SGLang's adaptive speculation on one server: at each level the best of the step counts its table allows
    at that batch (an upper bound on what its controller picks); 0 steps still pays the draft's extend pass."""
    curves = {}
    for k in sorted({k for _, _, ks in ADAPTIVE_TABLE for k in ks}):
        spec = (Speculative("adaptive-off", 0, 1, 1, 1.0, True) if k == 0
                else stepcost.chain(k, stepcost.chain_accept_length(k, alpha)))
        curves[k] = _curve(box, spec, inp, tp)
    tput, tpot, choice = {}, {}, {}
    for c in inp.levels:
        k = max(adaptive_steps(min(c, inp.spec_cap)), key=lambda k: curves[k][0][c])
        tput[c], tpot[c], choice[c] = curves[k][0][c], curves[k][1][c], k
    return tput, tpot, choice


def winners(tput: dict[str, dict[int, float]], levels, higher: bool = True) -> dict[int, str]:
    out = {}
    for c in levels:
        base = tput["baseline"][c]
        name = (max if higher else min)(tput, key=lambda n: tput[n][c])
        good = tput[name][c] >= base * (1 + NOISE) if higher else tput[name][c] <= base * (1 - NOISE)
        out[c] = name if good else "baseline"
    return out


def _why(box: Box, inp: Inputs) -> str:
    sh, lay, cal = box.shape, box.layout(), box.cal
    tree = stepcost.tree(accept_length=inp.tree_accept)
    one = stepcost.step_ms(sh, lay, cal, stepcost.BASELINE, 1)
    t_ms = stepcost.step_ms(sh, lay, cal, tree, 1)
    if sh.moe_layers:
        e, k = sh.routed_experts, sh.experts_per_token
        wake = stepcost.distinct_experts
        chain_tokens = 3
        return (f"why: a {tree.draft_tokens}-token tree wakes ~{wake(tree.draft_tokens, e, k):.0f} of {e} experts "
                f"per layer against {k} for a decode; a {chain_tokens}-token chain (2 steps) wakes "
                f"~{wake(chain_tokens, e, k):.0f} (uniform routing; ~{wake(tree.draft_tokens, e, k, cal.expert_reuse):.0f}"
                f" and ~{wake(chain_tokens, e, k, cal.expert_reuse):.0f} at the fitted reuse {cal.expert_reuse:.2f}), "
                f"so at one request a tree step costs {t_ms:.1f} ms against {one:.1f} ms for a decode "
                f"({t_ms / one:.1f}x) and must accept that many more tokens to pay")
    gb = sh.weight_bytes() / 1e9
    return (f"why: {sh.name} is dense: every step reads all {gb:.0f} GB of weights whatever its token count, so at "
            f"one request verifying {tree.draft_tokens} tokens costs {t_ms:.1f} ms against {one:.1f} ms for a decode "
            f"({t_ms / one:.1f}x; a mixture of experts pays for every extra expert its tokens wake); speculation pays "
            f"until the batch's tokens make the GEMMs compute-bound")


def advise(inp: Inputs) -> Advice:
    fits = memory.fit_all(inp.model, inp.hw)
    adv = Advice(inp, fits)
    box = inp.box
    if box is None:
        return adv
    tp = inp.hw.gpus
    box = replace(box, gpus=tp)
    if box.shape.draft is None:
        adv.why = (f"why: {box.shape.name} has no draft head in this shape, so only the baseline is planned "
                   f"(add a `draft:` entry to plan speculation)")
        adv.tput["baseline"], adv.tpot["baseline"] = _curve(box, stepcost.BASELINE, inp, tp)
        adv.best_tput = adv.best_latency = {c: "baseline" for c in inp.levels}
        return adv
    adv.why = _why(box, inp)
    seen: dict[float, tuple[dict, dict]] = {}

    def at(a: float) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
        """Every setting's throughput and ms per token at chain acceptance a (each acceptance computed once)."""
        if a not in seen:
            tput, tpot = {}, {}
            for name, spec in _settings(inp, a).items():
                tput[name], tpot[name] = _curve(box, spec, inp, tp)
            tput["adaptive"], tpot["adaptive"], choice = _adaptive(box, inp, a, tp)
            if a == inp.alpha:
                adv.adaptive_choice = choice
            seen[a] = tput, tpot
        return seen[a]

    adv.tput, adv.tpot = at(inp.alpha)
    adv.best_tput = winners(adv.tput, inp.levels)
    adv.best_latency = winners(adv.tpot, inp.levels, higher=False)
    lo, hi = inp.alpha_range
    for a in (lo, inp.alpha, hi):
        adv.alpha_sweep[a] = winners(at(a)[0], inp.levels)
    _ranges(adv, at)
    _split(adv, box, inp)
    if fits[memory.COLOCATED].fits:
        # global routing on a co-located pair: one server serves everything (interleaving cost left out)
        spec_name = max((n for n in adv.tput if n not in ("baseline", "adaptive")), key=lambda n: adv.tput[n][1])
        adv.colocated = {c: max(adv.tput[spec_name][c], adv.tput["baseline"][c]) for c in inp.levels}
    return adv


def range_points(inp: Inputs) -> tuple[list[float], list[float]]:
    """The acceptances and model errors a recommendation's range spans: alpha +- alpha_band (five points, so a
    winner that changes between the ends is seen) and a speedup factor 1 - model_error, 1, 1 + model_error."""
    lo, hi = (max(ALPHA_LIMITS[0], inp.alpha - inp.alpha_band), min(ALPHA_LIMITS[1], inp.alpha + inp.alpha_band))
    alphas = sorted({lo, (lo + inp.alpha) / 2, inp.alpha, (inp.alpha + hi) / 2, hi})
    return alphas, sorted({1 - inp.model_error, 1.0, 1 + inp.model_error})


def _ranges(adv: Advice, at) -> None:
    """What the inputs' range allows at each level: acceptance alpha +- alpha_band (five points, so a winner that
    changes between the ends is seen) and every speculative setting's speedup over the baseline off by
    model_error either way. A level is uncertain where the winner changes anywhere inside that range."""
    inp, levels = adv.inputs, adv.inputs.levels
    alphas, errors = range_points(inp)
    for higher, nominal, choices_out, range_out in ((True, adv.best_tput, adv.tput_choices, adv.tput_range),
                                                    (False, adv.best_latency, adv.latency_choices, adv.latency_range)):
        found = {c: [nominal[c]] for c in levels}
        ratios: dict[int, list[float]] = {c: [] for c in levels}
        for a in alphas:
            figures = at(a)[0 if higher else 1]
            for err in errors:
                # throughput x err; ms per token / err: the setting's speedup over the baseline x err either way
                scaled = {n: d if n == "baseline" else {c: (v * err if higher else v / err) for c, v in d.items()}
                          for n, d in figures.items()}
                win = winners(scaled, levels, higher)
                for c in levels:
                    if win[c] not in found[c]:
                        found[c].append(win[c])
                    rec, base = scaled[nominal[c]][c], scaled["baseline"][c]
                    ratios[c].append(rec / base if higher else base / rec)
        for c in levels:
            first, rest = found[c][0], found[c][1:]
            nom = adv.tput if higher else adv.tpot
            rest.sort(key=lambda n: -nom[n][c] if higher else nom[n][c])
            choices_out[c] = (first, *rest)
            range_out[c] = (min(ratios[c]), max(ratios[c]))


def _split(adv: Advice, box: Box, inp: Inputs) -> None:
    """The TP(n/2)+TP(n/2) split with a router placing requests as well as possible between its two servers.
    Both halves' steps are the TP8 model's scaled by one ratio r (TP4 step / TP8 step): the model's, or the
    user's measured --tp4-step-ratio. The break-even ratio at c is the split's throughput at r = 1 over TP8's."""
    if inp.hw.gpus // 2 < 1:
        return
    spec_name = max((n for n in adv.tput if n not in ("baseline", "adaptive")), key=lambda n: adv.tput[n][1])
    spec = _settings(inp, inp.alpha)[spec_name]
    adv.tp4_ratio, adv.tp4_ratio_source = _tp4_ratio(box, inp)
    even, split = _split_curve(box, spec, inp, (1.0, adv.tp4_ratio))
    for c in inp.levels:
        adv.breakeven[c] = even[c] / adv.tput["baseline"][c]
        adv.split[c] = split[c]


def _tp4_ratio(box: Box, inp: Inputs) -> tuple[float, str]:
    """A TP(n/2) server's step over a TP(n) server's: the user's measured --tp4-step-ratio, else the model's
    mean over 1, 10 and 64 requests; and where it comes from."""
    if inp.tp4_step_ratio is not None:
        return inp.tp4_step_ratio, "--tp4-step-ratio"
    lay4, lay8 = box.layout(inp.hw.gpus // 2), box.layout()
    rs = [stepcost.step_ms(box.shape, lay4, box.cal, stepcost.BASELINE, n)
          / stepcost.step_ms(box.shape, lay8, box.cal, stepcost.BASELINE, n) for n in (1, 10, 64)]
    return sum(rs) / len(rs), (f"the step-cost model over {box.link.name} (n = 1, 10, 64: "
                               + ", ".join(f"{x:.2f}" for x in rs) + ")")


def _split_curve(box: Box, spec: Speculative, inp: Inputs, ratios: tuple[float, ...]) -> list[dict[int, float]]:
    """The split's throughput at each level for each TP(n/2)/TP(n) step ratio: k requests on the speculative
    half and c - k on the baseline half, the best k (0..c), both halves' TP(n) curves slowed by the ratio."""
    sub = replace(inp, levels=tuple(range(1, max(inp.levels) + 1)))
    s8, _ = _curve(box, spec, sub, inp.hw.gpus)
    b8, _ = _curve(box, stepcost.BASELINE, sub, inp.hw.gpus)
    out = []
    for ratio in ratios:
        best = {}
        for c in inp.levels:
            best[c] = max([b8[c]] + [s8[k] + (b8[c - k] if c - k else 0.0) for k in range(1, c + 1)]) / ratio
        out.append(best)
    return out


# The deployments of one box's GPUs the verdict map compares (docs/BENCH.md, "The verdict map"), by the names
# `deployments` gives them: one TP server of each kind on all the GPUs, the split and the co-located pair.
DEPLOYMENTS = ("baseline", "eagle3", "adaptive", "split", "colocated")


def deployments(inp: Inputs, eagle3: str, alpha: float) -> dict[str, dict[int, float]]:
    """Each deployment's throughput (tok/s, all GPUs) at each level, chain acceptance `alpha`: the TP baseline;
    TP EAGLE-3 at `eagle3` (stepcost.setting's names: `tree`, the seed's, at the measured tree_accept; `chainK` at
    `alpha`); TP adaptive (the best step count its table allows); the TP(n/2) split of that EAGLE-3 and the
    baseline (the model's TP ratio, each request placed as well as possible); the co-located pair under global
    routing (the better of its two servers, interleaving cost left out). Whether each fits is memory.fit_all's."""
    assert inp.box is not None
    tp = inp.hw.gpus
    box = replace(inp.box, gpus=tp)
    spec = stepcost.setting(eagle3, alpha, inp.tree_accept)
    base, _ = _curve(box, stepcost.BASELINE, inp, tp)
    eag, _ = _curve(box, spec, inp, tp)
    ada, _, _ = _adaptive(box, inp, alpha, tp)
    (split,) = _split_curve(box, spec, inp, (_tp4_ratio(box, inp)[0],))
    colocated = {c: max(eag[c], base[c]) for c in inp.levels}
    return {"baseline": base, "eagle3": eag, "adaptive": ada, "split": split, "colocated": colocated}


def deployment_ranges(inp: Inputs, eagle3: str) -> list[dict[str, dict[int, float]]]:
    """Each deployment's throughput over the baseline's at each level, at every point of the inputs' range
    (range_points: the acceptance band, and every deployment but the baseline x the model's error either way, as
    plan's recommendations); the nominal point (inp.alpha, no error) first."""
    alphas, errors = range_points(inp)
    points = [(inp.alpha, 1.0)] + [(a, e) for a in alphas for e in errors if (a, e) != (inp.alpha, 1.0)]
    curves = {a: deployments(inp, eagle3, a) for a in alphas}
    out = []
    for a, err in points:
        d = curves[a]
        out.append({n: {c: 1.0 if n == "baseline" else v[c] / d["baseline"][c] * err for c in inp.levels}
                    for n, v in d.items()})
    return out


def _bands(best: dict[int, str]) -> str:
    parts, run = [], []
    for c, name in best.items():
        if run and run[-1][1] != name:
            parts.append(run)
            run = []
        run.append((c, name))
    if run:
        parts.append(run)
    return "; ".join(f"c={r[0][0]}" + (f"-{r[-1][0]}" if len(r) > 1 else "") + f": {r[0][1]}" for r in parts)


def render(adv: Advice) -> str:
    inp, fits = adv.inputs, adv.fits
    lines = [memory.summary_line(fits)]
    if adv.why:
        lines.append(adv.why)
    g = inp.hw.gpus
    lines.append("")
    lines.append(f"memory fit on {g} x {inp.hw.gpu_memory_gib:.1f} GiB ({inp.model.name}, weights "
                 f"{inp.model.weights_gib:.1f} GiB + draft {inp.model.draft_weights_gib:.2f} GiB, "
                 f"KV {inp.model.kv_bytes_per_token:,.0f} bytes/token):")
    for f in fits.values():
        lines.append(f"  {'fits ' if f.fits else 'NO   '} {f.reason}")
    if inp.box is None:
        lines.append("")
        lines.append("no step model without a preset or --shape: measure with `spec-bench sweep` and pass the "
                     "compare/demo JSON, or add --preset/--shape to predict")
        return "\n".join(lines)
    tp_ok = fits[memory.TP_BASELINE].fits
    spec_ok = fits[memory.TP_EAGLE3].fits
    lines.append("")
    box = inp.box
    lines.append(f"predicted by the step-cost model ({box.name}: {box.shape.name} on {g}x {box.gpu.name}, "
                 f"{box.link.name}; closed loop, {inp.max_tokens} output tokens, {inp.prompt_tokens:g}-token prompts; "
                 f"tree accept length {inp.tree_accept:g} measured, chains at per-token acceptance {inp.alpha:g} "
                 f"assumed; every setting on the same {g} GPUs, TP{g}):")
    t = stepcost.tree()
    lines.append(f"  (tree = EAGLE-3's draft tree, topk {t.topk}, {t.steps} steps, {t.draft_tokens} draft tokens: the "
                 "seed's setting; chainN = a topk-1 chain of N draft steps, --speculative-eagle-topk 1 "
                 "--speculative-num-steps N)")
    if not tp_ok:
        lines.append(f"  TP{g} does not fit either: nothing to recommend on these GPUs")
        return "\n".join(lines)
    names = list(adv.tput)
    rows = [["conc"] + [f"{n} tok/s" for n in names] + ["most tok/s", "lowest ms/token"]]
    for c in inp.levels:
        cells = [str(c)] + [f"{adv.tput[n][c]:.0f}" for n in names]
        cells += [_pick(adv.best_tput[c], spec_ok), _pick(adv.best_latency[c], spec_ok)]
        rows.append(cells)
    lines += _grid(rows)
    if "adaptive" in adv.tput:
        lines.append("  adaptive = SGLang --speculative-adaptive's default table, best allowed step count per batch "
                     "(an upper bound on its controller): " +
                     ", ".join(f"c={c}: {k} step{'' if k == 1 else 's'}" for c, k in adv.adaptive_choice.items()))
        lines.append("    (its controller picks by measured acceptance, not cost: `spec-bench sim --profile "
                     "PRESET.adaptive-tp8` runs it; `spec-bench demo --preset PRESET` compares it)")
    lines.append("")
    if spec_ok and adv.tput_choices:
        lines.append("RUN (throughput): " + _ranged_bands(adv.tput_choices, adv.tput_range))
        lines.append("RUN (latency, ms per output token of a running request): "
                     + _ranged_bands(adv.latency_choices, adv.latency_range))
        lo = max(ALPHA_LIMITS[0], inp.alpha - inp.alpha_band)
        hi = min(ALPHA_LIMITS[1], inp.alpha + inp.alpha_band)
        accept = f"{lo:g}-{hi:g} around the stated {inp.alpha:g}" if lo < hi else f"{inp.alpha:g}"
        lines.append(f"  (each with the range its inputs allow: chain acceptance {accept}, and the model's held-out "
                     f"error, every speculative setting's speedup x {1 - inp.model_error:g}-{1 + inp.model_error:g} "
                     "(docs/SIMULATOR.md \"Held-out evidence\"), the widest of a band's levels; "
                     f"Nx = the setting's throughput, or for latency its speed per token, over the TP{g} baseline's; "
                     "\"uncertain: X or Y\" where the winner changes inside that range)")
    elif spec_ok:
        lines.append("RUN (throughput): " + _bands(adv.best_tput))
        lines.append("RUN (latency, ms per output token of a running request): " + _bands(adv.best_latency))
    else:
        lines.append(f"RUN: TP{g} baseline at every load (no speculative server fits: "
                     f"{fits[memory.TP_EAGLE3].reason})")
    if not adv.alpha_sweep:
        return "\n".join(lines)
    lo, mid, hi = sorted(adv.alpha_sweep)
    lines.append(f"chain acceptance is an assumption; the throughput verdict at per-token acceptance {lo:g} / "
                 f"{mid:g} / {hi:g} (chain3 accepts {stepcost.chain_accept_length(3, lo):.2f} / "
                 f"{stepcost.chain_accept_length(3, mid):.2f} / {stepcost.chain_accept_length(3, hi):.2f}):")
    for a in (lo, mid, hi):
        lines.append(f"  {a:g}: {_bands(adv.alpha_sweep[a])}")
    lines.append("")
    lines += _split_lines(adv)
    return "\n".join(lines)


def _label(choices: tuple[str, ...], span: tuple[float, float]) -> str:
    """`adaptive 2.1-3.4x`, or `uncertain: chain4 1.2-1.9x or chain3`: the range is the first-named setting's."""
    lo, hi = f"{span[0]:.2f}", f"{span[1]:.2f}"
    first = choices[0] if choices[0] == "baseline" else f"{choices[0]} {lo}x" if lo == hi else f"{choices[0]} {lo}-{hi}x"
    if len(choices) == 1:
        return first
    return "uncertain: " + ", ".join([first, *choices[1:-1]]) + f" or {choices[-1]}"


def _ranged_bands(choices: dict[int, tuple[str, ...]], span: dict[int, tuple[float, float]]) -> str:
    """Adjacent levels with the same choices in one band, its range the widest of theirs."""
    parts: list[tuple[list[int], tuple[str, ...]]] = []
    for c, ch in choices.items():
        if parts and parts[-1][1] == ch:
            parts[-1][0].append(c)
        else:
            parts.append(([c], ch))
    out = []
    for cs, ch in parts:
        band = (min(span[c][0] for c in cs), max(span[c][1] for c in cs))
        out.append(f"c={cs[0]}" + (f"-{cs[-1]}" if len(cs) > 1 else "") + ": " + _label(ch, band))
    return "; ".join(out)


def _pick(name: str, spec_ok: bool) -> str:
    return name if spec_ok or name == "baseline" else "baseline"


def _split_lines(adv: Advice) -> list[str]:
    inp, fits = adv.inputs, adv.fits
    g, half = inp.hw.gpus, inp.hw.gpus // 2
    out = []
    split_fit = fits[memory.SPLIT]
    if not adv.breakeven:
        return out
    levels = list(adv.breakeven)
    r = adv.tp4_ratio
    won = [c for c in levels if adv.split[c] >= adv.tput["baseline"][c] * (1 + NOISE)]
    tail = f"; measure one TP{half} server with `spec-bench sweep` to know"
    moot = "" if split_fit.fits else f" (moot here: {split_fit.reason})"
    if won and won == levels[len(levels) - len(won):] and len(won) < len(levels):
        n = won[0]
        head = (f"break-even: the split beats TP{g} baseline at c >= {n} if a TP{half} server's step is within "
                f"{min(adv.breakeven[c] for c in won):.2f}x of TP{g}")
    elif won and won == levels[:len(won)]:
        n = won[-1]
        head = (f"break-even: the split beats TP{g} baseline at c <= {n} if a TP{half} server's step is within "
                f"{min(adv.breakeven[c] for c in won):.2f}x of TP{g}")
    elif won:
        head = (f"break-even: the split beats TP{g} baseline at c={','.join(map(str, won))} if a TP{half} "
                f"server's step is within {min(adv.breakeven[c] for c in won):.2f}x of TP{g}")
    else:
        best = max(levels, key=adv.breakeven.__getitem__)
        head = (f"break-even: the split beats TP{g} baseline nowhere at the predicted ratio; at c={best}, its best "
                f"level, only if a TP{half} server's step is within {adv.breakeven[best]:.2f}x of TP{g}")
    out.append(head + tail + moot)
    out.append(f"  predicted TP{half} step / TP{g} step = {r:.2f}x ({adv.tp4_ratio_source}); the split "
               f"(a router placing each request as well as possible between its two servers) needs: "
               + ", ".join(f"c={c} {adv.breakeven[c]:.2f}x" for c in levels))
    if adv.colocated:
        ratio = [adv.colocated[c] / adv.tput["baseline"][c] for c in levels]
        out.append(f"  co-located pair ({fits[memory.COLOCATED].reason.split(': ', 1)[-1]}), global routing: "
                   f"{min(ratio):.2f}-{max(ratio):.2f}x of TP{g} baseline (interleaving cost left out)")
    return out


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)) for r in rows]


def advice_json(adv: Advice) -> dict:
    return {"memory": {n: f.as_dict() for n, f in adv.fits.items()}, "why": adv.why,
            "throughput": {n: {str(c): v for c, v in d.items()} for n, d in adv.tput.items()},
            "ms_per_token": {n: {str(c): v for c, v in d.items()} for n, d in adv.tpot.items()},
            "run_throughput": {str(c): n for c, n in adv.best_tput.items()},
            "run_latency": {str(c): n for c, n in adv.best_latency.items()},
            "run_throughput_choices": {str(c): list(ch) for c, ch in adv.tput_choices.items()},
            "run_throughput_range": {str(c): list(r) for c, r in adv.tput_range.items()},
            "run_latency_choices": {str(c): list(ch) for c, ch in adv.latency_choices.items()},
            "run_latency_range": {str(c): list(r) for c, r in adv.latency_range.items()},
            "adaptive_steps": {str(c): k for c, k in adv.adaptive_choice.items()},
            "alpha_sweep": {str(a): {str(c): n for c, n in d.items()} for a, d in adv.alpha_sweep.items()},
            "split_breakeven_ratio": {str(c): v for c, v in adv.breakeven.items()},
            "split_throughput": {str(c): v for c, v in adv.split.items()}, "tp4_step_ratio": adv.tp4_ratio,
            "colocated_throughput": {str(c): v for c, v in adv.colocated.items()}}
