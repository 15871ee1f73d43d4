"""The restructure into one decision core kept every decision: drive Pools.place / report_done / report_loads with
random inputs (prefix routing on, pinned pools, health flips, /v1/loads reports; spillover, least-inflight and
adaptive) and print every decision, under the router before the restructure (commit 1e79935) and under this one.
Run (from this checkout):
  git worktree add /tmp/before-core 1e79935
  PYTHONPATH=/tmp/before-core .venv/bin/python bench/results/decision-equivalence/diffdrive.py 25 > /tmp/old.txt
  PYTHONPATH=$PWD .venv/bin/python bench/results/decision-equivalence/diffdrive.py 25 > /tmp/new.txt
  cmp /tmp/old.txt /tmp/new.txt && wc -l /tmp/new.txt
Output: bench/results/decision-equivalence/diffdrive.txt (the cmp and the count)."""
import random
import sys

from router import prefix
from router.affinity import Affinity
from router.observe import LoadFigures, Observation
from router.pools import Pools

try:
    from router.adaptive import Adaptive
    from router.policies import LeastInflight, Spillover
    def pol(kind):
        return {"spill": lambda: Spillover(3), "least": LeastInflight, "adaptive": lambda: Adaptive()}[kind]()
except ImportError:
    from router.adaptive import Adaptive
    from router.policy import build
    def pol(kind):
        return {"spill": lambda: build("spillover", threshold=3), "least": lambda: build("least-inflight"),
                "adaptive": lambda: Adaptive()}[kind]()


def run(seed, kind):
    rng = random.Random(seed)
    aff = Affinity(max_running=rng.choice([None, 4]), cross_pool=rng.random() < 0.8)
    ps = Pools(["s1", "s2"], ["b1", "b2"], policy=pol(kind), rng=random.Random(seed + 1), affinity=aff)
    for b in ps.backends:
        b.healthy = True
    convs = [bytes(rng.getrandbits(8) for _ in range(20000)) for _ in range(6)]
    turns = [1] * 6
    out, held = [], []
    for _step in range(600):
        r = rng.random()
        if r < 0.5:
            c = rng.randrange(6)
            turns[c] += 1
            raw = convs[c][: min(20000, 1500 * turns[c])]
            p = prefix.Prompt(prefix.TEXT, len(raw), prefix.chain(raw)) if rng.random() < 0.9 else \
                prefix.Prompt(prefix.TEXT, 100, [])
            pinned = rng.choice([None, None, None, "speculative", "baseline"])
            got = ps.place(pinned, p)
            if got is None:
                out.append("none")
                continue
            lease, d, pl = got
            out.append((d.url, d.reason, pl.reason if pl else None, pl.expected_cached if pl else None,
                        pl.depth if pl else None))
            held.append((lease, pl))
        elif r < 0.85 and held:
            lease, pl = held.pop(rng.randrange(len(held)))
            b = lease.backend
            tok = rng.randint(2, 300)
            obs = Observation(b.pool, b.url, b.inflight, b.inflight, rng.uniform(0.5, 5), rng.uniform(0.05, 0.5),
                              rng.randint(100, 5000), tok, True, float(b.inflight),
                              rng.randint(100, 5000), rng.choice([None, rng.randint(0, 3000)]))
            lease.prefilled()
            ps.report_done(b, obs, pl)
            lease.release()
        elif r < 0.95:
            b = rng.choice(ps.backends)
            figs = LoadFigures(rng.randint(0, 8), rng.randint(0, 3), max_running=rng.choice([None, 2, 4, 64]),
                               accept_length=rng.choice([None, 2.5, 3.0]), gen_throughput=rng.choice([None, 30.0]),
                               cache_hit_rate=rng.choice([None, 0.0, 0.5]),
                               max_total_tokens=rng.choice([None, 100000, 500000]))
            ps.report_loads(b, figs)
        else:
            b = rng.choice(ps.backends)
            b.healthy = not b.healthy
            if not any(x.healthy for x in ps.backends):
                b.healthy = True
    return out


for kind in ("spill", "least", "adaptive"):
    for seed in range(int(sys.argv[1])):
        for line in run(seed, kind):
            print(kind, seed, line)
