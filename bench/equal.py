"""Equal hardware: how many GPUs each deployment uses, reference deployments, and per-level verdicts
between router configurations and references (pure: figures in, words and rows out)."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from bench import figures
from bench.figures import gpus_label, hardware_note

NOISE = 0.03  # closed-loop runs of a few requests per client repeat within about this fraction


@dataclass(frozen=True)
class Reference:
    """A deployment the router is judged against: a running server (url) or a simulator (profile)."""

    name: str
    gpus: int | None
    url: str | None = None
    profile: str | None = None

    def describe(self) -> str:
        what = f"profile {self.profile}" if self.profile else self.url
        return f"{self.name} = {what} ({gpus_label(self.gpus)})"

    def as_dict(self) -> dict:
        return {"url": self.url, "profile": self.profile, "gpus": self.gpus}


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def profile_gpus(profile: str) -> int:
    """A simulator profile's GPU count: its tensor-parallel size (tp4 = 4, tp8 = 8)."""
    from bench.cli import profile as load

    return load(profile).tp_size


def parse_reference(text: str) -> Reference:
    """`NAME=profile:PROFILE[@GPUS]` or `NAME=URL[@GPUS]` (argparse type: one-line errors)."""
    name, sep, rest = text.partition("=")
    if not sep or not _NAME_RE.match(name) or not rest:
        raise argparse.ArgumentTypeError(
            f"expected NAME=profile:PROFILE or NAME=http://HOST:PORT[@GPUS], got {text!r}")
    gpus = None
    if "@" in rest:
        rest, _, g = rest.rpartition("@")
        if not g.isdigit() or int(g) < 1:
            raise argparse.ArgumentTypeError(f"{name}: GPU count after '@' must be a positive integer, got {g!r}")
        gpus = int(g)
    if rest.startswith("profile:"):
        profile = rest.removeprefix("profile:")
        if not profile:
            raise argparse.ArgumentTypeError(f"{name}: profile:PROFILE needs a profile name or .json file")
        return Reference(name, gpus, profile=profile)
    if not rest.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"{name}: expected profile:PROFILE or http://HOST:PORT, got {rest!r}")
    return Reference(name, gpus, url=rest.rstrip("/").removesuffix("/v1"))


def resolve_gpus(refs: list[Reference], default_gpus: int | None) -> list[Reference]:
    """Fill in each reference's GPU count: its own `@GPUS`, else its profile's TP size, else the
    `--reference-gpus` default. Raises ValueError (one line) when a URL reference has none."""
    out = []
    for r in refs:
        gpus = r.gpus
        if gpus is None and r.profile:
            gpus = profile_gpus(r.profile)
        if gpus is None:
            gpus = default_gpus
        if gpus is None:
            raise ValueError(f"reference {r.name}: say how many GPUs it uses ({r.name}=URL@GPUS or "
                             "--reference-gpus N); comparisons on unequal hardware must say so")
        out.append(Reference(r.name, gpus, r.url, r.profile))
    return out


def header(name: str, gpus: dict[str, int | None]) -> str:
    """A column name that carries its GPU count: `balanced [8 GPUs]`."""
    return f"{name} [{gpus_label(gpus.get(name))}]" if name in gpus else name


def _level(figs: list[dict], i: int) -> dict | None:
    f = figs[i] if i < len(figs) else None
    return f if f and f.get("completed") else None


def _lat(f: dict) -> float:
    return f["median_e2e_latency_ms"]


def judge(results: dict[str, list[dict]], configs: list[str], refs: list[str],
          gpus: dict[str, int | None]) -> list[dict]:
    """Per level: every router configuration against every reference (throughput and median-latency
    ratios), the throughput and latency winners among all of them, and by how much they win."""
    rows = []
    names = configs + refs
    levels = [f["concurrency"] for f in results[names[0]]]
    for i, c in enumerate(levels):
        figs = {n: _level(results[n], i) for n in names}
        ok = {n: f for n, f in figs.items() if f is not None}
        row: dict = {"concurrency": c, "pairs": []}
        for cfg in configs:
            for ref in refs:
                a, b = figs[cfg], figs[ref]
                if a is None or b is None:
                    continue
                tp_ratio = figures.tput(a) / figures.tput(b) if figures.tput(b) else float("inf")
                lat_ratio = _lat(a) / _lat(b) if _lat(b) else float("inf")
                row["pairs"].append({"config": cfg, "reference": ref, "throughput": figures.tput(a),
                                     "reference_throughput": figures.tput(b), "throughput_ratio": tp_ratio,
                                     "median_e2e_ms": _lat(a), "reference_median_e2e_ms": _lat(b),
                                     "latency_ratio": lat_ratio, "note": hardware_note([cfg, ref], gpus)})
        if ok:
            tw = max(ok, key=lambda n: figures.tput(ok[n]))
            lw = min(ok, key=lambda n: _lat(ok[n]))
            row |= {"throughput_winner": tw, "latency_winner": lw,
                    "throughput_margin": _margin(tw, ok, configs, refs, figures.tput, higher=True),
                    "latency_margin": _margin(lw, ok, configs, refs, _lat, higher=False),
                    "note": hardware_note(list(ok), gpus)}
        rows.append(row)
    return rows


def _margin(winner: str, ok: dict[str, dict], configs: list[str], refs: list[str], key, higher: bool):
    """The winner against the best of the other side (a router configuration against the best reference,
    a reference against the best router configuration): (that deployment, ratio >= 1)."""
    side = refs if winner in configs else configs
    others = [n for n in side if n in ok] or [n for n in ok if n != winner]
    if not others:
        return None
    best = (max if higher else min)(others, key=lambda n: key(ok[n]))
    w, o = key(ok[winner]), key(ok[best])
    ratio = (w / o if o else float("inf")) if higher else (o / w if w else float("inf"))
    return [best, ratio]


def _status(ratio: float) -> str:
    return "wins" if ratio >= 1 + NOISE else ("ties (within noise)" if ratio > 1 - NOISE else "loses")


def verdict_lines(rows: list[dict], configs: list[str], refs: list[str], gpus: dict[str, int | None]) -> list[str]:
    """A headline (which deployment of these GPUs to run), then one line per level."""
    lines = [headline(rows, configs, refs, gpus)]
    for row in rows:
        c = row["concurrency"]
        if "throughput_winner" not in row:
            lines.append(f"c={c}: no deployment completed a request")
            continue
        tw, (tb, tr) = row["throughput_winner"], row["throughput_margin"] or ("-", 1.0)
        lw, (lb, lr) = row["latency_winner"], row["latency_margin"] or ("-", 1.0)
        text = f"c={c}: throughput: {_won(tw, tb, tr, gpus, 'of')}"
        close = _close_references(row, tw, refs) if tr >= 1 + NOISE else []
        if close:  # a reference wins against the router's best, and another reference ties it: not a win over that
            text += f" ({' and '.join(close)} within the {NOISE:.0%} noise band of it)"
        text += f"; median latency: {_won(lw, lb, lr, gpus, 'shorter than')}"
        if row.get("note"):
            text += f" ({row['note']})"
        lines.append(text)
    return lines


def _close_references(row: dict, winner: str, refs: list[str]) -> list[str]:
    """The other references whose throughput at this level is within the noise band of the winning reference's
    (its margin is against the router's configurations only, so the plan may name one of these instead)."""
    tput = {p["reference"]: p["reference_throughput"] for p in row["pairs"]}
    if winner not in refs or not tput.get(winner):
        return []
    return [r for r in refs if r != winner and tput.get(r) and tput[winner] / tput[r] < 1 + NOISE]


def _won(winner: str, other: str, ratio: float, gpus: dict[str, int | None], rel: str) -> str:
    if ratio < 1 + NOISE:
        return f"{winner} and {other} tie ({ratio:.2f}x, within the {NOISE:.0%} noise band)"
    return f"{winner} [{gpus_label(gpus.get(winner))}] wins, {ratio:.2f}x {rel} {other}"


def headline(rows: list[dict], configs: list[str], refs: list[str], gpus: dict[str, int | None]) -> str:
    """One line: which deployment wins where on throughput (levels within the noise band are ties), with
    the GPU count of each, and how far the router's best configuration is from a reference that wins all."""
    by_winner: dict[str, list[int]] = {}
    ties: list[int] = []
    tied: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        if "throughput_winner" not in row:
            continue
        margin = row.get("throughput_margin")
        if margin and margin[1] < 1 + NOISE:
            ties.append(row["concurrency"])
            tied.setdefault(tuple(sorted((row["throughput_winner"], margin[0]))), []).append(row["concurrency"])
        else:
            by_winner.setdefault(row["throughput_winner"], []).append(row["concurrency"])
    if not by_winner and not ties:
        return "verdict: nothing completed a request"
    note = hardware_note(configs + refs, gpus)
    suffix = f" ({note})" if note else f" (every deployment here uses {gpus_label(gpus.get((configs + refs)[0]))})"
    pairs = "; ".join(f"{a} and {b} at c={_levels(lv)}" for (a, b), lv in tied.items())
    if not by_winner:
        return (f"verdict: no deployment wins on throughput by more than the {NOISE:.0%} noise band at any level: "
                f"{pairs}" + suffix)
    tie_text = f"; ties within the {NOISE:.0%} noise band: {pairs}" if ties else ""
    if len(by_winner) == 1:
        (w, levels), = by_winner.items()
        if not ties:
            where = "at every level measured"
        else:
            where = "at the one other level" if len(levels) == 1 else "at every other level"
        text = f"verdict: {w} wins on throughput {where} (c={_levels(levels)}){tie_text}"
        if w in refs:
            ratios = [max((p["throughput_ratio"] for p in row["pairs"] if p["reference"] == w), default=None)
                      for row in rows if row["concurrency"] in levels]
            ratios = [r for r in ratios if r is not None]
            if ratios:
                text += f"; the best router configuration reaches {span(ratios)} of its throughput there"
        return text + suffix
    parts = [f"{w} at c={_levels(levels)}" for w, levels in sorted(by_winner.items(), key=lambda kv: kv[1][0])]
    return "verdict: throughput winner by load: " + "; ".join(parts) + tie_text + suffix


def span(values: list[float]) -> str:
    """`0.88x`, or `0.84-0.91x` when the values differ at two decimals."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _levels(levels: list[int]) -> str:
    return ",".join(str(c) for c in levels)


def render_text(rows: list[dict], configs: list[str], refs: list[str], gpus: dict[str, int | None]) -> str:
    """Every router configuration next to every reference: throughput ratio and median-latency ratio."""
    out = ["each router configuration against each reference (throughput ratio / median E2E latency ratio; "
           "above 1.00x throughput and below 1.00x latency means the router configuration is better):"]
    head = ["conc"] + [f"{c}/{r}" for c in configs for r in refs]
    body = []
    for row in rows:
        by = {(p["config"], p["reference"]): p for p in row["pairs"]}
        cells = [str(row["concurrency"])]
        for c in configs:
            for r in refs:
                p = by.get((c, r))
                cells.append(f"{p['throughput_ratio']:.2f}x / {p['latency_ratio']:.2f}x" if p else "-")
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    out.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(x.rjust(w) for x, w in zip(b, widths, strict=True)) for b in body]
    out.append("GPUs: " + ", ".join(f"{n} {gpus_label(gpus.get(n))}" for n in configs + refs))
    return "\n".join(out)


def render_markdown(results: dict[str, list[dict]], rows: list[dict], configs: list[str], refs: list[str],
                    gpus: dict[str, int | None]) -> str:
    """Side-by-side throughput (every column's GPU count in its header), ratios to each reference, winners."""
    names = configs + refs
    note = hardware_note(names, gpus)
    title = ("Output throughput (tok/s) of each deployment, GPUs in each column header"
             + (f"; {note}" if note else f"; all on the same {gpus_label(gpus.get(names[0]))}") + ":")
    pairs = [(c, r) for c in configs for r in refs]

    def table(figure, ratio: str, winners: tuple[tuple[str, str], ...] = ()) -> list[str]:
        """One markdown table: a row per level, each deployment's `figure`, each pair's `ratio`, the winners."""
        out = ["| concurrency | " + " | ".join(header(n, gpus) for n in names) + " | "
               + " | ".join(f"{c} / {r}" for c, r in pairs) + "".join(f" | {w}" for w, _ in winners) + " |",
               "|" + "---|" * (len(names) + len(pairs) + 1 + len(winners))]
        for i, row in enumerate(rows):
            by = {(p["config"], p["reference"]): p for p in row["pairs"]}
            cells = [str(row["concurrency"])]
            cells += [figure(f) if (f := _level(results[n], i)) else "-" for n in names]
            cells += [f"{by[k][ratio]:.2f}x" if k in by else "-" for k in pairs]
            cells += [row.get(key, "-") for _, key in winners]
            out.append("| " + " | ".join(cells) + " |")
        return out

    out = [title, ""] + table(lambda f: f"{figures.tput(f):.1f}", "throughput_ratio",
                              (("throughput winner", "throughput_winner"),
                               ("median-latency winner", "latency_winner")))
    out += ["", "Median E2E latency (s) of each deployment and its ratio to each reference (below 1.00x: "
            "the router configuration answers faster):", ""]
    out += table(lambda f: f"{_lat(f) / 1000:.2f}", "latency_ratio")
    return "\n".join(out) + "\n"
