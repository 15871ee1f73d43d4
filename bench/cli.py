"""What every spec-bench command shares at its edge: the parser (one-line errors), flag types, run_async, the
readiness wait, profile lookup by name or path, and the open-file limit. Library code: no command lives here."""
from __future__ import annotations

import argparse
import asyncio
import math
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from router.cliargs import ArgError as ArgError  # re-exported: every command catches it from here
from router.cliargs import OneLineParser
from router.curves import CurvePoints, parse_curve

PROG = "spec-bench"


class Parser(OneLineParser):
    """argparse for a spec-bench command: `prog` is `spec-bench CMD` in every usage line; no abbreviations, and a
    bad flag raises ArgError (router.cliargs): the command prints `spec-bench CMD: MESSAGE` (one line), exit 2."""

    def __init__(self, command: str, description: str | None = None, **kw) -> None:
        super().__init__(prog=f"{PROG} {command}", description=description, **kw)


def parser(command: str, description: str | None = None) -> Parser:
    return Parser(command, description)


def fail(command: str, exc: BaseException | str) -> int:
    """The one line of a user-caused error; returns the exit code 2."""
    print(f"spec-bench {command}: {exc}", file=sys.stderr)
    return 2


# ---- flag types
def int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not (v > 0 and math.isfinite(v)) for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def positive(kind):
    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):  # nan and inf are not sizes either
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return v
    return conv


def nonneg(text: str) -> float:
    """A finite number >= 0 (a window start, a think time, a size that may be zero)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


BARE_TARGET = "target"  # the name of a --target given as a bare URL


def target(text: str) -> tuple[str, str]:
    """`--target [NAME=]URL` -> (name, base URL): a trailing `/` or `/v1` is dropped (the paths are added per
    request). A bare URL is named `target` (one target needs no name; several need NAME= to be told apart, and
    the commands refuse repeated names). A text that starts with a scheme is a bare URL, `=` in it or not."""
    if text.startswith(("http://", "https://")):
        name, url = BARE_TARGET, text
    else:
        name, sep, url = text.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"expected [NAME=]http://HOST:PORT, got {text!r}")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return name, url


def unique_targets(targets: list[tuple[str, str]]) -> None:
    """Raises ArgError when two --target flags share a name (their figures would overwrite each other)."""
    names = [n for n, _ in targets]
    if len(set(names)) != len(names):
        raise ArgError("target names must be unique (name each target NAME=URL)")


def curve(text: str) -> CurvePoints:
    """A throughput curve as the router's `*_curve` settings write it: "1:77.5,2:125.1,..."."""
    try:
        return parse_curve(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- running
def run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


class NotServing(Exception):
    """A server did not become ready in time (or exited first); one line."""


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    lines = log.read_text(errors="replace").strip().splitlines()
    return f"; its log ends: {lines[-1][:300]}" if lines else ""


async def wait_serving(url: str, *, model: str = "default", within: float = 30.0, every_backend: bool = False,
                       proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Wait until `url` serves: answers a one-token chat request with a 2xx (a router may start before its health
    probes mark backends up), or with every_backend, until the router's /ready lists every backend up (no request
    sent: a run that counts every request must not see one more). `proc`: fail at once when that process exits
    (with the last line of `log`). Raises NotServing."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + within
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5 if every_backend else 10)) as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise NotServing(f"{url}: exited with code {proc.returncode} before serving{_tail(log)}")
            try:
                if every_backend:
                    async with s.get(url + "/ready") as r:
                        ready = await r.json(content_type=None)
                        backends = ready.get("backends", {}) if isinstance(ready, dict) else {}
                        if r.status == 200 and all(backends.values()):
                            return
                        last = f"/ready: HTTP {r.status}"
                else:
                    async with s.post(url + "/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        if 200 <= resp.status < 300:
                            return
                        last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                last = str(exc) or type(exc).__name__
            await asyncio.sleep(0.1 if every_backend else 0.2)
    what = "have every backend up" if every_backend else "serve a request"
    raise NotServing(f"{url} did not {what} within {within:g}s (last: {last}){_tail(log)}")


async def until_signal() -> None:
    """Wait for SIGTERM or SIGINT (a server's main coroutine, once it printed its `listening on` line)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def raise_fd_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


# ---- profiles
def profile(ref: str):
    """A simulator profile by built-in name or by path to a .json file (bench.sim.profiles.Profile);
    raises ProfileError with one line."""
    from bench.sim.profiles import load_profile, load_profile_file

    return load_profile_file(ref) if ref.endswith(".json") else load_profile(ref)
