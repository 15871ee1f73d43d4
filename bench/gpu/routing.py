"""Expert routing for the benchmarks (pure Python, no torch): uniform or Zipf-skewed top-k, and coverage counts.

Only `random.Random.random()` is drawn (Mersenne Twister, stable across Python versions), so a routing recorded in
the JSON as (tokens, experts, k, skew, seed) regenerates exactly on any machine, which the physical-sense test does.
"""
from __future__ import annotations

import bisect
import random
from collections import Counter
from dataclasses import dataclass

# The skew used for "skewed" routing: expert popularity ~ 1/rank^s over a random order of the experts, each token
# taking k distinct experts by successive weighted draws. s = 1.2 puts about 20% of the first picks on the most
# popular of 384 experts; real routers with load balancing sit between this and uniform.
ZIPF_S = 1.2


@dataclass(frozen=True)
class Routing:
    tokens: int
    experts: int
    k: int
    skew: float  # 0 = uniform, else the Zipf exponent
    seed: int
    picks: tuple[tuple[int, ...], ...]  # per token: its k distinct experts

    def counts(self) -> list[int]:
        """Tokens routed to each expert (assignments, index = expert id)."""
        c = Counter(e for row in self.picks for e in row)
        return [c.get(e, 0) for e in range(self.experts)]

    def distinct(self) -> int:
        return sum(1 for x in self.counts() if x)

    def max_load(self) -> int:
        return max(self.counts())


def _weights(experts: int, skew: float, rng: random.Random) -> list[float]:
    if skew <= 0:
        return [1.0] * experts
    order = list(range(experts))
    for i in range(experts - 1, 0, -1):  # Fisher-Yates from random() alone
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    w = [0.0] * experts
    for rank, e in enumerate(order):
        w[e] = 1.0 / (rank + 1) ** skew
    return w


def route(tokens: int, experts: int, k: int, skew: float = 0.0, seed: int = 0) -> Routing:
    """k distinct experts per token: uniform (skew 0) or Zipf(skew) popularity, successive draws without replacement."""
    if not (0 < k <= experts) or tokens < 0:
        raise ValueError(f"bad routing: tokens={tokens} experts={experts} k={k}")
    rng = random.Random(seed)
    w = _weights(experts, skew, rng)
    cum, total = [], 0.0
    for x in w:
        total += x
        cum.append(total)
    picks = []
    for _ in range(tokens):
        row: list[int] = []
        seen: set[int] = set()
        while len(row) < k:  # rejection of repeats = sampling proportional to weight among those left
            e = min(bisect.bisect_right(cum, rng.random() * total), experts - 1)
            if e not in seen:
                seen.add(e)
                row.append(e)
        picks.append(tuple(row))
    return Routing(tokens, experts, k, skew, seed, tuple(picks))


def expected_distinct_uniform(tokens: int, experts: int, k: int) -> float:
    """Expected distinct experts touched by `tokens` tokens of k uniform distinct picks: E·(1 − (1 − k/E)^n)."""
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def grouped(r: Routing) -> tuple[list[int], list[int], list[int]]:
    """The permutation a grouped GEMM needs: (token of each assignment sorted by expert, slot k of it, cumulative
    end offset per expert)."""
    rows = sorted(((e, t, j) for t, row in enumerate(r.picks) for j, e in enumerate(row)))
    tok = [t for _, t, _ in rows]
    slot = [j for _, _, j in rows]
    offs, acc = [], 0
    counts = r.counts()
    for e in range(r.experts):
        acc += counts[e]
        offs.append(acc)
    return tok, slot, offs


def moe_padded_rows(assignments: int, experts: int, block_m: int) -> int:
    """Rows a fused MoE kernel's sorted index needs when each touched expert's run is padded to block_m: at most
    min(assignments, experts) experts are touched, each adding up to block_m - 1 padding rows."""
    rows = assignments + min(assignments, experts) * (block_m - 1)
    return -(-rows // block_m) * block_m
