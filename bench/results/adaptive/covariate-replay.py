"""The prompt covariate on the pure policy, replayed on the llama.cpp pair's measured requests (no servers).

One client: every decision sees both backends idle; the chosen engine serves one prompt drawn at random from the 36
measured in bench/results/adaptive/engine-scatter.txt (its seconds per token and time to first token there, times a
0.04 log-sd draw: the same prompt twice), 24 tokens, and the router's prompt-size estimate (the table's tokens).
The speculative engine's decode (its time after the first token) is slowed by SLOW, as the judge's repeats found
it 0-13% slower alone than the baseline (the scatter table has them tied). Per block of 24 requests (a judge level
at 24): the share sent to the speculative engine and the throughput against all-baseline on the same prompts,
over 40 seeds: no covariate (COVARIATE_SAMPLES out of reach, MAX_EARLY 0), the covariate with samples folded at
once, and the covariate with MAX_EARLY 16 (recorded when the first samples waited for the covariate; they are now
folded unmoved and rebuilt once it is measured, so a rerun's third table differs).
It sets the policy's former module constants, which router.tuning.Tuning replaced (MAX_EARLY is now derived from
covariate_samples, so two of its modes cannot be expressed): it runs against the router before that change.
Run (from this checkout; the router of commit 1e79935, its results beside it):
  git worktree add /tmp/before-tuning 1e79935 && PYTHONPATH=/tmp/before-tuning .venv/bin/python \
  bench/results/adaptive/covariate-replay.py > bench/results/adaptive/covariate-replay.txt"""
import math
import random
import statistics

import router.adaptive as adaptive
from router.adaptive import Adaptive
from router.observe import Observation
from router.policy import BackendLoad, View, decide

S, B = "http://s:1", "http://b:1"
TOKENS = 24
ROWS = [list(map(float, line.split())) for line in open("bench/results/adaptive/engine-scatter.txt")
        if line[:1].isdigit()]  # i prompt_tokens tokens spec_s/tok base_s/tok spec_ttft base_ttft


def serve(pool: str, row: list, slow: float, rng: random.Random | None) -> tuple[float, float]:
    s_tok, ttft = (row[3], row[5]) if pool == "speculative" else (row[4], row[6])
    dur = s_tok * TOKENS
    decode = (dur - ttft) * (slow if pool == "speculative" else 1.0)
    k = 1.0 if rng is None else math.exp(rng.gauss(0, 0.04))
    return (ttft + decode) * k, ttft * k


def run(seed: int, slow: float, n: int) -> tuple[list[bool], float, float]:
    rng = random.Random(seed)
    pol = Adaptive()
    sent, t_spent, t_base = [], 0.0, 0.0
    for _ in range(n):
        v = View.of([BackendLoad(S, "speculative", 0, True), BackendLoad(B, "baseline", 0, True)])
        d = decide(pol, v, None, rng)
        row = rng.choice(ROWS)
        dur, ttft = serve(d.pool, row, slow, rng)
        t_spent += dur
        t_base += serve("baseline", row, slow, None)[0]
        pol.observe(Observation(d.pool, S if d.pool == "speculative" else B, 1, 1, dur, ttft, None, TOKENS,
                                True, data_events=TOKENS + 1, estimated_prompt_tokens=int(row[1])))
        sent.append(d.pool == "speculative")
    return sent, t_spent, t_base


MODES = {"no covariate": (10**9, 0), "covariate, samples folded at once": (8, 0),
         "covariate, MAX_EARLY 16": (8, 16)}


def table(slow: float, mode: str, n: int = 96, seeds: int = 40) -> None:
    adaptive.COVARIATE_SAMPLES, adaptive.MAX_EARLY = MODES[mode]
    runs = [run(s, slow, n) for s in range(seeds)]
    print(f"speculative decode x{slow:.2f}, {mode}: share sent to the speculative "
          f"engine per 24 requests, mean over {seeds} seeds (and the worst seed)")
    for lo in range(0, n, 24):
        shares = [sum(r[0][lo:lo + 24]) / 24 for r in runs]
        print(f"  requests {lo + 1:3d}-{lo + 24:3d}: {statistics.mean(shares):5.1%} (worst {max(shares):5.1%})")
    speed = [r[2] / r[1] for r in runs]
    print(f"  all {n}: throughput / all-baseline's on the same prompts: mean {statistics.mean(speed):.3f}, "
          f"min {min(speed):.3f}")


def alone(pool: str, mode: str, slow: float = 1.3, n: int = 80, seeds: int = 10) -> None:
    """Every request to one engine: the model's speed alone over the set's, as served (how far off it is learned)."""
    adaptive.COVARIATE_SAMPLES, adaptive.MAX_EARLY = MODES[mode]
    got = []
    for seed in range(seeds):
        rng, pol, total = random.Random(seed), Adaptive(explore=0.0), 0.0
        for _ in range(n):
            row = rng.choice(ROWS)
            dur, ttft = serve(pool, row, slow, rng)
            total += dur
            pol.observe(Observation(pool, S if pool == "speculative" else B, 1, 1, dur, ttft, None, TOKENS, True,
                                    data_events=TOKENS + 1, estimated_prompt_tokens=int(row[1])))
        learned = pol.state(View.of([BackendLoad(S, "speculative", 0, True), BackendLoad(B, "baseline", 0, True)]))
        got.append(learned["pools"][pool]["tok_s_alone"] / (TOKENS * n / total))
    print(f"  {pool}, {mode}: learned speed alone / served, mean {statistics.mean(got):.3f} "
          f"(min {min(got):.3f}, max {max(got):.3f})")


def scatter() -> None:
    """One request's seconds per token over the 36 prompts as measured, and moved to the mean prompt by the slope
    of time to first token on prompt tokens (least squares): the log sd of each."""
    p = [r[1] for r in ROWS]
    for name, yi, ti in (("speculative", 3, 5), ("baseline", 4, 6)):
        y, t = [r[yi] for r in ROWS], [r[ti] for r in ROWS]
        mp, mt = statistics.mean(p), statistics.mean(t)
        k = sum((a - mp) * (b - mt) for a, b in zip(p, t, strict=True)) / sum((a - mp) ** 2 for a in p)
        moved = [a - k * (b - mp) / TOKENS for a, b in zip(y, p, strict=True)]
        print(f"  {name}: {k * 1e3:.1f} ms a prompt token; log sd of s/token {statistics.pstdev(map(math.log, y)):.3f}, "
              f"moved {statistics.pstdev(map(math.log, moved)):.3f}")


if __name__ == "__main__":
    print("the measured requests (engine-scatter.txt, round 0):")
    scatter()
    for slow in (1.0, 1.15, 1.3):
        for mode in MODES:
            table(slow, mode)
    print("every request to one engine, 10 seeds of 80 requests (speculative decode x1.30):")
    for pool in ("speculative", "baseline"):
        for mode in MODES:
            alone(pool, mode)
