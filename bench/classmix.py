"""The class mix of `spec-bench replay`: which share of a workload's conversations carries which latency targets,
how a class is sent (llm-d's `x-slo-ttft-ms` / `x-slo-tpot-ms` headers, OpenAI's `service_tier` in the body), and
each class's goodput, judged client-side against its own targets whatever the target did with them."""
from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from bench import figures
from bench.load import RequestRecord

TTFT_HEADER, TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"  # llm-d's names
# The documented default: three tenths of the conversations are interactive (a chat or an agent step waiting on
# every token: TTFT 5 s, the SLO every earlier replay in docs/BENCH.md used, and TPOT 30 ms, about 33 tokens/s);
# half carry no target (OpenAI's default tier, nothing sent); a fifth are `flex`, sheddable (a 429 is not a
# failure), judged against the targets the router's default `flex` tier names (router.settings: 30 s, 100 ms).
DEFAULT_MIX = "interactive=0.3,default=0.5,flex=0.2"
DEFAULT_TARGETS = {"interactive": (5000.0, 30.0), "flex": (30000.0, 100.0)}
DEFAULT_TIERS = {"flex": "flex"}
NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class MixError(ValueError):
    """A class-mix flag that cannot be used: one line for the CLI (exit 2)."""


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    share: float
    ttft_ms: float | None = None  # the class's targets; None = no target of that kind
    tpot_ms: float | None = None
    tier: str | None = None  # `service_tier` sent in the body

    @property
    def targets(self) -> str:
        parts = [f"TTFT {self.ttft_ms:g} ms" if self.ttft_ms is not None else "",
                 f"TPOT {self.tpot_ms:g} ms" if self.tpot_ms is not None else ""]
        return ", ".join(p for p in parts if p) or "none (completion counts)"

    def headers(self, send: bool, speedup: float = 1.0) -> dict[str, str]:
        """The request headers of this class; none when targets are not sent. A target runs `speedup` times faster
        than the deployment it stands for (simulators), so its router sees the targets divided by `speedup`."""
        if not send:
            return {}
        out = {}
        if self.ttft_ms is not None:
            out[TTFT_HEADER] = f"{self.ttft_ms / speedup:g}"
        if self.tpot_ms is not None:
            out[TPOT_HEADER] = f"{self.tpot_ms / speedup:g}"
        return out

    def body(self, send: bool) -> dict:
        """Fields this class adds to the request body; none when targets are not sent."""
        return {"service_tier": self.tier} if send and self.tier else {}


def _name(text: str, flag: str) -> str:
    name = text.strip()
    if not NAME_RE.match(name):
        raise MixError(f"{flag}: class name {name!r} must be lower-case letters, digits, '_' or '-' "
                       "(starting with a letter)")
    return name


def _pairs(text: str, flag: str, sep: str = ",") -> list[tuple[str, str]]:
    out = []
    for part in text.split(sep):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        if not eq:
            raise MixError(f"{flag}: expected CLASS=VALUE, got {part.strip()!r}")
        out.append((_name(name, flag), value.strip()))
    if not out:
        raise MixError(f"{flag}: empty")
    return out


def parse_mix(text: str) -> dict[str, float]:
    """`interactive=0.3,default=0.5,flex=0.2` -> shares in order; they must add up to 1."""
    shares: dict[str, float] = {}
    for name, value in _pairs(text, "--class-mix"):
        try:
            share = float(value)
        except ValueError:
            raise MixError(f"--class-mix: share of {name!r} must be a number, got {value!r}") from None
        if not (math.isfinite(share) and 0 <= share <= 1):
            raise MixError(f"--class-mix: share of {name!r} must be between 0 and 1, got {value}")
        if name in shares:
            raise MixError(f"--class-mix: class {name!r} given twice")
        shares[name] = share
    total = sum(shares.values())
    if abs(total - 1.0) > 1e-6:
        raise MixError(f"--class-mix: shares add up to {total:g}, not 1")
    return shares


def parse_targets(text: str) -> tuple[str, float | None, float | None]:
    """`interactive=ttft:2000,tpot:50` (either may be left out; `CLASS=none` clears a default) -> (class, ttft, tpot)."""
    name, eq, rest = text.partition("=")
    if not eq:
        raise MixError(f"--class-targets: expected CLASS=ttft:MS,tpot:MS, got {text!r}")
    name = _name(name, "--class-targets")
    if rest.strip() == "none":
        return name, None, None
    got: dict[str, float] = {}
    for part in rest.split(","):
        key, colon, value = part.strip().partition(":")
        if not colon or key not in ("ttft", "tpot") or key in got:
            raise MixError(f"--class-targets: expected CLASS=ttft:MS,tpot:MS (each at most once), got {text!r}")
        try:
            ms = float(value)
        except ValueError:
            raise MixError(f"--class-targets: {key} of {name!r} must be a number of ms, got {value!r}") from None
        if not (math.isfinite(ms) and ms > 0):
            raise MixError(f"--class-targets: {key} of {name!r} must be a positive number of ms, got {value!r}")
        got[key] = ms
    return name, got.get("ttft"), got.get("tpot")


def parse_tier(text: str) -> tuple[str, str | None]:
    """`flex=flex`: the class sends `service_tier: flex` in the body; `CLASS=none` sends none."""
    name, eq, tier = text.partition("=")
    tier = tier.strip()
    if not eq or not NAME_RE.match(tier):
        raise MixError(f"--class-tier: expected CLASS=TIER (one pair per flag), got {text!r}")
    return _name(name, "--class-tier"), None if tier == "none" else tier


def build(mix: str, targets: Sequence[str] = (), tiers: Sequence[str] = ()) -> list[RequestClass]:
    """The classes of a mix, each with the default targets and tier of its name unless a flag says otherwise."""
    shares = parse_mix(mix)
    tgt = {n: DEFAULT_TARGETS.get(n, (None, None)) for n in shares}
    tier = {n: DEFAULT_TIERS.get(n) for n in shares}
    for text in targets:
        name, ttft, tpot = parse_targets(text)
        if name not in shares:
            raise MixError(f"--class-targets: class {name!r} is not in the mix ({', '.join(shares)})")
        tgt[name] = (ttft, tpot)
    for text in tiers:
        name, t = parse_tier(text)
        if name not in shares:
            raise MixError(f"--class-tier: class {name!r} is not in the mix ({', '.join(shares)})")
        tier[name] = t
    return [RequestClass(n, s, *tgt[n], tier[n]) for n, s in shares.items()]


def assign(key: int, seed: int, classes: Sequence[RequestClass]) -> RequestClass:
    """The class of conversation `key`: one uniform draw seeded by (seed, key), so a conversation keeps one class
    across its turns, runs and targets, and other conversations do not move it."""
    u = random.Random(f"class-mix {seed} {key}").random()
    acc = 0.0
    for c in classes:
        acc += c.share
        if u < acc:
            return c
    return next(c for c in reversed(classes) if c.share > 0)  # u within rounding of 1


def is_shed(rec: RequestRecord) -> bool:
    """Answered 429 (a sheddable request the target refused: counted apart, not as a failure)."""
    return rec.error is not None and rec.error.startswith("HTTP 429")


def meets(rec: RequestRecord, c: RequestClass, speedup: float) -> bool:
    """Completed and within both of the class's targets (in the target's time); a one-token answer has no TPOT."""
    if not rec.ok:
        return False
    k = float(speedup)
    if c.ttft_ms is not None and (rec.ttft is None or rec.ttft * k * 1000 > c.ttft_ms):
        return False
    t = figures.tpot(rec.latency, rec.ttft, rec.output_tokens) if rec.ttft is not None else None
    return not (c.tpot_ms is not None and t is not None and t * k * 1000 > c.tpot_ms)


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": (figures.percentile(values, q) if values else None) for q in (50, 90, 99)}


def score(records: Sequence[tuple[RequestRecord, str]], classes: Sequence[RequestClass], *, speedup: float,
          duration_s: float) -> dict:
    """Goodput overall and per class: requests meeting their class's targets per second of `duration_s` (the
    target's time); attainment = met / (requests - shed); TTFT/TPOT percentiles of the completed ones (ms)."""
    k = float(speedup)
    by_name = {c.name: c for c in classes}
    per: dict[str, dict] = {}
    for c in classes:
        mine = [r for r, n in records if n == c.name]
        shed = sum(is_shed(r) for r in mine)
        ok = [r for r in mine if r.ok]
        good = sum(meets(r, c, k) for r in mine)
        tpots = [t * k * 1000 for r in ok if r.ttft is not None
                 and (t := figures.tpot(r.latency, r.ttft, r.output_tokens)) is not None]
        asked = len(mine) - shed
        per[c.name] = {
            "share": c.share, "ttft_target_ms": c.ttft_ms, "tpot_target_ms": c.tpot_ms, "tier": c.tier,
            "requests": len(mine), "shed": shed, "failed": len(mine) - shed - len(ok), "completed": len(ok),
            "good": good, "attainment": good / asked if asked else None,
            "goodput": good / duration_s if duration_s > 0 else 0.0,
            "output_throughput": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else 0.0,
            "ttft_ms": _pcts([r.ttft * k * 1000 for r in ok if r.ttft is not None]), "tpot_ms": _pcts(tpots)}
    unknown = {n for _, n in records if n not in by_name}
    if unknown:
        raise ValueError(f"records of classes not in the mix: {sorted(unknown)}")
    good = sum(p["good"] for p in per.values())
    return {"goodput": good / duration_s if duration_s > 0 else 0.0, "good": good,
            "shed": sum(p["shed"] for p in per.values()), "classes": per}


# Goodput over time from a cold start: the run's requests in the order they were sent, cut into WINDOWS windows of
# equal count; the warm-up ends at the first window from which every window's goodput stays within BAND of the
# mean of the last half of the windows (the run's settled goodput, as far as one run shows it).
WINDOWS, BAND = 4, 0.10


def over_time(records: Sequence[tuple[RequestRecord, str]], classes: Sequence[RequestClass], *, speedup: float,
              windows: int = WINDOWS, band: float = BAND) -> dict | None:
    """Each window scored by `score` over its own span (first start to last end of its requests less 429s, in the
    target's time, as the whole run's goodput is), its send rate (its requests over the time from its first send to
    the next window's first; the last window: to its own last send), goodput and each targeted class's attainment;
    then the warm-up in requests: those sent before the first window that stays within `band`. None without
    requests; `warm_from` None when even the last windows do not stay within the band."""
    order = sorted(records, key=lambda x: x[0].start)
    n = min(windows, len(order))
    if n == 0:
        return None
    k = float(speedup)
    targeted = [c.name for c in classes if c.ttft_ms is not None or c.tpot_ms is not None]
    sizes = [len(order) // n + (i < len(order) % n) for i in range(n)]
    out: list[dict] = []
    first = 0
    for size in sizes:
        part = order[first:first + size]
        kept = [r for r, _ in part if not is_shed(r)]
        span = (max(r.end for r in kept) - min(r.start for r in kept)) * k if kept else 0.0
        nxt = order[first + size][0].start if first + size < len(order) else part[-1][0].start
        sent_span = (nxt - part[0][0].start) * k
        count = size if first + size < len(order) else size - 1  # the last window: gaps between its own sends
        s = score(part, classes, speedup=k, duration_s=span)
        out.append({"first": first, "requests": size, "span_s": span,
                    "sent_rate": count / sent_span if sent_span > 0 else None,
                    "goodput": s["goodput"], "good": s["good"], "shed": s["shed"],
                    "attainment": {c: s["classes"][c]["attainment"] for c in targeted}})
        first += size
    tail = out[n - max(1, n // 2):]
    ref = sum(w["goodput"] for w in tail) / len(tail)
    warm = None
    for i in range(n - 1, -1, -1):  # walk back from the end while every window stays within the band
        if abs(out[i]["goodput"] - ref) > band * ref:
            break
        warm = i
    return {"windows": out, "band": band, "reference_windows": len(tail), "reference_goodput": ref,
            "warm_from": warm, "warmup_requests": None if warm is None else out[warm]["first"]}
