"""Start `python -m bench sim` / `python -m router serve` as subprocesses on port 0, learn their URL
from the `listening on` line, stop them by PID (SIGTERM, then SIGKILL), and pin them to CPUs."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

# An HTTP server prints its URL; `spec-router epp` (gRPC) prints HOST:PORT.
LISTEN_RE = re.compile(r"^listening on ((?:http://)?\S+)\s*$")


def terminate(proc: subprocess.Popen, grace: float = 5.0) -> int | None:
    """SIGTERM, wait `grace` seconds, then SIGKILL. Only this child's PID is signalled."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
    return proc.returncode


class ProcError(Exception):
    """A child server did not come up; the message says which and why, in one line."""


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    url: str = ""
    urls: list[str] = field(default_factory=list)  # every `listening on` URL (two for a co-located pair)
    _stderr: deque = field(default_factory=lambda: deque(maxlen=20))
    _readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self) -> str:
        return " | ".join(line.strip() for line in self._stderr if line.strip())[-400:]

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, wait `grace` seconds, then SIGKILL. Only this child's PID is signalled."""
        terminate(self.proc, grace)
        for t in self._readers:  # each reader closes its pipe at EOF
            t.join(2.0)
        return self.proc.returncode


def start(name: str, args: list[str], wait_s: float = 30.0, env: dict | None = None, lines: int = 1) -> Proc:
    """Run `python -m <args>` and wait for its `listening on URL` line (or its first `lines` such lines)."""
    cmd = [sys.executable, "-m", *args]
    try:
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
    except OSError as exc:
        raise ProcError(f"{name}: cannot start {' '.join(cmd)}: {exc}") from None
    p = Proc(name=name, proc=popen)
    found: list[str] = []
    ready = threading.Event()
    eof = threading.Event()

    def read_stdout() -> None:
        # Keep draining after the line so a chatty child never blocks on a full pipe.
        with popen.stdout:  # type: ignore[union-attr]
            for line in popen.stdout:  # type: ignore[union-attr]
                if len(found) < lines and (m := LISTEN_RE.match(line.strip())):
                    found.append(m.group(1))
                    if len(found) == lines:
                        ready.set()
        eof.set()
        ready.set()  # EOF: the child exited (or closed its stdout)

    def read_stderr() -> None:
        with popen.stderr:  # type: ignore[union-attr]
            for line in popen.stderr:  # type: ignore[union-attr]
                p._stderr.append(line)

    p._readers = [threading.Thread(target=read_stdout, daemon=True),
                  threading.Thread(target=read_stderr, daemon=True)]
    for t in p._readers:
        t.start()
    try:
        ready.wait(wait_s)
    except BaseException:
        # Interrupted while it starts (a SIGTERM's unwinding lands here): it is in no ProcGroup yet, and in a session
        # of its own nothing else stops it. A `bench compare` stopped this way left its first router running.
        terminate(popen, 2.0)
        raise
    if len(found) >= lines:
        p.url, p.urls = found[0], list(found[:lines])
        return p
    rc = popen.poll()
    if rc is None and eof.is_set():
        # stdout closed just before the exit: give the child a moment to be reaped (a loaded machine)
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = popen.wait(5)
    if rc is None:
        p.stop()
        what = "line" if lines == 1 else f"{lines} lines"
        raise ProcError(f"{name}: no 'listening on' {what} within {wait_s:g}s ({' '.join(args)})")
    p.stop()  # reaps it and lets the readers reach EOF, so the stderr tail is complete
    raise ProcError(f"{name}: exited with code {rc} before listening ({' '.join(args)}): {p.stderr_tail()}")


def profile_flags(profile: str) -> list[str]:
    """`bench sim`'s flags for a profile given by name or as a path to a JSON file (as bench.cli.profile reads it)."""
    return ["--profile-file", profile] if profile.endswith(".json") else ["--profile", profile]


def start_sim(profile: str, speedup: float, name: str | None = None, extra: list[str] | None = None) -> Proc:
    """`profile` is a built-in profile name or a path to a profile JSON file."""
    return start(name or f"sim {profile}",
                 ["bench", "sim", *profile_flags(profile), "--port", "0", "--speedup", f"{speedup:g}", *(extra or [])])


def start_colocated(profile_a: str, profile_b: str, speedup: float, kv_share: float = 0.5,
                    extra: list[str] | None = None, name: str | None = None) -> tuple[Proc, str, str]:
    """Two simulated servers time-sharing one set of simulated GPUs, in one process: (proc, url_a, url_b).

    `profile_a` gets `kv_share` of its KV capacity, `profile_b` the rest; each is a built-in profile name or
    a profile JSON path. Stopping the Proc stops both servers."""
    p = start(name or f"co-located sims {profile_a} + {profile_b}",
              ["bench", "sim", *profile_flags(profile_a), "--colocated-with", profile_b, "--kv-share", f"{kv_share:g}", "--port", "0",
               "--port-b", "0", "--speedup", f"{speedup:g}", *(extra or [])], lines=2)
    return p, p.urls[0], p.urls[1]


def start_router(speculative: list[str], baseline: list[str], policy: str, threshold: int | None = None,
                 name: str | None = None, extra: list[str] | None = None) -> Proc:
    args = ["router", "serve", "--policy", policy, "--port", "0"]
    for u in speculative:
        args += ["--speculative", u]
    for u in baseline:
        args += ["--baseline", u]
    if threshold is not None:
        args += ["--threshold", str(threshold)]
    return start(name or f"router {policy}", args + list(extra or []))


class ProcGroup:
    """Context manager: everything started through it is stopped on exit, newest first."""

    # The groups inside their `with` block, for stop_all: a SIGTERM whose unwinding was swallowed still stops them.
    live: weakref.WeakSet[ProcGroup] = weakref.WeakSet()

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def add(self, p: Proc) -> Proc:
        self.procs.append(p)
        return p

    def stop(self, p: Proc) -> None:
        p.stop()
        if p in self.procs:
            self.procs.remove(p)

    def __enter__(self) -> ProcGroup:
        ProcGroup.live.add(self)
        return self

    def __exit__(self, *exc) -> None:
        ProcGroup.live.discard(self)
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def stop_all(grace: float = 2.0) -> None:
    """Stop every server every live ProcGroup started (newest first), by PID: the last resort of a command that
    must exit now. Their readers are not joined: the command is about to exit."""
    for group in list(ProcGroup.live):
        for p in reversed(list(group.procs)):
            with contextlib.suppress(Exception):
                terminate(p.proc, grace)


# Which process runs on which core (spec-bench overhead, scripts/ttfb_probe.py): children started inside
# `pinned` inherit its CPU mask.
def plan_cpus(pin: bool) -> dict[str, set[int] | None]:
    """Proxy alone on one core; backend and load generator on the others (their own each from 3 cores)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return {"proxy": None, "backend": None, "load": None}
    if len(cpus) == 2:
        return {"proxy": {cpus[0]}, "backend": {cpus[1]}, "load": {cpus[1]}}
    return {"proxy": {cpus[0]}, "backend": {cpus[1]}, "load": set(cpus[2:])}


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """Children started inside inherit this thread's CPU mask, from their first instruction on."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def loadavg() -> str:
    """This machine's load average line, for a run's record ("n/a" where there is no /proc)."""
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


async def sim_stats(urls: list[str]) -> list[dict]:
    """Each simulator's /_sim/stats (its request and token counters), in order."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        out = []
        for u in urls:
            async with s.get(u + "/_sim/stats") as r:
                out.append(await r.json())
        return out
