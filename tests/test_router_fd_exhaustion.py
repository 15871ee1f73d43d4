"""A router process that runs out of file descriptors backs off accepting, then serves again once they free up."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import aiohttp

from tests.fixtures_router import CHAT_BODY

# The router raises its soft limit to the hard one at start-up, so both are lowered before it runs.
LAUNCH = ("import resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
          "from router.__main__ import main; sys.exit(main(sys.argv[2:]))")
FD_LIMIT = 64  # an idle router holds about 15
WARNING = "cannot accept connections"


async def _chat(url: str) -> int:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s, \
                s.post(url + "/v1/chat/completions", json=CHAT_BODY) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def _until_ok(url: str, within: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if await _chat(url) == 200:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_out_of_descriptors_backs_off_then_accepts_again(raw_backend_factory):
    """Connections are held open until accept() fails with EMFILE; the router must log and pause rather than
    spin on a listening socket that stays readable, and must start accepting again by itself.
    Catches: removing `self._pause(0.5)` from the accept loop (thousands of warnings a second) and removing
    the `call_later(..., self.start)` in `_pause` (the router never accepts again)."""
    backend = await raw_backend_factory()
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block; waiting is done in a thread
        [sys.executable, "-c", LAUNCH, str(FD_LIMIT), "serve", "--speculative", backend.url, "--port", "0",
         "--health-interval", "0.2", "--health-success-threshold", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    reader.start()
    held: list[socket.socket] = []
    try:
        async with asyncio.timeout(30):
            line = await asyncio.to_thread(proc.stdout.readline)
        assert line.startswith("listening on "), (line, errors)
        url = line.split()[-1]
        assert await _until_ok(url, 15), errors
        port = urlsplit(url).port
        # More connections than descriptors: the kernel completes them all (backlog), the router cannot.
        for _ in range(FD_LIMIT + 16):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not any(WARNING in e for e in errors) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        first = sum(WARNING in e for e in errors)
        assert first >= 1, errors[-5:]
        await asyncio.sleep(1.0)  # an observation window, not a synchronisation: how often does it retry?
        during = sum(WARNING in e for e in errors) - first
        assert during <= 10, f"{during} accept warnings in 1 s: the accept loop spins"
        for s in held:
            s.close()
        held.clear()
        assert await _until_ok(url, 20), errors[-5:]
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 5)
        proc.stdout.close()
        reader.join(5)
        proc.stderr.close()
