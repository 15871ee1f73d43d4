"""CLI entry for `python -m bench`: dispatches each subcommand to the module that owns it."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Each module exposes main(argv: list[str]) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("bench.sim.cli", "run a simulated SGLang server (speculative or baseline profile)"),
    "fit": ("bench.sim.fit", "fit a simulator profile to a measured throughput table"),
    "sweep": ("bench.sweep", "closed/open-loop concurrency sweep against OpenAI-compatible targets"),
    "compare": ("bench.compare", "router policies vs single pools on one pair of backends"),
    "calibrate": ("bench.calibrate", "measure both pools and recommend the spillover threshold"),
    "plan": ("bench.plan", "break-even: which deployment of the same GPUs wins at which load (from compare JSON)"),
    "demo": ("bench.demo", "two simulated backends + router + a short sweep (the README's first command)"),
    "stress": ("bench.stress", "many concurrent streams through the router; checks nothing is lost"),
    "faults": ("bench.faultmatrix", "inject each backend fault under load and record what clients saw"),
}


def usage() -> str:
    lines = ["usage: python -m bench COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`python -m bench COMMAND --help` documents each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bench: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
