"""Kimi's Mooncake trace as the bench reads it: one request a line (timestamp, prompt and output lengths, the
prompt's 512-token blocks by hash id), parsed with one-line errors, and the workload a replay sends from it (the
sessions, a time window, whole conversations sampled). Shared by `replay` and `plan --fleet`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.load import BenchInputError

BLOCK_TOKENS = 512  # Mooncake's hash_ids name blocks of 512 prompt tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int


def _field(obj: dict, name: str, where: str, *, minimum: int, integer: bool = True) -> float:
    if name not in obj:
        raise BenchInputError(f"{where}: missing field '{name}'")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int if integer else int | float) or (
            isinstance(v, float) and not math.isfinite(v)):
        raise BenchInputError(f"{where}: '{name}' must be {'an integer' if integer else 'a number'}, got {v!r}")
    if v < minimum:
        raise BenchInputError(f"{where}: '{name}' must be >= {minimum}, got {v!r}")
    return v


def parse_trace(text: str, name: str) -> list[TraceRequest]:
    """Mooncake JSONL: {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [int, ...]}."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchInputError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise BenchInputError(f"{where}: expected a JSON object with timestamp, input_length, "
                                  "output_length, hash_ids")
        ts = _field(obj, "timestamp", where, minimum=0, integer=False)
        n_in = _field(obj, "input_length", where, minimum=1)
        n_out = _field(obj, "output_length", where, minimum=0)
        ids = obj.get("hash_ids")
        if "hash_ids" not in obj:
            raise BenchInputError(f"{where}: missing field 'hash_ids'")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
            raise BenchInputError(f"{where}: 'hash_ids' must be a non-empty list of non-negative integers")
        if not (len(ids) - 1) * BLOCK_TOKENS < n_in <= len(ids) * BLOCK_TOKENS:
            raise BenchInputError(f"{where}: {len(ids)} hash_ids of {BLOCK_TOKENS} tokens cannot hold "
                                  f"input_length {n_in}")
        out.append(TraceRequest(float(ts), int(n_in), int(n_out), tuple(ids), lineno))
    if not out:
        raise BenchInputError(f"{name}: no requests found")
    out.sort(key=lambda r: r.timestamp_ms)  # bench_serving sorts by timestamp too
    return out


def load_trace(path: Path) -> list[TraceRequest]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchInputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchInputError(f"{path}: cannot read ({exc})") from None
    return parse_trace(text, str(path))


@dataclass
class Session:
    """One arrival: a trace line (its rounds sent at once, as bench_serving does) or a synthetic conversation
    (each turn after the previous reply and a think time)."""

    at: float  # seconds after the workload's start, in the target's (simulated) time, before slowdown
    trace: TraceRequest | None = None
    turns: int = 1
    index: int = 0


@dataclass
class Workload:
    kind: str  # "trace" | "synthetic"
    sessions: list[Session]
    description: str
    token_scale: float = 1.0
    num_rounds: int = 1
    # synthetic: stated parameters
    params: dict = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(s.turns for s in self.sessions)

    @property
    def span_s(self) -> float:
        return (self.sessions[-1].at - self.sessions[0].at) if self.sessions else 0.0


def conversation(req: TraceRequest) -> int:
    """Which conversation a line belongs to: its first block after the system prompt every line shares (block 0).
    Lines of one conversation share that block, so keeping whole conversations keeps their prefix reuse."""
    return req.hash_ids[1] if len(req.hash_ids) > 1 else req.hash_ids[0]


def trace_workload(reqs: list[TraceRequest], path: str, *, limit: int | None, window: tuple[float, float | None],
                   token_scale: float, num_rounds: int, sample: int = 1) -> Workload:
    start, end = window
    t0 = reqs[0].timestamp_ms
    chosen = [r for r in reqs if (r.timestamp_ms - t0) / 1000.0 >= start
              and (end is None or (r.timestamp_ms - t0) / 1000.0 < end)
              and (sample == 1 or conversation(r) % sample == 0)]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise BenchInputError(f"{path}: no request in the window {start:g}s..{'end' if end is None else f'{end:g}s'}")
    first = chosen[0].timestamp_ms
    sessions = [Session(at=(r.timestamp_ms - first) / 1000.0, trace=r, turns=num_rounds, index=i)
                for i, r in enumerate(chosen)]
    lines = f"lines {chosen[0].line}..{chosen[-1].line}"
    kept = "" if sample == 1 else f", one conversation in {sample} (second block id % {sample} == 0)"
    return Workload("trace", sessions, f"{path} ({len(chosen)} sessions, {lines}{kept})", token_scale, num_rounds)
