"""`python -m bench.gpu run`: ceilings, correctness checks, then every single-GPU benchmark, into one JSON."""
from __future__ import annotations

import datetime as dt
import gc
import json
import math
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from bench.gpu import floors, routing, schema
from bench.gpu import kernels as K
from bench.gpu.shapes import DRAFTS, KIMI, LLAMA, MODELS, Slice, draft_slice, layer_slice, mla_kv_dim

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
TOKENS_QUICK = [1, 16, 256]
BATCHES = [1, 8, 32, 64]
CONTEXTS = [1024, 4096, 16384, 65536, 131072]
PROMPTS = [1024, 2048, 4096, 8192, 16384, 32768]
L2_BYTES_MIN = 4 * 60e6  # every timed replay streams at least 4x the L2 through distinct buffers
MAX_CACHE_TOKENS = 4 * 1024 * 1024  # batch x context cap per cache (memory and time)


class Run:
    def __init__(self, out: str, quick: bool, budget_s: float):
        self.out, self.quick, self.t0, self.budget_s = out, quick, time.monotonic(), budget_s
        self.reps = 8 if quick else 20
        self.doc: dict = {"schema": schema.SCHEMA, "kind": "single-gpu", "quick": quick,
                          "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                          "command": " ".join(["python -m bench.gpu"] + sys.argv[1:]),
                          "dtype": "bf16 weights, activations and caches; fp32 accumulation (cuBLAS/CUTLASS)",
                          "kernels": {}, "checks": [], "errors": [], "skipped": [],
                          **{k: [] for k in schema.SECTIONS}}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        with open(self.out, "w") as f:
            json.dump(self.doc, f, indent=1)

    def check(self, name: str, out, ref, tol: float, candidate: bool = False) -> bool:
        """Record a correctness check. A candidate kernel that fails is not timed (recorded as such)."""
        e = K.rel_err(out, ref)
        ok = e == e and e <= tol
        rec = {"name": name, "rel_err": e if e == e else None, "tol": tol, "ok": ok}
        if candidate and not ok:
            rec["timed"] = False
        self.doc["checks"].append(rec)
        self.log(f"check {name}: rel_err={e:.2e} tol={tol:g} {'ok' if ok else 'FAILED'}")
        return ok

    def section(self, name: str, fn) -> None:
        if getattr(self, "dead", False):
            self.doc["skipped"].append(f"{name}: CUDA context lost in an earlier section")
            return
        if self.left() < 5:
            self.doc["skipped"].append(f"{name}: time budget spent")
            self.log(f"skip {name}: budget")
            return
        self.log(f"== {name}")
        try:
            fn()
        except Exception as exc:  # one section failing must not lose the others' figures
            msg = f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            self.doc["errors"].append(msg)
            self.log(f"ERROR {msg}")
        finally:
            gc.collect()
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # the CUDA context is lost (e.g. an illegal address): nothing more can run
                self.doc["errors"].append(f"{name}: CUDA context lost: {type(exc).__name__}")
                self.dead = True
            self.save()

    def floor(self, nbytes, flops) -> float:
        c = self.doc["ceilings"]
        return floors.floor_ms(nbytes, flops, c["bw_gbps"], c["bf16_tflops"])

    def bound(self, nbytes, flops) -> str:
        c = self.doc["ceilings"]
        return floors.bound(nbytes, flops, c["bw_gbps"], c["bf16_tflops"])

    def floors_of(self, fl: dict) -> dict:
        """A record's floor and what bounds it, from its bytes and flops (floors.py)."""
        return {"floor_ms": self.floor(fl["bytes"], fl["flops"]), "bound": self.bound(fl["bytes"], fl["flops"])}


def per_copy(t: dict, copies: int) -> dict:
    """K.timed's figures over `copies` rotated copies, per copy."""
    return {"ms": t["ms"] / copies, "p10_ms": t["p10_ms"] / copies, "p90_ms": t["p90_ms"] / copies,
            "graph": t["graph"]}


def device_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:
        drv = f"unknown ({type(exc).__name__})"
    nccl = None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    return {"name": p.name, "driver": drv.split(",")[0].strip(), "nvidia_smi": drv, "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
            "l2_bytes": getattr(p, "L2_cache_size", None), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": nccl, "python": platform.python_version()}


# ---------------------------------------------------------------- ceilings

def ceilings(run: Run) -> None:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB per buffer
    a = torch.randn(n, device="cuda", dtype=K.BF16)
    b = torch.empty_like(a)
    copy = K.timed(lambda a=a, b=b: b.copy_(a), reps=10, graph=False)
    read = K.timed(lambda a=a: torch.sum(a, dtype=torch.float32), reps=10, graph=False)
    v = K.rand(8192)
    gemv = K.timed(lambda a=a: a.view(-1, 8192) @ v, reps=10, graph=False)
    a = b = None
    # the fastest read seen in practice is a fused attention kernel streaming a KV cache once: time one as well,
    # so that no decode-attention figure can beat the bandwidth its floor is computed from
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = K.rand(16, 8, 65536, 128), K.rand(16, 8, 65536, 128)
    q = K.rand(16, 8, 8, 128)

    def attn(q=q, k=k, v=v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)
    try:
        sdpa = K.timed(attn, reps=10, graph=False)
        sdpa_gbps = (k.numel() + v.numel()) * 2 / (sdpa["ms"] * 1e-3) / 1e9
    except Exception as exc:
        sdpa_gbps = 0.0
        run.doc["errors"].append(f"ceilings: SDPA read: {type(exc).__name__}")
    k = v = q = None
    m = 8192
    x, y = K.rand(m, m), K.rand(m, m)
    mm = K.timed(lambda: x @ y, reps=10, graph=False)
    copy_gbps = 2 * 2 * n / (copy["ms"] * 1e-3) / 1e9
    sum_gbps = 2 * n / (read["ms"] * 1e-3) / 1e9
    gemv_gbps = 2 * n / (gemv["ms"] * 1e-3) / 1e9
    read_gbps = max(sum_gbps, gemv_gbps, sdpa_gbps)
    tflops = 2 * m ** 3 / (mm["ms"] * 1e-3) / 1e12
    run.doc["ceilings"] = {
        "copy_gbps": copy_gbps, "read_gbps": read_gbps, "read_sum_gbps": sum_gbps, "read_gemv_gbps": gemv_gbps,
        "read_sdpa_gbps": sdpa_gbps,
        "bw_gbps": max(copy_gbps, read_gbps), "bf16_tflops": tflops,
        "method": "copy: 2 GiB bf16 device-to-device, bytes read + written; read: the fastest of an fp32-accumulated "
                  "sum and a cuBLAS matrix-vector product over the same 2 GiB and a flash-SDPA decode over a 4 GiB "
                  "K/V cache (bytes read); matmul: 8192^3 bf16 on "
                  "random data; medians of 10 after 3 warm-ups. bw_gbps = the largest, the bandwidth every bytes "
                  "floor uses"}
    run.log(f"ceilings: copy {copy_gbps:.0f} GB/s, read sum {sum_gbps:.0f} / gemv {gemv_gbps:.0f} / sdpa "
            f"{sdpa_gbps:.0f} GB/s, "
            f"bf16 {tflops:.0f} TFLOP/s")


# ---------------------------------------------------------------- MoE and dense layers vs tokens per step

def make_route(r: routing.Routing, dtype=K.BF16) -> K.Route:
    tok, _slot, offs = routing.grouped(r)
    w = torch.rand(len(tok), 1, device="cuda", dtype=torch.float32).add_(0.1).to(dtype)
    return K.Route(tok, offs, w, [e for e, c in enumerate(r.counts()) if c])


def moe_checks(run: Run, s: Slice, experts: int, hidden: int) -> str:
    """Check grouped GEMM (and the fallback) against fp32 expert by expert on fresh inputs; pick the kernel."""
    w13, w2 = K.make_experts(s, experts)
    x = K.rand(37, hidden)
    r = make_route(routing.route(37, experts, 8, 0.0, seed=12345))
    ref = K.routed_reference(x, w13, w2, r)
    kernel = "loop"
    try:
        if run.check(f"routed grouped_mm {s.model} tp{s.tp}", K.routed_grouped(x, w13, w2, r), ref, 2e-2):
            kernel = "grouped"
    except Exception as exc:
        run.doc["errors"].append(f"grouped_mm unavailable: {type(exc).__name__}: {str(exc)[:200]}")
    if kernel == "loop" and not run.check(f"routed loop {s.model} tp{s.tp}", K.routed_loop(x, w13, w2, r), ref, 2e-2):
        raise RuntimeError("no routed-expert kernel passed its check")
    # the whole MoE layer forward in bf16 vs the same code in fp32 (fp32 weights, fp32 reference experts)
    d = K.make_dense(s)
    d32 = {k: v.float() for k, v in d.items()}
    routed = K.routed_grouped if kernel == "grouped" else K.routed_loop
    out = K.moe_layer(x, d, s, w13, w2, r, routed)
    ref = K.moe_layer(x.float(), d32, s, w13.float(), w2.float(), K._as_float(r), K.routed_loop)
    run.check(f"moe layer {s.model} tp{s.tp}", out, ref, 2e-2)
    return kernel


def n_copies(bytes_per_copy: float, lo: int = 2, hi: int = 256) -> int:
    return max(lo, min(hi, math.ceil(L2_BYTES_MIN / max(bytes_per_copy, 1))))


def moe_sweep(run: Run, model_name: str, tp: int, skews: list[float], with_prefill: bool) -> None:
    m = MODELS[model_name]
    s = layer_slice(m, tp)
    kernel = moe_checks(run, s, m.experts, m.hidden)
    run.doc["kernels"]["routed_experts"] = {
        "grouped": "torch._grouped_mm (CUTLASS grouped GEMM, bf16) over all experts; empty groups launch no tiles",
        "loop": "one F.linear pair per touched expert"}[kernel]
    routed = K.routed_grouped if kernel == "grouped" else K.routed_loop
    R = 2 if run.quick else 4  # layer copies rotated: a step touches distinct memory for every layer it times
    dense = [K.make_dense(s) for _ in range(R)]
    experts = [K.make_experts(s, m.experts) for _ in range(R)]
    gc.collect()
    tokens = TOKENS_QUICK if run.quick else TOKENS
    for skew in skews:
        for n in tokens:
            if run.left() < 20:
                run.doc["skipped"].append(f"moe {model_name} tp{tp} skew{skew} n{n}: budget")
                continue
            seed = 1000 * tp + n + int(skew * 100)
            rt = routing.route(n, m.experts, m.active, skew, seed)
            r = make_route(rt)
            x = K.rand(n, m.hidden)
            whole = K.timed(lambda x=x, r=r: [K.moe_layer(x, dense[i], s, *experts[i], r, routed) for i in range(R)],
                            run.reps)
            dpart = K.timed(lambda x=x: [K.moe_dense(x, dense[i], s) for i in range(R)], run.reps)
            rpart = K.timed(lambda x=x, r=r: [routed(x, *experts[i], r) for i in range(R)], run.reps)
            fl = floors.moe_layer(s, n, m.active, rt.distinct(), m.hidden)
            rec = {"model": model_name, "tp": tp, "routing": "uniform" if skew == 0 else "zipf", "skew": skew,
                   "seed": seed, "tokens": n, "k": m.active, "experts": m.experts, "distinct": rt.distinct(),
                   "max_load": rt.max_load(), "expected_distinct_uniform": routing.expected_distinct_uniform(
                       n, m.experts, m.active), "kernel": kernel, "layers_rotated": R,
                   **per_copy(whole, R), "dense_ms": dpart["ms"] / R, "routed_ms": rpart["ms"] / R,
                   **run.floors_of(fl), "floor_ms_int4": run.floor(fl["bytes_int4_experts"], fl["flops"]),
                   "dense_floor_ms": run.floor(fl["dense_bytes"], fl["dense_flops"]),
                   "routed_floor_ms": run.floor(fl["routed_bytes"], fl["routed_flops"]),
                   "routed_floor_ms_int4": run.floor(fl["routed_bytes_int4"], fl["routed_flops"]), **fl}
            run.doc["moe_layer"].append(rec)
            run.log(f"moe {model_name} tp{tp} {rec['routing']} n={n}: {rec['ms']:.3f} ms (dense {rec['dense_ms']:.3f}"
                    f" routed {rec['routed_ms']:.3f}; floor {rec['floor_ms']:.3f}, int4 {rec['floor_ms_int4']:.3f})"
                    f" distinct={rec['distinct']}")
        run.save()
    if with_prefill:
        prefill_moe(run, m, s, dense, experts, routed)


def dense_sweep(run: Run, model_name: str, tp: int, with_prefill: bool) -> None:
    m = MODELS[model_name]
    s = layer_slice(m, tp)
    d = K.make_dense(s)
    x = K.rand(29, m.hidden)
    run.check(f"dense layer {model_name} tp{tp}", K.gqa_layer(x, d, s),
              K.gqa_layer(x.float(), {k: v.float() for k, v in d.items()}, s), 2e-2)
    del d
    R = max(2, n_copies(s.dense_params() * 2, lo=2, hi=8))
    dense = [K.make_dense(s) for _ in range(R)]
    for n in TOKENS_QUICK if run.quick else TOKENS:
        if run.left() < 20:
            run.doc["skipped"].append(f"dense {model_name} tp{tp} n{n}: budget")
            continue
        x = K.rand(n, m.hidden)
        t = K.timed(lambda x=x: [K.gqa_layer(x, dense[i], s) for i in range(R)], run.reps)
        fl = floors.dense_layer(s, n, m.hidden)
        rec = {"model": model_name, "tp": tp, "tokens": n, "layers_rotated": R, "kernel": "cuBLAS F.linear",
               **per_copy(t, R), **run.floors_of(fl), **fl}
        run.doc["dense_layer"].append(rec)
        run.log(f"dense {model_name} tp{tp} n={n}: {rec['ms']:.3f} ms (floor {rec['floor_ms']:.3f})")
    if with_prefill:
        prefill_dense(run, m, s, dense)


# ---------------------------------------------------------------- prefill

def prompts(run: Run) -> list[int]:
    return [1024, 4096] if run.quick else PROMPTS


def prefill_moe(run: Run, m, s: Slice, dense, experts, routed) -> None:
    h = s.heads
    # causal attention check (MLA prefill shape, v padded) on fresh input against fp32
    T = 512
    qkv_a = K.rand(T, 2112)
    d = dense[0]
    out = K.mla_prefill_attn(qkv_a, d, s)
    q = F.linear(qkv_a[:, :1536].float(), d["q_b"].float()).view(T, h, 192).transpose(0, 1).unsqueeze(0)
    kv = F.linear(qkv_a[:, 1536:2048].float(), d["kv_b"].float()).view(T, h, 256)
    k = torch.cat([kv[..., :128], qkv_a[:, 2048:].float().unsqueeze(1).expand(T, h, 64)], -1)
    k = k.transpose(0, 1).unsqueeze(0)
    v = kv[..., 128:].transpose(0, 1).unsqueeze(0)
    ref = K.causal_ref(q, k, v, 192 ** -0.5)[0].transpose(0, 1).reshape(T, h * 128)
    run.check(f"mla prefill attention {m.name} tp{s.tp}", out, ref, 2e-2)
    run.doc["kernels"]["prefill_attention"] = sdpa_backend_name(
        lambda: K.mla_prefill_attn(qkv_a, d, s))
    for T in prompts(run):
        if run.left() < 25:
            run.doc["skipped"].append(f"prefill {m.name} tp{s.tp} T{T}: budget")
            continue
        if T > 8192 and run.doc["kernels"]["prefill_attention"] == "SDPA MATH":
            run.doc["skipped"].append(f"prefill {m.name} tp{s.tp} T{T}: only the math SDPA backend (T x T scores)")
            continue
        rt = routing.route(T, m.experts, m.active, 0.0, seed=7 + T)
        r = make_route(rt)
        x = K.rand(T, m.hidden)
        t = K.timed(lambda x=x, r=r: [K.mla_prefill_layer(x, dense[i], s, *experts[i], r, routed) for i in range(2)],
                    max(5, run.reps // 2))
        qa = F.linear(x, dense[0]["qkv_a"])
        ta = K.timed(lambda qa=qa: [K.mla_prefill_attn(qa, dense[i], s) for i in range(2)], max(5, run.reps // 2))
        fl = floors.prefill_layer(s, T, m.hidden, "mla", m.active, rt.distinct())
        prefill_record(run, m, s, T, t, ta, fl, run.doc["kernels"]["prefill_attention"], distinct=rt.distinct(),
                       seed=7 + T)


def prefill_dense(run: Run, m, s: Slice, dense) -> None:
    T = 512
    d = dense[0]
    qkv = K.rand(T, (s.heads + 2 * s.kv_heads) * 128)
    out = K.gqa_prefill_attn(qkv, s)
    h, kv = s.heads, s.kv_heads
    q = qkv[:, : h * 128].view(T, h, 128).transpose(0, 1).unsqueeze(0)
    k = qkv[:, h * 128:(h + kv) * 128].view(T, kv, 128).transpose(0, 1).unsqueeze(0).repeat_interleave(h // kv, 1)
    v = qkv[:, (h + kv) * 128:].view(T, kv, 128).transpose(0, 1).unsqueeze(0).repeat_interleave(h // kv, 1)
    ref = K.causal_ref(q, k, v, 128 ** -0.5)[0].transpose(0, 1).reshape(T, h * 128)
    run.check(f"gqa prefill attention {m.name} tp{s.tp}", out, ref, 2e-2)
    name = sdpa_backend_name(lambda: K.gqa_prefill_attn(qkv, s))
    if name == "SDPA MATH":  # no fused kernel takes enable_gqa: expand k, v (the math backend would OOM at 32k)
        K.GQA_EXPAND[0] = True
        run.check(f"gqa prefill attention expanded {m.name} tp{s.tp}", K.gqa_prefill_attn(qkv, s), ref, 2e-2)
        name = sdpa_backend_name(lambda: K.gqa_prefill_attn(qkv, s)) + ", k/v expanded to all query heads"
    run.doc["kernels"]["prefill_attention_gqa"] = name
    for T in prompts(run):
        if run.left() < 25:
            run.doc["skipped"].append(f"prefill {m.name} tp{s.tp} T{T}: budget")
            continue
        x = K.rand(T, m.hidden)
        t = K.timed(lambda x=x: [K.gqa_prefill_layer(x, dense[i], s) for i in range(2)], max(5, run.reps // 2))
        qkv2 = F.linear(x, d["qkv"])
        ta = K.timed(lambda q=qkv2: [K.gqa_prefill_attn(q, s) for _ in range(2)], max(5, run.reps // 2))
        fl = floors.prefill_layer(s, T, m.hidden, "gqa")
        prefill_record(run, m, s, T, t, ta, fl, run.doc["kernels"]["prefill_attention_gqa"])


def prefill_record(run: Run, m, s: Slice, T: int, t: dict, ta: dict, fl: dict, kernel: str, **extra) -> None:
    """One prompt length's figures (two rotated layer copies timed: the layer in `t`, its attention in `ta`)."""
    rec = {"model": m.name, "tp": s.tp, "tokens": T, "ms": t["ms"] / 2, "attn_ms": ta["ms"] / 2,
           "ms_per_token": t["ms"] / 2 / T, "graph": t["graph"], **extra, **run.floors_of(fl), "kernel": kernel, **fl}
    run.doc["prefill"].append(rec)
    run.log(f"prefill {m.name} tp{s.tp} T={T}: {rec['ms']:.2f} ms ({1e3 * rec['ms_per_token']:.2f} us/token,"
            f" attention {rec['attn_ms']:.2f} ms; floor {rec['floor_ms']:.2f})")
    torch.cuda.empty_cache()


def fused_sdpa_backends() -> tuple:
    """The fused SDPA backends in PyTorch's own order of preference (the math backend is the fallback)."""
    from torch.nn.attention import SDPBackend

    return SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION


def first_passing_sdpa(run: Run, check: str, call, ref, what: str) -> tuple[str, object] | None:
    """The first fused SDPA backend whose output of `call()` passes its check against `ref` (one check per backend
    tried, named `check` with the backend's name in its `{}`): (label, backend), or None when none does."""
    from torch.nn.attention import sdpa_kernel

    for b in fused_sdpa_backends():
        try:
            with sdpa_kernel([b]):
                out = call()
            if run.check(check.format(b.name), out, ref, 2e-2):
                return f"SDPA {b.name} ({what})", b
        except Exception:
            continue
    return None


def sdpa_backend_name(fn) -> str:
    """Which SDPA backend accepts this call, tried alone in PyTorch's own order of preference."""
    from torch.nn.attention import sdpa_kernel

    for b in fused_sdpa_backends():
        try:
            with sdpa_kernel([b]):
                fn()
            torch.cuda.synchronize()
            return f"SDPA {b.name} (default dispatch; this is the first backend that accepts the shape)"
        except Exception:
            continue
    return "SDPA MATH"


# ---------------------------------------------------------------- decode attention

def decode_attention(run: Run) -> None:
    from torch.nn.attention import sdpa_kernel

    batches = [1, 8] if run.quick else BATCHES
    contexts = [1024, 8192] if run.quick else CONTEXTS
    cases = [("kimi-k2.5", "mla", 8), ("kimi-k2.5", "mla", 4), ("llama-3.3-70b", "gqa", 8),
             ("llama-3.3-70b", "gqa", 4)]
    for model_name, kind, tp in cases:
        m = MODELS[model_name]
        s = layer_slice(m, tp)
        # pick the kernels that pass on fresh input, fastest first
        B, T = 2, 3000
        paths = []
        if kind == "mla":
            D = mla_kv_dim(m)
            scale = 192 ** -0.5
            q, cache = K.rand(B, s.heads, D), K.rand(B, T, D)
            ref = K.mla_decode_ref(q, cache, scale)
            fused = first_passing_sdpa(run, f"mla decode SDPA {{}} tp{tp}",
                                       lambda q=q, c=cache, sc=scale: K.mla_decode_sdpa(q, c, sc), ref,
                                       "heads folded into the query, one latent head")
            paths += [fused] if fused else []
            if run.check(f"mla decode bmm tp{tp}", K.mla_decode_bmm(q, cache, scale), ref, 2e-2):
                paths.append(("bmm + fp32 softmax + bmm (reads the cache twice)", None))
            try:
                from bench.gpu.triton_mla import mla_decode_triton

                ok = True
                for b2, t2 in ((2, 3000), (1, 77), (3, 40000), (5, 1 << 20)):  # ragged; long; offsets past 2^31
                    q2, c2 = K.rand(b2, s.heads, D), K.rand(b2, t2, D)
                    ok &= run.check(f"mla decode triton tp{tp} B{b2} T{t2}", mla_decode_triton(q2, c2, scale),
                                    K.mla_decode_ref(q2, c2, scale), 2e-2, candidate=True)
                if ok:
                    paths.append(("triton split-K flash-decode (bench/gpu/triton_mla.py; reads the cache once)",
                                  "triton"))
            except Exception as exc:  # no Triton, or it would not compile: the other kernels still run
                run.doc["skipped"].append(f"mla decode triton: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            G = s.heads // s.kv_heads
            q, k, v = K.rand(B, s.kv_heads, G, 128), K.rand(B, s.kv_heads, T, 128), K.rand(B, s.kv_heads, T, 128)
            ref = K.gqa_decode_ref(q, k, v)
            fused = first_passing_sdpa(run, f"gqa decode SDPA {{}} tp{tp}",
                                       lambda q=q, k=k, v=v: K.gqa_decode_sdpa(q, k, v), ref,
                                       f"each kv head's {G} query heads folded into the query")
            paths += [fused] if fused else []
        if not paths:
            raise RuntimeError(f"no decode attention kernel passed for {model_name} tp{tp}")
        for B in batches:
            for T in contexts:
                if B * T > MAX_CACHE_TOKENS:
                    continue
                if run.left() < 15:
                    run.doc["skipped"].append(f"decode attention {model_name} tp{tp} B{B} T{T}: budget")
                    continue
                fl = floors.decode_attention(kind, B, T, s.heads, s.kv_heads, kv_dim=mla_kv_dim(m) if kind == "mla"
                                             else 576)
                C = n_copies(fl["bytes"], lo=1, hi=256)
                for label, b in paths:
                    if kind == "mla":
                        caches = K.rand(C, B, T, mla_kv_dim(m))
                        q = K.rand(B, s.heads, mla_kv_dim(m))

                        def fn(caches=caches, q=q, b=b, C=C, scale=scale):
                            if b is None:
                                return [K.mla_decode_bmm(q, caches[i], scale) for i in range(C)]
                            if b == "triton":
                                from bench.gpu.triton_mla import mla_decode_triton

                                return [mla_decode_triton(q, caches[i], scale) for i in range(C)]
                            with sdpa_kernel([b]):
                                return [K.mla_decode_sdpa(q, caches[i], scale) for i in range(C)]
                    else:
                        ks = K.rand(C, B, s.kv_heads, T, 128)
                        vs = K.rand(C, B, s.kv_heads, T, 128)
                        q = K.rand(B, s.kv_heads, s.heads // s.kv_heads, 128)

                        def fn(ks=ks, vs=vs, q=q, b=b, C=C):
                            with sdpa_kernel([b]):
                                return [K.gqa_decode_sdpa(q, ks[i], vs[i]) for i in range(C)]
                    t = K.timed(fn, run.reps)
                    ms = t["ms"] / C
                    rec = {"model": model_name, "kind": kind, "tp": tp, "heads": s.heads, "kv_heads": s.kv_heads,
                           "batch": B, "context": T, "kernel": label, "copies": C, **per_copy(t, C),
                           "ms_per_ktoken": ms / (B * T / 1000), "layers": m.layers,
                           "model_ms_per_ktoken": ms / (B * T / 1000) * m.layers, **run.floors_of(fl), **fl}
                    run.doc["decode_attention"].append(rec)
                    run.log(f"attn {model_name} tp{tp} B={B} T={T} [{label[:20]}]: {ms * 1e3:.1f} us/layer, "
                            f"{rec['ms_per_ktoken'] * 1e3:.2f} us/ktok/layer (floor {rec['floor_ms'] * 1e3:.1f} us)")
                    fn = caches = ks = vs = None
                    torch.cuda.empty_cache()
        run.save()


# ---------------------------------------------------------------- EAGLE-3 draft

def draft(run: Run) -> None:
    variants = {"topk4x2": (4, [1, 4]), "topk1x3": (1, [1, 1, 1])}
    for target in DRAFTS:
        hid = DRAFTS[target]["hidden"]
        for tp in (8, 4):
            for vocab in (DRAFTS[target]["vocab"], DRAFTS[target]["draft_vocab"]):
                s = draft_slice(target, tp, vocab)
                d = K.make_dense(s)
                x, e = K.rand(5, 3 * hid), K.rand(5, hid)
                out, _ = K.draft_step(e, x, d, s, 4, True)
                ref, _ = K.draft_step(e.float(), x.float(), {k: v.float() for k, v in d.items()}, s, 4, True)
                run.check(f"draft step {target} tp{tp} vocab{vocab}", out, ref, 2e-2)
                d = None
                copy_bytes = s.dense_params() * 2
                R = max(2, n_copies(copy_bytes, lo=2, hi=4))
                ds = [K.make_dense(s) for _ in range(R)]
                for name, (topk, mult) in variants.items():
                    for B in ([1, 8] if run.quick else [1, 8, 32]):
                        if run.left() < 10:
                            run.doc["skipped"].append(f"draft {target} tp{tp} {name} B{B}: budget")
                            continue
                        steps = [B * x for x in mult]
                        ins = [(K.rand(m, hid), K.rand(m, 3 * hid if i == 0 else hid)) for i, m in enumerate(steps)]

                        def fn(ins=ins, topk=topk, ds=ds, s=s, R=R):
                            return [K.draft_step(e_, h_, ds[r], s, topk, i == 0)
                                    for r in range(R) for i, (e_, h_) in enumerate(ins)]
                        t = K.timed(fn, run.reps)
                        fl = floors.draft_pass(s, steps, hid)
                        rec = {"model": target, "tp": tp, "variant": name, "topk": topk, "steps": steps, "batch": B,
                               "vocab": vocab, **per_copy(t, R), "copies": R, **run.floors_of(fl), **fl}
                        run.doc["draft"].append(rec)
                        run.log(f"draft {target} tp{tp} V={vocab} {name} B={B}: {rec['ms']:.3f} ms "
                                f"(floor {rec['floor_ms']:.3f})")
                ds = None
                torch.cuda.empty_cache()
        run.save()
    run.doc["kernels"]["draft"] = ("cuBLAS F.linear for fc/qkv/o/mlp/LM head + torch.topk; the draft layer's "
                                   "attention over its own cache is left out (it is the decode-attention cost of one "
                                   "more layer)")


def main(out: str, quick: bool, budget_s: float) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    run = Run(out, quick, budget_s)
    run.doc["device"] = device_info()
    run.log(f"device: {run.doc['device']}")
    ceilings(run)
    run.save()
    run.section("moe kimi tp8", lambda: moe_sweep(run, KIMI.name, 8, [0.0, routing.ZIPF_S], True))
    run.section("moe kimi tp4", lambda: moe_sweep(run, KIMI.name, 4, [0.0, routing.ZIPF_S], True))
    run.section("dense llama tp8", lambda: dense_sweep(run, LLAMA.name, 8, True))
    run.section("dense llama tp4", lambda: dense_sweep(run, LLAMA.name, 4, True))
    run.section("draft", lambda: draft(run))
    run.section("moe deepseek tp8", lambda: moe_sweep(run, "deepseek-v3", 8, [0.0], False))
    run.section("decode attention", lambda: decode_attention(run))  # last: it runs this repo's own Triton kernel
    run.doc["routing_skew"] = (f"zipf: expert popularity 1/rank^{routing.ZIPF_S} over a random order of the experts,"
                               " k distinct experts per token by successive weighted draws (bench/gpu/routing.py)")
    run.doc["notes"] = [
        "layer times leave out the attention core over the cache (the decode_attention section) and RMSNorm/RoPE",
        "MoE: pure tensor parallelism as SGLang runs Kimi at --tp 8 without expert parallelism: every GPU holds all "
        "routed experts, each split along its intermediate size",
        "int4: Kimi's routed experts ship int4 (group 32); times are bf16, floor_ms_int4 is the bytes floor with "
        "routed-expert weights at 0.5625 B/param; a bandwidth-bound int4 kernel could at best approach it",
        "prefill: one pass over the whole prompt (no chunking), uniform routing",
    ]
    run.save()
    probs = schema.validate(run.doc)
    sense = schema.physical_sense(run.doc)
    run.log(f"schema problems: {probs or 'none'}; physical-sense problems: {sense or 'none'}")
    run.log(f"checks failed: {[c['name'] for c in run.doc['checks'] if not c['ok']] or 'none'}; "
            f"errors: {run.doc['errors'] or 'none'}")
    return 0
