"""`spec-bench fit`: fit a profile's step model to a measured concurrency/throughput table (reproducible)."""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist

from bench.cli import ArgError, parser
from bench.sim.engine import ACCEPT_Z_CLIP, _accept_rate, request_accept_length
from bench.sim.profiles import EAGLE_DEFAULT_MAX_RUNNING, Profile, ProfileError, load_profile

# caps tried for a server whose --max-running-requests the table does not say (the best fit wins)
CAP_CANDIDATES = (64, 70, 80, 96, 100, 128, 160, 192, 256, 384, 512, 1024)


class FitError(ValueError):
    """Bad input for a fit; the message is one line for the CLI."""


def _prompt(prompt_tokens: float) -> tuple[int, int]:
    """(tokens, causal attention pairs) of one uncached prompt's prefill, for Profile.prefill_ms."""
    n = int(round(prompt_tokens))
    return n, n * (n + 1) // 2


@lru_cache(maxsize=64)
def expected_steps(tokens: int, accept_length: float, num_steps: int) -> float:
    """Expected decode steps to produce `tokens` tokens when each step gains 1..num_steps+1 of them."""
    if accept_length <= 1.0:
        return float(tokens)
    a = _accept_rate(accept_length, num_steps)
    probs = [(a**i) * (1 - a) for i in range(num_steps)] + [a**num_steps]  # gain 1, 2, ..., num_steps+1
    e = [0.0] * (tokens + 1)
    for r in range(1, tokens + 1):
        e[r] = 1.0 + sum(p * e[max(r - (i + 1), 0)] for i, p in enumerate(probs))
    return e[tokens]


# equally likely z values of a request's accept length around its class mean (the engine's clipped normal)
_Z_POINTS = 16
_ZS = tuple(max(-ACCEPT_Z_CLIP, min(ACCEPT_Z_CLIP, NormalDist().inv_cdf((i + 0.5) / _Z_POINTS)))
            for i in range(_Z_POINTS))


def mean_steps(profile: Profile, tokens: int, accept_length: float) -> float:
    """Expected decode steps for `tokens` tokens, averaged over the requests' own accept lengths."""
    if not profile.speculative or accept_length <= 1.0:
        return float(tokens)
    if not profile.accept_length_spread:
        return expected_steps(tokens, accept_length, profile.speculative_num_steps)
    return sum(expected_steps(tokens, request_accept_length(profile, accept_length, z), profile.speculative_num_steps)
               for z in _ZS) / len(_ZS)


def kv_ms(profile: Profile, n: int, max_tokens: int, prompt_tokens: float) -> float:
    """The KV-read part of a decode step of n requests, each holding its prompt and on average half its output."""
    return profile.kv_ms_per_ktoken * n * (prompt_tokens + max_tokens / 2.0) / 1000.0


def predict(profile: Profile, concurrency: int, max_tokens: int, prompt_tokens: float,
            accept_length: float | None = None) -> float:
    """Closed-loop output throughput (tok/s) the engine model gives at this concurrency."""
    n = min(concurrency, profile.max_running_requests)
    length = accept_length or (profile.accept_length_general if profile.speculative else 1.0)
    steps = 1 + mean_steps(profile, max_tokens - 1, length)
    # each request's cycle holds its own decode steps plus one admission (prefill) per batch slot
    step = profile.step_ms(n) + kv_ms(profile, n, max_tokens, prompt_tokens)
    cycle_ms = steps * step + n * profile.prefill_ms(*_prompt(prompt_tokens))
    return n * max_tokens / (cycle_ms / 1000.0)


def read_table(path: Path, column: str) -> list[tuple[int, float]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise FitError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    fields = reader.fieldnames or []
    if "concurrency" not in fields:
        raise FitError(f"{path}: needs a 'concurrency' column (has {', '.join(fields) or 'none'})")
    if column not in fields:
        raise FitError(f"{path}: no column {column!r}; columns are {', '.join(fields)}")
    rows = []
    for i, row in enumerate(reader, start=2):
        try:
            c, v = int(row["concurrency"]), float(row[column])
        except (TypeError, ValueError):
            raise FitError(f"{path}: row {i}: concurrency and {column} must be numbers") from None
        if c < 1 or v <= 0:
            raise FitError(f"{path}: row {i}: concurrency must be >= 1 and throughput > 0")
        rows.append((c, v))
    if len(rows) < 2:
        raise FitError(f"{path}: need at least 2 rows to fit, found {len(rows)}")
    return rows


def _least_squares(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve the normal equations (A^T A) x = A^T b by Gaussian elimination; None if singular."""
    k = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(k)] + [sum(r[i] * v for r, v in zip(a, b, strict=True))]
         for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]


def _solve(rows, cap, base: Profile, max_tokens, prompt_tokens, quadratic) -> Profile | None:
    """Least squares on step time (relative error) for one cap; None if no positive solution."""
    length = base.accept_length_general if base.speculative else 1.0
    steps = 1 + mean_steps(base, max_tokens - 1, length)
    xs, ys = [], []
    for c, thr in rows:
        n = min(c, cap)
        cycle_ms = n * max_tokens / thr * 1000.0
        step = (cycle_ms - n * base.prefill_ms(*_prompt(prompt_tokens))) / steps - kv_ms(base, n, max_tokens,
                                                                                            prompt_tokens)
        if step <= 0:
            return None
        xs.append(n)
        ys.append(step)
    # rows divided by y: minimise relative error
    design = [[1.0 / y, x / y] + ([x * x / y] if quadratic else []) for x, y in zip(xs, ys, strict=True)]
    coef = _least_squares(design, [1.0] * len(ys))
    if coef is None:
        return None
    if coef[0] <= 0 or coef[1] < 0 or (quadratic and coef[2] < 0):
        return None
    q = float(coef[2]) if quadratic else 0.0
    return base.model_copy(update={"decode_a_ms": round(float(coef[0]), 4), "decode_b_ms": round(float(coef[1]), 5),
                                   "decode_q_ms": round(q, 7), "max_running_requests": cap})


def _nelder_mead(f, x0: list[float], scale: list[float], iters: int = 400) -> list[float]:
    """Plain deterministic Nelder-Mead (the objective, a worst-case error, is not smooth)."""
    pts = [list(x0)] + [[x + (scale[i] if i == j else 0.0) for j, x in enumerate(x0)] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centroid = [sum(p[j] for p in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]

        worst = pts[-1]

        def toward(t: float, centroid=centroid, worst=worst) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]

        refl = toward(-1.0)
        fr = f(refl)
        if fr < vals[0]:
            exp = toward(-2.0)
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = toward(0.5)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [[b + 0.5 * (x - b) for b, x in zip(pts[0], p, strict=True)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = min(range(len(pts)), key=vals.__getitem__)
    return pts[best]


def _worst(prof: Profile, rows, max_tokens, prompt_tokens) -> float:
    return max(abs(predict(prof, c, max_tokens, prompt_tokens) / v - 1) for c, v in rows)


def _minimax(prof: Profile, rows, max_tokens, prompt_tokens, quadratic: bool) -> Profile:
    """Refine a least-squares start to the smallest worst-case relative error."""
    cap = prof.max_running_requests
    lo_n = min(min(c, cap) for c, _ in rows)

    length = prof.accept_length_general if prof.speculative else 1.0
    steps = 1 + mean_steps(prof, max_tokens - 1, length)
    prefill = prof.prefill_ms(*_prompt(prompt_tokens))
    # (batch size, measured, kv part of the step) per row: predict() without building a Profile each time
    data = [(min(c, cap), v, kv_ms(prof, min(c, cap), max_tokens, prompt_tokens)) for c, v in rows]

    def valid(a: float, b: float, q: float) -> bool:
        # the step must stay positive and not shrink as the batch grows, over the whole usable range
        return a > 0 and a + b * lo_n + q * lo_n * lo_n > 0 and b + 2 * q * cap >= 0 and b + 2 * q * lo_n >= 0

    def objective(x: list[float]) -> float:
        a, b, q = x[0], x[1], (x[2] if quadratic else 0.0)
        if not valid(a, b, q):
            return 1e9
        return max(abs(n * max_tokens * 1000.0 / (steps * (a + b * n + q * n * n + kv) + n * prefill) / v - 1)
                   for n, v, kv in data)

    def make(x: list[float]) -> Profile | None:
        a, b, q = x[0], x[1], (x[2] if quadratic else 0.0)
        if not valid(a, b, q):
            return None
        return prof.model_copy(update={"decode_a_ms": a, "decode_b_ms": b, "decode_q_ms": q})

    x0 = [prof.decode_a_ms, prof.decode_b_ms] + ([prof.decode_q_ms] if quadratic else [])
    scale = [0.2 * abs(v) + 1e-3 for v in x0[:2]] + ([1e-3 + abs(x0[2]) * 0.5] if quadratic else [])
    x = x0
    for _ in range(2):  # restarts help Nelder-Mead out of flat corners
        x = _nelder_mead(objective, x, scale)
    best = make(x) or prof
    return best.model_copy(update={"decode_a_ms": round(best.decode_a_ms, 4),
                                   "decode_b_ms": round(best.decode_b_ms, 5),
                                   "decode_q_ms": round(best.decode_q_ms, 8)})


def step_points(rows, prof: Profile, max_tokens: int, prompt_tokens: float) -> list[tuple[int, float]]:
    """The decode step (ms) each measured row implies at its batch size; rows sharing a batch size averaged."""
    length = prof.accept_length_general if prof.speculative else 1.0
    steps = 1 + mean_steps(prof, max_tokens - 1, length)
    by_n: dict[int, list[float]] = {}
    for c, thr in rows:
        n = min(c, prof.max_running_requests)
        cycle_ms = n * max_tokens / thr * 1000.0
        by_n.setdefault(n, []).append((cycle_ms - n * prof.prefill_ms(*_prompt(prompt_tokens))) / steps
                                      - kv_ms(prof, n, max_tokens, prompt_tokens))
    return [(n, round(sum(v) / len(v), 4)) for n, v in sorted(by_n.items())]


def fit(rows: list[tuple[int, float]], base: Profile, *, max_tokens: int, prompt_tokens: float,
        cap: int | None = None, shape: str = "line") -> tuple[Profile, list[tuple[int, float, float]]]:
    """The profile with the smallest worst relative error, and its (concurrency, measured, predicted) rows.

    shape "line": a + b*n (+ q*n^2) and the best cap. shape "points": that cap, then the step at every
    measured batch size, interpolated between them (reproduces each row; keeps the line for reference).
    """
    base = base.model_copy(update={"step_points_ms": None})
    caps = [cap] if cap else ([EAGLE_DEFAULT_MAX_RUNNING] if base.speculative else list(CAP_CANDIDATES))
    best = None
    for c in caps:
        for quadratic in (False, True):
            start = _solve(rows, c, base, max_tokens, prompt_tokens, False)
            if start is None:
                continue
            prof = _minimax(start, rows, max_tokens, prompt_tokens, quadratic)
            worst = _worst(prof, rows, max_tokens, prompt_tokens)
            # prefer the simpler (linear) model unless the quadratic one is clearly better
            key = worst + (0.005 if quadratic else 0.0)
            if best is None or key < best[0] - 1e-9:
                best = (key, prof)
    if best is None:
        raise FitError("no positive step model fits this table (check the column and --max-tokens)")
    prof = best[1]
    if shape == "points":
        pts = step_points(rows, prof, max_tokens, prompt_tokens)
        if len(pts) < 2 or any(ms <= 0 for _, ms in pts):
            raise FitError("the table implies a non-positive step time; check --max-tokens and --prompt-tokens")
        prof = prof.model_copy(update={"step_points_ms": pts})
    return prof, [(c, v, predict(prof, c, max_tokens, prompt_tokens)) for c, v in rows]


def build_parser() -> argparse.ArgumentParser:
    p = parser("fit", (
        "Fit the simulator's decode-step model (a + b*n [+ q*n^2] ms per step of n running requests) to a "
        "table of closed-loop output throughput by concurrency; write a profile JSON for --profile-file."))
    p.add_argument("--csv", required=True, type=Path, help="CSV with a 'concurrency' column ('#' lines ignored)")
    p.add_argument("--column", required=True, help="the throughput column (tok/s) to fit")
    p.add_argument("--out", required=True, type=Path, help="profile JSON to write")
    p.add_argument("--name", help="profile name (default: the --out file stem)")
    p.add_argument("--base", default=None, help="built-in profile to start from (default: baseline-tp8, or "
                                                 "eagle3-tp8 with --speculative)")
    p.add_argument("--speculative", action="store_true", help="the column was measured with EAGLE speculation")
    p.add_argument("--accept-length", type=float, help="mean accepted tokens per step of the measured prompts")
    p.add_argument("--accept-length-coding", type=float, help="same for coding prompts (default: --accept-length)")
    p.add_argument("--max-running-requests", type=int, help="the server's cap (default: 48 with speculation, "
                                                             "else the best-fitting of a few)")
    p.add_argument("--max-tokens", type=int, default=512, help="output tokens per request in the measurement")
    p.add_argument("--prompt-tokens", type=float, default=23.0, help="mean prompt tokens per request")
    p.add_argument("--prefill-base-ms", type=float, help="fixed cost of a prefill (not identifiable from "
                                                         "throughput alone; default: the base profile's)")
    p.add_argument("--prefill-ms-per-token", type=float, help="prefill cost per prompt token (ms)")
    p.add_argument("--kv-ms-per-ktoken", type=float, help="decode-step cost per 1000 tokens held by the batch "
                                                          "(attention reads; not identifiable from a table of short "
                                                          "prompts; default: the base profile's)")
    p.add_argument("--accept-length-spread", type=float, help="standard deviation of each request's own accept "
                                                              "length around its class mean (default: the base's)")
    p.add_argument("--shape", choices=["line", "points"], default="line",
                   help="line: a + b*n [+ q*n^2] (default); points: also keep the step each row implies and "
                        "interpolate between them, so the model reproduces every measured row")
    p.add_argument("--tp", type=int, help="tensor-parallel size to report")
    p.add_argument("--description", default=None, help="the profile's description (default: the base profile's)")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ArgError as exc:
        print(f"spec-bench fit: {exc}", file=sys.stderr)
        return 2
    try:
        profile, pred = run(args)
    except (FitError, ProfileError) as exc:
        print(f"spec-bench fit: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: a={profile.decode_a_ms} ms, b={profile.decode_b_ms} ms/req, "
          f"q={profile.decode_q_ms} ms/req^2, max_running_requests={profile.max_running_requests}")
    if profile.step_points_ms:
        print("step points (n, ms): " + ", ".join(f"({n}, {ms:g})" for n, ms in profile.step_points_ms))
    print("concurrency  measured  model  error")
    for c, v, p in pred:
        print(f"{c:>11}  {v:>8.1f}  {p:>5.1f}  {100 * (p / v - 1):+5.1f}%")
    return 0


def run(args: argparse.Namespace) -> tuple[Profile, list[tuple[int, float, float]]]:
    if args.max_tokens < 2:
        raise FitError("--max-tokens must be >= 2")
    if args.prompt_tokens < 0:
        raise FitError("--prompt-tokens must be >= 0")
    if args.max_running_requests is not None and args.max_running_requests < 1:
        raise FitError("--max-running-requests must be >= 1")
    base = load_profile(args.base or ("eagle3-tp8" if args.speculative else "baseline-tp8"))
    update: dict = {"speculative": bool(args.speculative or base.speculative)}
    if args.speculative and not base.speculative:
        update.update(max_running_requests=EAGLE_DEFAULT_MAX_RUNNING)
    if args.accept_length is not None:
        update["accept_length_general"] = args.accept_length
        update["accept_length_coding"] = args.accept_length_coding or args.accept_length
    elif args.accept_length_coding is not None:
        update["accept_length_coding"] = args.accept_length_coding
    for flag, key in (("prefill_base_ms", "prefill_base_ms"), ("prefill_ms_per_token", "prefill_ms_per_token"),
                      ("kv_ms_per_ktoken", "kv_ms_per_ktoken"), ("accept_length_spread", "accept_length_spread"),
                      ("tp", "tp_size"), ("description", "description")):
        if getattr(args, flag) is not None:
            update[key] = getattr(args, flag)
    update["name"] = args.name or args.out.stem
    update["fitted_from"] = f"{args.csv.name}:{args.column} (max_tokens {args.max_tokens}, " \
                            f"prompt_tokens {args.prompt_tokens:g})"
    try:
        base = Profile.model_validate({**base.model_dump(), **update})
    except ValueError as exc:
        raise FitError(str(exc).splitlines()[-1].strip() or str(exc)) from None
    rows = read_table(args.csv, args.column)
    profile, pred = fit(rows, base, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                        cap=args.max_running_requests, shape=args.shape)
    try:
        profile = Profile.model_validate(profile.model_dump())
    except ValueError as exc:
        raise FitError(f"fitted profile is not usable: {str(exc).splitlines()[-1].strip()}") from None
    data = profile.model_dump(mode="json")
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise FitError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    return profile, pred
