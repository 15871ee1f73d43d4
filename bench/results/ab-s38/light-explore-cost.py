"""s38: what light-load exploration costs at one client, on the pure policy (no servers, no clock).

One client: every decision sees both backends idle; the chosen one serves one request whose per-token time is
drawn lognormal around its mean with the given scatter (log sd). Counts the share sent to the slower-alone server per
block of 8 requests (a llama.cpp judge level), over 30 seeds. The llama.cpp pair (s38's judge): baseline 17.2,
speculative 13.3 tok/s alone; the learned models put the speculative engine's requests' scatter at 0.34-0.52
and the baseline's at 0.28-0.78, so the last table is the pair's, the first two what a steady baseline would give.
Run: .venv/bin/python bench/results/ab-s38/light-explore-cost.py"""
import math
import random

from router.adaptive import Adaptive
from router.observe import Observation
from router.policy import BackendLoad, View, decide

S, B = "http://s:1", "http://b:1"
TOKENS = 24


def run(seed: int, spec_tps: float, spec_spread: float, base_tps: float, base_spread: float, n: int) -> list[bool]:
    rng = random.Random(seed)
    pol = Adaptive()
    got = []
    for _ in range(n):
        v = View.of([BackendLoad(S, "speculative", 0, True), BackendLoad(B, "baseline", 0, True)])
        d = decide(pol, v, None, rng)
        tps, spread = (spec_tps, spec_spread) if d.pool == "speculative" else (base_tps, base_spread)
        per_token = math.exp(rng.gauss(0, spread) - spread * spread / 2) / tps
        dur = per_token * TOKENS
        pol.observe(Observation(d.pool, S if d.pool == "speculative" else B, 1, 1, dur, dur / TOKENS, TOKENS,
                                TOKENS // 2, True))
        got.append(d.pool == "speculative")
    return got


def table(spec_spread: float, base_spread: float, n: int = 160, seeds: int = 30) -> None:
    runs = [run(s, 13.3, spec_spread, 17.2, base_spread, n) for s in range(seeds)]
    print(f"speculative requests scattering by {spec_spread:.2f}, baseline's by {base_spread:.2f}: share sent to the "
          f"speculative one (23% slower alone), mean over {seeds} seeds, per 8 requests")
    for lo in range(0, n, 8):
        share = sum(sum(r[lo:lo + 8]) for r in runs) / (8 * seeds)
        loss = share * (1 - 13.3 / 17.2)
        print(f"  requests {lo + 1:3d}-{lo + 8:3d}: {share:5.1%}  (throughput lost ~{loss:4.1%})")
    total = [sum(r) for r in runs]
    print(f"  in all {n}: {sum(total) / seeds:.1f} requests on average (min {min(total)}, max {max(total)})")


if __name__ == "__main__":
    for sp, bp in ((0.37, 0.10), (0.10, 0.10), (0.37, 0.75)):
        table(sp, bp)
