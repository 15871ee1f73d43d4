"""What learning costs at one client on the llama.cpp pair's measured requests (the pure policy, no servers).

One client: every decision sees both engines idle; the chosen engine serves one of the 36 prompts measured in
bench/results/adaptive/engine-scatter.txt (its seconds per token and time to first token there, times a 0.04 log-sd
draw: the same prompt twice), 24 tokens. The speculative engine's decode is slowed by SLOW; at 1.4 it is 0.84x the
baseline alone on the set, as the judges measured the real pair (0.82-0.84). Before the judged requests,
the judge's warm-up as it ran there: 8 requests at one client, then 14 at two (one on each engine, so each sample
is one running alone), or none (cold).

Each run's throughput is over that of the better single engine on the same prompts (no host noise, no draw of
prompts between configurations: what routing alone costs). Per learner, over 200 seeds: the mean, the 10th
percentile, the worst, and how many runs fell below 0.95. Learners: adaptive as built; adaptive
without exploration (explore 0: the models alone); a textbook Thompson sampler (per engine, a normal posterior on
log seconds per request from the same samples, warm-up included); and, after a warm-up, adaptive with one of
its exploration constants moved (VARIANTS).
Run: .venv/bin/python bench/results/adaptive/explore-replay.py > bench/results/adaptive/explore-replay.txt"""
import dataclasses
import math
import random
import statistics

from router.adaptive import Adaptive
from router.observe import Observation
from router.policy import BackendLoad, View, decide
from router.tuning import DEFAULT

S, B = "http://s:1", "http://b:1"
SPEC, BASE = "speculative", "baseline"
TOKENS = 24
SEEDS = 200
ROWS = [list(map(float, line.split())) for line in open("bench/results/adaptive/engine-scatter.txt")
        if line[:1].isdigit()]  # i prompt_tokens tokens spec_s/tok base_s/tok spec_ttft base_ttft


def serve(pool: str, row: list, slow: float, rng: random.Random | None) -> tuple[float, float]:
    s_tok, ttft = (row[3], row[5]) if pool == SPEC else (row[4], row[6])
    dur = s_tok * TOKENS
    decode = (dur - ttft) * (slow if pool == SPEC else 1.0)
    k = 1.0 if rng is None else math.exp(rng.gauss(0, 0.04))
    return (ttft + decode) * k, ttft * k


class Router:
    """The router's policy: adaptive as built, or with explore 0, or with some of its exploration figures set
    (router.tuning.Tuning's fields, passed in)."""

    def __init__(self, rng: random.Random, explore: bool, **fields: float) -> None:
        tuning = dataclasses.replace(DEFAULT, **fields)
        self.rng = rng
        self.pol = Adaptive(tuning=tuning) if explore else Adaptive(explore=0.0, tuning=tuning)

    def pick(self) -> tuple[str, str]:
        d = decide(self.pol, View.of([BackendLoad(S, SPEC, 0, True), BackendLoad(B, BASE, 0, True)]), None, self.rng)
        return d.pool, d.reason

    def fold(self, pool: str, row: list, dur: float, ttft: float) -> None:
        self.pol.observe(Observation(pool, S if pool == SPEC else B, 1, 1, dur, ttft, None, TOKENS, True,
                                     data_events=TOKENS + 1, estimated_prompt_tokens=int(row[1])))


class Thompson:
    """Textbook Thompson sampling: per engine, log seconds per request, N(mean, sd^2 / n); an engine with fewer
    than two samples is tried first."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.logs = rng, {SPEC: [], BASE: []}

    def pick(self) -> tuple[str, str]:
        for pool, xs in self.logs.items():
            if len(xs) < 2:
                return pool, "try"
        draw = {p: self.rng.gauss(statistics.mean(xs), max(statistics.stdev(xs), 0.05) / math.sqrt(len(xs)))
                for p, xs in self.logs.items()}
        return min(draw, key=draw.get), "draw"

    def fold(self, pool: str, row: list, dur: float, ttft: float) -> None:
        self.logs[pool].append(math.log(dur))


LEARNERS = {"adaptive (as built)": lambda rng: Router(rng, True),
            "adaptive, explore 0": lambda rng: Router(rng, False),
            "textbook Thompson": Thompson}
# Exploration's constants moved one at a time (warm-up runs only): no random exploration of an unfed pool at any
# load (FRESH), half the cap on the chance explored at light load, half the light-load samples that end it.
VARIANTS = {"no random exploration": lambda rng: Router(rng, True, fresh=10**9),
            "chance cap 0.25": lambda rng: Router(rng, True, low_load_explore=0.25),
            "light samples cap 16": lambda rng: Router(rng, True, max_low_load_samples=16)}


def run(make, seed: int, slow: float, n: int, warm: bool) -> tuple[float, int, int]:
    rng = random.Random(seed)
    r = make(rng)

    def serve_one(pool: str) -> tuple[list, float]:
        row = rng.choice(ROWS)
        dur, ttft = serve(pool, row, slow, rng)
        r.fold(pool, row, dur, ttft)
        return row, dur

    if warm:
        for _ in range(8):
            serve_one(r.pick()[0])
        for i in range(14):
            serve_one(SPEC if i % 2 else BASE)
    spent = alone_s = alone_b = 0.0
    sent = explored = 0
    for _ in range(n):
        pool, reason = r.pick()
        row, dur = serve_one(pool)
        spent += dur
        alone_s += serve(SPEC, row, slow, None)[0]
        alone_b += serve(BASE, row, slow, None)[0]
        sent += pool == SPEC
        explored += reason == "explore"
    return min(alone_s, alone_b) / spent, sent, explored


def main() -> None:
    for slow in (1.4, 1.2, 1.0, 0.8, 0.6):
        tb = sum(serve(BASE, row, slow, None)[0] for row in ROWS)
        ts = sum(serve(SPEC, row, slow, None)[0] for row in ROWS)
        print(f"speculative decode x{slow:.1f}: the speculative engine alone {tb / ts:.2f}x the baseline on the set")
        for warm in (True, False):
            for n in (48, 96):
                for name, make in {**LEARNERS, **(VARIANTS if warm else {})}.items():
                    got = [run(make, seed, slow, n, warm) for seed in range(SEEDS)]
                    xs = sorted(g[0] for g in got)
                    print(f"  {'warm-up 8+14' if warm else 'cold'}, {n} requests, {name:21s}: "
                          f"mean {statistics.mean(xs):.3f}, p10 {xs[SEEDS // 10]:.3f}, worst {xs[0]:.3f}, "
                          f"below 0.95 in {sum(x < 0.95 for x in xs):3d} of {SEEDS}; "
                          f"sent to speculative {statistics.mean(g[1] for g in got):5.1f} "
                          f"(explorations {statistics.mean(g[2] for g in got):.1f})")


if __name__ == "__main__":
    main()
