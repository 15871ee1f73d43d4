"""Real llama.cpp engines (llama-cpp-python's server, Gemma 3 270M, CPU) for tests marked `real_engine`.

Without the `engine` extra these tests skip with the reason; under `bash scripts/test.sh --real-engine`
(SPEC_ROUTER_REAL_ENGINE=1) a missing extra fails them instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from bench.lab import engines as eng

__all__ = ["EnginePair", "engine_factory", "engine_model", "engine_pair"]


def _require() -> None:
    why = eng.available()
    if why is None:
        return
    if os.environ.get("SPEC_ROUTER_REAL_ENGINE") == "1":
        pytest.fail(f"real-engine run requested but {why}")
    pytest.skip(f"real engine: {why}")


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory):
    _require()
    return eng.model_path()


@dataclass
class EnginePair:
    speculative: eng.Engine  # prompt-lookup speculative decoding
    baseline: eng.Engine


@pytest.fixture(scope="session")
def engine_pair(engine_model, tmp_path_factory):
    """One speculative and one baseline engine for the whole session (a model load is ~1 s, a start ~3 s)."""
    logs = tmp_path_factory.mktemp("engines")
    started: list[eng.Engine] = []
    try:
        for spec in (True, False):
            started.append(eng.start_engine(engine_model, speculative=spec, log_dir=logs))
        yield EnginePair(*started)
    finally:
        for e in started:
            e.stop()


@pytest.fixture
def engine_factory(engine_model, tmp_path):
    """`engine_factory(speculative=bool, **engine_args) -> Engine`: a private engine (for killing, or with other
    server flags such as `interrupt_requests=True`), stopped at teardown."""
    started: list[eng.Engine] = []

    def make(*, speculative: bool, **kw) -> eng.Engine:
        e = eng.start_engine(engine_model, speculative=speculative, log_dir=tmp_path, **kw)
        started.append(e)
        return e

    yield make
    for e in started:
        e.stop()
