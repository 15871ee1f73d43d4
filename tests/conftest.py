"""Shared pytest fixtures: each area's factory fixtures live in tests/fixtures_*.py and are re-exported here."""
from tests.fixtures_engine import *  # noqa: F401,F403
from tests.fixtures_epp import *  # noqa: F401,F403
from tests.fixtures_family import *  # noqa: F401,F403
from tests.fixtures_rawbackend import *  # noqa: F401,F403
from tests.fixtures_router import *  # noqa: F401,F403
from tests.fixtures_sim import *  # noqa: F401,F403
from tests.test_fuzz_stack import FUZZ_SEED


def pytest_terminal_summary(terminalreporter) -> None:
    # Printed even with -q and on success: a failing fuzz run is replayed with exactly this seed.
    if any(r.nodeid.startswith("tests/test_fuzz_") for rs in terminalreporter.stats.values() for r in rs
           if hasattr(r, "nodeid")):
        terminalreporter.write_line(f"fuzz seed {FUZZ_SEED}: replay with FUZZ_SEED={FUZZ_SEED}")
