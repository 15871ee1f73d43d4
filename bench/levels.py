"""Load levels x targets: the shared load flags, a level's request count and time cap, the progress line, and
the run that turns each level into figures (JSON + CSV + PNG); sweep, calibrate, compare and demo use it."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import figures
from bench.cli import int_list, positive
from bench.load import LoadSpec, check_reachable, load_prompts, read_accept_length, run_closed, run_open

DEFAULT_CONCURRENCY = "1,2,5,10,30,70,100,250"


def add_load_args(p: argparse.ArgumentParser, *, concurrency: str = DEFAULT_CONCURRENCY) -> None:
    """Flags shared by sweep, compare, calibrate and demo."""
    p.add_argument("--concurrency", type=int_list, default=int_list(concurrency),
                   help=f"comma-separated closed-loop concurrency levels (default {concurrency})")
    p.add_argument("--max-tokens", type=positive(int), default=512,
                   help="max_tokens of every request (default 512)")
    p.add_argument("--prompts", default="coding", help="coding | general | FILE.jsonl")
    p.add_argument("--requests-per-level", type=positive(int), default=None,
                   help="requests per level (default: --rounds x concurrency, at least 16)")
    p.add_argument("--rounds", type=positive(int), default=4,
                   help="closed loop: requests per client per level when --requests-per-level is not given")
    p.add_argument("--duration-per-level", type=positive(float), default=None,
                   help="seconds of wall time per level instead of a request count")
    p.add_argument("--model", default="default", help="value of the 'model' field sent")
    p.add_argument("--speedup", type=positive(float), default=1.0,
                   help="the target's clock runs K times faster (simulator --speedup): report "
                        "throughput / K and latencies x K")
    p.add_argument("--timeout", type=positive(float), default=600.0, help="per-request timeout (s, wall)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send SGLang's ignore_eos so every request generates --max-tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order (default 0)")
    p.add_argument("--no-plot", action="store_true", help="write JSON and CSV only, no PNG (needs no matplotlib)")


@dataclass
class SweepConfig:
    targets: list[tuple[str, str]]
    concurrency: list[int]
    max_tokens: int = 512
    prompts: str = "coding"
    requests_per_level: int | None = None
    duration_per_level: float | None = None
    request_rates: list[float] | None = None
    model: str = "default"
    speedup: float = 1.0
    timeout: float = 600.0
    ignore_eos: bool = False
    seed: int = 0
    rounds: int = 4
    min_requests: int = 16
    extra: dict = field(default_factory=dict)
    # Wall seconds between one target's level and the next (see bench/compare.py, SETTLE_POLLS).
    settle_s: float = 0.0

    def requests_for(self, level: int) -> int | None:
        if self.duration_per_level is not None and self.requests_per_level is None:
            return None
        return self.requests_per_level or max(self.min_requests, self.rounds * level)

    def as_dict(self) -> dict:
        return {"targets": dict(self.targets), "concurrency": self.concurrency, "max_tokens": self.max_tokens,
                "prompts": self.prompts, "requests_per_level": self.requests_per_level,
                "duration_per_level": self.duration_per_level, "request_rates": self.request_rates,
                "model": self.model, "speedup": self.speedup, "ignore_eos": self.ignore_eos, "seed": self.seed,
                "rounds": self.rounds, "settle_seconds": self.settle_s}


def config_from_args(ns: argparse.Namespace, targets: list[tuple[str, str]]) -> SweepConfig:
    return SweepConfig(targets=targets, concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                       prompts=ns.prompts, requests_per_level=ns.requests_per_level,
                       duration_per_level=ns.duration_per_level,
                       request_rates=getattr(ns, "request_rate", None), model=ns.model,
                       speedup=ns.speedup, timeout=ns.timeout, ignore_eos=ns.ignore_eos, seed=ns.seed,
                       rounds=ns.rounds)


class ProgressBar:
    """One self-rewriting stderr line on a terminal; one line per finished level otherwise."""

    def __init__(self, total_levels: int, stream=None) -> None:
        self.total = total_levels
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.label = ""
        self._last = 0.0

    def start_level(self, label: str) -> None:
        self.label = label
        self._last = 0.0
        self.update(0, None)

    def update(self, finished: int, expected: int | None) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last < 0.2 and finished != expected:
            return
        self._last = now
        frac = (self.done + (finished / expected if expected else 0.0)) / max(self.total, 1)
        bar = "#" * int(frac * 30)
        count = f"{finished}/{expected}" if expected else f"{finished}"
        self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {self.label} {count} req   ")
        self.stream.flush()

    def end_level(self, summary: str) -> None:
        self.done += 1
        if self.tty:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(f"[{self.done}/{self.total}] {self.label}: {summary}\n")
        self.stream.flush()


async def run_sweep(cfg: SweepConfig, quiet: bool = False) -> dict[str, list[dict]]:
    """Every level, every target in turn (interleaved so drift hits all targets alike) -> figures."""
    prompts = load_prompts(cfg.prompts)
    for _, url in cfg.targets:
        await check_reachable(url)
    extra = dict(cfg.extra)
    if cfg.ignore_eos:
        extra["ignore_eos"] = True
    levels: list = cfg.request_rates or cfg.concurrency
    results: dict[str, list[dict]] = {name: [] for name, _ in cfg.targets}
    bar = ProgressBar(len(levels) * len(cfg.targets), stream=None if not quiet else _Null())
    for level in levels:
        for name, url in cfg.targets:
            if cfg.request_rates:
                # Default: about 30 s of arrivals in the target's own time.
                n = cfg.requests_per_level
                if n is None and cfg.duration_per_level is None:
                    n = max(16, int(level * 30))
            else:
                n = cfg.requests_for(level)
            spec = LoadSpec(url=url, prompts=prompts, model=cfg.model, max_tokens=cfg.max_tokens,
                            requests=n, duration=cfg.duration_per_level, timeout=cfg.timeout,
                            extra_body=extra, seed=cfg.seed,
                            level_timeout=level_cap(n, cfg.duration_per_level, cfg.timeout,
                                                    None if cfg.request_rates else level,
                                                    level * cfg.speedup if cfg.request_rates else None))
            if cfg.settle_s > 0:
                await asyncio.sleep(cfg.settle_s)
            bar.start_level(f"{name} {'rate' if cfg.request_rates else 'c'}={level:g}")
            if cfg.request_rates:
                # The rate is stated in the target's time; its clock runs K times faster than the wall clock.
                run = await run_open(spec, level * cfg.speedup, progress=bar.update)
                run.request_rate = level
            else:
                run = await run_closed(spec, level, progress=bar.update)
            run.accept_length = await read_accept_length(url)
            fig = figures.compute(run, cfg.speedup)
            results[name].append(fig)
            bar.end_level(f"{fig['output_throughput']:.1f} tok/s, TTFT p50 {fig['median_ttft_ms']:.0f} ms, "
                          f"{fig['completed']} ok, {fig['failed']} failed")
            if fig["completed"] == 0 and fig["failed"]:
                first = next(iter(fig["errors"]), "unknown error")
                print(f"warning: every request to {name} failed at this level: {first}", file=sys.stderr)
    return results


def level_cap(requests: int | None, duration: float | None, timeout: float, concurrency: int | None,
              rate: float | None) -> float:
    """Wall-time cap of one level: what its bounds allow if every request used its whole timeout,
    plus a minute; never shorter than a legitimate run, never unbounded."""
    caps = []
    if duration is not None:
        caps.append(duration + timeout)
    if requests is not None:
        if concurrency:
            caps.append(-(-requests // concurrency) * timeout)
        elif rate:
            caps.append(requests / rate + timeout)
    return min(caps) + 60.0


class _Null:
    def write(self, _s: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def write_outputs(out: Path, stem: str, cfg: dict, results: dict[str, list[dict]], title: str = "",
                  plot: bool = True, extra: dict | None = None,
                  gpus: dict[str, int | None] | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.csv"]
    figures.write_json(paths[0], {"config": cfg, "results": results, **(extra or {})})
    figures.write_csv(paths[1], results, gpus)
    if plot:
        paths.append(figures.plot(out / f"{stem}.png", results, title=title, gpus=gpus))
    return paths
