"""`spec-bench modelcheck`: record what the router observes under load, replay it through speed models."""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import aiohttp

from bench import procs
from bench.calibration import model_curve
from bench.cli import ArgError, parser, run_async
from bench.cli import profile as load_profile
from bench.load import BenchInputError, LoadSpec, load_prompts, run_closed
from bench.sim.profiles import ProfileError
from router.adaptive import sample
from router.curves import fit_token_time, parse_curve
from router.observe import Observation
from router.speedmodel import Params, SpeedModel

# (pool, n running, seconds per token per request, phase) in the order the router saw them.
Sample = tuple[str, float, float, str]


# ---- the models compared (each: predict(n) -> seconds per token per request, then update(n, y))
class Fixed:
    """A curve calibrated once (a + b*n from a calibration run), never updated: what `balanced` routes on."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta

    def predict(self, n: float) -> float:
        return self.alpha + self.beta * n

    def update(self, n: float, y: float) -> None:
        pass


class EwmaRequest:
    """EWMA of each request's own seconds per token, blind to load: 'how fast was this pool lately'."""

    def __init__(self, gain: float = 0.05) -> None:
        self.gain, self.y = gain, None

    def predict(self, n: float) -> float:
        return self.y if self.y is not None else math.nan

    def update(self, n: float, y: float) -> None:
        self.y = y if self.y is None else self.y + self.gain * (y - self.y)


class EwmaPool:
    """EWMA of the pool's throughput n/y (tok/s of the server): a request at load n then gets X/n."""

    def __init__(self, gain: float = 0.05) -> None:
        self.gain, self.x = gain, None

    def predict(self, n: float) -> float:
        return n / self.x if self.x else math.nan

    def update(self, n: float, y: float) -> None:
        x = n / y
        self.x = x if self.x is None else self.x + self.gain * (x - self.x)


class Fitted:
    """router.speedmodel.SpeedModel (a + b*n, robust, forgetting, per-band shape) behind the same two calls;
    `shape=False`: its straight line alone."""

    def __init__(self, forgetting: float, shape: bool = True) -> None:
        self.m = SpeedModel(forgetting)
        self.shape = shape

    def predict(self, n: float) -> float:
        if not self.m.samples:
            return math.nan
        p = self.m.params()
        return p.token_time(n) if self.shape else Params(p.alpha, p.beta).token_time(n)

    def update(self, n: float, y: float) -> None:
        self.m.update(n, y)


def replay(samples: Sequence[Sample], make: Callable[[str], object]) -> dict[tuple[str, str], list[float]]:
    """One-step-ahead relative errors |predicted - measured| / measured, by (pool, phase): each sample is
    predicted by the pool's model from the samples before it only, then folded in."""
    models: dict[str, object] = {}
    errs: dict[tuple[str, str], list[float]] = {}
    for pool, n, y, phase in samples:
        m = models.get(pool)
        if m is None:
            m = models[pool] = make(pool)
        p = m.predict(n)
        if math.isfinite(p):
            errs.setdefault((pool, phase), []).append(abs(p - y) / y)
        m.update(n, y)
    return errs


def summary(errs: dict[tuple[str, str], list[float]]) -> dict[str, dict[str, float]]:
    """Median and 90th percentile of the errors per pool and phase."""
    out = {}
    for (pool, phase), e in sorted(errs.items()):
        xs = sorted(e)
        out[f"{pool}/{phase}"] = {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))],
                                  "n": len(xs)}
    return out


def variants(fixed: dict[str, tuple[float, float]]) -> dict[str, Callable[[str], object]]:
    return {
        "adaptive: a+b*n, robust, forgetting 0.99": lambda pool: Fitted(0.99),
        "its line alone (no per-band shape)": lambda pool: Fitted(0.99, shape=False),
        "a+b*n without forgetting (128 samples per band)": lambda pool: Fitted(1.0),
        "EWMA of per-request tok/s (no load term)": lambda pool: EwmaRequest(),
        "EWMA of per-pool tok/s": lambda pool: EwmaPool(),
        "fixed curve (calibrated before the run)": lambda pool: Fixed(*fixed[pool]),
    }


def evaluate(data: dict) -> tuple[str, dict]:
    """The table of every model's error on a recording (JSON from `--record`)."""
    limits = data["max_running"]
    samples: list[Sample] = []
    for o in data["observations"]:
        phase = o.pop("phase")
        o.pop("t", None)
        got = sample(Observation(**o), limits.get(o["pool"]))
        if got is not None:
            samples.append((o["pool"], got[0], got[1], phase))
    fixed = {pool: tuple(v) for pool, v in data["fixed"].items()}
    result = {name: summary(replay(samples, make)) for name, make in variants(fixed).items()}
    keys = sorted({k for r in result.values() for k in r})
    lines = [f"one-step-ahead error of seconds per token per request (median / p90), {len(samples)} samples:",
             "", "| model | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, r in result.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{r[k]['median']:.1%} / {r[k]['p90']:.1%}" if k in r else "-" for k in keys) + " |")
    return "\n".join(lines), result


# ---- recording
async def _drift(url: str, accept: float) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/drift", json={"accept_length": accept}) as r:
        if r.status != 200:
            raise BenchInputError(f"drift on {url}: HTTP {r.status}")


async def record(ns) -> dict:
    """Both simulators, the adaptive router in this process (its observations tapped), closed-loop levels;
    with --drift-after, the speculative server's acceptance changes after that many levels."""
    from router.app import build_app, start
    from router.settings import load_settings
    from router.state import STATE

    with procs.ProcGroup() as group:
        su = group.add(procs.start_sim(ns.speculative_profile, ns.speedup, "speculative sim")).url
        bu = group.add(procs.start_sim(ns.baseline_profile, ns.speedup, "baseline sim")).url
        settings = load_settings(None, {"policy": "adaptive", "speculative": [su], "baseline": [bu],
                                        "load_signal": "backend", "load_interval": 0.5}, environ={})
        app = build_app(settings)
        runner, url = await start(app, "127.0.0.1", 0)
        pools = app[STATE].pools
        tapped: list[dict] = []
        phase = ["before"]
        t0 = time.monotonic()
        orig = pools.report_done

        def tap(backend, obs: Observation, placement=None) -> None:
            tapped.append(asdict(obs) | {"phase": phase[0], "t": round(time.monotonic() - t0, 3)})
            orig(backend, obs, placement)

        pools.report_done = tap
        try:
            prompts = load_prompts("coding")
            for i, c in enumerate(ns.levels):
                if ns.drift_after is not None and i == ns.drift_after:
                    await _drift(su, ns.accept_after)
                    phase[0] = "after"
                spec = LoadSpec(url=url, prompts=prompts, max_tokens=ns.max_tokens, requests=max(ns.rounds * c, 16),
                                timeout=600.0, level_timeout=1800.0)
                run = await run_closed(spec, c)
                print(f"c={c}: {sum(1 for r in run.records if r.ok)} requests", file=sys.stderr)
        finally:
            await runner.cleanup()
    return {"observations": tapped}


def main(argv: list[str]) -> int:
    p = parser("modelcheck", __doc__)
    p.add_argument("file", type=Path, help="recording (JSON): written with --record, else read and replayed")
    p.add_argument("--record", action="store_true", help="run the simulators and the router and write FILE")
    p.add_argument("--speculative-profile", default="eagle3-good-tp8",
                   help="--record: simulator profile of the speculative server (default eagle3-good-tp8)")
    p.add_argument("--baseline-profile", default="baseline-tp8",
                   help="--record: simulator profile of the baseline server (default baseline-tp8)")
    p.add_argument("--speedup", type=float, default=5.0, help="--record: simulator clock speed-up (default 5)")
    p.add_argument("--levels", default="5,30,100,10,70,2,30,100,5,250",
                   help="closed-loop concurrency levels in order (comma-separated)")
    p.add_argument("--rounds", type=int, default=3, help="requests per client per level (at least 16 a level)")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens of every request (default 512)")
    p.add_argument("--drift-after", type=int, default=None, metavar="K",
                   help="change the speculative server's acceptance after the first K levels")
    p.add_argument("--accept-after", type=float, default=1.6,
                   help="--drift-after: the speculative server's mean accept length after the change (default 1.6)")
    try:
        ns = p.parse_args(argv)
        ns.levels = [int(x) for x in ns.levels.split(",") if x.strip()]
        if not ns.levels or min(ns.levels) < 1 or ns.speedup <= 0 or ns.rounds < 1:
            raise ArgError("--levels must be positive integers, --speedup and --rounds > 0")
        if ns.record:
            spec, base = load_profile(ns.speculative_profile), load_profile(ns.baseline_profile)
    except (ArgError, ValueError, ProfileError) as exc:
        print(f"spec-bench modelcheck: {exc}", file=sys.stderr)
        return 2
    try:
        if ns.record:
            data = run_async(record(ns))
            # The calibration a person would have pasted: each profile's model curve, in the router's (wall)
            # seconds, before any drift.
            fixed = {}
            for pool, prof in (("speculative", ns.speculative_profile), ("baseline", ns.baseline_profile)):
                pts = parse_curve(model_curve(prof, ns.max_tokens))
                fixed[pool] = fit_token_time([(c, tok * ns.speedup) for c, tok in pts])
            data |= {"max_running": {"speculative": spec.max_running_requests,
                                     "baseline": base.max_running_requests},
                     "fixed": fixed, "command": "spec-bench modelcheck " + " ".join(argv)}
            ns.file.write_text(json.dumps(data), encoding="utf-8")
        data = json.loads(ns.file.read_text(encoding="utf-8"))
        text, _ = evaluate(data)
    except (OSError, ValueError, KeyError, TypeError, BenchInputError, procs.ProcError) as exc:
        print(f"spec-bench modelcheck: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
