"""Floor arithmetic (pure): the fewest bytes and FLOPs each benchmarked step needs, and the time they imply.

A floor is max(bytes / bandwidth, FLOPs / matrix rate) at the ceilings measured on the device in the same run;
no kernel can beat it by more than measurement noise. Weights count once per step (read from HBM, not L2: the
benchmarks rotate over enough layer copies); activations count once in and once out.
"""
from __future__ import annotations

from bench.gpu.routing import expected_distinct_uniform
from bench.gpu.shapes import BF16, INT4_BYTES_PER_PARAM, Model, Slice, layer_slice, mla_kv_dim


def floor_ms(nbytes: float, flops: float, bw_gbps: float, tflops: float) -> float:
    return max(nbytes / (bw_gbps * 1e9), flops / (tflops * 1e12)) * 1e3


def bound(nbytes: float, flops: float, bw_gbps: float, tflops: float) -> str:
    return "bytes" if nbytes / (bw_gbps * 1e9) >= flops / (tflops * 1e12) else "flops"


def moe_layer(s: Slice, tokens: int, k: int, distinct: int, hidden: int) -> dict:
    """One MoE layer's projections at `tokens` tokens: dense part + shared expert + the `distinct` routed experts."""
    act = 2 * tokens * hidden * BF16
    dense_b = s.dense_params() * BF16
    routed_p = distinct * s.expert_params()
    return {
        "bytes": dense_b + routed_p * BF16 + act,
        "bytes_int4_experts": dense_b + routed_p * INT4_BYTES_PER_PARAM + act,
        "flops": 2 * tokens * (s.dense_params() + k * s.expert_params()),
        "dense_bytes": dense_b + act,
        "dense_flops": 2 * tokens * s.dense_params(),
        "routed_bytes": routed_p * BF16,
        "routed_bytes_int4": routed_p * INT4_BYTES_PER_PARAM,
        "routed_flops": 2 * tokens * k * s.expert_params(),
    }


def dense_layer(s: Slice, tokens: int, hidden: int) -> dict:
    return {"bytes": s.dense_params() * BF16 + 2 * tokens * hidden * BF16, "flops": 2 * tokens * s.dense_params()}


def decode_attention(kind: str, batch: int, context: int, heads: int, kv_heads: int = 1, head_dim: int = 128,
                     kv_dim: int = 576, v_dim: int = 512) -> dict:
    """One layer's decode attention over the cache: each cached element read once; QK and PV FLOPs."""
    if kind == "mla":  # latent cache: one (kv_lora + rope) vector per token, shared by all heads
        per_tok = kv_dim * BF16
        flops = 2 * batch * heads * context * (kv_dim + v_dim)
    else:  # gqa: K and V per kv head
        per_tok = 2 * kv_heads * head_dim * BF16
        flops = 2 * batch * heads * context * head_dim * 2
    return {"bytes": batch * context * per_tok, "flops": flops, "bytes_per_token": per_tok}


def prefill_layer(s: Slice, tokens: int, hidden: int, kind: str, k: int = 0, distinct: int = 0) -> dict:
    """One layer's prefill of `tokens` prompt tokens: projections (+ routed experts) + causal attention."""
    if kind == "mla":
        attn_flops = 2 * s.heads * tokens * tokens / 2 * (192 + 128)  # qk over nope+rope, pv over v_head
    else:
        attn_flops = 2 * s.heads * tokens * tokens / 2 * 128 * 2
    nb = s.dense_params() * BF16 + distinct * s.expert_params() * BF16 + 2 * tokens * hidden * BF16
    flops = 2 * tokens * (s.dense_params() + k * s.expert_params()) + attn_flops
    return {"bytes": nb, "flops": flops, "attn_flops": attn_flops}


def draft_pass(s: Slice, steps: list[int], hidden: int) -> dict:
    """EAGLE-3 draft pass: per step, the layer and LM head over that step's tokens (fc on the first step only)."""
    params = {n: i * o for n, i, o in s.dense}
    layer = sum(v for n, v in params.items() if n != "fc")
    nb = flops = 0
    for i, m in enumerate(steps):
        p = layer + (params["fc"] if i == 0 else 0)
        nb += p * BF16 + 2 * m * hidden * BF16
        flops += 2 * m * p
    return {"bytes": nb, "flops": flops}


# Dense (non-MoE) leading layers per model: first_k_dense_replace in each config.json (shapes.py quotes them).
FIRST_DENSE = {"kimi-k2.5": 1, "deepseek-v3": 3}


def step_bytes(m: Model, tp: int, batch: int, ctx: int, expert_bytes_per_param: float = BF16) -> dict:
    """The fewest HBM bytes one full-depth decode step reads on one GPU of TP tp: every layer's dense weights,
    the routed experts `batch` tokens touch under uniform routing (expected count), the LM head shard, and each
    request's cache of `ctx` tokens (MLA latent 576/token/layer; GQA k and v of this GPU's kv heads)."""
    if m.experts:
        moe, dense0 = layer_slice(m, tp), layer_slice(m, tp, moe=False)
        n_dense = FIRST_DENSE[m.name]
        distinct = expected_distinct_uniform(batch, m.experts, m.active)
        dense_b = (n_dense * dense0.dense_params() + (m.layers - n_dense) * moe.dense_params()) * BF16
        expert_b = (m.layers - n_dense) * distinct * moe.expert_params() * expert_bytes_per_param
        kv_b = m.layers * batch * ctx * mla_kv_dim(m) * BF16
    else:
        s = layer_slice(m, tp)
        dense_b, expert_b = m.layers * s.dense_params() * BF16, 0.0
        kv_b = m.layers * batch * ctx * 2 * s.kv_heads * m.head_dim * BF16
    head_b = (m.vocab // tp) * m.hidden * BF16
    total = dense_b + expert_b + kv_b + head_b
    return {"bytes": total, "dense_bytes": dense_b + head_b, "expert_bytes": expert_b, "kv_bytes": kv_b}
