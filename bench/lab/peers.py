"""The routers users would run instead of ours (smg, vllm-router): which are installed, and starting one as a real
process on free 127.0.0.1 ports in front of given backends, stopped by PID through bench.procs."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import procs


@dataclass(frozen=True)
class Peer:
    """One peer router: its PyPI distribution, the module its launcher runs, the policies it is run with."""

    name: str  # label prefix: smg, vllm-router
    dist: str  # PyPI distribution
    module: str  # python -m <module> [launch] ...
    subcommand: tuple[str, ...]
    policies: tuple[str, ...]
    extra: tuple[str, ...] = ()  # flags every launch adds


PEERS = {
    # Shepherd Model Gateway (SGLang's router, Rust). No tokenizer: cache_aware then matches on request text
    # (chars), as it does in front of SGLang when no --model-path is given.
    "smg": Peer("smg", "smg", "smg", ("launch",), ("cache_aware", "round_robin", "power_of_two"),
                ("--disable-tokenizer-autoload", "--log-level", "warn")),
    # vLLM's router (the Rust sglang-router fork); talks plain OpenAI HTTP to any worker.
    "vllm-router": Peer("vllm-router", "vllm-router", "vllm_router.launch_router", (), ("cache_aware", "round_robin"),
                        ("--log-level", "warning")),
}


class PeerError(Exception):
    """A peer is not installed, would not start, or is not a known name/policy: one line."""


def version(peer: Peer) -> str | None:
    """The installed version, or None when the peer's distribution or launcher module is missing."""
    try:
        v = importlib.metadata.version(peer.dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    top = peer.module.split(".")[0]
    return v if importlib.util.find_spec(top) is not None else None


def parse(spec: str) -> tuple[Peer, str]:
    """`smg:cache_aware` -> (the smg Peer, "cache_aware")."""
    name, sep, policy = spec.partition(":")
    peer = PEERS.get(name)
    if peer is None or not sep:
        raise PeerError(f"expected PEER:POLICY with PEER one of {', '.join(PEERS)}, got {spec!r}")
    if policy not in peer.policies:
        raise PeerError(f"{name}: policy {policy!r} is not one of {', '.join(peer.policies)}")
    return peer, policy


def free_port() -> int:
    # Bound and closed again: another process could take it before the peer binds (peers cannot bind port 0
    # and tell us the port); then the peer exits and its run is a skipped row with its log's last line.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(peer: Peer, policy: str, workers: list[str], log_path: Path) -> procs.Proc:
    """The peer in front of `workers`, listening on a free port; its output in `log_path`. The caller waits
    for it to serve (bench.cli.wait_serving) and stops it (Proc.stop, by PID)."""
    if version(peer) is None:
        raise PeerError(f"{peer.name} is not installed (pip install 'spec-router[peers]')")
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", peer.module, *peer.subcommand, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--policy", policy,
           "--worker-urls", *workers, *peer.extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}  # never asks a hub: no tokenizer is loaded
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError as exc:
        raise PeerError(f"{peer.name}: cannot start: {exc}") from None
    return procs.Proc(name=f"{peer.name} {policy}", proc=popen, url=f"http://127.0.0.1:{port}")
