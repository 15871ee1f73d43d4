"""The five deployments of one box that `bench demo` runs: their names, each server's profile, which do not fit."""

from __future__ import annotations

from bench.cli import ArgError

SPLIT, COLOCATED, TP8_BASE, TP8_SPEC = "split+balanced", "colocated+global", "tp8-baseline", "tp8-eagle3"
TP8_ADAPTIVE = "tp8-adaptive"
# the built-in (fitted) families' adaptive twin: the same drafter as a topk-1 chain (bench.sim.stepcost)
ADAPTIVE_OF = {"eagle3": "adaptive-tp8", "eagle3-good": "adaptive-good-tp8"}
# --preset: the step-cost model's settings for each drafter (the seed's tree; the better drafter as a 3-step chain)
PRESET_SETTINGS = {"eagle3": ("tree", "adaptive"), "eagle3-good": ("chain3-good", "adaptive-good")}


def profiles(ns) -> tuple[dict[str, str], dict[str, str]]:
    """The profile of each server, and {deployment kind: why it does not fit} (bench.sim.memory)."""
    from bench.sim import memory, presets, stepcost

    if ns.preset:
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
