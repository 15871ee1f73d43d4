"""The timed work (torch): layer forwards at a per-GPU TP slice, decode attention, prefill, draft pass; the timer.

Every function takes tensors already on the GPU and does only the step's work, so the suite can capture it in a
CUDA graph. Weights use nn.Linear's (out, in) layout; routed experts sit in one (E, out, in) tensor per layer.
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from bench.gpu.shapes import Slice

BF16 = torch.bfloat16


def timed(fn, reps: int, warmup: int = 3, graph: bool = True) -> dict:
    """Median ms of `fn` over `reps` runs (CUDA events), replayed from a CUDA graph when capture works."""
    torch.cuda.synchronize()
    run, used_graph, why = fn, False, ""
    g = None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, used_graph = g.replay, True
        except Exception as exc:  # capture not possible for this op: time eagerly and say so
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            g = None
            torch.cuda.synchronize()
            run = fn
    for _ in range(warmup):
        run()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    del g
    out = {"ms": statistics.median(ts), "p10_ms": ts[len(ts) // 10], "p90_ms": ts[(len(ts) * 9) // 10],
           "reps": reps, "graph": used_graph}
    if why:
        out["graph_error"] = why
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def rand(*shape, dtype=BF16, scale: float | None = None) -> torch.Tensor:
    t = torch.randn(*shape, device="cuda", dtype=dtype)
    if scale is not None:
        t.mul_(scale)
    return t


def make_dense(s: Slice, dtype=BF16) -> dict[str, torch.Tensor]:
    return {name: rand(o, i, dtype=dtype, scale=i ** -0.5) for name, i, o in s.dense}


def make_experts(s: Slice, experts: int, dtype=BF16) -> tuple[torch.Tensor, torch.Tensor]:
    f, h = s.expert_ffn, s.expert_in
    return (rand(experts, 2 * f, h, dtype=dtype, scale=h ** -0.5), rand(experts, h, f, dtype=dtype, scale=f ** -0.5))


# ---------------------------------------------------------------- routed experts

class Route:
    """A routing on the GPU, as a grouped GEMM consumes it: assignment rows sorted by expert."""

    def __init__(self, tok: list[int], offs: list[int], weights: torch.Tensor, touched: list[int]):
        self.tok = torch.tensor(tok, device="cuda", dtype=torch.int64)
        self.offs = torch.tensor(offs, device="cuda", dtype=torch.int32)
        self.w = weights  # (rows, 1) bf16 routing weights, in the sorted order
        self.offs_host = offs
        self.touched = touched


def routed_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, r: Route) -> torch.Tensor:
    """Gather -> grouped GEMM (gate_up) -> SiLU*up -> grouped GEMM (down) -> weighted scatter-add.

    torch._grouped_mm (CUTLASS grouped GEMM on sm90): experts with no rows launch no tiles, so their weights are
    never read.
    """
    f = w2.shape[2]
    xs = x.index_select(0, r.tok)
    g = torch._grouped_mm(xs, w13.transpose(1, 2), offs=r.offs)
    a = F.silu(g[:, :f]) * g[:, f:]
    o = torch._grouped_mm(a, w2.transpose(1, 2), offs=r.offs) * r.w
    return torch.zeros_like(x).index_add_(0, r.tok, o)


def routed_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, r: Route) -> torch.Tensor:
    """The fallback: one pair of GEMMs per touched expert (host-side loop, captured into the graph)."""
    f = w2.shape[2]
    xs = x.index_select(0, r.tok)
    outs = []
    start = 0
    for e, end in enumerate(r.offs_host):
        if end > start:
            g = F.linear(xs[start:end], w13[e])
            outs.append(F.linear(F.silu(g[:, :f]) * g[:, f:], w2[e]))
        start = end
    o = torch.cat(outs) * r.w
    return torch.zeros_like(x).index_add_(0, r.tok, o)


def routed_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, r: Route) -> torch.Tensor:
    """Plain fp32 reference of the routed experts, expert by expert."""
    return routed_loop(x.float(), w13.float(), w2.float(), _as_float(r))


def _as_float(r: Route) -> Route:
    c = Route.__new__(Route)
    c.tok, c.offs, c.w, c.offs_host, c.touched = r.tok, r.offs, r.w.float(), r.offs_host, r.touched
    return c


# ---------------------------------------------------------------- layer forwards (decode step of n tokens)

def mla_attn_proj(x: torch.Tensor, d: dict, s: Slice, kv_lora: int = 512, q_lora: int = 1536) -> torch.Tensor:
    """MLA's projections at decode, with SGLang's weight absorption: qkv_a, q_b, q_nope x W_UK, (attention core
    left out: it is the decode-attention benchmark), latent x W_UV, o_proj."""
    n, h = x.shape[0], s.heads
    qkv = F.linear(x, d["qkv_a"])
    q = F.linear(qkv[:, :q_lora], d["q_b"]).view(n, h, 192)
    kvb = d["kv_b"].view(h, 256, kv_lora)
    q_lat = torch.bmm(q[..., :128].transpose(0, 1), kvb[:, :128, :])  # (h, n, 512)
    o_lat = torch.bmm(q_lat, kvb[:, 128:, :].transpose(1, 2))  # stand-in for the attention output latent
    return F.linear(o_lat.transpose(0, 1).reshape(n, h * 128), d["o"])


def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    f = down.shape[1]
    g = F.linear(x, gate_up)
    return F.linear(F.silu(g[:, :f]) * g[:, f:], down)


def moe_dense(x: torch.Tensor, d: dict, s: Slice) -> torch.Tensor:
    """The MoE layer's dense part: attention projections, the router gate, the shared expert."""
    h1 = x + mla_attn_proj(x, d, s)
    logits = F.linear(h1, d["gate"])  # routing itself comes from the benchmark's generator
    return h1 + mlp(h1, d["shared_gate_up"], d["shared_down"]) + logits[:, :1] * 0


def moe_layer(x, d, s, w13, w2, r, routed=routed_grouped):
    h1 = x + mla_attn_proj(x, d, s)
    logits = F.linear(h1, d["gate"])
    return h1 + mlp(h1, d["shared_gate_up"], d["shared_down"]) + routed(h1, w13, w2, r) + logits[:, :1] * 0


def gqa_layer(x: torch.Tensor, d: dict, s: Slice) -> torch.Tensor:
    """Llama layer at decode without the attention core: qkv, o (fed q as a stand-in), gate_up, down."""
    qkv = F.linear(x, d["qkv"])
    h1 = x + F.linear(qkv[:, : s.heads * 128], d["o"])
    return h1 + mlp(h1, d["gate_up"], d["down"])


# ---------------------------------------------------------------- decode attention

def mla_decode_sdpa(q: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, 576), cache (B, T, 576): MQA over the latent, the H heads folded into the query length."""
    B, H, D = q.shape
    k = cache.unsqueeze(1)
    return F.scaled_dot_product_attention(q.unsqueeze(1), k, k[..., :512], scale=scale).squeeze(1)


def mla_decode_bmm(q: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Two batched GEMMs and a softmax: reads the cache twice (scores, then values)."""
    s = torch.bmm(q, cache.transpose(1, 2)).float().mul_(scale)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.bmm(p, cache[:, :, :512])


def mla_decode_ref(q, cache, scale):
    s = torch.bmm(q.float(), cache.float().transpose(1, 2)) * scale
    return torch.bmm(torch.softmax(s, -1), cache.float()[:, :, :512])


def gqa_decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, Hkv, G, 128): each kv head's G query heads folded into the query length; k, v (B, Hkv, T, 128)."""
    return F.scaled_dot_product_attention(q, k, v)


def gqa_decode_ref(q, k, v):
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v.float()


# ---------------------------------------------------------------- prefill

def mla_prefill_attn(qkv_a: torch.Tensor, d: dict, s: Slice, kv_lora: int = 512, q_lora: int = 1536):
    """MLA prefill as SGLang runs it (no absorption): q_b, kv_b, rope key broadcast, causal SDPA with v padded
    from 128 to 192 so one flash kernel takes it; returns (T, H*128)."""
    T, h = qkv_a.shape[0], s.heads
    q = F.linear(qkv_a[:, :q_lora], d["q_b"]).view(T, h, 192)
    kv = F.linear(qkv_a[:, q_lora:q_lora + kv_lora], d["kv_b"]).view(T, h, 256)
    k_rope = qkv_a[:, q_lora + kv_lora:].unsqueeze(1).expand(T, h, 64)
    k = torch.cat([kv[..., :128], k_rope], dim=-1)
    v = F.pad(kv[..., 128:], (0, 64))
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=192 ** -0.5)
    return o[0, :, :, :128].transpose(0, 1).reshape(T, h * 128)


def mla_prefill_layer(x, d, s, w13, w2, r, routed=routed_grouped):
    h1 = x + F.linear(mla_prefill_attn(F.linear(x, d["qkv_a"]), d, s), d["o"])
    logits = F.linear(h1, d["gate"])
    return h1 + mlp(h1, d["shared_gate_up"], d["shared_down"]) + routed(h1, w13, w2, r) + logits[:, :1] * 0


# Set by the suite when no fused backend takes enable_gqa: then k, v are expanded to every query head first.
GQA_EXPAND = [False]


def gqa_prefill_attn(qkv: torch.Tensor, s: Slice) -> torch.Tensor:
    T, h, kv = qkv.shape[0], s.heads, s.kv_heads
    q = qkv[:, : h * 128].view(T, h, 128).transpose(0, 1).unsqueeze(0)
    k = qkv[:, h * 128:(h + kv) * 128].view(T, kv, 128).transpose(0, 1).unsqueeze(0)
    v = qkv[:, (h + kv) * 128:].view(T, kv, 128).transpose(0, 1).unsqueeze(0)
    if GQA_EXPAND[0]:
        k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(T, h * 128)


def gqa_prefill_layer(x, d, s):
    h1 = x + F.linear(gqa_prefill_attn(F.linear(x, d["qkv"]), s), d["o"])
    return h1 + mlp(h1, d["gate_up"], d["down"])


def causal_ref(q, k, v, scale):
    """fp32 causal attention, (1, H, T, D) each (k, v already expanded to H heads)."""
    q, k, v = q.float(), k.float(), v.float()
    s = (q @ k.transpose(-1, -2)) * scale
    T = q.shape[2]
    mask = torch.ones(T, T, device=q.device, dtype=torch.bool).triu(1)
    return torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v


# ---------------------------------------------------------------- EAGLE-3 draft

def draft_step(embed: torch.Tensor, hid: torch.Tensor, d: dict, s: Slice, topk: int, first: bool):
    """One draft step over m tokens: (fc on the target's 3 hidden states, first step only), the layer with its
    qkv over [embedding, hidden], the LM head shard, top-k."""
    h = F.linear(hid, d["fc"]) if first else hid
    x = torch.cat([embed, h], dim=-1)
    qkv = F.linear(x, d["qkv"])
    h1 = h + F.linear(qkv[:, : s.heads * 128], d["o"])  # attention core over the draft's cache left out
    h2 = h1 + mlp(h1, d["gate_up"], d["down"])
    logits = F.linear(h2, d["lm_head"])
    return logits, torch.topk(logits, topk, dim=-1)
