"""`spec-bench sim`: run one simulated SGLang server (or a co-located pair) until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pydantic import ValidationError

from bench.cli import ArgError, parser, run_async
from bench.cli import profile as profile_ref
from bench.sim import specadaptive
from bench.sim.faults import Faults
from bench.sim.gpu import DEFAULT_SWITCH_MS, Gpu
from bench.sim.profiles import builtin_names, load_profile_file
from bench.sim.server import SimConfig, SimServer


def build_parser() -> argparse.ArgumentParser:
    p = parser("sim", "Simulated SGLang 0.5.23 server (OpenAI API, /metrics, /health, ...) on one port.")
    p.add_argument("--profile", default="baseline-tp8", help=f"built-in profile: {', '.join(builtin_names())}")
    p.add_argument("--profile-file", help="a profile JSON file (e.g. from `spec-bench fit`); overrides --profile")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--speedup", type=float, default=1.0, help="run the clock K times faster")
    p.add_argument("--model", help="served model name (default: the profile's model path)")
    p.add_argument("--max-running-requests", type=int,
                   help="SGLang's --max-running-requests: beyond it requests wait (default: the profile's)")
    p.add_argument("--max-queued-requests", type=int,
                   help="SGLang's --max-queued-requests: beyond it requests are refused (default: no limit)")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds during which /health is 503")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the per-request accept lengths and injected errors (default 0)")
    p.add_argument("--max-total-tokens", type=int, help="KV capacity in tokens, shared by running requests and "
                   "the prefix cache (SGLang's max_total_num_tokens; default: the profile's)")
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache (every prompt token "
                   "prefilled, 0 cached), as SGLang's flag")
    p.add_argument("--speculative-adaptive-config", metavar="FILE", help="SGLang's adaptive speculation config "
                   "(JSON: batch-size keys with candidate_steps, optional knobs) for an adaptive profile "
                   "(adaptive-tp8, PRESET.adaptive-tp8); default: SGLang's table")
    p.add_argument("--enable-cache-report", action="store_true", help="report usage.prompt_tokens_details."
                   "cached_tokens, as SGLang's flag (off by default there too)")
    c = p.add_argument_group("co-location (two servers time-sharing the same GPUs, in this one process)")
    c.add_argument("--colocated-with", metavar="PROFILE", help="also run a second server with this profile (built-in "
                   "name or .json file) on the same simulated GPUs; prints a second 'listening on' line")
    c.add_argument("--kv-share", type=float, default=0.5, help="fraction of the profile's KV capacity the first "
                   "server gets (its memory share); the second gets the rest (default 0.5)")
    c.add_argument("--port-b", type=int, help="port of the second server (default: --port + 1, or 0 with --port 0)")
    c.add_argument("--switch-ms", type=float, default=DEFAULT_SWITCH_MS, help="assumed simulated ms a GPU "
                   f"context switch costs when both servers are busy (default {DEFAULT_SWITCH_MS:g})")
    f = p.add_argument_group("faults (wall-clock seconds; also settable at run time via POST /_sim/faults)")
    f.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered with an error")
    f.add_argument("--error-status", type=int, default=500, choices=[500, 503],
                   help="status of the injected errors (default 500)")
    f.add_argument("--hang", action="store_true", help="accept requests and never send a byte")
    f.add_argument("--stall-after-chunks", type=int, help="stream N chunks, then go silent")
    f.add_argument("--drop-after-chunks", type=int, help="close the connection after N chunks")
    f.add_argument("--health-delay", type=float, default=0.0, help="seconds before /health answers")
    f.add_argument("--health-status", type=int, help="force this /health status")
    f.add_argument("--refuse-for", type=float, default=0.0, help="stop listening for S seconds after start")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Raises ValueError (ProfileError included) with a one-line message on bad input."""
    return configs_from_args(args)[0]


def configs_from_args(args: argparse.Namespace) -> list[SimConfig]:
    """One config, or two for a co-located pair (first: --profile, second: --colocated-with).

    Raises ValueError (ProfileError included) with a one-line message on bad input."""
    profile = load_profile_file(args.profile_file) if args.profile_file else profile_ref(args.profile)
    try:
        faults = Faults(error_rate=args.error_rate, error_status=args.error_status, hang=args.hang,
                        stall_after_chunks=args.stall_after_chunks, drop_after_chunks=args.drop_after_chunks,
                        health_delay=args.health_delay, health_status=args.health_status,
                        refuse_for=args.refuse_for)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        raise ValueError(f"--max-total-tokens must be >= 1, got {args.max_total_tokens}")
    adaptive = args.speculative_adaptive_config
    if adaptive is not None:
        specadaptive.check_profile(specadaptive.load_config(adaptive), profile)
    common = dict(model=args.model, speedup=args.speedup, max_running_requests=args.max_running_requests,
                  max_queued_requests=args.max_queued_requests, startup_delay=args.startup_delay, seed=args.seed,
                  disable_radix_cache=args.disable_radix_cache, enable_cache_report=args.enable_cache_report)
    if args.colocated_with is None:
        return [SimConfig(profile=profile, faults=faults, max_total_tokens=args.max_total_tokens,
                          speculative_adaptive_config=adaptive, **common)]
    other = profile_ref(args.colocated_with)
    if other.tp_size != profile.tp_size:
        raise ValueError(f"--colocated-with: both servers share the same GPUs, but {profile.name} is TP"
                         f"{profile.tp_size} and {other.name} is TP{other.tp_size}")
    if adaptive is not None:
        raise ValueError("--speculative-adaptive-config: not with --colocated-with (run the adaptive server alone)")
    if not 0 < args.kv_share < 1:
        raise ValueError(f"--kv-share must be between 0 and 1 (exclusive), got {args.kv_share:g}")
    if args.switch_ms < 0:
        raise ValueError(f"--switch-ms must be >= 0, got {args.switch_ms:g}")
    if args.port_b is not None and not 0 <= args.port_b <= 65535:
        raise ValueError(f"--port-b must be 0..65535, got {args.port_b}")
    shares = (args.kv_share, 1.0 - args.kv_share)
    # --max-total-tokens: the KV both servers' memory shares split (default: each profile's own capacity)
    return [SimConfig(profile=prof, faults=faults.model_copy(),
                      max_total_tokens=max(1, int((args.max_total_tokens or prof.max_total_num_tokens) * f)),
                      **common) for prof, f in zip((profile, other), shares, strict=True)]


async def _serve(cfgs: list[SimConfig], host: str, ports: list[int], switch_ms: float) -> int:
    gpu = Gpu(switch_ms) if len(cfgs) > 1 else None
    servers = [SimServer(cfg, gpu) for cfg in cfgs]
    for server, port in zip(servers, ports, strict=True):
        try:
            await server.start(host, port)
        except OSError as exc:
            for s in servers:
                await s.close()
            print(f"spec-bench sim: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    # Handlers go in before the line that tells a parent we are up, so its SIGTERM is never the default one.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for server in servers:  # the first server's line first: parents read them in that order
        print(f"listening on {server.url}", flush=True)
    await stop.wait()
    for server in servers:
        await server.close()
    return 0


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ArgError as exc:
        print(f"spec-bench sim: {exc}", file=sys.stderr)
        return 2
    try:
        cfgs = configs_from_args(args)
    except ValueError as exc:
        print(f"spec-bench sim: {exc}", file=sys.stderr)
        return 2
    ports = [args.port]
    if len(cfgs) > 1:
        ports.append(args.port_b if args.port_b is not None else (args.port + 1 if args.port else 0))
    return run_async(_serve(cfgs, args.host, ports, args.switch_ms))
