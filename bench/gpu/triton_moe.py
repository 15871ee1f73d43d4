"""A fused MoE kernel (Triton), in the shape of SGLang's and vLLM's `fused_moe`: one launch per projection.

The assignments (token, expert) of a step are grouped by expert on the GPU and each expert's run padded to BLOCK_M
rows (`align_triton`, one launch, so a CUDA graph captures it with the routing computed inside the step). Each program
takes BLOCK_M rows of one expert and BLOCK_N output columns: it gathers its input rows by index, streams that
expert's weight slice once, and writes the rows back to their assignment slots. An expert no token picked launches
no work, so a 1-token step reads only its k experts' weights. Weights may be fp8 (e4m3, upcast in the kernel:
weight-only, so the bytes halve and the arithmetic stays bf16); routed_dtype in shapes.py says what models ship.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.gpu.routing import moe_padded_rows

BLOCK_M = 16  # tl.dot's smallest tile; decode steps give each expert a handful of rows


def _configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s)
            for n, k, s in ((16, 256, 3), (32, 128, 4), (64, 128, 3), (64, 64, 4), (128, 64, 3))]


@triton.autotune(configs=_configs(), key=["n_valid", "N", "K"])
@triton.jit
def _moe_gemm(a_ptr, b_ptr, c_ptr, w_ptr, sid_ptr, eid_ptr, n_valid, N, K, E, stride_am, stride_be, stride_bn,
              stride_cm, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_W: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(eid_ptr + pid_m)
    if e >= E:  # a block past the last expert's padded rows: nothing to do
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sid_ptr + offs_m)
    mmask = slot < n_valid
    if A_PER_TOKEN:
        row = slot // TOP_K
    else:
        row = slot
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        acc += tl.dot(a, b.to(a.dtype))
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_W:
        acc = acc * tl.load(w_ptr + slot, mask=mmask, other=0.0)[:, None]
    c_ptrs = c_ptr + slot[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _align_kernel(ids_ptr, sid_ptr, eid_ptr, cnt_ptr, n, E, ROWS, NBLK, NP: tl.constexpr, EP: tl.constexpr,
                  RP: tl.constexpr, BP: tl.constexpr, BM: tl.constexpr, MAXB: tl.constexpr):
    """One program: count per expert (atomics), pad each run to BM, prefix-sum, name each block's expert, then
    place every assignment at its expert's cursor. A decode step has at most a few hundred assignments."""
    offs = tl.arange(0, NP)
    m = offs < n
    ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
    ev = tl.arange(0, EP)
    em = ev < E
    tl.store(cnt_ptr + ev, tl.zeros([EP], tl.int32), mask=em)
    r = tl.arange(0, RP)
    tl.store(sid_ptr + r, tl.zeros([RP], tl.int32) + n, mask=r < ROWS)
    b = tl.arange(0, BP)
    tl.store(eid_ptr + b, tl.zeros([BP], tl.int32) + E, mask=b < NBLK)
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + ids, 1, mask=m)
    tl.debug_barrier()
    counts = tl.load(cnt_ptr + ev, mask=em, other=0)
    padded = (counts + BM - 1) // BM * BM
    pstart = tl.cumsum(padded, 0) - padded
    tl.debug_barrier()
    tl.store(cnt_ptr + ev, pstart, mask=em)  # the counters become each expert's write cursor
    for j in range(0, MAXB):
        tl.store(eid_ptr + pstart // BM + j, ev, mask=em & (j * BM < padded))
    tl.debug_barrier()
    pos = tl.atomic_add(cnt_ptr + ids, 1, mask=m)
    tl.store(sid_ptr + pos, offs, mask=m)


def align_triton(topi: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_torch`'s result in one launch (rows within an expert in any order), as engines' moe_align does."""
    flat = topi.reshape(-1)
    n = flat.numel()
    rows = moe_padded_rows(n, experts, block_m)
    sid = torch.empty(rows, device=flat.device, dtype=torch.int32)
    eid = torch.empty(rows // block_m, device=flat.device, dtype=torch.int32)
    cnt = torch.empty(experts, device=flat.device, dtype=torch.int32)
    _align_kernel[(1,)](flat, sid, eid, cnt, n, experts, rows, rows // block_m, NP=triton.next_power_of_2(n),
                        EP=triton.next_power_of_2(experts), RP=triton.next_power_of_2(rows),
                        BP=triton.next_power_of_2(rows // block_m), BM=block_m, MAXB=triton.cdiv(n, block_m),
                        num_warps=4)
    return sid, eid


def align_torch(topi: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, k) expert ids -> (slot of each padded row, or n as padding; expert of each BLOCK_M block, or
    `experts` past the end). Fixed-size outputs and no host sync, so it runs inside a captured graph; about 20
    small launches, so the step uses align_triton when it passes its check."""
    flat = topi.reshape(-1)
    n = flat.numel()
    counts = torch.zeros(experts, device=flat.device, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = padded.cumsum(0)
    cend = counts.cumsum(0)
    sv, si = torch.sort(flat, stable=True)
    pos = (pend - padded)[sv] + torch.arange(n, device=flat.device) - (cend - counts)[sv]
    rows = moe_padded_rows(n, experts, block_m)
    sid = torch.full((rows,), n, device=flat.device, dtype=torch.int32)
    sid.scatter_(0, pos, si.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=flat.device, dtype=torch.int64)
    eid = torch.searchsorted(pend, starts, right=True).to(torch.int32)
    return sid, eid


# The alignment the step uses; the step's check falls back to align_torch if the one-launch kernel fails it.
ALIGN = [align_triton]


def _gemm(a, w, sid, eid, n_valid, top_k, per_token, weights=None):
    E, N, K = w.shape
    c = torch.empty(n_valid, N, device=a.device, dtype=torch.bfloat16)

    def grid(meta):
        return (eid.numel(), triton.cdiv(N, meta["BLOCK_N"]))

    _moe_gemm[grid](a, w, c, weights if weights is not None else c, sid, eid, n_valid, N, K, E, a.stride(0),
                    w.stride(0), w.stride(1), c.stride(0), TOP_K=top_k, A_PER_TOKEN=per_token,
                    MUL_W=weights is not None, BLOCK_M=BLOCK_M)
    return c


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topi: torch.Tensor,
              topw: torch.Tensor) -> torch.Tensor:
    """x (T, H) bf16; w13 (E, 2F, H), w2 (E, H, F) bf16 or fp8; topi (T, k) int64; topw (T, k) fp32 -> (T, H)."""
    T, k = topi.shape
    f = w2.shape[2]
    sid, eid = ALIGN[0](topi, w13.shape[0])
    n = T * k
    g = _gemm(x, w13, sid, eid, n, k, True)
    act = F.silu(g[:, :f]) * g[:, f:]
    o = _gemm(act, w2, sid, eid, n, k, False, weights=topw.reshape(-1).float().contiguous())
    return o.view(T, k, -1).sum(1)


def fused_moe_reference(x, w13, w2, topi, topw) -> torch.Tensor:
    """fp32, assignment by assignment."""
    T, k = topi.shape
    f = w2.shape[2]
    out = torch.zeros(T, w2.shape[1], device=x.device, dtype=torch.float32)
    for t in range(T):
        for j in range(k):
            e = int(topi[t, j])
            g = x[t].float() @ w13[e].float().T
            out[t] += float(topw[t, j]) * ((F.silu(g[:f]) * g[f:]) @ w2[e].float().T)
    return out
