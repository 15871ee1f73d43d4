"""Factory fixtures that start simulated SGLang servers on 127.0.0.1, port 0 (owned by the simulator work)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.sim.faults import Faults
from bench.sim.profiles import Profile, load_profile
from bench.sim.server import SimConfig, SimServer

REPO = Path(__file__).resolve().parents[1]


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
