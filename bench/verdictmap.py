"""The verdict map's cells (docs/BENCH.md, "The verdict map"): each committed simulator run's winner per level, with
the range its inputs allow and "uncertain: X or Y" where the winner changes inside it. The runs (demo JSON in
bench/results/verdict/) give the nominal figures; the ranges come from the planner's model (bench.planmodel, the
range `spec-bench plan` gives its recommendations: chain acceptance +- its band, every deployment but the baseline
x the model's held-out error either way), applied to each run's figures as the model's relative change, since
rerunning every cell at every point of the range would take hours of simulator time.
`bench/results/verdict_table.py` prints both tables as docs/BENCH.md carries them (pure but for reading the runs)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench import planmodel
from bench.sim import memory, presets, stepcost

RUNS = Path(__file__).resolve().parent / "results" / "verdict"
LEVELS = (1, 4, 16, 64)  # the runs' concurrency levels (bench/results/verdict_map.sh)
MAX_TOKENS, PROMPT_TOKENS = 256, 23.0  # the runs' workload: spec-bench demo's seed-style requests
# a run's deployment -> the planner's name for it
KINDS = {"tp8-baseline": "baseline", "tp8-eagle3": "eagle3", "tp8-adaptive": "adaptive", "split+balanced": "split",
         "colocated+global": "colocated"}
UNFIT = {"split": "split", "colocated": "colocated"}  # a run's `unfit` key -> the deployment it rules out
SHORT = {"baseline": "baseline", "eagle3": "EAGLE-3", "adaptive": "adaptive", "split": "split",
         "colocated": "co-located"}
LONG = {"baseline": "TP8 baseline", "eagle3": "TP8 EAGLE-3", "adaptive": "TP8 adaptive", "split": "split + router",
        "colocated": "co-located"}


@dataclass(frozen=True)
class Row:
    run: str  # the committed run: demo-{run}.json in bench/results/verdict/
    box: str
    model: str
    drafter: str
    preset: str  # the step-cost box whose model gives the range
    eagle3: str  # the static EAGLE-3 server's setting in the model: `tree` (the seed's) or `chain3` (the better one)
    alpha: float  # the chain acceptance the run assumed (adaptive; and chain3's)
    spec_cap: int = stepcost.EAGLE_DEFAULT_MAX_RUNNING
    also: tuple[str, ...] = ()  # deployments whose figure a cell adds when they do not win


H200 = "H200, NVLink (Hopper step measured on one H100)"
KIMI, LLAMA = "Kimi K2.5: TP8 only", "Llama-70B: all five"
SEED_A, GOOD_A, LOW_A = stepcost.CHAIN_ALPHA, stepcost.GOOD_CHAIN_ALPHA, 0.55
CAP = "TP8 speculative servers capped at 64 (`--speculative-cap 64`)"
XK = "the 0-step extend pass at its low-end cost (`PRESET.adaptive-good-xk-tp8`)"
MAP = (
    Row("seed-fitted-eagle3", "RTX PRO 6000, PCIe, fitted", KIMI, "seed", "seed", "tree", SEED_A),
    Row("seed-fitted-eagle3-good", "RTX PRO 6000, PCIe, fitted", KIMI, "good", "seed", "chain3", GOOD_A),
    Row("seed-eagle3", "RTX PRO 6000, PCIe, `--preset seed`", KIMI, "seed", "seed", "tree", SEED_A),
    Row("seed-adaptive-a55", "same, chain acceptance 0.55", KIMI, "seed", "seed", "tree", LOW_A),
    Row("seed-eagle3-good", "RTX PRO 6000, PCIe, `--preset seed`", KIMI, "good", "seed", "chain3", GOOD_A),
    Row("kimi-k25-h200-nvlink-eagle3", f"{H200}, `--preset kimi-k25-h200-nvlink`", KIMI, "seed",
        "kimi-k25-h200-nvlink", "tree", SEED_A),
    Row("kimi-k25-h200-nvlink-adaptive-a55", "same, chain acceptance 0.55", KIMI, "seed", "kimi-k25-h200-nvlink",
        "tree", LOW_A),
    Row("kimi-k25-h200-nvlink-eagle3-good", f"{H200}, `--preset kimi-k25-h200-nvlink`", KIMI, "good",
        "kimi-k25-h200-nvlink", "chain3", GOOD_A),
    Row("compose-eagle3", "RTX PRO 6000, PCIe, `--preset compose`", LLAMA, "seed", "compose", "tree", SEED_A),
    Row("compose-eagle3-good", "RTX PRO 6000, PCIe, `--preset compose`", LLAMA, "good", "compose", "chain3", GOOD_A,
        also=("split",)),
    Row("llama70b-h200-nvlink-eagle3", f"{H200}, `--preset llama70b-h200-nvlink`", LLAMA, "seed",
        "llama70b-h200-nvlink", "tree", SEED_A, also=("split",)),
    Row("llama70b-h200-nvlink-eagle3-good", f"{H200}, `--preset llama70b-h200-nvlink`", LLAMA, "good",
        "llama70b-h200-nvlink", "chain3", GOOD_A, also=("split",)),
    Row("compose-eagle3-good-cap64", f"the PCIe Llama row, good drafter, {CAP}", LLAMA, "good", "compose", "chain3",
        GOOD_A, 64, also=("split", "adaptive")),
    Row("llama70b-h200-nvlink-eagle3-good-cap64", f"the H200 Llama row, good drafter, {CAP}", LLAMA, "good",
        "llama70b-h200-nvlink", "chain3", GOOD_A, 64, also=("split", "adaptive")),
    Row("compose-eagle3-good-cap64-xk", f"the PCIe capped row, {XK}", LLAMA, "good", "compose", "chain3", GOOD_A,
        64, also=("split", "adaptive")),
    Row("llama70b-h200-nvlink-eagle3-good-cap64-xk", f"the H200 capped row, {XK}", LLAMA, "good",
        "llama70b-h200-nvlink", "chain3", GOOD_A, 64, also=("split", "adaptive")),
)
PCIE8, H2008 = "8x RTX PRO 6000, PCIe", f"8x {H200}"
KIMI8, LLAMA8 = "Kimi K2.5: the three TP8 only", "Llama-3.3-70B: all five"
# the summary at the top of the section: (run, box, model, drafter) at 1, 16 and 64 clients
SUMMARY = (
    ("seed-eagle3", PCIE8, KIMI8, "seed, topk-1 chain accepts 0.7"),
    ("seed-adaptive-a55", PCIE8, KIMI8, "seed, chain accepts 0.55"),
    ("seed-eagle3-good", PCIE8, KIMI8, "better drafter"),
    ("kimi-k25-h200-nvlink-eagle3", H2008, KIMI8, "seed, 0.7"),
    ("compose-eagle3", PCIE8, LLAMA8, "seed"),
    ("compose-eagle3-good", PCIE8, LLAMA8, "better drafter"),
    ("llama70b-h200-nvlink-eagle3-good", H2008, LLAMA8, "better drafter"),
)
SUMMARY_LEVELS = (1, 16, 64)


@dataclass
class Cell:
    tied: tuple[str, ...]  # the run's winner and every deployment within the noise band of it, best first
    figures: dict[str, float]  # the run's throughput over its baseline's, every deployment that fits
    span: tuple[float, float] | None  # the named deployment's range (the first of `tied` that is not the baseline)
    others: tuple[str, ...]  # who else wins somewhere inside the range ("uncertain" when any)

    def label(self, names: dict[str, str], also: tuple[str, ...] = ()) -> str:
        parts = []
        for n in self.tied:
            if self.span is not None and n == next(m for m in self.tied if m != "baseline"):
                lo, hi = self.span
                parts.append(f"{names[n]} {self.figures[n]:.2f}x ({lo:.2f}-{hi:.2f}x)")
            else:
                parts.append(names[n])
        text = " = ".join(parts)
        if self.others:
            rest = [names[n] for n in self.others]
            text = "uncertain: " + ", ".join([text, *rest[:-1]]) + f" or {rest[-1]}"
        extra = [f"{names[n]} {self.figures[n]:.2f}x" for n in also
                 if n in self.figures and n not in self.tied and n not in self.others]
        return "; ".join([text, *extra])


def cell(figures: dict[str, float], points: list[dict[str, float]]) -> Cell:
    """One level of one run. `figures`: each deployment's throughput over the baseline's in the run (those that
    fit); `points`: the planner's figures (same names, over its baseline) at every point of the range, the nominal
    point first. At each point a run's figure moves by the model's relative change; the point's winner is plan's
    (planmodel.winners: the baseline unless a deployment beats it by the noise band)."""
    top = max(figures.values())
    tied = tuple(sorted((n for n, v in figures.items() if v >= top * (1 - planmodel.NOISE)),
                        key=lambda n: -figures[n]))
    nominal = points[0]
    moved = [{n: figures[n] * p[n] / nominal[n] for n in figures} for p in points]
    named = next((n for n in tied if n != "baseline"), None)
    span = None if named is None else (min(m[named] for m in moved), max(m[named] for m in moved))
    others: list[str] = []
    for m in moved:
        win = planmodel.winners({n: {0: v} for n, v in m.items()}, (0,))[0]
        if win not in tied and win not in others:
            others.append(win)
    others.sort(key=lambda n: -figures[n])
    return Cell(tied, figures, span, tuple(others))


def row_cells(row: Row, runs: Path = RUNS) -> dict[int, Cell]:
    """Every level's cell of one committed run, its range from the planner's model of the row's box."""
    d = json.loads((runs / f"demo-{row.run}.json").read_text(encoding="utf-8"))
    unfit = {UNFIT[k] for k in d.get("unfit") or {} if k in UNFIT}
    res = {KINDS[k]: v for k, v in d["results"].items() if k in KINDS and KINDS[k] not in unfit}
    box = presets.box(row.preset)
    inp = planmodel.Inputs(box=box, model=stepcost.memory_model(box.shape),
                           hw=memory.Hardware(box.gpus, box.gpu.memory_gib), levels=LEVELS, max_tokens=MAX_TOKENS,
                           prompt_tokens=PROMPT_TOKENS, alpha=row.alpha, spec_cap=row.spec_cap)
    spans = planmodel.deployment_ranges(inp, row.eagle3)
    out = {}
    for i, c in enumerate(LEVELS):
        tput = {n: f[i]["output_throughput"] for n, f in res.items() if i < len(f) and f[i].get("completed")}
        figures = {n: v / tput["baseline"] for n, v in tput.items()}
        out[c] = cell(figures, [{n: p[n][c] for n in figures} for p in spans])
    return out


def map_table(runs: Path = RUNS) -> list[str]:
    lines = ["| box (TP scaling) | model: what fits | drafter | 1 client | 4 | 16 | 64 |",
             "|---|---|---|---|---|---|---|"]
    for row in MAP:
        cells = row_cells(row, runs)
        lines.append(f"| {row.box} | {row.model} | {row.drafter} | "
                     + " | ".join(cells[c].label(SHORT, row.also) for c in LEVELS) + " |")
    return lines


def summary_table(runs: Path = RUNS) -> list[str]:
    rows = {r.run: r for r in MAP}
    lines = ["| box | model: deployments that fit | drafter (assumption) | 1 client | 16 | 64 |",
             "|---|---|---|---|---|---|"]
    for run, box, model, drafter in SUMMARY:
        cells = row_cells(rows[run], runs)
        lines.append(f"| {box} | {model} | {drafter} | "
                     + " | ".join(cells[c].label(LONG) for c in SUMMARY_LEVELS) + " |")
    return lines

