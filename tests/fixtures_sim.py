"""Factory fixtures that start simulated SGLang servers on 127.0.0.1, port 0 (owned by the simulator work)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.sim.faults import Faults
from bench.sim.profiles import Profile, load_profile
from bench.sim.server import SimConfig, SimServer

REPO = Path(__file__).resolve().parents[1]
# the pinned SGLang wheel, installed with --no-deps; only files that need no torch are loaded from it
SGLANG_DIR = Path(sysconfig.get_paths()["purelib"]) / "sglang"


def _load_by_path(name: str, path: Path) -> types.ModuleType:
    if not path.is_file():
        raise RuntimeError(f"{path} not found: install the pinned wheel with "
                           "`pip install --no-deps sglang==0.5.23` (scripts/install.sh does)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pydantic look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_sglang_protocol() -> types.ModuleType:
    """sglang/srt/entrypoints/openai/protocol.py, loaded by path (importing `sglang` itself pulls in torch).

    The file's one sglang import is `from sglang.utils import convert_json_schema_to_str` (sglang/utils.py
    imports numpy and more). It is used only to render response_format schemas of requests, which the
    simulator tests never send, so a stub `sglang.utils` is in sys.modules only while the file executes.
    """
    stubs = {}
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = []
        utils = types.ModuleType("sglang.utils")
        utils.convert_json_schema_to_str = lambda schema: schema if isinstance(schema, str) else json.dumps(schema)
        stubs = {"sglang": pkg, "sglang.utils": utils}
        sys.modules.update(stubs)
    try:
        return _load_by_path("sglang_protocol_0_5_23", SGLANG_DIR / "srt/entrypoints/openai/protocol.py")
    finally:
        for key in stubs:
            sys.modules.pop(key, None)


def load_sglang_sse_utils() -> types.ModuleType:
    """sglang/srt/entrypoints/openai/sse_utils.py (msgspec only): how SGLang renders chat content chunks."""
    return _load_by_path("sglang_sse_utils_0_5_23", SGLANG_DIR / "srt/entrypoints/openai/sse_utils.py")


@pytest.fixture(scope="session")
def sglang_protocol() -> types.ModuleType:
    """SGLang 0.5.23's own pydantic protocol models (ChatCompletionResponse, ErrorResponse, ...)."""
    return load_sglang_protocol()


@pytest.fixture(scope="session")
def sglang_sse_utils() -> types.ModuleType:
    return load_sglang_sse_utils()


@pytest.fixture
async def sim_factory():
    """`await sim_factory(profile="baseline-tp8", speedup=50.0, **SimConfig fields)` -> started SimServer."""
    servers: list[SimServer] = []

    async def make(profile: str | Profile = "baseline-tp8", speedup: float = 50.0, **config) -> SimServer:
        prof = load_profile(profile) if isinstance(profile, str) else profile
        faults = config.pop("faults", None)
        if isinstance(faults, dict):
            faults = Faults(**faults)
        cfg = SimConfig(profile=prof, speedup=speedup, faults=faults or Faults(), **config)
        server = SimServer(cfg)
        servers.append(server)
        await server.start("127.0.0.1", 0)
        return server

    yield make
    for server in servers:
        await server.close()


@dataclass
class SimProcess:
    """A simulator running as a real subprocess (so tests can SIGKILL it)."""

    url: str
    proc: subprocess.Popen

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=10)


def sim_command(profile: str = "baseline-tp8", speedup: float = 50.0, **flags) -> list[str]:
    cmd = [sys.executable, "-m", "bench", "sim", "--profile", profile, "--port", "0", "--speedup", str(speedup)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (None, False):
            cmd += [flag, str(value)]
    return cmd


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
async def sim_process_factory():
    """`await sim_process_factory(profile="baseline-tp8", speedup=50.0, **cli_flags)` -> SimProcess."""
    procs: list[SimProcess] = []

    async def make(profile: str = "baseline-tp8", speedup: float = 50.0, **flags) -> SimProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = _popen(sim_command(profile, speedup, **flags), env)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=30)
        except TimeoutError:
            proc.kill()
            proc.wait()
            raise RuntimeError("simulator subprocess did not report its port within 30 s") from None
        if not line.startswith("listening on "):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"simulator subprocess failed to start: {line!r} {err.strip()}")
        handle = SimProcess(url=line.split("listening on ", 1)[1].strip(), proc=proc)
        procs.append(handle)
        return handle

    yield make
    for handle in procs:
        handle.kill()
        for stream in (handle.proc.stdout, handle.proc.stderr):
            if stream is not None:
                stream.close()
