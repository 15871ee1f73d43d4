"""`spec-bench gpu step`: one full-depth decode step (every layer, the LM head, one CUDA graph) on one GPU.

One GPU stands in for one rank of TP tp: every matrix is that rank's shard (shapes.layer_slice), so the time is a
rank's compute and HBM traffic; the two all-reduces per layer that TP adds are NOT here (one GPU, no NCCL). The
step is what an engine runs per decode iteration: embedding, per layer RMSNorm, projections, rotary, the new
token's cache write, decode attention over `ctx` cached tokens per request (Triton split-K MLA kernel for Kimi,
PyTorch's fused SDPA for Llama's GQA), the router's gate and top-k, the routed experts through a fused MoE kernel
(triton_moe.py, routing computed inside the graph) and the shared expert; then the final norm, the LM head
shard and the argmax. Kimi's routed experts do not fit one GPU (about 4.2 GB a layer in bf16 at TP8), so the
step cycles over `expert_buffers` expert tensors; every layer picks its own experts, and the bytes of one
layer's touched experts pass the L2 size, so a later layer reusing a buffer still reads from HBM. A variant
without the attention core shows how much of the step the cache reads take.
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from bench.gpu import floors, shapes, triton_moe
from bench.gpu import kernels as K
from bench.gpu.suite import device_info
from bench.gpu.triton_mla import mla_decode_triton
from bench.gpu.triton_moe import fused_moe, fused_moe_reference

BF16 = torch.bfloat16
EPS = 1e-6
MOE_TOL = 2e-2  # bf16 operands and a bf16 intermediate: METHOD.md's 1e-3..1e-2 band, with headroom


def _w(o: int, i: int, dtype=BF16) -> torch.Tensor:
    return K.rand(o, i, scale=i ** -0.5).to(dtype)


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, device="cuda", dtype=BF16)


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def rotation(d: int, pos: int) -> torch.Tensor:
    """Neox-style rotary at one position as a (d, d) matrix: x @ R rotates the pairs (i, i + d/2), one small GEMM
    per use, about what an engine's fused rotary kernel costs in launches."""
    half = d // 2
    ang = pos * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    c, s = ang.cos(), ang.sin()
    r = torch.zeros(d, d, dtype=torch.float64)
    i = torch.arange(half)
    r[i, i], r[i + half, i], r[i + half, i + half], r[i, i + half] = c, -s, c, s
    return r.to(device="cuda", dtype=BF16)


class Llama:
    """Llama-3.3-70B's rank of TP tp: all layers' shards resident (17.5 GB at TP8)."""

    def __init__(self, tp: int, layers: int, max_batch: int, ctx: int):
        m = shapes.LLAMA
        self.s = s = shapes.layer_slice(m, tp)
        self.m, self.ctx, self.h, self.kv = m, ctx, s.heads, s.kv_heads
        f = m.ffn // tp
        self.layers = [dict(ln1=_ones(m.hidden), qkv=_w((s.heads + 2 * s.kv_heads) * 128, m.hidden),
                            o=_w(m.hidden, s.heads * 128), ln2=_ones(m.hidden),
                            gate_up=_w(2 * f, m.hidden), down=_w(m.hidden, f),
                            k=K.rand(max_batch, s.kv_heads, ctx + 1, 128), v=K.rand(max_batch, s.kv_heads, ctx + 1, 128))
                       for _ in range(layers)]
        self.embed = K.rand(m.vocab // tp, m.hidden)
        self.head = _w(m.vocab // tp, m.hidden)
        self.lnf = _ones(m.hidden)
        self.rot = rotation(128, ctx)

    def step(self, ids: torch.Tensor, attention: bool = True) -> torch.Tensor:
        B, h, kv, T = ids.shape[0], self.h, self.kv, self.ctx
        x = self.embed[ids]
        for L in self.layers:
            qkv = F.linear(rms(x, L["ln1"]), L["qkv"])
            q = qkv[:, : h * 128].reshape(B * h, 128) @ self.rot
            k = qkv[:, h * 128:(h + kv) * 128].reshape(B * kv, 128) @ self.rot
            L["k"][:B, :, T].copy_(k.view(B, kv, 128))
            L["v"][:B, :, T].copy_(qkv[:, (h + kv) * 128:].view(B, kv, 128))
            if attention:  # each kv head's h/kv query heads folded into the query length (one fused kernel)
                a = F.scaled_dot_product_attention(q.view(B, kv, h // kv, 128), L["k"][:B], L["v"][:B])
            else:
                a = q
            x = x + F.linear(a.reshape(B, h * 128), L["o"])
            x = x + K.mlp(rms(x, L["ln2"]), L["gate_up"], L["down"])
        return F.linear(rms(x, self.lnf), self.head).argmax(-1)


class Kimi:
    """Kimi K2.5's rank of TP tp (MLA, 384 experts, top-8, one shared expert, first layer dense)."""

    def __init__(self, tp: int, layers: int, max_batch: int, ctx: int, expert_buffers: int, expert_dtype):
        m = shapes.KIMI
        self.m, self.ctx = m, ctx
        s = shapes.layer_slice(m, tp)
        self.h = h = s.heads
        f = m.moe_ffn // tp
        fd = m.ffn // tp
        self.experts = [(_w(m.experts * 2 * f, m.hidden, expert_dtype).view(m.experts, 2 * f, m.hidden),
                         _w(m.experts * m.hidden, f, expert_dtype).view(m.experts, m.hidden, f))
                        for _ in range(expert_buffers)]
        self.layers = []
        for i in range(layers):
            kvb = _w(h * 256, m.kv_lora_rank).view(h, 256, m.kv_lora_rank)
            L = dict(ln1=_ones(m.hidden),
                     qkv_a=_w(m.q_lora_rank + m.kv_lora_rank + m.qk_rope, m.hidden),
                     q_ln=_ones(m.q_lora_rank),
                     kv_ln=_ones(m.kv_lora_rank),
                     q_b=_w(h * 192, m.q_lora_rank), w_uk=kvb[:, :128, :].contiguous(),
                     w_uv=kvb[:, 128:, :].transpose(1, 2).contiguous(), o=_w(m.hidden, h * 128),
                     ln2=_ones(m.hidden),
                     cache=K.rand(max_batch, ctx + 1, shapes.mla_kv_dim(m)))
            if i < floors.FIRST_DENSE[m.name]:
                L.update(gate_up=_w(2 * fd, m.hidden), down=_w(m.hidden, fd))
            else:
                L.update(gate=_w(m.experts, m.hidden), sh_gate_up=_w(2 * f * m.shared, m.hidden),
                         sh_down=_w(m.hidden, f * m.shared), buf=i % expert_buffers)
            self.layers.append(L)
        self.embed = K.rand(m.vocab // tp, m.hidden)
        self.head = _w(m.vocab // tp, m.hidden)
        self.lnf = _ones(m.hidden)
        self.rot = rotation(m.qk_rope, ctx)
        self.scale = (m.qk_nope + m.qk_rope) ** -0.5

    def route(self, hx: torch.Tensor, L: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the gate's logits, softmax over the k (engines fuse Kimi's sigmoid + bias top-k into one or two
        kernels; this is three)."""
        w, i = torch.topk(F.linear(hx, L["gate"]), self.m.active, dim=-1)
        return i, torch.softmax(w.float(), dim=-1)

    def step(self, ids: torch.Tensor, attention: bool = True) -> torch.Tensor:
        m, B, h, T = self.m, ids.shape[0], self.h, self.ctx
        x = self.embed[ids]
        for L in self.layers:
            a = F.linear(rms(x, L["ln1"]), L["qkv_a"])
            qa = rms(a[:, : m.q_lora_rank], L["q_ln"])
            lat = rms(a[:, m.q_lora_rank:m.q_lora_rank + m.kv_lora_rank], L["kv_ln"])
            kr = a[:, m.q_lora_rank + m.kv_lora_rank:] @ self.rot
            L["cache"][:B, T, : m.kv_lora_rank].copy_(lat)
            L["cache"][:B, T, m.kv_lora_rank:].copy_(kr)
            q = F.linear(qa, L["q_b"]).view(B, h, 192)
            q_lat = torch.bmm(q[..., :128].transpose(0, 1), L["w_uk"])  # (h, B, 512): absorbed W_UK
            q_rope = (q[..., 128:].reshape(B * h, m.qk_rope) @ self.rot).view(B, h, m.qk_rope)
            qf = torch.cat([q_lat.transpose(0, 1), q_rope], dim=-1)
            o_lat = mla_decode_triton(qf.contiguous(), L["cache"][:B], self.scale) if attention else q_lat.transpose(0, 1)
            o = torch.bmm(o_lat.transpose(0, 1), L["w_uv"])  # (h, B, 128): absorbed W_UV
            x = x + F.linear(o.transpose(0, 1).reshape(B, h * 128), L["o"])
            hx = rms(x, L["ln2"])
            if "gate_up" in L:
                x = x + K.mlp(hx, L["gate_up"], L["down"])
            else:
                topi, topw = self.route(hx, L)
                w13, w2 = self.experts[L["buf"]]
                x = x + K.mlp(hx, L["sh_gate_up"], L["sh_down"]) + fused_moe(hx, w13, w2, topi, topw)
        return F.linear(rms(x, self.lnf), self.head).argmax(-1)


def check_moe(expert_dtype) -> dict:
    """The fused kernel against an fp32 reference on fresh random inputs, with the one-launch alignment; if that
    fails (an error or rel err over MOE_TOL), again with align_torch, which the step then uses."""
    m, s = shapes.KIMI, shapes.layer_slice(shapes.KIMI, 8)
    f = s.expert_ffn
    out: dict = {"align": triton_moe.ALIGN[0].__name__}
    for T in (1, 5, 64):
        w13 = _w(m.experts * 2 * f, m.hidden, expert_dtype).view(m.experts, 2 * f, m.hidden)
        w2 = _w(m.experts * m.hidden, f, expert_dtype).view(m.experts, m.hidden, f)
        x = K.rand(T, m.hidden)
        topi = torch.stack([torch.randperm(m.experts, device="cuda")[: m.active] for _ in range(T)])
        topw = torch.rand(T, m.active, device="cuda").softmax(-1)
        ref = fused_moe_reference(x, w13, w2, topi, topw)
        try:
            err = K.rel_err(triton_moe.fused_moe(x, w13, w2, topi, topw), ref)
        except Exception as exc:  # the alignment kernel did not compile or run here
            err, out["align_error"] = float("nan"), f"{type(exc).__name__}: {str(exc)[:200]}"
        if not err <= MOE_TOL and triton_moe.ALIGN[0] is not triton_moe.align_torch:
            out[f"T{T}_align_triton"] = err
            triton_moe.ALIGN[0] = triton_moe.align_torch
            out["align"] = "align_torch"
            err = K.rel_err(triton_moe.fused_moe(x, w13, w2, topi, topw), ref)
        out[f"T{T}"] = err
        del w13, w2
    return out


def kernels_per_step(model, ids: torch.Tensor) -> int | None:
    """CUDA kernels one eager step launches (torch profiler): the count behind the step's fixed cost."""
    try:
        from torch.profiler import ProfilerActivity, profile

        model.step(ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.step(ids)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:
        return None


def bandwidth() -> float:
    """Device-to-device copy, GB/s counting bytes read plus written (the bytes ceiling of the floors)."""
    a = K.rand(1 << 30)
    b = torch.empty_like(a)
    t = K.timed(lambda a=a, b=b: b.copy_(a), reps=10, graph=False)
    return 2 * (1 << 30) * 2 / (t["ms"] * 1e-3) / 1e9


def graph_launch_us(kernels: int = 1000) -> float:
    """Microseconds per kernel of a graph of tiny dependent kernels: the launch floor every step kernel pays."""
    x = torch.zeros(1, device="cuda")

    def chain(x=x):
        for _ in range(kernels):
            x.add_(1.0)

    return K.timed(chain, reps=20)["ms"] * 1e3 / kernels


def main(out: str, models: list[str], batches: list[int], ctx: int, tp: int, expert_buffers: int,
         layers: int | None, reps: int, command: str) -> int:
    t0 = time.time()
    doc = {"kind": "step", "command": command, "device": device_info(), "tp_rank_of": tp, "ctx": ctx,
           "allreduce": "not measured (one GPU stands in for one rank of TP; two all-reduces per layer are missing)",
           "points": [], "checks": {}, "kernels_per_step": {}, "errors": []}
    doc["copy_gbps"] = bw = bandwidth()
    doc["graph_launch_us"] = graph_launch_us()
    print(f"copy {bw:.0f} GB/s, {doc['graph_launch_us']:.2f} us per tiny kernel in a graph", flush=True)

    def save():
        doc["wall_s"] = round(time.time() - t0, 1)
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)

    dtypes = {"bf16": BF16, "fp8": torch.float8_e4m3fn}
    for spec in models:
        name, _, dt = spec.partition(":")
        dt = dt or "bf16"
        try:
            if name == "kimi-k2.5":
                doc["checks"][f"fused_moe_{dt}_rel_err"] = c = check_moe(dtypes[dt])
                print(f"fused MoE {dt} rel err {c}", flush=True)
                model = Kimi(tp, layers or shapes.KIMI.layers, max(batches), ctx, expert_buffers, dtypes[dt])
                m, ebytes = shapes.KIMI, {"bf16": 2, "fp8": 1}[dt]
            elif name == "llama-3.3-70b":
                model, m, ebytes = Llama(tp, layers or shapes.LLAMA.layers, max(batches), ctx), shapes.LLAMA, 2
            else:
                raise ValueError(f"unknown model {name}")
            n_layers = len(model.layers)
            doc["kernels_per_step"][spec] = kernels_per_step(model, torch.zeros(1, dtype=torch.int64, device="cuda"))
            print(f"{spec}: {doc['kernels_per_step'][spec]} kernels per eager step", flush=True)
            for B in batches:
                ids = torch.randint(0, m.vocab // tp, (B,), device="cuda")
                for attn in (True, False):
                    t = K.timed(lambda mo=model, i=ids, a=attn: mo.step(i, a), reps=reps)
                    fl = floors.step_bytes(m, tp, B, ctx if attn else 0, ebytes)
                    if n_layers != m.layers:  # a --layers smoke run: scale the per-layer bytes
                        fl = {k: v * n_layers / m.layers for k, v in fl.items()}
                    p = {"model": name, "experts": dt if m.experts else None, "layers": n_layers, "batch": B,
                         "attention": attn, **t, "tok_s_per_request": 1e3 / t["ms"], "tok_s": B * 1e3 / t["ms"],
                         **fl, "floor_ms": fl["bytes"] / (bw * 1e9) * 1e3}
                    doc["points"].append(p)
                    print(f"{name:14s} {dt:4s} B={B:3d} attn={int(attn)} {t['ms']:8.3f} ms (floor "
                          f"{p['floor_ms']:.3f}) graph={t['graph']}", flush=True)
                    save()
            del model
        except Exception as exc:  # keep what was measured; say what broke
            doc["errors"].append(f"{spec}: {type(exc).__name__}: {str(exc)[:300]}")
            print(doc["errors"][-1], flush=True)
        torch.cuda.empty_cache()
    save()
    return 1 if doc["errors"] else 0
