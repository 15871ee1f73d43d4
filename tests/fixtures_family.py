"""Factory fixture for the server family (bench/lab/family.py): member pairs on port 0, closed at teardown."""
from __future__ import annotations

import pytest

from bench.lab.family import MEMBERS, start_pair

FAMILY_SPEEDUP = 5.0


@pytest.fixture
async def family_pair():
    """`await family_pair(name) -> (speculative, baseline)` FamilyServers of that member at FAMILY_SPEEDUP."""
    made = []

    async def make(name: str):
        pair = await start_pair(MEMBERS[name], FAMILY_SPEEDUP)
        made.extend(pair)
        return pair

    yield make
    for s in made:
        await s.close()
