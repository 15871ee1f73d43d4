"""Shared pytest fixtures: each area's factory fixtures live in tests/fixtures_*.py and are re-exported here."""
from tests.fixtures_rawbackend import *  # noqa: F401,F403
from tests.fixtures_router import *  # noqa: F401,F403
from tests.fixtures_sim import *  # noqa: F401,F403
