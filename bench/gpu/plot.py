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


def draw(doc: dict, path: str) -> None:
    if doc.get("kind") == "tp":
        return draw_tp(doc, path)
    dev = doc["device"]
    fig, ax = plt.subplots(2, 2, figsize=(14, 10))
    a = ax[0][0]
    colors = {8: "tab:blue", 4: "tab:red"}
    for (model, tp, rt), pts in sorted(_series(doc["moe_layer"], lambda r: (r["model"], r["tp"], r["routing"]),
                                               "tokens", "ms").items()):
        ls = "-" if rt == "uniform" else "--"
        mk = "o" if model == "kimi-k2.5" else "^"
        a.plot(*zip(*pts, strict=True), ls, marker=mk, ms=4, color=colors.get(tp, "k"),
               label=f"{model} MoE TP{tp} {rt}")
    for (model, tp), pts in sorted(_series(doc["dense_layer"], lambda r: (r["model"], r["tp"]), "tokens",
                                           "ms").items()):
        a.plot(*zip(*pts, strict=True), "-", marker="s", ms=4, color={8: "tab:green", 4: "tab:olive"}.get(tp, "k"),
               label=f"{model} dense TP{tp}")
    for (model, tp, rt), pts in sorted(_series(doc["moe_layer"], lambda r: (r["model"], r["tp"], r["routing"]),
                                               "tokens", "floor_ms_int4").items()):
        if model == "kimi-k2.5" and rt == "uniform":
            a.plot(*zip(*pts, strict=True), ":", color=colors.get(tp, "k"), lw=1,
                   label=f"kimi TP{tp} uniform: floor, experts at int4")
    for (model, tp, rt), pts in sorted(_series(doc["moe_layer"], lambda r: (r["model"], r["tp"], r["routing"]),
                                               "tokens", "floor_ms").items()):
        if model == "kimi-k2.5" and rt == "uniform":
            a.plot(*zip(*pts, strict=True), "-.", color=colors.get(tp, "k"), lw=0.8,
                   label=f"kimi TP{tp} uniform: floor, bf16")
    a.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="ms per layer (one GPU's slice)",
          title="one layer's projections + experts vs tokens per step")
    a.legend(fontsize=6.5, loc="upper left")
    a.grid(True, which="both", alpha=0.3)

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
               marker="o" if model.startswith("kimi") else "s", ms=4, color=colors.get(tp, "k"),
               label=f"{model} {'MLA' if model.startswith('kimi') else 'GQA'} TP{tp} batch {b}")
    a.set(xscale="log", yscale="log", xlabel="cached tokens per request", ylabel="us per 1000 cached tokens, per layer",
          title="decode attention (fastest kernel per point)")
    a.legend(fontsize=7)
    a.grid(True, which="both", alpha=0.3)

    a = ax[1][0]
    for (model, tp), pts in sorted(_series(doc["prefill"], lambda r: (r["model"], r["tp"]), "tokens",
                                           "ms_per_token").items()):
        a.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "-", marker="o", ms=4,
               color=colors.get(tp, "k") if model.startswith("kimi") else {8: "tab:green", 4: "tab:olive"}[tp],
               label=f"{model} TP{tp} layer")
    for (model, tp), pts in sorted(_series([dict(r, apt=r["attn_ms"] / r["tokens"]) for r in doc["prefill"]],
                                           lambda r: (r["model"], r["tp"]), "tokens", "apt").items()):
        a.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], ":", marker=".",
               color=colors.get(tp, "k") if model.startswith("kimi") else {8: "tab:green", 4: "tab:olive"}[tp],
               label=f"{model} TP{tp} attention only")
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="us per prompt token, per layer",
          title="prefill of one layer (whole prompt at once)")
    a.legend(fontsize=7)
    a.grid(True, which="both", alpha=0.3)

    a = ax[1][1]
    dcol = {}
    for (model, tp, var, v), pts in sorted(_series(doc["draft"], lambda r: (r["model"], r["tp"], r["variant"],
                                                                            r["vocab"]), "batch", "ms").items()):
        if tp != 8:
            continue
        c = dcol.setdefault((model, v), f"C{len(dcol)}")
        a.plot(*zip(*pts, strict=True), "-" if var == "topk4x2" else "--", marker="o", ms=4, color=c,
               label=f"{model} TP8 {var} vocab {v}")
    a.set(xscale="log", xlabel="requests in the batch", ylabel="ms per draft pass (one GPU's slice)",
          title="EAGLE-3 draft pass (layer + LM head per step)")
    a.legend(fontsize=7)
    a.grid(True, which="both", alpha=0.3)
    c = doc["ceilings"]
    fig.suptitle(f"{dev['name']} (driver {dev['driver']}, torch {dev['torch']}), {doc['date']}: copy "
                 f"{c['copy_gbps']:.0f} GB/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s; bf16 random weights, "
                 f"per-GPU slices of TP8/TP4{' (QUICK smoke run)' if doc.get('quick') else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_tp(doc: dict, path: str) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    for (tp, link), pts in sorted(_series(doc["allreduce"], lambda r: (r["tp"], r["link"]), "bytes", "ms").items()):
        ax[0].plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "-" if link == "nvlink" else "--", marker="o",
                   ms=4, label=f"TP{tp} {link}")
    ax[0].set(xscale="log", yscale="log", xlabel="message bytes (tokens x 7168 x bf16)", ylabel="us per all-reduce",
              title="all-reduce latency")
    for (tp, link), pts in sorted(_series(doc["stack"], lambda r: (r["tp"], r["link"]), "tokens",
                                          "ms_per_layer").items()):
        ax[1].plot(*zip(*pts, strict=True), "-" if link == "nvlink" else "--", marker="o", ms=4,
                   label=f"TP{tp} {link} (one group)")
    for (tp, link), pts in sorted(_series([dict(r, mpl=r["ms"] / r["layers"]) for r in doc["split"]],
                                          lambda r: (r["tp"], r["link"]), "tokens", "mpl").items()):
        ax[1].plot(*zip(*pts, strict=True), ":", marker="x", ms=5, label=f"2 x TP{tp} {link} at once")
    ax[1].set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="ms per layer per step",
              title="Kimi-shaped layer stack, sharded")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{doc['label']} - {doc['device']['name']}, NCCL {doc['device'].get('nccl')}, {doc['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
