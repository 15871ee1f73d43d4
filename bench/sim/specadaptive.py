"""SGLang's --speculative-adaptive controller as the simulator runs it: the per-batch-size slots, their EMA rule, and
the `--speculative-adaptive-config` JSON file (python/sglang/srt/speculative/adaptive_spec_params.py)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

from bench.sim.profiles import read_json_file

# SGLang's DEFAULT_ADAPTIVE_CONFIG: batch-size lower bound -> the draft step counts that slot may run (0: no
# drafting; the draft model still runs its extend pass) and its hysteresis. Knobs not given take the slot
# defaults below, as SGLang's AdaptiveStepSlot does.
DEFAULT_CONFIG: dict = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
SLOT_DEFAULTS = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
                 "up_hysteresis": 0.0, "ceiling_coeff": 0}


class AdaptiveConfigError(ValueError):
    """A config file the controller cannot use; the message is one line for the CLI."""


def load_config(path: str | Path | None) -> dict:
    """SGLang's adaptive config: a JSON object whose integer-string keys are batch-size lower bounds, each with
    `candidate_steps` (non-negative ints) and optional knobs; other keys are knobs for every slot. None: the default."""
    if path is None:
        return DEFAULT_CONFIG
    path = Path(path)
    cfg = read_json_file(path, "adaptive config", AdaptiveConfigError)
    check_config(cfg, str(path))
    return cfg


def check_config(cfg, where: str = "adaptive config") -> None:
    """SGLang's validation (_load_adaptive_config, resolve_adaptive_strategy), one line per failure."""
    if not isinstance(cfg, dict):
        raise AdaptiveConfigError(f"{where}: speculative adaptive config must be a JSON object, "
                                  f"got {type(cfg).__name__}")
    strategy = cfg.get("strategy", "ema")
    if strategy == "throughput_aware":
        # SGLang profiles synthetic batches at startup for it; nothing here measures that, so it is refused
        raise AdaptiveConfigError(f"{where}: strategy 'throughput_aware' is not simulated (only 'ema', SGLang's "
                                  "default)")
    if strategy != "ema":
        raise AdaptiveConfigError(f"{where}: 'strategy' must be 'ema' or 'throughput_aware', got {strategy!r}")
    slots = 0
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if (not isinstance(steps, list) or not steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)):
            raise AdaptiveConfigError(f"{where}: BS {key}: candidate_steps must be a list of non-negative ints, "
                                      f"got {steps!r}")
        slots += 1
    if not slots:
        raise AdaptiveConfigError(f'{where}: needs at least one integer-string BS key, e.g. '
                                  f'{{"1": {{"candidate_steps": [1,3,7]}}}}; got keys {list(cfg)}')
    for key in ("ema_alpha", "update_interval", "warmup_batches"):
        for entry in [cfg] + [e for k, e in cfg.items() if k.isdigit()]:
            value = entry.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise AdaptiveConfigError(f"{where}: {key} must be a non-negative number, got {value!r}")


def candidate_steps(cfg: dict) -> list[int]:
    """Union of every slot's candidate steps (SGLang sizes its buffers, here: the step curves a profile needs)."""
    return sorted({s for k, e in cfg.items() if k.isdigit() for s in e["candidate_steps"]})


def initial_steps(cfg: dict) -> int:
    """SGLang's speculative_num_steps when --speculative-num-steps is not given: the middle of the union."""
    steps = candidate_steps(cfg)
    return steps[len(steps) // 2]


def check_profile(cfg: dict | None, profile) -> None:
    """ValueError (one line) unless the profile is adaptive and has a step curve for every candidate step."""
    if not profile.speculative_adaptive:
        if cfg is not None:
            raise AdaptiveConfigError(f"--speculative-adaptive-config needs an adaptive profile; {profile.name} is "
                                      "not one (e.g. adaptive-tp8)")
        return
    have = sorted(profile.adaptive_step_points_ms or {})
    missing = sorted(set(candidate_steps(DEFAULT_CONFIG if cfg is None else cfg)) - set(have))
    if missing:
        raise AdaptiveConfigError(f"profile {profile.name} has no step curve for {missing} draft steps, which the "
                                  f"adaptive config allows (it has {have})")


class Slot:
    """One batch-size slot (SGLang's AdaptiveStepSlot): an EMA of accepted drafts per request, and every
    `update_interval` batches after `warmup_batches` a step count from it: drop while the EMA is at or below the
    next lower candidate - 0.5 (0.5 when that candidate is 0) + down_hysteresis, else rise while it is above
    the current candidate - 0.5 + up_hysteresis; a slot at 0 probes the next candidate up."""

    def __init__(self, initial: int, cfg: dict) -> None:
        knobs = SLOT_DEFAULTS | {k: v for k, v in cfg.items() if k in SLOT_DEFAULTS}
        self.candidates = sorted(set(cfg["candidate_steps"]))
        self.ema_alpha = float(knobs["ema_alpha"])
        self.update_interval = max(1, int(knobs["update_interval"]))
        self.warmup_batches = int(knobs["warmup_batches"])
        self.down_hysteresis = float(knobs["down_hysteresis"])
        self.up_hysteresis = float(knobs["up_hysteresis"])
        self.ceiling_coeff = float(knobs["ceiling_coeff"])
        self.current = initial if initial in self.candidates else self.candidates[len(self.candidates) // 2]
        self.ema = float(self.current - 1)
        self.batches = 0
        self.changes = 0

    def update(self, accepted_drafts: list[int]) -> bool:
        if not accepted_drafts:
            return False
        if self.current > 0:
            mean = sum(accepted_drafts) / len(accepted_drafts)
            self.ema = (1 - self.ema_alpha) * self.ema + self.ema_alpha * mean
        self.batches += 1
        if self.batches <= self.warmup_batches or (self.batches - self.warmup_batches) % self.update_interval:
            return False
        return self._recompute()

    def _recompute(self) -> bool:
        old = self.current
        idx = start = self.candidates.index(old)
        if old == 0:
            idx = min(idx + 1, len(self.candidates) - 1)
            target = self.candidates[idx]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            return self._apply(target)
        while idx > 0:
            prev = self.candidates[idx - 1]
            drop = (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis
            if self.ema <= drop:
                idx -= 1
            else:
                break
        if idx == start:
            while idx < len(self.candidates) - 1 and self.ema > self.candidates[idx] - 0.5 + self.up_hysteresis:
                idx += 1
        target = self.candidates[idx]
        if self.ceiling_coeff > 0:
            import math

            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            if ceiling < target <= old:
                while idx > 0 and self.candidates[idx] > ceiling:
                    idx -= 1
                target = self.candidates[idx]
        return self._apply(target)

    def _apply(self, target: int) -> bool:
        if target == self.current:
            return False
        self.current = target
        self.changes += 1
        return True


@dataclass(frozen=True)
class Decision:
    slot: int  # the slot's batch-size key
    steps: int


class Controller:
    """Routes a batch size to its slot (the largest key at or below it; SGLang also pads to a CUDA-graph batch
    size first, which the simulator does not model) and feeds that slot each verify's accepted drafts."""

    def __init__(self, cfg: dict | None = None, initial: int | None = None) -> None:
        cfg = DEFAULT_CONFIG if cfg is None else cfg
        check_config(cfg)
        common = {k: v for k, v in cfg.items() if not k.isdigit()}
        self.config = cfg
        self.initial = initial_steps(cfg) if initial is None else initial
        self.slots = {int(k): Slot(self.initial, common | e) for k, e in sorted(cfg.items(), key=lambda kv: (
            not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)) if k.isdigit()}
        self._keys = sorted(self.slots)

    @property
    def candidate_steps(self) -> list[int]:
        return candidate_steps(self.config)

    def slot_key(self, batch: int) -> int:
        return self._keys[max(0, bisect.bisect_right(self._keys, batch) - 1)]

    def allowed(self, batch: int) -> list[int]:
        return self.slots[self.slot_key(batch)].candidates

    def steps_for(self, batch: int) -> int:
        return self.slots[self.slot_key(batch)].current

    def observe(self, batch: int, accepted_drafts: list[int]) -> None:
        self.slots[self.slot_key(batch)].update(accepted_drafts)

    def state(self) -> dict:
        return {str(k): {"candidate_steps": s.candidates, "steps": s.current, "ema_accept_len": round(s.ema, 4),
                         "batches": s.batches, "changes": s.changes} for k, s in self.slots.items()}
