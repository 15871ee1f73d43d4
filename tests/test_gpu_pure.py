"""bench/gpu's pure parts (no torch): routing, coverage, floors, shapes, the JSON schema and physical-sense checks,
the CLI without CUDA, the TP launcher's environment; and the committed H200 results themselves."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import floors, routing, schema, shapes, tp

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu"


def test_torch_free_modules_do_not_import_torch():
    code = ("import sys; import bench.gpu.cli, bench.gpu.routing, bench.gpu.floors, bench.gpu.schema, "
            "bench.gpu.shapes, bench.gpu.tp; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)


def test_routing_is_deterministic_distinct_and_k_per_token():
    a = routing.route(200, 384, 8, 0.0, seed=3)
    assert a == routing.route(200, 384, 8, 0.0, seed=3)
    assert a != routing.route(200, 384, 8, 0.0, seed=4)
    assert all(len(set(row)) == 8 and all(0 <= e < 384 for e in row) for row in a.picks)
    assert sum(a.counts()) == 200 * 8


def test_uniform_coverage_matches_formula():
    for n in (1, 4, 16, 64, 256):
        got = sum(routing.route(n, 384, 8, 0.0, seed=s).distinct() for s in range(40)) / 40
        want = routing.expected_distinct_uniform(n, 384, 8)
        assert abs(got - want) <= 0.03 * want + 1.0, (n, got, want)
    assert routing.route(1, 384, 8).distinct() == 8
    assert routing.expected_distinct_uniform(1, 384, 8) == pytest.approx(8.0)
    assert routing.expected_distinct_uniform(10_000, 384, 8) == pytest.approx(384, abs=1e-6)


def test_skewed_routing_touches_fewer_experts_and_loads_one_more():
    for n in (16, 128, 1024):
        u = routing.route(n, 384, 8, 0.0, seed=1)
        z = routing.route(n, 384, 8, routing.ZIPF_S, seed=1)
        assert z.distinct() < u.distinct()
        assert z.max_load() > u.max_load()


def test_grouped_permutation_sorts_assignments_by_expert():
    r = routing.route(33, 16, 4, 0.8, seed=9)
    tok, slot, offs = routing.grouped(r)
    assert len(tok) == 33 * 4 and offs[-1] == 33 * 4 and len(offs) == 16
    start = 0
    for e, end in enumerate(offs):
        for i in range(start, end):
            assert r.picks[tok[i]][slot[i]] == e
        start = end


def test_routing_rejects_bad_arguments():
    with pytest.raises(ValueError):
        routing.route(4, 8, 9)
    with pytest.raises(ValueError):
        routing.route(4, 8, 0)


def test_slices_split_as_sglang_does():
    k8, k4 = shapes.layer_slice(shapes.KIMI, 8), shapes.layer_slice(shapes.KIMI, 4)
    assert (k8.heads, k8.expert_ffn, k4.heads, k4.expert_ffn) == (8, 256, 16, 512)
    d8 = dict((n, (i, o)) for n, i, o in k8.dense)
    assert d8["qkv_a"] == (7168, 1536 + 512 + 64)  # replicated: same at every tp
    assert dict((n, (i, o)) for n, i, o in k4.dense)["qkv_a"] == d8["qkv_a"]
    assert d8["q_b"] == (1536, 8 * 192) and d8["kv_b"] == (512, 8 * 256) and d8["o"] == (8 * 128, 7168)
    # one routed expert's slice at TP8: 3 x 7168 x 256 params
    assert k8.expert_params() == 3 * 7168 * 256
    # the whole model's routed experts (61 - 1 dense layers) across 8 GPUs at int4 ~ Kimi's published ~0.6 TB
    total = 60 * 384 * k8.expert_params() * 8 * shapes.INT4_BYTES_PER_PARAM
    assert 5.5e11 < total < 6.5e11
    l8, l4 = shapes.layer_slice(shapes.LLAMA, 8), shapes.layer_slice(shapes.LLAMA, 4)
    assert (l8.heads, l8.kv_heads, l4.heads, l4.kv_heads) == (8, 1, 16, 2)
    # Llama 70B: ~70e9 params over 80 layers at TP1 (embeddings aside)
    assert 80 * shapes.layer_slice(shapes.LLAMA, 1).dense_params() == pytest.approx(68.5e9, rel=0.02)
    assert l4.dense_params() == pytest.approx(2 * l8.dense_params(), rel=0.01)
    with pytest.raises(ValueError):
        shapes.layer_slice(shapes.KIMI, 3)
    dr = shapes.draft_slice("kimi-k2.5", 8)
    assert dict((n, (i, o)) for n, i, o in dr.dense)["lm_head"] == (7168, 163840 // 8)


def test_mla_cache_per_token_matches_the_simulator_docs():
    # docs/SIMULATOR.md: ~35 KB per token in FP8 over 61 layers
    assert shapes.mla_kv_dim(shapes.KIMI) * shapes.KIMI.layers == 35136


def test_floor_arithmetic():
    assert floors.floor_ms(4e9, 0, 4000, 800) == pytest.approx(1.0)
    assert floors.floor_ms(0, 8e11, 4000, 800) == pytest.approx(1.0)
    assert floors.floor_ms(4e9, 1.6e12, 4000, 800) == pytest.approx(2.0)
    assert floors.bound(4e9, 1e9, 4000, 800) == "bytes" and floors.bound(1, 1e15, 4000, 800) == "flops"
    s = shapes.layer_slice(shapes.KIMI, 8)
    one = floors.moe_layer(s, 1, 8, 8, 7168)
    assert one["routed_bytes"] == 8 * 3 * 7168 * 256 * 2
    assert one["routed_bytes_int4"] == pytest.approx(one["routed_bytes"] * 0.5625 / 2)
    assert one["bytes"] > one["bytes_int4_experts"] > one["dense_bytes"]
    # at 1 token a MoE layer is bandwidth bound at H200-like ceilings; at 1024 tokens with every expert touched
    # the expert FLOPs are 1024*8/384 ~ 21 tokens per expert: still bandwidth bound
    assert floors.bound(one["bytes"], one["flops"], 4300, 780) == "bytes"
    att = floors.decode_attention("mla", 2, 1000, 8)
    assert att["bytes"] == 2 * 1000 * 576 * 2 and att["bytes_per_token"] == 1152
    g = floors.decode_attention("gqa", 1, 1000, 8, kv_heads=1)
    assert g["bytes_per_token"] == 512
    p1, p2 = floors.prefill_layer(s, 1000, 7168, "mla", 8, 384), floors.prefill_layer(s, 2000, 7168, "mla", 8, 384)
    assert p2["attn_flops"] == pytest.approx(4 * p1["attn_flops"])
    dr = shapes.draft_slice("llama-3.3-70b", 8)
    a, b = floors.draft_pass(dr, [1, 4], 8192), floors.draft_pass(dr, [1], 8192)
    assert a["bytes"] > b["bytes"] and a["flops"] > b["flops"]


def _doc() -> dict:
    """A minimal well-formed single-GPU document built from the real routing and floor code."""
    s = shapes.layer_slice(shapes.KIMI, 8)
    rt = routing.route(16, 384, 8, routing.ZIPF_S, seed=5)
    fl = floors.moe_layer(s, 16, 8, rt.distinct(), 7168)
    c = {"copy_gbps": 4000.0, "read_gbps": 4200.0, "bw_gbps": 4200.0, "bf16_tflops": 780.0}
    f = lambda b, x: floors.floor_ms(b, x, 4200.0, 780.0)  # noqa: E731
    moe = {"model": "kimi-k2.5", "tp": 8, "routing": "zipf", "skew": routing.ZIPF_S, "seed": 5, "tokens": 16, "k": 8,
           "experts": 384, "distinct": rt.distinct(), "max_load": rt.max_load(), "kernel": "grouped", "graph": True,
           "floor_ms": f(fl["bytes"], fl["flops"]), "floor_ms_int4": f(fl["bytes_int4_experts"], fl["flops"]),
           "dense_floor_ms": f(fl["dense_bytes"], fl["dense_flops"]),
           "routed_floor_ms": f(fl["routed_bytes"], fl["routed_flops"]), **fl}
    moe.update(ms=moe["floor_ms"] * 1.5, dense_ms=moe["dense_floor_ms"] * 2, routed_ms=moe["routed_floor_ms"] * 1.3)
    return {"schema": schema.SCHEMA, "kind": "single-gpu", "date": "2026-12-03T10:00:00+00:00",
            "device": {"name": "NVIDIA H200", "driver": "580", "torch": "2.11", "cuda": "13.0", "capability": "9.0",
                       "sms": 132, "memory_bytes": 1},
            "ceilings": c, "checks": [{"name": "x", "rel_err": 1e-3, "tol": 2e-2, "ok": True}], "errors": [],
            "kernels": {}, "moe_layer": [moe], "dense_layer": [], "decode_attention": [], "prefill": [], "draft": []}


def test_schema_and_physical_sense_accept_a_good_document():
    d = _doc()
    assert schema.validate(d) == []
    assert schema.physical_sense(d) == []


def test_physical_sense_catches_a_time_below_its_floor():
    d = _doc()
    d["moe_layer"][0]["routed_ms"] = d["moe_layer"][0]["routed_floor_ms"] * 0.9
    assert any("routed_ms" in p and "below its floor" in p for p in schema.physical_sense(d))
    d = _doc()
    d["moe_layer"][0]["ms"] = d["moe_layer"][0]["floor_ms"] * 0.97  # within the stated 5%
    assert schema.physical_sense(d) == []


def test_physical_sense_catches_coverage_that_its_routing_does_not_produce():
    d = _doc()
    d["moe_layer"][0]["distinct"] += 1
    assert any("its routing gives" in p for p in schema.physical_sense(d))
    d = _doc()
    d["moe_layer"][0]["seed"] += 1
    assert any("its routing gives" in p for p in schema.physical_sense(d))


def test_physical_sense_reports_failed_checks_and_schema_missing_fields():
    d = _doc()
    d["checks"][0]["ok"] = False
    assert any("check failed" in p for p in schema.physical_sense(d))
    d["checks"][0]["timed"] = False  # a candidate kernel that failed its check and was never timed
    assert schema.physical_sense(d) == []
    d = _doc()
    d = _doc()
    del d["device"]["driver"]
    del d["moe_layer"][0]["floor_ms"]
    d["ceilings"]["bw_gbps"] = 0
    probs = schema.validate(d)
    assert any("device.driver" in p for p in probs) and any("lacks floor_ms" in p for p in probs)
    assert any("bw_gbps" in p for p in probs)


def _tp_doc() -> dict:
    ar = [{"tp": t, "link": "nvlink", "tokens": n, "bytes": n * 7168 * 2, "ms": (8 + 0.002 * n * t) / 1e3,
           "graph": True} for t in (4, 8) for n in (1, 16, 256)]
    st = [{"tp": t, "link": "nvlink", "tokens": n, "layers": 4, "ms": 4 * (0.5 * 8 / t + 0.016), "ms_per_layer": 0,
           "allreduce_ms": 0.016, "weight_ms": 0.5 * 8 / t} for t in (4, 8) for n in (1, 16)]
    return {"schema": schema.SCHEMA, "kind": "tp", "date": "d", "world": 8, "label": "x",
            "device": {"name": "H200", "driver": "580", "torch": "2.11", "nccl": "2.27"},
            "env": dict(tp.MULTICAST_OFF), "allreduce": ar, "stack": st,
            "split": [{"tp": 4, "groups": 2, "link": "nvlink", "tokens": 1, "ms": 2.0, "tokens_per_s_world": 1}]}


def test_tp_schema_and_sense():
    d = _tp_doc()
    assert schema.validate_tp(d) == [] and schema.physical_sense_tp(d) == []
    bad = copy.deepcopy(d)
    bad["allreduce"][2]["ms"] = bad["allreduce"][0]["ms"] / 2  # 256 tokens faster than 1 token
    assert any("less than" in p for p in schema.physical_sense_tp(bad))
    bad = copy.deepcopy(d)
    for r in bad["stack"]:
        if r["tp"] == 8:
            r["weight_ms"] = 5.0
    assert any("not below TP4" in p for p in schema.physical_sense_tp(bad))
    bad = copy.deepcopy(d)
    bad["env"]["NCCL_NVLS_ENABLE"] = "1"
    assert any("NCCL_NVLS_ENABLE" in p for p in schema.validate_tp(bad))


def test_tp_launcher_environment():
    env: dict = {"NCCL_NVLS_ENABLE": "1"}
    with pytest.raises(RuntimeError):
        tp.assert_multicast_off(env)
    tp.multicast_off(env)
    tp.assert_multicast_off(env)
    assert tp.link_env("nop2p", env)["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in tp.link_env("nvlink", env)


def test_cli_without_cuda_exits_2_with_one_line(tmp_path):
    code = ("import sys, builtins\nreal = builtins.__import__\n"
            "def imp(name, *a, **k):\n    if name == 'torch' or name.startswith('torch.'):\n"
            "        raise ImportError('no torch')\n    return real(name, *a, **k)\nbuiltins.__import__ = imp\n"
            "from bench.gpu.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    for cmd in (["run", "--out", str(tmp_path / "x.json")], ["tp", "--out", str(tmp_path / "y.json")],
                ["step", "--out", str(tmp_path / "x.json")]):
        p = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert p.returncode == 2, p
        assert p.stderr.count("\n") == 1 and "CUDA" in p.stderr and "Traceback" not in p.stderr
        assert not (tmp_path / "x.json").exists()
    for bad in (["run"], ["bogus"], ["plot", "x.json", "--out", "y.png", "--bogus"]):  # bad flags: one line
        p = subprocess.run([sys.executable, "-m", "bench", "gpu", *bad], capture_output=True, text=True, cwd=ROOT,
                           timeout=30)
        assert p.returncode == 2 and p.stderr.startswith("spec-bench gpu: ") and p.stderr.count("\n") == 1, p
    for bad in (["--models", "gpt2"], ["--models", "kimi-k2.5:int3"], ["--batches", "0,4"], ["--batches", "x"]):
        p = subprocess.run([sys.executable, "-m", "bench", "gpu", "step", "--out", str(tmp_path / "s.json"), *bad],
                           capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert p.returncode == 2 and p.stderr.startswith("spec-bench gpu step: ") and p.stderr.count("\n") == 1, p
    p = subprocess.run([sys.executable, "-m", "bench", "gpu", "check", str(tmp_path / "missing.json")],
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1


def test_moe_padded_rows_bounds_the_sorted_index():
    for n, e, bm in ((8, 384, 16), (512, 384, 16), (1, 8, 16), (40, 4, 16)):
        rows = routing.moe_padded_rows(n, e, bm)
        assert rows % bm == 0 and rows >= n
        # the worst case: every touched expert holds one row short of a full block
        touched = min(n, e)
        assert rows >= n + touched * (bm - 1)
    assert routing.moe_padded_rows(8, 384, 16) == 128  # 8 experts, one row each, each padded to 16


def test_step_bytes_counts_weights_experts_and_cache():
    llama, kimi = shapes.LLAMA, shapes.KIMI
    one = floors.step_bytes(llama, 8, 1, 0)
    # 70B params over 8 GPUs in bf16, LM head included: about 17.4 GB a step at batch 1 and no cache
    assert 17.0e9 < one["bytes"] < 17.8e9 and one["kv_bytes"] == 0 and one["expert_bytes"] == 0
    kv = floors.step_bytes(llama, 8, 4, 1000)["kv_bytes"]
    assert kv == 80 * 4 * 1000 * 2 * 1 * 128 * shapes.BF16  # k and v of the one kv head this GPU holds
    k1, k64 = floors.step_bytes(kimi, 8, 1, 0), floors.step_bytes(kimi, 8, 64, 0)
    assert k1["dense_bytes"] == k64["dense_bytes"]
    per_expert = shapes.layer_slice(kimi, 8).expert_params() * shapes.BF16
    assert k1["expert_bytes"] == pytest.approx(60 * 8 * per_expert)  # 60 MoE layers x top-8
    assert k64["expert_bytes"] / k1["expert_bytes"] == pytest.approx(routing.expected_distinct_uniform(64, 384, 8) / 8)
    assert floors.step_bytes(kimi, 8, 1, 0, 1)["expert_bytes"] == pytest.approx(k1["expert_bytes"] / 2)  # fp8


# ---------------------------------------------------------------- the committed results from the H200

def _committed(name: str) -> dict:
    path = RESULTS / name
    assert path.exists(), f"{path} is missing: the H200 run's JSON must be committed"
    return json.loads(path.read_text())


def test_committed_h200_results_pass_schema_and_physical_sense():
    d = _committed("h200.json")
    assert d["device"]["name"].startswith("NVIDIA H200") and not d.get("quick")
    assert schema.validate(d) == []
    assert schema.physical_sense(d) == []
    # every item of issue 32's list is covered, at TP8 and TP4
    for sec in schema.SECTIONS:
        assert {r["tp"] for r in d[sec]} >= {4, 8}, sec
    moe = d["moe_layer"]
    assert {r["routing"] for r in moe} == {"uniform", "zipf"}
    assert {r["tokens"] for r in moe} >= {1, 16, 1024}
    assert {r["kind"] for r in d["decode_attention"]} == {"mla", "gqa"}
    assert {r["variant"] for r in d["draft"]} == {"topk4x2", "topk1x3"}
    assert (RESULTS / "h200.png").exists()


def test_committed_uniform_coverage_is_near_the_formula():
    for r in _committed("h200.json")["moe_layer"]:
        if r["routing"] == "uniform":
            want = routing.expected_distinct_uniform(r["tokens"], r["experts"], r["k"])
            assert abs(r["distinct"] - want) <= 4 * math.sqrt(want) + 1, r


def test_committed_tp1_is_labelled_a_code_path_check():
    d = _committed("tp1-codepath.json")
    assert d["world"] == 1 and "NOT a scaling result" in d["label"]
    assert schema.validate_tp(d) == [] and schema.physical_sense_tp(d) == []
    assert d["allreduce"] and d["stack"]


def test_report_renders_the_tables_and_comparisons():
    from bench.gpu import report

    d = _doc()
    d["moe_layer"].append(dict(d["moe_layer"][0], routing="uniform", tokens=4, ms=0.3))
    d["moe_layer"].append(dict(d["moe_layer"][0], routing="uniform", tokens=16, ms=0.6))
    text = report.render(d)
    assert "| 16 |" in text and "verify, Kimi TP8, 1 request(s)" in text and "0.50x" in text
    assert report.bw_ratio(d) == pytest.approx(4200 / 1792)


def test_committed_report_renders():
    from bench.gpu import report

    text = report.render(_committed("h200.json"))
    assert "kv term, Kimi MLA TP8" in text and "TP4/TP8 per-GPU layer time" in text


def test_tp_merge_takes_the_slowest_rank_and_derives_weight_time(tmp_path):
    """The launcher's merge of per-rank files, as an 8-GPU run would write them (2 ranks here)."""
    env = dict(tp.MULTICAST_OFF, NCCL_P2P_DISABLE=None)

    def part(rank, ar_ms, st_ms, sp_ms):
        return {"env": env, "errors": [],
                "allreduce": [{"tp": 2, "link": "nvlink", "tokens": 16, "bytes": 16 * 7168 * 2, "ms": ar_ms,
                               "graph": True, "rank": rank}],
                "stack": [{"tp": 2, "link": "nvlink", "tokens": 16, "layers": 4, "ms": st_ms, "graph": True,
                           "rank": rank, "group": 0}],
                "split": [{"tp": 1, "link": "nvlink", "tokens": 16, "layers": 4, "ms": sp_ms, "graph": True,
                           "rank": rank, "group": rank, "groups": 2}]}
    for r, vals in enumerate(((0.010, 4.0, 3.0), (0.012, 4.4, 3.5))):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(part(r, *vals)))
    doc = {"allreduce": [], "stack": [], "split": [], "errors": [], "env": {}}
    tp._merge(doc, str(tmp_path), 2, "nvlink")
    assert [r["ms"] for r in doc["allreduce"]] == [0.012]
    (st,) = doc["stack"]
    assert st["ms"] == 4.4 and st["ms_per_layer"] == pytest.approx(1.1)
    assert st["allreduce_ms"] == pytest.approx(0.024) and st["weight_ms"] == pytest.approx(1.1 - 0.024)
    assert st["tokens_per_s_world"] == pytest.approx(16 / 4.4e-3)
    (sp,) = doc["split"]  # the slower of the two groups, two groups' tokens
    assert sp["ms"] == 3.5 and sp["tokens_per_s_world"] == pytest.approx(2 * 16 / 3.5e-3)
    assert doc["env"] == tp.MULTICAST_OFF and doc["env_by_link"]["nvlink"]["NCCL_P2P_DISABLE"] is None
    (tmp_path / "rank1.json").unlink()
    doc = {"allreduce": [], "stack": [], "split": [], "errors": [], "env": {}}
    tp._merge(doc, str(tmp_path), 2, "nvlink")
    assert "rank 1 wrote no results" in doc["errors"]


def test_committed_step_result_is_sane():
    """bench/results/gpu/step-h100.json (`spec-bench gpu step`): every point graph-captured, at or above its bytes
    floor, the fused MoE within tolerance, and the time above the floor roughly flat in the batch (the fixed cost
    docs/SIMULATOR.md quotes)."""
    doc = json.loads((RESULTS / "step-h100.json").read_text())
    assert doc["kind"] == "step" and doc["device"]["name"].startswith("NVIDIA H100") and not doc["errors"]
    assert doc["command"].startswith("spec-bench gpu step")
    for check in doc["checks"].values():
        assert all(v < 0.02 for k, v in check.items() if k.startswith("T")), check
    models = {(p["model"], p["experts"]) for p in doc["points"]}
    assert models == {("kimi-k2.5", "bf16"), ("kimi-k2.5", "fp8"), ("llama-3.3-70b", None)}
    for p in doc["points"]:
        assert p["graph"] and p["ms"] >= 0.95 * p["floor_ms"] > 0, p
    for m, e in models:
        over = [p["ms"] - p["floor_ms"] for p in doc["points"] if (p["model"], p["experts"]) == (m, e)
                and not p["attention"]]
        assert max(over) < 1.7 * min(over), (m, e, over)
