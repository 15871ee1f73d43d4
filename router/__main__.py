"""CLI: `spec-router serve ...` (= `python -m router serve ...`) and `spec-router epp ...`: parse flags, load
Settings, install uvloop, serve until SIGTERM, drain."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import typing
from typing import NoReturn

from router.cliargs import OneLineParser
from router.settings import OLD_NAMES, ConfigError, Settings, load_settings

PROG = "spec-router"  # one name in every usage and error line (python -m router runs the same)


class _Parser(OneLineParser):
    def error(self, message: str) -> NoReturn:
        # One line, exit 2: bad flags are the user's to fix, not a traceback to read.
        self.exit(2, f"{PROG}: error: {message} (see {PROG} serve --help)\n")


def _is_list(name: str) -> bool:
    field = Settings.model_fields.get(name)
    return field is not None and typing.get_origin(field.annotation) is list


def _metavar(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(typing.get_args(annotation)) + "}"
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = args[0]
    if typing.get_origin(kind) is typing.Literal:
        return "{" + ",".join(typing.get_args(kind)) + "}"
    if typing.get_origin(kind) is tuple:
        return "C:TOK_S,..."  # a throughput curve
    # a switch takes its value (true/false, also 1/0, yes/no, on/off: pydantic's words)
    return {bool: "{true,false}", int: "N", float: "SECONDS", str: "TEXT"}.get(kind, "KEY")  # type: ignore[call-overload]


SHORT_USAGE = (f"{PROG} serve [--speculative URL]... [--baseline URL]... [--config FILE] [--policy NAME] "
               "[--port P] [more flags]")


SHORT_HELP = f"""usage: {SHORT_USAGE}

An OpenAI-compatible reverse proxy in front of a speculative and a baseline pool of LLM servers (SGLang, or
any OpenAI-compatible engine): each request goes to the pool that serves it best at the current load.

commands:
  serve    run the router
  epp      run the endpoint picker for Envoy (Gateway API Inference Extension; the epp extra)

examples:
  {PROG} serve --speculative http://127.0.0.1:30001 --baseline http://127.0.0.1:30002 --policy adaptive
  {PROG} serve --config deploy/router.example.yaml

Every setting is a flag, a ROUTER_<NAME> env var and a YAML key: {PROG} serve --help lists them all.
Docs: README.md, docs/ROUTER.md."""


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    # allow_abbrev off: `--baseli` must be an error, not silently `--baseline`.
    parser = _Parser(prog=PROG, allow_abbrev=False, usage=SHORT_USAGE,
                     description="Load-aware OpenAI-compatible reverse proxy in front of a speculative and a "
                     "baseline pool of LLM servers (SGLang, or any OpenAI-compatible engine).",
                     epilog=f"Every setting: {PROG} serve --help. Docs: README.md, docs/ROUTER.md.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, title="commands")
    serve = sub.add_parser(
        "serve", help="run the router", allow_abbrev=False, prog=f"{PROG} serve",
        description="Run the router. Settings come from --config YAML, then ROUTER_<NAME> env vars, then these "
                    "flags (each flag is also a YAML key and an env var).",
    )
    epp = sub.add_parser(
        "epp", help="run the endpoint picker for Envoy", allow_abbrev=False, prog=f"{PROG} epp",
        description="Run the Gateway API Inference Extension endpoint picker (Envoy ext_proc over gRPC on "
                    "host:epp_port) over the same pools and settings as serve.",
    )
    for command in (serve, epp):
        _add_settings(command)
    return parser, serve


def _add_settings(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--config", metavar="FILE", help="YAML file of settings (also ROUTER_CONFIG)")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # A float that is a share, not a duration (the adaptive policy's factors).
        meta = "RATIO" if name in ("adaptive_forgetting", "adaptive_explore", "adaptive_deadband") \
            else _metavar(field.annotation)
        # A field may name its value's form itself (json_schema_extra metavar); a list is of URLs otherwise.
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if _is_list(name):
            serve.add_argument(flag, dest=name, action="append", metavar=str(extra.get("metavar", "URL")),
                               help=f"{field.description}; repeat or comma-separate")
        else:
            default = field.default
            shown = "unset" if default is None else ("***" if "key" in name else default)
            # A default built per instance (a mapping) is spelled out in the description itself.
            tail = "" if field.default_factory is not None else f" (default: {shown})"
            serve.add_argument(flag, dest=name, metavar=str(extra.get("metavar", meta)),
                               help=f"{field.description}{tail}")
    for old in OLD_NAMES:  # still taken, not listed: --help shows the new name
        serve.add_argument("--" + old.replace("_", "-"), dest=old, help=argparse.SUPPRESS)
    serve.set_defaults(**{name: None for name in (*Settings.model_fields, *OLD_NAMES)})


def _short_usage() -> None:
    print(f"usage: {SHORT_USAGE}\n{PROG}: error: a command is required (serve); {PROG} --help says more, "
          f"{PROG} serve --help lists every flag", file=sys.stderr)


def parse(argv: list[str]) -> Settings:
    """Flags to Settings; raises SystemExit(2) with one line on any problem."""
    return parse_command(argv)[1]


def parse_command(argv: list[str]) -> tuple[str, Settings]:
    """The command (serve or epp) and its Settings; raises SystemExit(2) with one line on any problem."""
    args = build_parser().parse_args(argv)
    if args.command not in ("serve", "epp"):
        _short_usage()
        raise SystemExit(2)
    overrides = {}
    for name in (*Settings.model_fields, *OLD_NAMES):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = ",".join(value) if _is_list(name) else value
    try:
        return args.command, load_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


async def serve(settings: Settings) -> int:
    from router.app import build_app, start

    app = build_app(settings)
    try:
        runner, url = await start(app, settings.host, settings.port)
    except OSError as exc:
        print(f"{PROG}: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    # Handlers go in before the line that tells a parent we are up, so its SIGTERM is never the default one.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on {url}", flush=True)
    await stop.wait()
    logging.getLogger("router").info("shutting down: draining for up to %.0f s", settings.drain_timeout)
    # Stops accepting, waits for in-flight requests up to drain_timeout, then cancels the rest.
    await runner.cleanup()
    return 0


async def epp(settings: Settings) -> int:
    try:
        from router.epp.app import Epp, ListenError
    except ImportError as exc:
        print(f"{PROG}: error: epp needs the epp extra (pip install 'spec-router[epp]'): {exc}", file=sys.stderr)
        return 2
    picker = Epp(settings)
    try:
        port = await picker.start()
    except ListenError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # gRPC's own failure to bind
        print(f"{PROG}: error: cannot listen on {settings.host}:{settings.epp_port}: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(f"listening on {host}:{port}", flush=True)
    await stop.wait()
    logging.getLogger("router").info("shutting down: draining for up to %.0f s", settings.drain_timeout)
    await picker.stop()
    return 0


def _raise_fd_limit() -> None:
    # Each stream holds two sockets (client and backend); the common soft limit of 1024 caps that at ~500.
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass


def _loop_factory() -> typing.Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        _short_usage()  # a bare command is a usage error: stderr, exit 2
        return 2
    if argv[0] in ("-h", "--help"):
        print(SHORT_HELP)
        return 0
    command, settings = parse_command(argv)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":
        # aiohttp logs a traceback for every malformed request it rejects (400/431): bad input from clients
        # must not flood the log. Handler errors are logged by the router's own middleware.
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    _raise_fd_limit()
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(settings) if command == "serve" else epp(settings))


if __name__ == "__main__":
    sys.exit(main())
