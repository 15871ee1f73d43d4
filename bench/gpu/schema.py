"""The GPU benchmarks' JSON (pure): its schema, and the physical-sense checks a committed result must pass.

Single-GPU (`kind: single-gpu`, bench/gpu/suite.py) and tensor-parallel (`kind: tp`, bench/gpu/tp.py) documents.
"""
from __future__ import annotations

from bench.gpu import routing

SCHEMA = "spec-router/gpu-bench/1"
SECTIONS = ("moe_layer", "dense_layer", "decode_attention", "prefill", "draft")
# A measured time may undercut its floor by this much: the floor divides by bandwidth and matrix rate measured
# once in the same run (median of 10), and a kernel's own streaming pattern can beat the copy/sum used for them.
FLOOR_TOLERANCE = 0.05
DEVICE_KEYS = ("name", "driver", "torch", "cuda", "capability", "sms", "memory_bytes")
RECORD_KEYS = {
    "moe_layer": ("model", "tp", "routing", "skew", "seed", "tokens", "k", "experts", "distinct", "max_load", "ms",
                  "dense_ms", "routed_ms", "floor_ms", "floor_ms_int4", "dense_floor_ms", "routed_floor_ms", "bytes",
                  "flops", "kernel", "graph"),
    "dense_layer": ("model", "tp", "tokens", "ms", "floor_ms", "bytes", "flops", "graph"),
    "decode_attention": ("model", "kind", "tp", "batch", "context", "kernel", "ms", "ms_per_ktoken", "floor_ms",
                         "bytes", "flops", "graph"),
    "prefill": ("model", "tp", "tokens", "ms", "attn_ms", "ms_per_token", "floor_ms", "bytes", "flops"),
    "draft": ("model", "tp", "variant", "topk", "steps", "batch", "vocab", "ms", "floor_ms", "bytes", "flops"),
}
# Pairs (time, its floor) checked in each record.
FLOOR_PAIRS = {"moe_layer": (("ms", "floor_ms"), ("dense_ms", "dense_floor_ms"), ("routed_ms", "routed_floor_ms")),
               "dense_layer": (("ms", "floor_ms"),), "decode_attention": (("ms", "floor_ms"),),
               "prefill": (("ms", "floor_ms"),), "draft": (("ms", "floor_ms"),)}


def _num(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x


def _header(doc: dict, kind: str, keys: tuple[str, ...]) -> list[str]:
    """Problems with a document's schema version, kind and top-level keys."""
    p = [f"{k} is {doc.get(k)!r}, expected {want!r}" for k, want in (("schema", SCHEMA), ("kind", kind))
         if doc.get(k) != want]
    return p + [f"missing {key}" for key in keys if key not in doc]


def validate(doc: dict) -> list[str]:
    """Problems with a single-GPU document's shape (empty when it is well formed)."""
    p = _header(doc, "single-gpu", ("date", "device", "ceilings", "checks", "errors", "kernels"))
    dev = doc.get("device") or {}
    p += [f"device.{k} missing" for k in DEVICE_KEYS if k not in dev]
    c = doc.get("ceilings") or {}
    for k in ("copy_gbps", "read_gbps", "bw_gbps", "bf16_tflops"):
        if not (_num(c.get(k)) and c[k] > 0):
            p.append(f"ceilings.{k} not a positive number")
    for sec in SECTIONS:
        recs = doc.get(sec)
        if not isinstance(recs, list):
            p.append(f"{sec} is not a list")
            continue
        for i, r in enumerate(recs):
            for k in RECORD_KEYS[sec]:
                if k not in r:
                    p.append(f"{sec}[{i}] lacks {k}")
            for t, _ in FLOOR_PAIRS[sec]:
                if t in r and not (_num(r[t]) and r[t] > 0):
                    p.append(f"{sec}[{i}].{t} not a positive number")
    for i, ch in enumerate(doc.get("checks") or []):
        if not {"name", "rel_err", "tol", "ok"} <= set(ch):
            p.append(f"checks[{i}] malformed")
    return p


def physical_sense(doc: dict, tol: float = FLOOR_TOLERANCE, recount: bool = True) -> list[str]:
    """What a real run must satisfy: every time at or above its floor (within tol), every check passed, and each
    MoE record's expert coverage equal to what its recorded routing (tokens, experts, k, skew, seed) produces."""
    p: list[str] = []
    for sec in SECTIONS:
        for i, r in enumerate(doc.get(sec) or []):
            for t, f in FLOOR_PAIRS[sec]:
                if _num(r.get(t)) and _num(r.get(f)) and r[t] < r[f] * (1 - tol):
                    p.append(f"{sec}[{i}] {r.get('model')} tp{r.get('tp')}: {t}={r[t]:.4g} ms is below its floor "
                             f"{r[f]:.4g} ms by more than {tol:.0%}")
    for ch in doc.get("checks") or []:
        if not ch.get("ok") and ch.get("timed", True):  # a candidate that failed and was never timed is fine
            p.append(f"check failed: {ch.get('name')} rel_err={ch.get('rel_err')}")
    if recount:
        for i, r in enumerate(doc.get("moe_layer") or []):
            rt = routing.route(r["tokens"], r["experts"], r["k"], r["skew"], r["seed"])
            if (rt.distinct(), rt.max_load()) != (r["distinct"], r["max_load"]):
                p.append(f"moe_layer[{i}]: distinct/max_load {r['distinct']}/{r['max_load']} but its routing gives "
                         f"{rt.distinct()}/{rt.max_load()}")
    return p


# ---------------------------------------------------------------- tensor-parallel documents (issue 33)

TP_RECORD_KEYS = {
    "allreduce": ("tp", "link", "tokens", "bytes", "ms", "graph"),
    "stack": ("tp", "link", "tokens", "layers", "ms", "allreduce_ms", "weight_ms"),
    "split": ("tp", "groups", "link", "tokens", "ms", "tokens_per_s_world"),
}
# Latency may dip between neighbouring message sizes by this much (noise, protocol switches) and still count as
# non-decreasing: later <= earlier * (1 - tol) - abs_us is a violation.
LATENCY_TOL, LATENCY_ABS_US = 0.10, 2.0


def validate_tp(doc: dict) -> list[str]:
    """Problems with a tensor-parallel document's shape (empty when it is well formed)."""
    p = _header(doc, "tp", ("date", "device", "world", "env", "label"))
    p += [f"device.{k} missing" for k in ("name", "driver", "torch", "nccl") if k not in (doc.get("device") or {})]
    env = doc.get("env") or {}
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        if env.get(k) != v:
            p.append(f"env {k} was {env.get(k)!r}, must be {v!r}")
    for sec, keys in TP_RECORD_KEYS.items():
        recs = doc.get(sec)
        if not isinstance(recs, list):
            p.append(f"{sec} is not a list")
            continue
        for i, r in enumerate(recs):
            p += [f"{sec}[{i}] lacks {k}" for k in keys if k not in r]
            if "ms" in r and not (_num(r["ms"]) and r["ms"] > 0):
                p.append(f"{sec}[{i}].ms not a positive number")
    return p


def physical_sense_tp(doc: dict) -> list[str]:
    """All-reduce latency non-decreasing in message size per (tp, link); TP8's per-GPU weight time below TP4's."""
    p: list[str] = []
    by: dict[tuple, list] = {}
    for r in doc.get("allreduce") or []:
        by.setdefault((r["tp"], r["link"]), []).append(r)
    for (tp, link), rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["bytes"])
        for a, b in zip(rs, rs[1:], strict=False):
            if b["ms"] * 1e3 < a["ms"] * 1e3 * (1 - LATENCY_TOL) - LATENCY_ABS_US:
                p.append(f"allreduce tp{tp} {link}: {b['bytes']} B took {b['ms'] * 1e3:.1f} us, less than "
                         f"{a['bytes']} B at {a['ms'] * 1e3:.1f} us")
    w = {(r["tp"], r["link"], r["tokens"]): r["weight_ms"] for r in doc.get("stack") or []}
    for (tp, link, n), ms in w.items():
        if tp == 8 and (4, link, n) in w and not ms < w[(4, link, n)]:
            p.append(f"stack {link} n={n}: TP8 per-GPU weight time {ms:.3f} ms not below TP4's {w[(4, link, n)]:.3f}")
    return p
