"""Markdown tables from a single-GPU result JSON (pure): headline figures and their comparison with the simulator.

`python -m bench.gpu report FILE` prints what docs/SIMULATOR.md "Measured on H200" quotes.
Mapping to another GPU is an ASSUMPTION stated here once: a bytes-bound figure scales with the ratio of memory
bandwidths, a FLOP-bound one with the ratio of dense bf16 matrix rates, each the target's datasheet figure over the
H200's measured ceiling. RTX PRO 6000 Blackwell (the seed table's GPU): 1792 GB/s GDDR7, ~500 TFLOP/s dense bf16
(NVIDIA datasheet figures, not measured here).
"""
from __future__ import annotations

import statistics

RTX_PRO_6000 = {"bw_gbps": 1792.0, "bf16_tflops": 500.0}


def _best_attention(doc: dict) -> dict:
    best: dict = {}
    for r in doc["decode_attention"]:
        k = (r["model"], r["tp"], r["batch"], r["context"])
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    return best


def _layer(doc: dict, model: str, tp: int, routing: str = "uniform") -> dict[int, dict]:
    sec = "dense_layer" if model.startswith("llama") else "moe_layer"
    return {r["tokens"]: r for r in doc[sec] if r["model"] == model and r["tp"] == tp
            and r.get("routing", "uniform") == routing}


def kv_term(doc: dict, model: str, tp: int, min_batch: int = 32, min_context: int = 16384) -> dict:
    """Decode attention per 1000 cached tokens for the whole model (x layers), where it is bandwidth bound."""
    pts = [r for (m, t, b, c), r in _best_attention(doc).items() if m == model and t == tp and b >= min_batch
           and c >= min_context]
    if not pts:
        return {}
    return {"ms_per_ktoken": statistics.median(r["model_ms_per_ktoken"] for r in pts),
            "floor_ms_per_ktoken": statistics.median(r["floor_ms"] / (r["batch"] * r["context"] / 1000) * r["layers"]
                                                     for r in pts),
            "kernels": sorted({r["kernel"].split(" (")[0] for r in pts}), "points": len(pts)}


def bw_ratio(doc: dict, target: dict = RTX_PRO_6000) -> float:
    return doc["ceilings"]["bw_gbps"] / target["bw_gbps"]


def flops_ratio(doc: dict, target: dict = RTX_PRO_6000) -> float:
    return doc["ceilings"]["bf16_tflops"] / target["bf16_tflops"]


def render(doc: dict) -> str:
    c, dev = doc["ceilings"], doc["device"]
    out = [f"Device: {dev['name']}, driver {dev['driver']}, torch {dev['torch']} (CUDA {dev['cuda']}), {doc['date']}; "
           f"ceilings: copy {c['copy_gbps']:.0f} GB/s, read {c['read_gbps']:.0f} GB/s, bf16 {c['bf16_tflops']:.0f} "
           f"TFLOP/s.", ""]
    out += ["Per-GPU layer time (ms) vs tokens per step; in brackets the bytes/FLOPs floor (bf16 / experts at int4); "
            "distinct experts touched after /:", "",
            "| tokens | Kimi TP8 uniform | Kimi TP8 Zipf | Kimi TP4 uniform | Kimi TP4 Zipf | DeepSeek-V3 TP8 | "
            "Llama-70B TP8 | Llama-70B TP4 |", "|---:|---|---|---|---|---|---|---|"]
    cols = [_layer(doc, "kimi-k2.5", 8), _layer(doc, "kimi-k2.5", 8, "zipf"), _layer(doc, "kimi-k2.5", 4),
            _layer(doc, "kimi-k2.5", 4, "zipf"), _layer(doc, "deepseek-v3", 8), _layer(doc, "llama-3.3-70b", 8),
            _layer(doc, "llama-3.3-70b", 4)]
    for n in sorted({n for col in cols for n in col}):
        cells = []
        for col in cols:
            r = col.get(n)
            if r is None:
                cells.append("")
            elif "distinct" in r:
                cells.append(f"{r['ms']:.3f} ({r['floor_ms']:.3f}/{r['floor_ms_int4']:.3f}) /{r['distinct']}")
            else:
                cells.append(f"{r['ms']:.3f} ({r['floor_ms']:.3f})")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "Decode attention, fastest checked kernel, us per 1000 cached tokens per layer (x layers = ms per "
            "1000 tokens per step):", "", "| model | TP | batch | 1k | 4k | 16k | 64k | 128k | kernel at 128k/64k |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    best = _best_attention(doc)
    for model, tp in sorted({(k[0], k[1]) for k in best}):
        for b in sorted({k[2] for k in best if k[:2] == (model, tp)}):
            row = {k[3]: v for k, v in best.items() if k[:3] == (model, tp, b)}
            cells = [f"{1e3 * row[t]['ms_per_ktoken']:.2f}" if t in row else "" for t in
                     (1024, 4096, 16384, 65536, 131072)]
            last = row[max(row)]["kernel"].split(" (")[0]
            out.append(f"| {model} | {tp} | {b} | " + " | ".join(cells) + f" | {last} |")
    out += ["", "Prefill of one layer (whole prompt): us per prompt token (attention alone); x layers for the model:",
            "", "| model | TP | 1k | 2k | 4k | 8k | 16k | 32k | model ms/token at 8k-32k |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    layers = {"kimi-k2.5": 61, "llama-3.3-70b": 80, "deepseek-v3": 61}
    for model, tp in sorted({(r["model"], r["tp"]) for r in doc["prefill"]}):
        row = {r["tokens"]: r for r in doc["prefill"] if (r["model"], r["tp"]) == (model, tp)}
        cells = [f"{1e3 * row[t]['ms_per_token']:.2f} ({1e3 * row[t]['attn_ms'] / t:.2f})" if t in row else ""
                 for t in (1024, 2048, 4096, 8192, 16384, 32768)]
        long = [row[t]["ms_per_token"] for t in row if t >= 8192]
        m = f"{layers[model] * min(long):.3f}-{layers[model] * max(long):.3f}" if long else ""
        out.append(f"| {model} | {tp} | " + " | ".join(cells) + f" | {m} |")
    out += ["", "EAGLE-3 draft pass (ms, one GPU's slice; floor in brackets):", "",
            "| model | TP | vocab | variant | batch 1 | batch 8 | batch 32 |", "|---|---:|---:|---|---:|---:|---:|"]
    keys = sorted({(r["model"], r["tp"], r["vocab"], r["variant"]) for r in doc["draft"]})
    for k in keys:
        row = {r["batch"]: r for r in doc["draft"] if (r["model"], r["tp"], r["vocab"], r["variant"]) == k}
        cells = [f"{row[b]['ms']:.3f} ({row[b]['floor_ms']:.3f})" if b in row else "" for b in (1, 8, 32)]
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    out += ["", "Derived (what docs/SIMULATOR.md compares):", ""]
    for tp in (8, 4):
        kv = kv_term(doc, "kimi-k2.5", tp)
        if kv:
            out.append(f"- kv term, Kimi MLA TP{tp}, bf16 latent cache, batch>=32, context>=16k: "
                       f"{kv['ms_per_ktoken']:.4f} ms per 1000 tokens per step on the H200 (floor "
                       f"{kv['floor_ms_per_ktoken']:.4f}; {', '.join(kv['kernels'])}); x bandwidth ratio "
                       f"{bw_ratio(doc):.2f} -> {kv['ms_per_ktoken'] * bw_ratio(doc):.4f} on an RTX PRO 6000 "
                       f"(fp8 cache: half the bytes)")
    k8, k4 = _layer(doc, "kimi-k2.5", 8), _layer(doc, "kimi-k2.5", 4)
    for b in (1, 4, 16, 64):
        if 4 * b in k8 and 16 * b in k8:
            out.append(f"- verify, Kimi TP8, {b} request(s): 4 draft tokens each (topk 1, 3 steps) "
                       f"{k8[4 * b]['ms']:.3f} ms/layer vs 16 (topk 4, 2 steps) {k8[16 * b]['ms']:.3f}: "
                       f"{k8[4 * b]['ms'] / k8[16 * b]['ms']:.2f}x"
                       + (f"; a decode of {b}: {k8[b]['ms']:.3f} ms/layer" if b in k8 else ""))
    ratios = [f"{n}: {k4[n]['ms'] / k8[n]['ms']:.2f}" for n in sorted(k8) if n in k4]
    out.append(f"- TP4/TP8 per-GPU layer time, Kimi uniform, by tokens per step: {', '.join(ratios)}")
    l8, l4 = _layer(doc, "llama-3.3-70b", 8), _layer(doc, "llama-3.3-70b", 4)
    ratios = [f"{n}: {l4[n]['ms'] / l8[n]['ms']:.2f}" for n in sorted(l8) if n in l4]
    out.append(f"- TP4/TP8 per-GPU layer time, Llama dense: {', '.join(ratios)}")
    kv8, kv4 = kv_term(doc, "kimi-k2.5", 8), kv_term(doc, "kimi-k2.5", 4)
    g8, g4 = kv_term(doc, "llama-3.3-70b", 8), kv_term(doc, "llama-3.3-70b", 4)
    if kv8 and kv4 and g8 and g4:
        out.append(f"- TP4/TP8 kv term: Kimi MLA {kv4['ms_per_ktoken'] / kv8['ms_per_ktoken']:.2f}x (the latent "
                   f"cache is replicated, not split), Llama GQA {g4['ms_per_ktoken'] / g8['ms_per_ktoken']:.2f}x")
    out.append(f"- ratios used to map to an RTX PRO 6000 (assumption, datasheet over measured): bandwidth "
               f"{bw_ratio(doc):.2f}, bf16 matrix rate {flops_ratio(doc):.2f}")
    return "\n".join(out)
