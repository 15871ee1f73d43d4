"""Prefix index benchmark: memory at N conversations of T-token prompts and the decision time at B backends.

python scripts/prefix_bench.py [--conversations 10000] [--tokens 13000] [--backends 16]"""
from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

from router.affinity import Affinity
from router.core.scheduler import Scheduler
from router.policies import LeastInflight
from router.policy import BackendLoad, View
from router.prefix import TEXT, Prompt, chain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=13_000)
    p.add_argument("--backends", type=int, default=16)
    p.add_argument("--capacity-tokens", type=int, default=10**9, help="per backend (default: never evicts)")
    p.add_argument("--decisions", type=int, default=2000)
    a = p.parse_args()
    rng = random.Random(0)
    aff = Affinity(capacity_tokens=a.capacity_tokens)
    nbytes = int(a.tokens * aff.bytes_per_token)
    backends = [BackendLoad(f"http://10.0.0.{i}:30000", "baseline", rng.randint(0, 20), True)
                for i in range(a.backends)]
    view = View.of(backends)
    tracemalloc.start()
    for c in range(a.conversations):
        # distinct conversations (no shared prefix): the index's worst case; the chain of random blocks
        blocks = [rng.getrandbits(63) for _ in range(nbytes // aff.block_bytes)]
        aff.index.of(backends[c % a.backends].url, 0, aff.capacity_of("")).insert(blocks)
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    blocks_held = sum(aff.index.size(b.url) for b in backends)
    body = bytes(rng.getrandbits(8) for _ in range(nbytes))

    # decisions: half a held conversation's next turn, half new prompts
    t_hash = t_place = 0.0
    sched = Scheduler(LeastInflight(), aff)
    r = random.Random(1)
    for i in range(a.decisions):
        t0 = time.perf_counter()
        blocks = chain(body if i % 2 else body[:-1] + bytes([i % 256]))
        t1 = time.perf_counter()
        got = sched.decide(sched.snapshot(view.backends, None, Prompt(TEXT, nbytes, blocks)), r)
        d, pl = got.decision, got.placement
        aff.sent(d.backend, pl)
        t2 = time.perf_counter()
        t_hash += t1 - t0
        t_place += t2 - t1
    n = a.decisions
    print(json.dumps({"conversations": a.conversations, "prompt_tokens": a.tokens, "prompt_bytes": nbytes,
                      "block_bytes": aff.block_bytes, "backends": a.backends, "blocks_held": blocks_held,
                      "index_mb": round(mem / 2**20, 1), "bytes_per_block": round(mem / max(1, blocks_held), 1),
                      "hash_us": round(t_hash / n * 1e6, 1), "decide_and_insert_us": round(t_place / n * 1e6, 1),
                      "total_us": round((t_hash + t_place) / n * 1e6, 1)}))


if __name__ == "__main__":
    main()
