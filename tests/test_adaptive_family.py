"""adaptive through the real router on two members of the server family (bench/lab/family.py): cold, then the share
of requests it sends to the faster server at light load and at saturation."""
from __future__ import annotations

import pytest

from bench.lab.family import MEMBERS, predict
from bench.load import LoadSpec, load_prompts, run_closed

TOKENS = 96


async def _cold_adaptive(family_pair, router_factory, name: str) -> str:
    """A cold adaptive router (load_signal backend) in front of one member pair; its URL."""
    spec, base = await family_pair(name)
    router = await router_factory([spec.url], [base.url], policy="adaptive", load_signal="backend",
                                  load_interval=0.2)
    return router.url


async def _records(url: str, c: int, n: int) -> list:
    spec = LoadSpec(url=url, prompts=load_prompts("coding"), max_tokens=TOKENS, requests=n, timeout=30.0,
                    level_timeout=90.0)
    run = await run_closed(spec, c)
    assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok][:3]
    return sorted(run.records, key=lambda r: r.start)


@pytest.mark.timeout(90)
async def test_light_load_goes_to_the_server_faster_alone(family_pair, router_factory):
    """convex-10 at one client: the speculative server alone is 1.8x the baseline (by its parameters), so once
    both are measured nearly every request goes there."""
    m = MEMBERS["convex-10"]
    assert predict(m.speculative, 1, TOKENS) > 1.5 * predict(m.baseline, 1, TOKENS)
    recs = await _records(await _cold_adaptive(family_pair, router_factory, "convex-10"), 1, 40)
    late = recs[20:]
    share = sum(r.pool == "speculative" for r in late) / len(late)
    assert share >= 0.85, [r.pool for r in recs]


@pytest.mark.timeout(120)
async def test_saturation_splits_toward_the_server_faster_there(family_pair, router_factory):
    """linear-12 at 32 clients: the speculative server saturates at 16 running and 462 tok/s, the baseline
    reaches 1101 with 32; the best split by the parameters keeps 8 of 32 on the speculative server, where each
    request runs faster, so about 72% of the requests complete on the baseline. Cold, the first round is spread
    by load; by the later rounds adaptive must lean to the baseline, but not abandon the other server."""
    recs = await _records(await _cold_adaptive(family_pair, router_factory, "linear-12"), 32, 160)
    late = recs[64:]
    share = sum(r.pool == "baseline" for r in late) / len(late)
    assert 0.6 <= share <= 0.9, share
