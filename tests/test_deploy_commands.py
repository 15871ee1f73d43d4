"""The compose commands really run: simulated servers and the router started exactly as the stacks start them."""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench import procs
from tests.test_deploy_compose import COMPOSE, COMPOSE_SIM, dockerfile_instructions, load_compose

ROOT = Path(__file__).resolve().parent.parent
STARTUP_DELAY = 4.0  # the shipped 20 s, shortened: the test only needs to see the 503 phase


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localize(command: list[str], port: int) -> list[str]:
    """A compose command on loopback and `port` with a short start-up delay; everything else as shipped."""
    out = []
    for arg in command:
        name = arg.split("=", 1)[0]
        out.append({"--host": "--host=127.0.0.1", "--port": f"--port={port}", "--speedup": "--speedup=20",
                    "--startup-delay": f"--startup-delay={STARTUP_DELAY:g}"}.get(name, arg))
    return out


def backends_up(router_url: str) -> int:
    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(1 for line in text.splitlines() if line.startswith("router_backend_up{") and line.endswith(" 1.0"))


def wait_for(cond, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def run_healthcheck(test: list[str], port: int, env: dict[str, str] | None = None) -> int:
    """Run a compose/Dockerfile healthcheck command on this host, pointed at `port`."""
    kind, *argv = test
    assert kind in ("CMD", "CMD-SHELL")
    if kind == "CMD-SHELL":
        argv = shlex.split(argv[0])
    argv = [a.replace("30000", str(port)) for a in argv]
    if argv[0] == "python":
        argv[0] = sys.executable
    proc = subprocess.run(argv, capture_output=True, timeout=30, env={**os.environ, **(env or {})})
    return proc.returncode


def test_sim_stack_commands_and_router_env_work_together() -> None:
    sim = load_compose(COMPOSE_SIM)["services"]
    router_env = {k: str(v) for k, v in load_compose(COMPOSE)["services"]["router"]["environment"].items()}
    ports = {name: free_port() for name in ("sglang-speculative", "sglang-baseline")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    started: list[procs.Proc] = []
    try:
        # As in compose, the router comes up first, while its backends do not even listen yet.
        env = {**router_env, "ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": "0",
               "ROUTER_SPECULATIVE": json.dumps([urls["sglang-speculative"]]),
               "ROUTER_BASELINE": json.dumps([urls["sglang-baseline"]]), "ROUTER_HEALTH_INTERVAL": "0.2"}
        cmd = json.loads([r for op, r in dockerfile_instructions() if op == "CMD"][-1])
        router = procs.start("router", cmd[2:], env=env)  # the image's CMD, configured by env only
        started.append(router)
        assert status(router.url + "/health") == 200
        assert status(router.url + "/ready") == 503

        healthcheck = sim["sglang-baseline"]["healthcheck"]["test"]
        for name in ("sglang-speculative", "sglang-baseline"):
            command = localize(sim[name]["command"], ports[name])
            assert command[:4] == ["python", "-m", "bench", "sim"]
            p = procs.start(name, command[2:])
            started.append(p)
            assert p.url == urls[name]
            # Like SGLang loading a model: up, but /health is 503 until the start-up delay is over.
            assert status(p.url + "/health") == 503
            assert run_healthcheck(healthcheck, ports[name]) != 0

        assert wait_for(lambda: status(router.url + "/ready") == 200, STARTUP_DELAY + 10)
        assert wait_for(lambda: backends_up(router.url) == 2, 10), "router never saw both backends healthy"
        req = urllib.request.Request(
            router.url + "/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode())
        # No Authorization header: the compose default (empty ROUTER_API_KEY) means no authentication.
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            # Cold adaptive (the compose default) may explore either pool first: which one is its choice; that
            # the header names the backend that served, in the pool it says, is the wiring under test.
            pool = r.headers["X-Router-Pool"]
            assert pool in ("speculative", "baseline")
            assert r.headers["X-Router-Backend"] == urls[f"sglang-{pool}"]
            assert json.loads(r.read())["usage"]["completion_tokens"] > 0
        for port in ports.values():
            assert run_healthcheck(healthcheck, port) == 0

        image_check = [r for op, r in dockerfile_instructions() if op == "HEALTHCHECK"][-1]
        check_cmd = json.loads(image_check[image_check.index("CMD ") + 4:])
        router_port = router.url.rsplit(":", 1)[1]
        assert run_healthcheck(["CMD", *check_cmd], 0, {"ROUTER_PORT": router_port}) == 0
        assert run_healthcheck(["CMD", *check_cmd], 0, {"ROUTER_PORT": "1"}) != 0
    finally:
        for p in reversed(started):
            p.stop()


@pytest.mark.parametrize("setting", ["ROUTER_THRESHOLD=-1", "ROUTER_POLICY=fastest"])
def test_a_bad_env_value_is_a_one_line_error(setting: str) -> None:
    """What a user sees in `docker compose logs router` after a typo in .env."""
    env = {k: str(v) for k, v in load_compose(COMPOSE)["services"]["router"]["environment"].items()}
    key, value = setting.split("=")
    proc = subprocess.run([sys.executable, "-m", "router", "serve"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env, key: value, "ROUTER_PORT": "0"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert key.removeprefix("ROUTER_").lower() in lines[0]
