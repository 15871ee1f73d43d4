"""Throughput-curve arithmetic shared by the policies, bench and the simulator: parsing, interpolation, per-request and
marginal speed, the token-time fit."""
from __future__ import annotations

from collections.abc import Sequence

# A measured closed-loop curve of ONE instance: (concurrency, output tok/s) points, concurrency increasing.
CurvePoints = tuple[tuple[float, float], ...]


def interpolate(points: Sequence[tuple[float, float]], x: float, *, extend: bool = False) -> float:
    """Linear between points, from (0, 0), flat beyond the last point. extend: no (0, 0); the end segments carry
    on straight outside the points instead (needs two points)."""
    if extend:
        i = 1
        while i < len(points) - 1 and x > points[i][0]:
            i += 1
        (x1, y1), (x2, y2) = points[i - 1], points[i]
        return y1 + (y2 - y1) * (x - x1) / (x2 - x1)
    if x <= 0:
        return 0.0
    x0, y0 = 0.0, 0.0
    for x1, y1 in points:
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        x0, y0 = x1, y1
    return y0


def parse_curve(text: str) -> CurvePoints:
    """ "1:77.5,2:125.1,..." (the `*_curve` settings as env vars and flags write them) -> points; ValueError with
    one line on a bad point. Only the syntax: router.settings checks the values."""
    points = []
    for part in text.split(","):
        c, sep, tok = part.strip().partition(":")
        try:
            points.append((float(c), float(tok)))
        except ValueError:
            raise ValueError(f"bad curve point {part.strip()!r} (expected CONCURRENCY:TOK_S)") from None
        if not sep:
            raise ValueError(f"bad curve point {part.strip()!r} (expected CONCURRENCY:TOK_S)")
    return tuple(points)


def curve_throughput(points: Sequence[tuple[float, float]], c: float) -> float:
    """Output tok/s of one instance at `c` in flight: linear between points, 0 at 0, flat beyond the last
    (a saturated server: more requests only queue)."""
    return interpolate(points, c)


def request_speed(points: Sequence[tuple[float, float]], inflight: int) -> float:
    """Tok/s a new request would get on an instance already holding `inflight`: X(n+1)/(n+1); beyond the
    curve's last point this falls as 1/n, which is how a saturated server's queue behaves."""
    return curve_throughput(points, inflight + 1) / (inflight + 1)


def marginal_gain(points: Sequence[tuple[float, float]], inflight: int) -> float:
    """Tok/s the whole instance gains from one more request: X(n+1) - X(n). Equal marginal gains across
    pools is the split of greatest total throughput (for concave curves)."""
    return curve_throughput(points, inflight + 1) - curve_throughput(points, inflight)


def fit_token_time(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) of seconds per token per request = alpha + beta * n, the model
    X(n) = n / (alpha + beta * n), from a curve's (n, tok/s) points: a prior for the adaptive policy."""
    xs = [float(c) for c, _ in points]
    ys = [c / tok for c, tok in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    beta = max(beta, 0.0)
    alpha = max(my - beta * mx, 1e-6)
    return alpha, beta
