"""A split-K flash-decoding kernel for MLA's latent cache (Triton): reads each cached 576-vector once.

PyTorch has no fused kernel for MLA decode (SDPA's flash backend stops at head dim 256; its memory-efficient one
takes 576 but is slow for this shape; the bmm path reads the cache twice). Engines use FlashMLA / FlashInfer; this
stands in for them so the measured time per 1000 cached tokens is a kernel that streams the cache once.
Grid: (batch, splits); each program takes every head of one request over one chunk of its context, keeps an
online softmax, and writes a partial output and log-sum-exp; torch combines the splits.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_decode_split(q_ptr, c_ptr, o_ptr, lse_ptr, T, chunk, sm_scale,
                      stride_qb, stride_qh, stride_cb, stride_ct, stride_ob, stride_os, stride_oh, stride_lb,
                      stride_ls, H: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr,
                      DR: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # b * stride_cb passes 2^31 elements at batch 32 x 128k tokens
    sp = tl.program_id(1)
    offs_h = tl.arange(0, HP)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)
    offs_n = tl.arange(0, BLOCK_N)
    hmask = offs_h < H
    qb = q_ptr + b * stride_qb + offs_h[:, None] * stride_qh
    q_nope = tl.load(qb + offs_v[None, :], mask=hmask[:, None], other=0.0)
    q_rope = tl.load(qb + DV + offs_r[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, DV], tl.float32)
    start = sp * chunk
    end = tl.minimum(start + chunk, T)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        nmask = n < end
        base = c_ptr + b * stride_cb + n[:, None].to(tl.int64) * stride_ct
        k_nope = tl.load(base + offs_v[None, :], mask=nmask[:, None], other=0.0)
        k_rope = tl.load(base + DV + offs_r[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_rope, tl.trans(k_rope))
        s = tl.where(nmask[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
        m_i = m_new
    ob = o_ptr + b * stride_ob + sp * stride_os + offs_h[:, None] * stride_oh
    tl.store(ob + offs_v[None, :], acc / l_i[:, None], mask=hmask[:, None])
    tl.store(lse_ptr + b * stride_lb + sp * stride_ls + offs_h, m_i + tl.log(l_i), mask=hmask)


BLOCK_N = 32
TARGET_PROGRAMS = 2 * 132  # two programs per multiprocessor of an H100/H200


def mla_decode_triton(q: torch.Tensor, cache: torch.Tensor, scale: float, dv: int = 512) -> torch.Tensor:
    """q (B, H, 576), cache (B, T, 576) contiguous bf16 -> (B, H, dv) bf16."""
    B, H, D = q.shape
    T = cache.shape[1]
    splits = max(1, min(math.ceil(TARGET_PROGRAMS / B), math.ceil(T / BLOCK_N)))
    chunk = math.ceil(math.ceil(T / splits) / BLOCK_N) * BLOCK_N
    splits = math.ceil(T / chunk)  # every split non-empty
    o = torch.empty(B, splits, H, dv, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, splits, H, device=q.device, dtype=torch.float32)
    hp = max(16, triton.next_power_of_2(H))
    _mla_decode_split[(B, splits)](q, cache, o, lse, T, chunk, scale, q.stride(0), q.stride(1), cache.stride(0),
                                   cache.stride(1), o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                                   lse.stride(1), H=H, HP=hp, BLOCK_N=BLOCK_N, DV=dv, DR=D - dv, num_warps=4,
                                   num_stages=2)
    m = lse.amax(1, keepdim=True)
    w = torch.exp(lse - m)
    return ((o * w.unsqueeze(-1)).sum(1) / w.sum(1).unsqueeze(-1)).to(q.dtype)
