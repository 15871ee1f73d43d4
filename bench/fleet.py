"""The fleet question of `spec-bench plan --fleet N`: of N servers of one box class, how many should speculate,
given a trace's traffic and a class mix with latency targets (pure: inputs in, rows and words out).

Each server runs the step-cost model's profile (bench.sim.stepcost) at the arrival rate the router gives it. The
router of the model is ours with targets: the classes with a TPOT target go to the speculative servers, the
rest share what is left, split in the proportion that meets most targets. A server at rate lambda (requests/s)
runs n requests where n = lambda x (output tokens x its time per token at n) (Little's law, solved by fixed
point); past its running limit it is overloaded and meets no target. Time per token is the decode step at n
(KV reads included) over the accept length, stretched by the share of time the server spends in prefill. A
request's TTFT is its uncached prefill plus half a decode step plus the prefill queued ahead (M/D/1 wait).
Named assumptions: steady state (no burst), mean times (a server meets a TPOT target or not; TTFT varies by
prompt), and the prefix cache between none and the trace's ideal reuse (both ends are the range's)."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from bench.planmodel import ALPHA_LIMITS
from bench.sim import stepcost
from bench.sim.fit import kv_ms
from bench.sim.profiles import Profile
from bench.sim.stepcost import Box

BLOCK_TOKENS = 512  # the Mooncake trace's block (its README)
SPLIT_GRID = 20  # the untargeted traffic's share on the speculative servers: 0, 1/20, ..., 1
TARGETED_GRID = 10  # the targeted classes' share there: 0, 1/10, ..., 1 (the router moves them when spec is full)
NOISE = 0.03  # a split must beat the next by this share of goodput to be named alone (the bench's noise band)
FIXED_POINT_ROUNDS = 200


def targeted(cls) -> bool:
    """A class (bench.classmix.RequestClass: name, share, ttft_ms, tpot_ms) with a target of either kind."""
    return cls.tpot_ms is not None or cls.ttft_ms is not None


@dataclass(frozen=True)
class Traffic:
    """A trace reduced to what the model needs: the arrival rate and each request's prompt, its prefix reused
    from earlier requests of the trace (an unbounded cache: the ideal end), and its output."""

    rate: float  # requests/s
    prompts: tuple[int, ...]
    reused: tuple[int, ...]  # tokens of each prompt an earlier request sent first (ideal prefix cache)
    outputs: tuple[int, ...]
    description: str = ""

    @property
    def mean_output(self) -> float:
        return sum(self.outputs) / len(self.outputs)


def traffic_of(requests, span_s: float, token_scale: float = 1.0, description: str = "") -> Traffic:
    """From bench.replay's TraceRequests (at the arrival spacing they will be replayed with: `span_s`)."""
    seen: set[int] = set()
    prompts, reused, outputs = [], [], []
    for r in requests:
        hit = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            hit += 1
        seen.update(r.hash_ids)
        p = max(1, round(r.input_length / token_scale))
        prompts.append(p)
        reused.append(min(p - 1, round(hit * BLOCK_TOKENS / token_scale)))
        outputs.append(max(1, round(r.output_length / token_scale)))
    rate = len(prompts) / span_s if span_s > 0 else float(len(prompts))
    return Traffic(rate, tuple(prompts), tuple(reused), tuple(outputs), description)


@dataclass
class ServerLoad:
    """One server at one arrival rate: what it runs and how fast."""

    rate: float
    running: float = 0.0
    tpot_ms: float = 0.0
    prefill_share: float = 0.0
    overloaded: bool = False
    prefills_ms: tuple[float, ...] = ()  # each request's prefill here, sorted
    ttft_extra_ms: float = 0.0  # added to every prefill: half a step and the prefills queued ahead

    def ttft_share(self, target_ms: float) -> float:
        """The share of the traffic's requests whose TTFT here is at most `target_ms`."""
        return bisect_right(self.prefills_ms, target_ms - self.ttft_extra_ms) / len(self.prefills_ms)


def _prefill_ms(prof: Profile, prompt: int, cached: int) -> float:
    new = prompt - cached
    return prof.prefill_ms(new, new * cached + new * (new + 1) // 2)


def load_on(prof: Profile, rate: float, traffic: Traffic, cached: tuple[int, ...], error: float = 0.0) -> ServerLoad:
    """Server `prof` receiving `rate` requests/s of `traffic` (its prompts cached by `cached` tokens each);
    `error`: every step and prefill taken (1 + error) times as long (the model's held-out error)."""
    k = 1.0 + error
    out = ServerLoad(rate)
    n_req = len(traffic.prompts)
    prompt_mean = sum(traffic.prompts) / n_req
    pre = _prefills(prof, traffic, cached, k)
    out.prefills_ms = pre
    pre_mean = sum(pre) / n_req
    out.prefill_share = rate * pre_mean / 1000.0
    length = prof.accept_length_general if prof.speculative else 1.0
    o = traffic.mean_output

    def tpot(n: float) -> float:
        m = max(1, round(n))
        step = k * (prof.step_ms(m) + kv_ms(prof, m, o, prompt_mean))
        return step / length / max(1e-9, 1.0 - out.prefill_share)

    if rate <= 0:
        out.tpot_ms = tpot(1)
        out.ttft_extra_ms = k * prof.step_ms(1) / 2
        return out
    if out.prefill_share >= 1.0:
        out.overloaded, out.tpot_ms, out.running = True, float("inf"), float("inf")
        return out
    n = rate * o * tpot(1) / 1000.0
    for _ in range(FIXED_POINT_ROUNDS):
        nxt = rate * o * tpot(n) / 1000.0
        if abs(nxt - n) < 1e-3:
            break
        n = nxt if nxt < 10 * prof.max_running_requests else float("inf")
        if n == float("inf"):
            break
    out.running = n
    if n > prof.max_running_requests:
        out.overloaded, out.tpot_ms = True, float("inf")
        return out
    out.tpot_ms = tpot(n)
    wait = out.prefill_share / (2 * (1 - out.prefill_share)) * pre_mean  # M/D/1: the prefills queued ahead
    half_step = k * (prof.step_ms(max(1, round(n))) + kv_ms(prof, max(1, round(n)), o, prompt_mean)) / 2
    out.ttft_extra_ms = wait + half_step
    return out


_PREFILLS: dict[tuple[int, int, float], tuple[Profile, tuple[int, ...], tuple[float, ...]]] = {}


def _prefills(prof: Profile, traffic: Traffic, cached: tuple[int, ...], k: float) -> tuple[float, ...]:
    """Each request's prefill on `prof`, sorted; kept for the objects it was computed for (checked by identity)."""
    key = (id(prof), id(cached), k)
    got = _PREFILLS.get(key)
    if got is None or got[0] is not prof or got[1] is not cached:
        if len(_PREFILLS) > 256:  # bounded: one planner run uses a few dozen
            _PREFILLS.clear()
        got = (prof, cached, tuple(sorted(k * _prefill_ms(prof, p, c) for p, c in zip(traffic.prompts, cached, strict=True))))
        _PREFILLS[key] = got
    return got[2]


@dataclass
class Split:
    """k speculative servers of `servers`, as the router with targets runs them best: a group of servers kept for
    the targeted classes (`kept`: speculative first, then baseline) takes a share `targeted` of their traffic and a
    share `untargeted` of the rest; the other servers take what is left; every server of a group and kind at the
    same rate. `blind`: no class kept apart (every server the same rate of the same mix: a class-blind balancer)."""

    speculative: int
    servers: int
    goodput: float  # requests/s meeting their class's targets (classes without targets: completed)
    attainment: dict[str, float] = field(default_factory=dict)
    kept: tuple[int, int] = (0, 0)  # (speculative, baseline) servers in the group kept for the targeted classes
    targeted: float = 0.0
    untargeted: float = 0.0
    loads: dict[str, ServerLoad] = field(default_factory=dict)  # "kept spec", "kept base", "spec", "base"
    blind: bool = False


def _attain(cls, load: ServerLoad) -> float:
    """The share of a class's requests on this server that meet its targets (0 when overloaded)."""
    if load.overloaded:
        return 0.0
    if cls.tpot_ms is not None and load.tpot_ms > cls.tpot_ms:
        return 0.0
    return 1.0 if cls.ttft_ms is None else load.ttft_share(cls.ttft_ms)


def _grid(n: int) -> list[float]:
    return [i / n for i in range(n + 1)]


def _score(servers: int, k: int, kept: tuple[int, int], g: float, f: float, base: Profile, spec: Profile,
           traffic: Traffic, classes: tuple, cached: tuple[int, ...], error: float, blind: bool = False) -> Split:
    ks, kb = kept
    groups = {"kept spec": ks, "kept base": kb, "spec": k - ks, "base": servers - k - kb}
    n_kept = ks + kb
    n_rest = servers - n_kept
    rate_t = sum(traffic.rate * c.share for c in classes if targeted(c))
    rate_u = traffic.rate - rate_t
    per_kept = (g * rate_t + f * rate_u) / n_kept if n_kept else 0.0
    per_rest = ((1 - g) * rate_t + (1 - f) * rate_u) / n_rest if n_rest else 0.0
    loads = {}
    for name, count in groups.items():
        if count:
            prof = spec if name.endswith("spec") else base
            loads[name] = load_on(prof, per_kept if name.startswith("kept") else per_rest, traffic, cached, error)
    good, att = 0.0, {}
    for c in classes:
        share_kept = g if targeted(c) else f
        a = 0.0
        for name, count in groups.items():
            if not count:
                continue
            role_share, role_n = (share_kept, n_kept) if name.startswith("kept") else (1 - share_kept, n_rest)
            a += role_share * count / role_n * _attain(c, loads[name])
        att[c.name] = a
        good += traffic.rate * c.share * a
    return Split(k, servers, good, att, kept, g, f, loads, blind)


def evaluate(servers: int, k: int, base: Profile, spec: Profile, traffic: Traffic, classes: tuple,
             cached: tuple[int, ...], error: float = 0.0) -> Split:
    """The best the router with targets does with k speculative servers: over every group kept for the targeted
    classes (none to all servers, the speculative ones first) and every share of each kind of traffic sent there."""
    best: Split | None = None
    for n_kept in range(servers + 1):
        kept = (min(n_kept, k), max(0, n_kept - k))
        if n_kept in (0, servers):  # one group: every server the same share
            choices = [(float(n_kept > 0), float(n_kept > 0))]
        else:
            choices = [(g, f) for g in _grid(TARGETED_GRID) for f in _grid(SPLIT_GRID)]
        for g, f in choices:
            split = _score(servers, k, kept, g, f, base, spec, traffic, classes, cached, error)
            if best is None or split.goodput > best.goodput + 1e-9:
                best = split
    assert best is not None
    return best


def blind(servers: int, k: int, base: Profile, spec: Profile, traffic: Traffic, classes: tuple,
          cached: tuple[int, ...], error: float = 0.0) -> Split:
    """A homogeneous fleet (k = 0 or k = servers) behind a class-blind balancer: every server the same mix."""
    assert k in (0, servers)
    return _score(servers, k, (0, 0), 0.0, 0.0, base, spec, traffic, classes, cached, error, blind=True)


@dataclass
class FleetAdvice:
    servers: int
    classes: tuple
    traffic: Traffic
    splits: list[Split]  # ours with targets, nominal inputs, k = 0..servers
    blind: list[Split] = field(default_factory=list)  # all baseline, all speculative: a class-blind balancer
    low: dict[tuple[int, bool], float] = field(default_factory=dict)  # (k, blind) -> lowest goodput in the range
    high: dict[tuple[int, bool], float] = field(default_factory=dict)
    winners: tuple[int, ...] = ()  # every k that wins somewhere inside the range, the nominal winner first
    setting: str = ""
    tp: int = 8


def advise_fleet(box: Box, servers: int, tp: int, traffic: Traffic, classes: tuple, *, setting: str,
                 alpha: float, alpha_band: float, model_error: float, tree_accept: float,
                 profiles: tuple[Profile, Profile] | None = None) -> FleetAdvice:
    """Nominal: the speculative `setting` (bench.sim.stepcost.setting: tree, chainK) at chain acceptance `alpha`,
    the ideal prefix cache, the model as fitted. The range: acceptance alpha +- alpha_band (a chain's), the
    speculative server's costs x (1 +- model_error), the prefix cache none or ideal. `profiles`: (baseline,
    speculative) server profiles to plan on instead of the model's (their acceptance is theirs: no band)."""
    none = tuple(0 for _ in traffic.prompts)
    base = profiles[0] if profiles else stepcost.derive_profile(box, stepcost.BASELINE, tp)

    def spec_at(a: float) -> Profile:
        if profiles:
            return profiles[1]
        a = min(max(a, ALPHA_LIMITS[0]), ALPHA_LIMITS[1])
        return stepcost.derive_profile(box, stepcost.setting(setting, a, tree_accept), tp)

    def rows(spec: Profile, cached: tuple[int, ...]) -> tuple[list[Split], list[Split]]:
        ours = [evaluate(servers, k, base, spec, traffic, classes, cached) for k in range(servers + 1)]
        return ours, [blind(servers, k, base, spec, traffic, classes, cached) for k in (0, servers)]

    splits, blinds = rows(spec_at(alpha), traffic.reused)
    adv = FleetAdvice(servers, classes, traffic, splits, blinds,
                      setting=f"profile {profiles[1].name}" if profiles else setting, tp=tp)
    corners = [(spec_at(alpha), traffic.reused)] + [
        (_scaled(spec_at(a), e), cached) for a in (alpha - alpha_band, alpha + alpha_band)
        for e in (-model_error, model_error) for cached in (none, traffic.reused)]
    winners: list[int] = []
    for i, (spec, cached) in enumerate(corners):
        ours, bl = (splits, blinds) if i == 0 else rows(spec, cached)
        for s in ours + bl:
            key = (s.speculative, s.blind)
            adv.low[key] = min(adv.low.get(key, s.goodput), s.goodput)
            adv.high[key] = max(adv.high.get(key, s.goodput), s.goodput)
        # Splits are compared within one corner (a cache-less corner moves them all).
        top = max(s.goodput for s in ours)
        order = sorted(range(servers + 1), key=lambda k: -ours[k].goodput)
        winners += [k for k in order if ours[k].goodput >= top * (1 - NOISE) and k not in winners]
    adv.winners = tuple(winners)
    return adv


def _scaled(prof: Profile, error: float) -> Profile:
    """The speculative server's speedup off by `error`: its steps and prefills (1 + error) times as long."""
    k = 1.0 + error
    return prof.model_copy(update={
        "step_points_ms": [(n, ms * k) for n, ms in prof.step_points_ms or []],
        "decode_a_ms": prof.decode_a_ms * k,
        "prefill_base_ms": prof.prefill_base_ms * k, "prefill_ms_per_token": prof.prefill_ms_per_token * k,
        "kv_ms_per_ktoken": prof.kv_ms_per_ktoken * k})


def _targets(c) -> str:
    parts = [f"{kind} {ms:g} ms" for kind, ms in (("TTFT", c.ttft_ms), ("TPOT", c.tpot_ms)) if ms is not None]
    return ", ".join(parts) or "no target"


def _tpot(s: Split, names: tuple[str, ...]) -> str:
    got = [s.loads[n] for n in names if n in s.loads]
    if not got:
        return "-"
    return " / ".join("overloaded" if x.overloaded else f"{x.tpot_ms:.0f}" for x in got)


def render_fleet(adv: FleetAdvice, box_name: str) -> str:
    t = adv.traffic
    n, tp = adv.servers, adv.tp
    mix = ", ".join(f"{c.name} {c.share:.0%} ({_targets(c)})" for c in adv.classes)
    lines = [f"Fleet: {n} servers of TP{tp} on {box_name} ({n * tp} GPUs in every row), the speculative ones "
             f"running {adv.setting}; {t.rate:.2f} requests/s, mean prompt {sum(t.prompts) / len(t.prompts):,.0f} "
             f"tokens (ideal reuse {sum(t.reused) / max(1, sum(t.prompts)):.0%}), mean output "
             f"{t.mean_output:,.0f}; {mix}.",
             "Ours with targets keeps a group of servers (speculative first) for the targeted classes and sends each "
             "kind of traffic there in the share that meets most targets; class-blind: every server the same mix.",
             "",
             "| speculative servers | router | goodput req/s (range) | "
             + " | ".join(f"{c.name} met" for c in adv.classes)
             + " | kept for targets | targeted / untargeted there | TPOT ms kept | TPOT ms rest |",
             "|---|---|---|" + "---|" * len(adv.classes) + "---|---|---|---|"]

    def row(s: Split) -> str:
        kept = "-" if s.blind or not sum(s.kept) else " + ".join(
            f"{c} {kind}" for c, kind in zip(s.kept, ("spec", "base"), strict=True) if c)
        there = "-" if s.blind or not sum(s.kept) else f"{s.targeted:.0%} / {s.untargeted:.0%}"
        key = (s.speculative, s.blind)
        return (f"| {s.speculative} of {n} | {'class-blind' if s.blind else 'ours, targets'} | {s.goodput:.2f} "
                f"({adv.low[key]:.2f}-{adv.high[key]:.2f}) | "
                + " | ".join(f"{s.attainment[c.name]:.0%}" for c in adv.classes)
                + f" | {kept} | {there} | {_tpot(s, ('kept spec', 'kept base'))} | {_tpot(s, ('spec', 'base'))} |")

    lines += [row(adv.blind[0])] + [row(s) for s in adv.splits] + [row(adv.blind[-1])]
    if len(adv.winners) == 1:
        verdict = f"speculate on {adv.winners[0]} of {n} servers"
    else:
        verdict = "uncertain: " + " or ".join(f"{k} of {n}" for k in adv.winners) + " speculating"
    best = max(adv.splits, key=lambda s: s.goodput)
    lines += ["", f"Keeping servers for the targets, with no speculation: {adv.splits[0].goodput:.2f} requests/s against "
              f"{adv.blind[0].goodput:.2f} class-blind on all baseline servers; speculation on top: "
              f"{best.goodput:.2f} at {best.speculative} of {n}."]
    lines += ["", "A steady-state model: bursts, prompt-length tails, KV admission and a balancer's imbalance are "
              "left out, so it is optimistic under load (on the simulator, at 1.5 requests/s on 4 Kimi servers, by "
              "up to 2x: docs/BENCH.md, \"The fleet question\")."]
    lines += ["", f"Recommendation (ours with targets): {verdict}. Inside the range: chain acceptance +- band, the "
              "speculative servers' costs x (1 +- the model's error), the prefix cache none to ideal; a split within "
              f"{NOISE:.0%} of the best counts as winning."]
    return "\n".join(lines)


def fleet_json(adv: FleetAdvice) -> dict:
    def load(x: ServerLoad) -> dict:
        return {"rate_per_server": x.rate, "running": None if x.overloaded else x.running,
                "tpot_ms": None if x.overloaded else x.tpot_ms, "prefill_share": x.prefill_share,
                "overloaded": x.overloaded}

    def split(s: Split) -> dict:
        key = (s.speculative, s.blind)
        return {"speculative": s.speculative, "blind": s.blind, "goodput": s.goodput, "low": adv.low[key],
                "high": adv.high[key], "attainment": s.attainment, "kept": list(s.kept), "targeted": s.targeted,
                "untargeted": s.untargeted, "loads": {k: load(v) for k, v in s.loads.items()}}

    t = adv.traffic
    return {
        "servers": adv.servers, "tp": adv.tp, "setting": adv.setting, "winners": list(adv.winners),
        "traffic": {"rate": t.rate, "requests": len(t.prompts), "mean_prompt": sum(t.prompts) / len(t.prompts),
                    "ideal_reuse": sum(t.reused) / max(1, sum(t.prompts)), "mean_output": t.mean_output,
                    "description": t.description},
        "classes": [{"name": c.name, "share": c.share, "ttft_ms": c.ttft_ms, "tpot_ms": c.tpot_ms}
                    for c in adv.classes],
        "splits": [split(s) for s in adv.splits], "blind": [split(s) for s in adv.blind],
    }
