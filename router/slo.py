"""A request's latency targets, read by both front ends: the `x-slo-ttft-ms` / `x-slo-tpot-ms` headers (llm-d's
names) and the body's `service_tier` through the configured tiers (Settings.slo_tiers); a bad value is the client's
400 in OpenAI's shape."""
from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from router.core.latency import Targets
from router.errors import BadRequest
from router.headers import SLO_TPOT_HEADER, SLO_TTFT_HEADER

# The tier label of a request whose targets came from headers alone (router_slo_* metrics).
NO_TIER = "none"


def _ms(name: str, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise BadRequest(f"{name} must be a positive number of milliseconds, got {value[:40]!r}",
                         code="invalid_latency_target", param=name)
    return ms / 1000.0


def targets_of(ttft_header: str | None, tpot_header: str | None, tier: object, tiers: Mapping) -> Targets | None:
    """The request's targets, or None when it has none (no header, and no tier or a tier without targets): such
    a request is routed as if no targets existed. `tier`: the body's service_tier (msgspec.UNSET or None: absent);
    `tiers`: name -> SloTier (router.settings). Headers override the tier's numbers; the tier says whether the
    request may be shed. Raises BadRequest (400) for a bad header value or a tier not configured."""
    ttft = _ms(SLO_TTFT_HEADER, ttft_header)
    tpot = _ms(SLO_TPOT_HEADER, tpot_header)
    name = None
    sheddable = False
    if tier is not msgspec.UNSET and tier is not None:
        if not isinstance(tier, str) or tier not in tiers:
            shown = tier[:40] if isinstance(tier, str) else type(tier).__name__
            raise BadRequest(f"service_tier {shown!r} is not one of {', '.join(sorted(tiers))}",
                             code="invalid_service_tier", param="service_tier")
        t = tiers[tier]
        name, sheddable = tier, t.sheddable
        if ttft is None and t.ttft_ms is not None:
            ttft = t.ttft_ms / 1000.0
        if tpot is None and t.tpot_ms is not None:
            tpot = t.tpot_ms / 1000.0
    if ttft is None and tpot is None:
        return None
    return Targets(ttft, tpot, name, sheddable)


def tier_label(targets: Targets) -> str:
    return NO_TIER if targets.tier is None else targets.tier
