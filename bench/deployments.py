"""The five deployments of one box that `spec-bench demo` runs: their names, each server's profile, which do not
fit, and the demo's default box."""

from __future__ import annotations

from bench.cli import ArgError

SPLIT, COLOCATED, TP8_BASE, TP8_SPEC = "split+balanced", "colocated+global", "tp8-baseline", "tp8-eagle3"
TP8_ADAPTIVE = "tp8-adaptive"
# the built-in (fitted) families' adaptive twin: the same drafter as a topk-1 chain (bench.sim.stepcost)
ADAPTIVE_OF = {"eagle3": "adaptive-tp8", "eagle3-good": "adaptive-good-tp8"}
# The demo's default: Llama-3.3-70B on the seed's box (the docker-compose default), where every deployment fits, so
# the first run shows where the router's deployments pay; the better drafter (a 3-step chain accepting 0.7 per
# token, an assumption) because with the seed's tree the router's deployments win no load there.
DEFAULT_PRESET, DEFAULT_DRAFTER = "compose", "eagle3-good"
# What each preset drafter is, said in the demo's first lines (the router's case rests on it).
DRAFTER_TEXT = {"eagle3": "the seed's EAGLE-3 tree (accept length 2.5, measured)",
                "eagle3-good": "a better drafter (a 3-step chain accepting 0.7 per token: an assumption)"}
# --preset fitted: the built-in profiles fitted to the seed's measured rows (Kimi K2.5 on 8 x RTX PRO 6000)
FITTED = "fitted"
# --preset: the step-cost model's settings for each drafter (the seed's tree; the better drafter as a 3-step chain)
PRESET_SETTINGS = {"eagle3": ("tree", "adaptive"), "eagle3-good": ("chain3-good", "adaptive-good")}


def profiles(ns) -> tuple[dict[str, str], dict[str, str]]:
    """The profile of each server, and {deployment kind: why it does not fit} (bench.sim.memory)."""
    from bench.sim import memory, presets, stepcost

    if ns.preset and ns.preset != FITTED:
        if ns.drafter not in PRESET_SETTINGS:
            raise ArgError(f"--drafter with --preset: one of {', '.join(PRESET_SETTINGS)}, got {ns.drafter!r}")
        try:
            box = presets.box(ns.preset)
        except stepcost.ShapeError as exc:
            raise ArgError(str(exc)) from None
        spec, adaptive = PRESET_SETTINGS[ns.drafter]
        half = box.gpus // 2
        prof = {"spec8": f"{ns.preset}.{spec}-tp{box.gpus}", "spec4": ns.split_profile or f"{ns.preset}.{spec}-tp{half}",
                "base8": f"{ns.preset}.baseline-tp{box.gpus}", "base4": f"{ns.preset}.baseline-tp{half}",
                "adaptive": ns.adaptive_profile or f"{ns.preset}.{adaptive}-tp{box.gpus}"}
        fits = memory.fit_all(stepcost.memory_model(box.shape), memory.Hardware(box.gpus, box.gpu.memory_gib))
    else:
        prof = {"spec8": f"{ns.drafter}-tp8", "spec4": ns.split_profile or f"{ns.drafter}-tp4",
                "base8": f"{ns.baseline}-tp8", "base4": f"{ns.baseline}-tp4",
                "adaptive": ns.adaptive_profile or ADAPTIVE_OF.get(ns.drafter, "adaptive-tp8")}
        # the built-in profiles are Kimi K2.5 on 8 x RTX PRO 6000 (96 GB): the seed's box
        fits = memory.fit_all(memory.KIMI_K25, memory.SEED_BOX)
    unfit = {kind: fits[kind].reason for kind in (memory.SPLIT, memory.COLOCATED) if not fits[kind].fits}
    return prof, unfit


def where_it_does_not_fit() -> str:
    """One line: the model on the seed's box where the router's deployments do not fit (bench.sim.memory)."""
    from bench.sim import memory

    fits = memory.fit_all(memory.KIMI_K25, memory.SEED_BOX)
    fitting = [k for k in memory.DEPLOYMENTS if fits[k].fits]
    if fitting == list(memory.DEPLOYMENTS):
        return ""
    what = ("only the TP8 servers" if set(fitting) == {memory.TP_BASELINE, memory.TP_EAGLE3, memory.TP_ADAPTIVE}
            else "only " + ", ".join(fitting))
    return (f"where the router does not fit: {memory.KIMI_K25.name} on the same box fits {what} "
            "(`spec-bench demo --preset seed`)")
