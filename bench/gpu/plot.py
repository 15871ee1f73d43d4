"""Plots of the GPU benchmark JSONs (matplotlib): layer time vs tokens per step, attention, prefill, draft; TP."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(recs, keyf, x, y):
    out: dict = {}
    for r in recs:
        out.setdefault(keyf(r), []).append((r[x], r[y]))
    return {k: sorted(v) for k, v in out.items()}


TP_COLORS = {8: "tab:blue", 4: "tab:red"}  # Kimi (MoE) by TP size
DENSE_COLORS = {8: "tab:green", 4: "tab:olive"}  # Llama (dense) by TP size


def _color(model: str, tp: int) -> str:
    return (TP_COLORS if model.startswith("kimi") else DENSE_COLORS).get(tp, "k")


def _finish(a, title: str, xlabel: str, ylabel: str, *, fontsize: float = 7, yscale: str | None = "log",
            **legend) -> None:
    """One panel's axes (log x, log y unless told), title, legend and grid: the same on every panel."""
    a.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=title, **({"yscale": yscale} if yscale else {}))
    a.legend(fontsize=fontsize, **legend)
    a.grid(True, which="both", alpha=0.3)


def _save(fig, path: str, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(doc: dict, path: str) -> None:
    if doc.get("kind") == "tp":
        return draw_tp(doc, path)
    dev = doc["device"]
    fig, ax = plt.subplots(2, 2, figsize=(14, 10))
    a = ax[0][0]
    moe = lambda r: (r["model"], r["tp"], r["routing"])  # noqa: E731
    for (model, tp, rt), pts in sorted(_series(doc["moe_layer"], moe, "tokens", "ms").items()):
        a.plot(*zip(*pts, strict=True), "-" if rt == "uniform" else "--", marker="o" if model == "kimi-k2.5" else "^",
               ms=4, color=TP_COLORS.get(tp, "k"), label=f"{model} MoE TP{tp} {rt}")
    for (model, tp), pts in sorted(_series(doc["dense_layer"], lambda r: (r["model"], r["tp"]), "tokens",
                                           "ms").items()):
        a.plot(*zip(*pts, strict=True), "-", marker="s", ms=4, color=DENSE_COLORS.get(tp, "k"),
               label=f"{model} dense TP{tp}")
    for key, ls, lw, what in (("floor_ms_int4", ":", 1, "experts at int4"), ("floor_ms", "-.", 0.8, "bf16")):
        for (model, tp, rt), pts in sorted(_series(doc["moe_layer"], moe, "tokens", key).items()):
            if model == "kimi-k2.5" and rt == "uniform":
                a.plot(*zip(*pts, strict=True), ls, color=TP_COLORS.get(tp, "k"), lw=lw,
                       label=f"kimi TP{tp} uniform: floor, {what}")
    _finish(a, "one layer's projections + experts vs tokens per step", "tokens per step",
            "ms per layer (one GPU's slice)", fontsize=6.5, loc="upper left")

    a = ax[0][1]
    best: dict = {}
    for r in doc["decode_attention"]:
        k = (r["model"], r["tp"], r["batch"], r["context"])
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    for (model, tp, b), pts in sorted(_series(best.values(), lambda r: (r["model"], r["tp"], r["batch"]),
                                              "context", "ms_per_ktoken").items()):
        if b not in (1, 32):
            continue
        a.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "-" if b == 32 else "--",
               marker="o" if model.startswith("kimi") else "s", ms=4, color=TP_COLORS.get(tp, "k"),
               label=f"{model} {'MLA' if model.startswith('kimi') else 'GQA'} TP{tp} batch {b}")
    _finish(a, "decode attention (fastest kernel per point)", "cached tokens per request",
            "us per 1000 cached tokens, per layer")

    a = ax[1][0]
    apt = [dict(r, apt=r["attn_ms"] / r["tokens"]) for r in doc["prefill"]]
    for recs, key, ls, mk, what in ((doc["prefill"], "ms_per_token", "-", "o", "layer"),
                                    (apt, "apt", ":", ".", "attention only")):
        for (model, tp), pts in sorted(_series(recs, lambda r: (r["model"], r["tp"]), "tokens", key).items()):
            a.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], ls, marker=mk, **({"ms": 4} if mk == "o" else {}),
                   color=_color(model, tp), label=f"{model} TP{tp} {what}")
    _finish(a, "prefill of one layer (whole prompt at once)", "prompt tokens", "us per prompt token, per layer")

    a = ax[1][1]
    dcol = {}
    for (model, tp, var, v), pts in sorted(_series(doc["draft"], lambda r: (r["model"], r["tp"], r["variant"],
                                                                            r["vocab"]), "batch", "ms").items()):
        if tp != 8:
            continue
        c = dcol.setdefault((model, v), f"C{len(dcol)}")
        a.plot(*zip(*pts, strict=True), "-" if var == "topk4x2" else "--", marker="o", ms=4, color=c,
               label=f"{model} TP8 {var} vocab {v}")
    _finish(a, "EAGLE-3 draft pass (layer + LM head per step)", "requests in the batch",
            "ms per draft pass (one GPU's slice)", yscale=None)
    c = doc["ceilings"]
    _save(fig, path, f"{dev['name']} (driver {dev['driver']}, torch {dev['torch']}), {doc['date']}: copy "
                     f"{c['copy_gbps']:.0f} GB/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s; bf16 random weights, "
                     f"per-GPU slices of TP8/TP4{' (QUICK smoke run)' if doc.get('quick') else ''}")


def draw_tp(doc: dict, path: str) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    for (tp, link), pts in sorted(_series(doc["allreduce"], lambda r: (r["tp"], r["link"]), "bytes", "ms").items()):
        ax[0].plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "-" if link == "nvlink" else "--", marker="o",
                   ms=4, label=f"TP{tp} {link}")
    _finish(ax[0], "all-reduce latency", "message bytes (tokens x 7168 x bf16)", "us per all-reduce", fontsize=8)
    for (tp, link), pts in sorted(_series(doc["stack"], lambda r: (r["tp"], r["link"]), "tokens",
                                          "ms_per_layer").items()):
        ax[1].plot(*zip(*pts, strict=True), "-" if link == "nvlink" else "--", marker="o", ms=4,
                   label=f"TP{tp} {link} (one group)")
    for (tp, link), pts in sorted(_series([dict(r, mpl=r["ms"] / r["layers"]) for r in doc["split"]],
                                          lambda r: (r["tp"], r["link"]), "tokens", "mpl").items()):
        ax[1].plot(*zip(*pts, strict=True), ":", marker="x", ms=5, label=f"2 x TP{tp} {link} at once")
    _finish(ax[1], "Kimi-shaped layer stack, sharded", "tokens per step", "ms per layer per step", fontsize=8)
    _save(fig, path, f"{doc['label']} - {doc['device']['name']}, NCCL {doc['device'].get('nccl')}, {doc['date']}")
