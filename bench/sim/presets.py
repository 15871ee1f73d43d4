"""Presets of the step-cost model: model shapes from public config.json files, GPUs from datasheets, links,
and the boxes (model x GPUs x link x calibration) whose profiles the simulator loads by name.
Sources and assumptions: docs/SIMULATOR.md, "Step-cost model"."""
from __future__ import annotations

from bench.sim.stepcost import (
    BF16,
    INT4_G32,
    Box,
    Calibration,
    DraftShape,
    Gpu,
    Interconnect,
    ModelShape,
)

# FP8 with one fp32 scale per 128x128 block (DeepSeek-V3's checkpoint)
FP8_B128 = 1.0 + 4.0 / (128 * 128)


def mla_attn_params(hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int) -> int:
    """MLA projections of one layer: q down/up, kv down (latent + rope key), kv up, output."""
    return (hidden * q_lora + q_lora * heads * (nope + rope) + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v) + heads * v * hidden)


def gqa_attn_params(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden


def eagle3_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """An EAGLE-3 head's layer: fc (3 hidden states -> hidden), attention over [embedding; hidden] (2 x hidden
    input), a gated MLP. Its LM head (the draft vocabulary) is counted apart."""
    return (3 * hidden * hidden + 2 * hidden * heads * head_dim + 2 * 2 * hidden * kv_heads * head_dim
            + heads * head_dim * hidden + 3 * hidden * intermediate)


def _mla_flops_per_ctx(heads: int, kv_lora: int, rope: int) -> int:
    # absorbed MLA decode: scores over latent + rope (kv_lora + rope), values over the latent (kv_lora)
    return heads * 2 * ((kv_lora + rope) + kv_lora)


def mla_moe_shape(*, name: str, model_path: str, source: str, heads: int, vocab: int, moe_layers: int,
                  routed_experts: int, weight_bytes: float, expert_bytes: float, **rest) -> ModelShape:
    """A DeepSeek-V3-family shape (Kimi K2.5 is one): hidden 7168, 61 layers, MLA with q_lora 1536, kv_lora 512,
    qk_nope 128, qk_rope 64, v 128; 8 of `routed_experts` per token plus 1 shared (moe_intermediate 2048); a dense
    MLP (intermediate 18432) in the first 61 - `moe_layers` layers. `weight_bytes` per parameter for everything
    but the routed experts (`expert_bytes`)."""
    h = 7168
    return ModelShape(
        name=name, model_path=model_path, source=source, layers=61, hidden=h, vocab=vocab,
        attn_params=mla_attn_params(h, heads, 1536, 512, 128, 64, 128), attn_bytes_per_param=weight_bytes,
        attn_replicated_params=h * (1536 + 512 + 64),
        attn_flops_per_ctx_token=_mla_flops_per_ctx(heads, 512, 64), prefill_attn_flops_per_pair=heads * 2 * (192 + 128),
        moe_layers=moe_layers, dense_mlp_params=3 * h * 18432, dense_bytes_per_param=weight_bytes,
        routed_experts=routed_experts, experts_per_token=8, expert_params=3 * h * 2048,
        expert_bytes_per_param=expert_bytes, shared_params=3 * h * 2048, shared_bytes_per_param=weight_bytes,
        embed_params=vocab * h, lm_head_params=vocab * h, kv_bytes_per_token_layer=(512 + 64) * BF16, kv_heads=None,
        **rest)


# moonshotai/Kimi-K2.5 config.json (text_config): hidden 7168, 61 layers (first_k_dense_replace 1), 64 heads,
# q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128, 384 routed experts, 8 per token, 1 shared,
# moe_intermediate 2048, intermediate 18432, vocab 163840; quantization_config: compressed-tensors int4
# (group 32) for the routed experts, lm_head / self_attn / shared_experts left in bf16.
KIMI_K25 = mla_moe_shape(
    name="Kimi K2.5", model_path="moonshotai/Kimi-K2.5", source="moonshotai/Kimi-K2.5 config.json",
    heads=64, vocab=163840, moe_layers=60, routed_experts=384, weight_bytes=BF16, expert_bytes=INT4_G32,
    other_weight_bytes=0.4e9 * BF16,  # the vision tower (MoonViT, ~0.4B parameters): an assumption
    # the seed's drafter: an EAGLE-3 head, one Llama-style layer at hidden 7168 (64 heads, 8 KV heads, MLP 18432)
    # with a 32k draft vocabulary (SpecForge's default shape for this model family): an assumption
    draft=DraftShape(params=eagle3_params(7168, 64, 8, 128, 18432), lm_head_params=32000 * 7168),
    eos_token_id=163586, context_len=262144)

# deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers (first_k_dense_replace 3), 128 heads, the same MLA
# ranks, 256 routed experts, 8 per token, 1 shared, moe_intermediate 2048, intermediate 18432, vocab 129280,
# FP8 weights (block 128); num_nextn_predict_layers 1: the MTP layer SGLang drafts with (EAGLE algorithm).
DEEPSEEK_V3 = mla_moe_shape(
    name="DeepSeek-V3", model_path="deepseek-ai/DeepSeek-V3", source="deepseek-ai/DeepSeek-V3 config.json",
    heads=128, vocab=129280, moe_layers=58, routed_experts=256, weight_bytes=FP8_B128, expert_bytes=FP8_B128,
    draft=DraftShape(params=2 * 7168 * 7168 + mla_attn_params(7168, 128, 1536, 512, 128, 64, 128)
                     + 3 * 7168 * 2048, bytes_per_param=FP8_B128, lm_head_params=0.0, moe=True),
    eos_token_id=1, context_len=163840)

# meta-llama/Llama-3.3-70B-Instruct config.json: hidden 8192, 80 layers, 64 heads, 8 KV heads, head_dim 128,
# intermediate 28672, vocab 128256, bf16. Draft: yuhuili/EAGLE3-LLaMA3.3-Instruct-70B (one layer at hidden 8192,
# 64 heads, 8 KV heads, MLP 28672, draft vocabulary 32000).
LLAMA_70B = ModelShape(
    name="Llama-3.3-70B", model_path="meta-llama/Llama-3.3-70B-Instruct",
    source="meta-llama/Llama-3.3-70B-Instruct config.json; yuhuili/EAGLE3-LLaMA3.3-Instruct-70B config.json",
    layers=80, hidden=8192, vocab=128256,
    attn_params=gqa_attn_params(8192, 64, 8, 128), attn_flops_per_ctx_token=64 * 2 * (128 + 128),
    moe_layers=0, dense_mlp_params=3 * 8192 * 28672,
    embed_params=128256 * 8192, lm_head_params=128256 * 8192,
    kv_bytes_per_token_layer=8 * 128 * 2 * BF16, kv_heads=8,
    draft=DraftShape(params=eagle3_params(8192, 64, 8, 128, 28672), lm_head_params=32000 * 8192),
    eos_token_id=128009, context_len=131072)

SHAPES = {"kimi-k25": KIMI_K25, "deepseek-v3": DEEPSEEK_V3, "llama70b": LLAMA_70B}

# Datasheets. RTX PRO 6000 Blackwell: 96 GB GDDR7 (nvidia-smi: 97887 MiB), 512-bit at 28 Gbps = 1792 GB/s,
# "4000 AI TOPS" (FP4 with sparsity) -> dense BF16 = 4000 / 2 (sparsity) / 2 (FP8) / 2 (BF16) = 500 TFLOPS;
# PCIe Gen5 x16, no NVLink. H200 SXM: 141 GB HBM3e (nvidia-smi: 143771 MiB), 4.8 TB/s, BF16 1979 TFLOPS
# with sparsity = 989 dense; NVLink 4 at 900 GB/s per GPU (both directions).
RTX_PRO_6000 = Gpu(name="RTX PRO 6000 Blackwell", memory_gib=97887 / 1024, bandwidth_gbs=1792.0, bf16_tflops=500.0,
                   source="NVIDIA RTX PRO 6000 Blackwell datasheet; nvidia-smi total")
H200 = Gpu(name="H200", memory_gib=143771 / 1024, bandwidth_gbs=4800.0, bf16_tflops=989.0,
           source="NVIDIA H200 datasheet; nvidia-smi total")
GPUS = {"rtxpro6000": RTX_PRO_6000, "h200": H200}

# Links. PCIe: latency per ring step and bus bandwidth are FITTED to the seed rows (fit_seed; the datasheet
# bound is PCIe Gen5 x16, 64 GB/s per direction). NVLink (H200, NVSwitch): assumptions from published NCCL /
# custom all-reduce figures: ~8 us for a small all-reduce at TP8 (5 us + 0.2 us per ring step), bus bandwidth
# 360 GB/s (nccl-tests all_reduce busbw on 8-GPU Hopper boxes).
PCIE_SEED = Interconnect(name="pcie", base_us=0.0, hop_us=0.4257, bus_gbs=22.41,
                         source="fitted to the seed table (bench.sim.stepcost.fit_seed)")
NVLINK = Interconnect(name="nvlink", base_us=5.0, hop_us=0.2, bus_gbs=360.0,
                      source="assumption: NCCL / custom all-reduce on 8x Hopper with NVSwitch")
LINKS = {"pcie": PCIE_SEED, "nvlink": NVLINK}

# GEMM efficiencies MEASURED on an H200 (GPU micro-benchmark, its first full run: bench/results/gpu/h200-first-run.json), as
# fractions of the datasheet bf16 rate: Kimi's routed experts (TP8 slice, bf16 grouped GEMM) at 1024 tokens,
# 90.2 GFLOP in 2.170 ms = 4.2%; Llama-3.3-70B's dense layer (TP8 slice) at 1024 tokens, 0.3434 ms = 64%.
# The rest is the seed box's fit (bench.sim.stepcost.fit_seed over both seed rows; docs/SIMULATOR.md).
SEED_CAL = Calibration(fixed_ms=4.76, per_request_ms=0.4562, bw_efficiency=0.6392, flops_efficiency=0.042,
                       dense_flops_efficiency=0.64, expert_reuse=0.4187)

SEED_BOX_NAME = "kimi-k25-rtxpro6000-pcie"

# Hopper boxes: the fixed cost MEASURED, not borrowed. `spec-bench gpu step` (bench/results/gpu/step-h100.json,
# one H100 standing in for one rank of TP8, CUDA graph, no all-reduce) times a full-depth decode step; above its
# bytes floor (bytes / measured copy bandwidth) it spends a near-constant time, the kernels' latency, per layer:
# (11.58 - 2.43) ms / 61 layers = 0.150 ms for the Kimi-shaped MLA + MoE model (fp8 experts, batch 1, 2048
# cached tokens) and (12.81 - 5.78) / 80 = 0.088 ms for Llama-3.3-70B; the excess grows by 0.074 ms per request
# for the MoE model (9.15 -> 13.82 ms from 1 to 64 requests) and not at all for Llama. The copy reached 90% of the
# datasheet (3.02 of 3.35 TB/s; 4.3 of 4.8 on an H200, .library KINDS.md). A pass pays its own layers' latency,
# so a 1-layer draft pass costs 1/61 of a target pass's, not a whole fixed_ms. CPU-side costs per pass and per
# request are taken as hidden behind the GPU by SGLang's overlap scheduler: an assumption. The routing skew
# (expert_reuse) is the model's, kept from the seed fit; the GEMM efficiencies are the H200's, as above.
HOPPER_MOE_CAL = SEED_CAL.model_copy(update={"fixed_ms": 0.0, "layer_ms": 0.150, "per_request_ms": 0.074,
                                             "bw_efficiency": 0.90})
HOPPER_DENSE_CAL = SEED_CAL.model_copy(update={"fixed_ms": 0.0, "layer_ms": 0.088, "per_request_ms": 0.0,
                                               "bw_efficiency": 0.90})


# The GPUs whose step the Hopper measurement stands for (one H100 measured, the H200 boxes use it).
HOPPER_GPUS = frozenset({H200.name})


def calibration(gpu: Gpu, shape: ModelShape) -> Calibration:
    """A box's calibration: on a Hopper GPU the measured Hopper one for the model's class (MoE or dense), on any
    other the seed box's fit."""
    if gpu.name in HOPPER_GPUS:
        return HOPPER_MOE_CAL if shape.moe_layers else HOPPER_DENSE_CAL
    return SEED_CAL


def _box(name: str, shape: ModelShape, gpu: Gpu, link: Interconnect, description: str) -> Box:
    # The RTX PRO 6000 boxes share the seed box's fit; the H200 boxes take the Hopper calibration above.
    return Box(name=name, shape=shape, gpu=gpu, gpus=8, link=link, cal=calibration(gpu, shape),
               description=description)


BOXES: dict[str, Box] = {b.name: b for b in (
    _box(SEED_BOX_NAME, KIMI_K25, RTX_PRO_6000, PCIE_SEED, "the seed's box: Kimi K2.5 on 8x RTX PRO 6000 over PCIe"),
    _box("kimi-k25-h200-nvlink", KIMI_K25, H200, NVLINK, "Kimi K2.5 on 8x H200 over NVLink"),
    _box("deepseek-v3-h200-nvlink", DEEPSEEK_V3, H200, NVLINK, "DeepSeek-V3 on 8x H200 over NVLink"),
    _box("llama70b-rtxpro6000-pcie", LLAMA_70B, RTX_PRO_6000, PCIE_SEED,
         "Llama-3.3-70B + EAGLE-3 on 8x RTX PRO 6000 over PCIe (the compose default on the seed's box)"),
    _box("llama70b-h200-nvlink", LLAMA_70B, H200, NVLINK, "Llama-3.3-70B + EAGLE-3 on 8x H200 over NVLink"),
)}
ALIASES = {"seed": SEED_BOX_NAME, "compose": "llama70b-rtxpro6000-pcie"}


def box(name: str) -> Box:
    name = ALIASES.get(name, name)
    if name not in BOXES:
        from bench.sim.stepcost import ShapeError

        raise ShapeError(f"unknown preset {name!r}; choose from {', '.join(sorted(BOXES) + sorted(ALIASES))}")
    return BOXES[name]
