"""`python -m bench.gpu tp`: all-reduce latency, a sharded Kimi-shaped layer stack, and the TP split (issue 33).

One process per GPU (torch.multiprocessing.spawn), NCCL. NVLink multicast stays off in the launcher and in every
child (the variables are set before any child starts and asserted in each). `nop2p` sets NCCL_P2P_DISABLE=1:
traffic goes through host memory, a stand-in for GPUs on PCIe without peer access, not a PCIe measurement.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sys
import tempfile
import time

from bench.gpu import routing, schema
from bench.gpu.shapes import KIMI, layer_slice

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
AR_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
AR_TOKENS_QUICK = [1, 16, 256, 1024]
STACK_TOKENS = [1, 4, 16, 64, 256, 1024]
STACK_TOKENS_QUICK = [1, 16, 256]


def multicast_off(env: dict | None = None) -> dict:
    """Set the three variables (in os.environ by default, which children inherit) and return that mapping."""
    env = os.environ if env is None else env
    env.update(MULTICAST_OFF)
    return env


def assert_multicast_off(env: dict | None = None) -> None:
    env = os.environ if env is None else env
    bad = {k: env.get(k) for k, v in MULTICAST_OFF.items() if env.get(k) != v}
    if bad:
        raise RuntimeError(f"NVLink multicast must be off in every process; wrong: {bad}")


def link_env(link: str, env: dict | None = None) -> dict:
    env = os.environ if env is None else env
    if link == "nop2p":
        env["NCCL_P2P_DISABLE"] = "1"
    else:
        env.pop("NCCL_P2P_DISABLE", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: str, world: int, links: list[str], layers: int, quick: bool) -> int:
    multicast_off()
    import torch
    import torch.multiprocessing as mp

    from bench.gpu.suite import device_info

    n = torch.cuda.device_count()
    world = world or n
    if not 1 <= world <= n:
        print(f"spec-bench gpu tp: --world {world} but {n} GPU(s) visible", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    doc = {"schema": schema.SCHEMA, "kind": "tp", "world": world, "quick": quick,
           "label": ("TP1 code-path check on one GPU: NOT a scaling result" if world == 1
                     else f"tensor-parallel scaling on {world} GPUs of one host"),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": device_info(),
           "links": {"nvlink": "NCCL defaults (peer access; NVLink where the GPUs have it)",
                     "nop2p": "NCCL_P2P_DISABLE=1: through host memory, a stand-in for PCIe GPUs without peer "
                              "access, not a PCIe measurement"},
           "allreduce": [], "stack": [], "split": [], "errors": [], "env": {},
           "tp1_note": ("at world size 1 NCCL's all-reduce launches no kernel (the captured graph is empty): its "
                        "'latency' is graph-replay overhead, and both link settings are the same one GPU")
           if world == 1 else None}
    for link in links:
        link_env(link)
        tmp = tempfile.mkdtemp(prefix="tpbench")
        try:
            mp.spawn(_worker, args=(world, _free_port(), link, layers, quick, tmp), nprocs=world, join=True)
        except Exception as exc:  # a failed link setting must not lose the other's figures
            doc["errors"].append(f"{link}: {type(exc).__name__}: {str(exc)[-400:]}")
        _merge(doc, tmp, world, link)
        print(f"[{time.monotonic() - t0:6.1f}s] tp {link} done", flush=True)
    link_env("nvlink")
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    doc["notes"] = ["stack/split times are per step of the whole stack, max over the ranks; per-layer figures in "
                    "ms_per_layer; weight_ms = ms_per_layer - 2 x the all-reduce latency measured at that size",
                    "layers: Kimi K2.5 shaped, as bench/gpu/shapes.py shards them (pure TP: all 384 experts on every "
                    "GPU, each split along its intermediate size), attention core left out, uniform routing"]
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}; schema problems: {schema.validate_tp(doc) or 'none'}; "
          f"physical-sense problems: {schema.physical_sense_tp(doc) or 'none'}")
    return 0


def _merge(doc: dict, tmp: str, world: int, link: str) -> None:
    """Each rank wrote its own timings; a figure for a group is its slowest rank."""
    merged: dict[tuple, dict] = {}
    for r in range(world):
        try:
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                part = json.load(f)
        except (OSError, json.JSONDecodeError):
            doc["errors"].append(f"rank {r} wrote no results")
            continue
        if r == 0:  # what the children saw: the multicast switches (asserted there) and the link setting
            doc["env"] = {k: part["env"].get(k) for k in MULTICAST_OFF}
            doc.setdefault("env_by_link", {})[link] = part["env"]
        doc["errors"] += part.get("errors", [])
        for sec in ("allreduce", "stack", "split"):
            for rec in part[sec]:
                key = (sec, rec["tp"], rec["link"], rec["tokens"], rec.get("group", 0))
                if key not in merged or rec["ms"] > merged[key]["ms"]:
                    merged[key] = rec
    ar = {(k[1], k[2], k[3]): v["ms"] for k, v in merged.items() if k[0] == "allreduce"}
    for (sec, *_), rec in sorted(merged.items(), key=lambda kv: kv[0][:4]):
        if sec == "stack":
            rec["ms_per_layer"] = rec["ms"] / rec["layers"]
            rec["allreduce_ms"] = 2 * ar.get((rec["tp"], rec["link"], rec["tokens"]), 0.0)
            rec["weight_ms"] = rec["ms_per_layer"] - rec["allreduce_ms"]
            if rec["tp"] == world:
                rec["tokens_per_s_world"] = rec["tokens"] / (rec["ms"] * 1e-3)
        if sec == "split":
            rec["tokens_per_s_world"] = rec["groups"] * rec["tokens"] / (rec["ms"] * 1e-3)
        doc[sec].append(rec)
    # one split record per (tp, link, tokens): the slower of its two groups
    best: dict[tuple, dict] = {}
    for rec in doc["split"]:
        k = (rec["tp"], rec["link"], rec["tokens"])
        if k not in best or rec["ms"] > best[k]["ms"]:
            best[k] = rec
    doc["split"] = [dict(v, tokens_per_s_world=v["groups"] * v["tokens"] / (v["ms"] * 1e-3)) for v in best.values()]


def _worker(rank: int, world: int, port: int, link: str, layers: int, quick: bool, tmp: str) -> None:
    assert_multicast_off()
    if link == "nop2p" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        raise RuntimeError("nop2p run without NCCL_P2P_DISABLE=1")
    import torch
    import torch.distributed as dist

    from bench.gpu import kernels as K
    from bench.gpu.suite import make_route

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=180), device_id=torch.device("cuda", rank))
    res = {"env": {k: os.environ.get(k) for k in (*MULTICAST_OFF, "NCCL_P2P_DISABLE")},
           "allreduce": [], "stack": [], "split": [], "errors": []}
    reps = 10 if quick else 20
    tps = [t for t in (1, 2, 4, 8) if t <= world]
    if world not in tps:
        tps.append(world)
    groups = {t: dist.new_group(list(range(t))) for t in tps}  # every rank creates every group, same order
    half = world // 2 if world >= 2 and world % 2 == 0 else 0
    lower = (groups[half] if half in groups else dist.new_group(list(range(half)))) if half else None
    upper = dist.new_group(list(range(half, world))) if half else None

    # Graph capture of NCCL collectives: try once on every rank, use it only if every rank could.
    probe = torch.ones(8, device="cuda", dtype=torch.bfloat16)
    ok = torch.tensor([1.0], device="cuda")
    try:
        dist.all_reduce(probe)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(probe)
        g.replay()
        torch.cuda.synchronize()
        del g
    except Exception as exc:
        ok.zero_()
        res["errors"].append(f"rank {rank}: NCCL graph capture failed, timing eagerly: {type(exc).__name__}: {exc}")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    use_graph = bool(ok.item() == 1.0)

    def time_it(fn):
        return K.timed(fn, reps, graph=use_graph)

    # 1. all-reduce latency, bf16 [tokens, hidden]
    for t in tps:
        for n in AR_TOKENS_QUICK if quick else AR_TOKENS:
            if rank < t:
                buf = torch.randn(n, KIMI.hidden, device="cuda", dtype=torch.bfloat16)
                inner = 20  # back-to-back collectives per timed call

                def fn(buf=buf, g=groups[t], inner=inner):
                    for _ in range(inner):
                        dist.all_reduce(buf, group=g)
                tm = time_it(fn)
                res["allreduce"].append({"tp": t, "link": link, "tokens": n, "bytes": buf.numel() * 2,
                                         "ms": tm["ms"] / inner, "graph": tm["graph"], "rank": rank})
            dist.barrier()

    # 2. the sharded layer stack at TP4/TP8 (and at the world size, e.g. TP1 on one GPU)
    stack_tps = [t for t in (4, 8) if t <= world]
    if world not in stack_tps:
        stack_tps.append(world)
    for t in stack_tps:
        _stack(res, rank, t, groups[t] if rank < t else None, link, layers, quick, time_it, "stack", 0,
               make_route, K, torch, dist)
        dist.barrier()
    # 3. the split: two groups of world/2 stepping at once on disjoint GPUs
    if half:
        g = lower if rank < half else upper
        _stack(res, rank, half, g, link, layers, quick, time_it, "split", int(rank >= half), make_route, K, torch,
               dist)
        dist.barrier()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _stack(res, rank, tp, group, link, layers, quick, time_it, sec, group_id, make_route, K, torch, dist):
    """Build this rank's shard of `layers` Kimi layers at TP tp and time one step (2 all-reduces per layer)."""
    s = layer_slice(KIMI, tp)
    per_layer = (s.dense_params() + KIMI.experts * s.expert_params()) * 2
    free = torch.cuda.mem_get_info()[0]
    L = max(1, min(layers, int(0.6 * free // per_layer)))
    if group is None:
        # ranks outside this TP group only take part in the barriers
        return
    dense = [K.make_dense(s) for _ in range(L)]
    experts = [K.make_experts(s, KIMI.experts) for _ in range(L)]
    for n in STACK_TOKENS_QUICK if quick else STACK_TOKENS:
        r = make_route(routing.route(n, KIMI.experts, KIMI.active, 0.0, seed=n))
        x = torch.randn(n, KIMI.hidden, device="cuda", dtype=torch.bfloat16)

        def step(x=x, r=r, dense=dense, experts=experts):
            h = x
            for i in range(L):
                a = K.mla_attn_proj(h, dense[i], s)
                dist.all_reduce(a, group=group)
                h = h + a
                m = K.mlp(h, dense[i]["shared_gate_up"], dense[i]["shared_down"]) + K.routed_grouped(
                    h, *experts[i], r)
                dist.all_reduce(m, group=group)
                h = h + m
            return h
        tm = time_it(step)
        res[sec].append({"tp": tp, "link": link, "tokens": n, "layers": L, "ms": tm["ms"], "graph": tm["graph"],
                         "rank": rank, "group": group_id, **({"groups": 2} if sec == "split" else {})})
    dense = experts = None
    torch.cuda.empty_cache()
