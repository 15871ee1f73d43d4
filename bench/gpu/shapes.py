"""Model shapes (from each model's public config.json) and their per-GPU slice under SGLang's tensor parallelism."""
from __future__ import annotations

from dataclasses import dataclass

# Numbers as published in each model's config.json on Hugging Face (read from the public files; no weights used).
#   Kimi K2.5: moonshotai/Kimi-K2.5, text_config (DeepseekV3 architecture): hidden_size 7168, num_hidden_layers 61,
#     first_k_dense_replace 1, intermediate_size 18432, moe_intermediate_size 2048, n_routed_experts 384,
#     num_experts_per_tok 8, n_shared_experts 1, num_attention_heads 64, q_lora_rank 1536, kv_lora_rank 512,
#     qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, vocab_size 163840; routed experts ship as int4
#     (compressed-tensors, pack-quantized, group size 32), attention and shared expert bf16.
#   DeepSeek-V3: deepseek-ai/DeepSeek-V3: same shapes except n_routed_experts 256, num_attention_heads 128,
#     first_k_dense_replace 3, vocab_size 129280; weights ship as fp8 (128x128 blocks).
#   Llama-3.3-70B: meta-llama/Llama-3.3-70B-Instruct: hidden_size 8192, num_hidden_layers 80, num_attention_heads 64,
#     num_key_value_heads 8, head_dim 128, intermediate_size 28672, vocab_size 128256; bf16.
#   EAGLE-3 drafts (one Llama-style decoder layer + LM head, e.g. yuhuili/EAGLE3-LLaMA3.3-Instruct-70B): the
#     target's hidden size, heads and ffn; its LM head covers draft_vocab_size 32000 in the published Llama
#     drafts. The brief asks for the full vocabulary (163840 Kimi, 128256 Llama), timed as the main figure; the
#     32000-row head is timed beside it. The Kimi draft's 64/8 heads and ffn 18432 are an ASSUMPTION (Llama-style).


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    hidden: int
    layers: int
    vocab: int
    attn: str  # "mla" or "gqa"
    heads: int
    kv_heads: int = 0  # gqa
    head_dim: int = 128  # gqa
    q_lora_rank: int = 0  # mla
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    ffn: int = 0  # dense MLP intermediate
    experts: int = 0  # routed experts (0: dense model)
    active: int = 0
    shared: int = 0
    moe_ffn: int = 0
    routed_dtype: str = "bf16"


KIMI = Model("kimi-k2.5", "moonshotai/Kimi-K2.5 config.json (text_config)", hidden=7168, layers=61, vocab=163840,
             attn="mla", heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
             ffn=18432, experts=384, active=8, shared=1, moe_ffn=2048,
             routed_dtype="int4 (group 32, bf16 scales) as shipped; timed in bf16")
DEEPSEEK = Model("deepseek-v3", "deepseek-ai/DeepSeek-V3 config.json", hidden=7168, layers=61, vocab=129280,
                 attn="mla", heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
                 ffn=18432, experts=256, active=8, shared=1, moe_ffn=2048,
                 routed_dtype="fp8 (128x128 blocks) as shipped; timed in bf16")
LLAMA = Model("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct config.json", hidden=8192, layers=80,
              vocab=128256, attn="gqa", heads=64, kv_heads=8, head_dim=128, ffn=28672)
MODELS = {m.name: m for m in (KIMI, DEEPSEEK, LLAMA)}

# The EAGLE-3 draft layer per target: (hidden, heads, kv_heads, head_dim, ffn, full vocab, draft vocab).
DRAFTS = {
    "kimi-k2.5": dict(hidden=7168, heads=64, kv_heads=8, head_dim=128, ffn=18432, vocab=163840, draft_vocab=32000),
    "llama-3.3-70b": dict(hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256, draft_vocab=32000),
}

BF16 = 2
# Bytes per routed-expert weight as Kimi ships it: 4-bit values plus one bf16 scale per group of 32.
INT4_BYTES_PER_PARAM = 0.5 + BF16 / 32


def mla_kv_dim(m: Model) -> int:
    """Elements per token of an MLA latent cache (compressed KV + the shared rope key), per layer."""
    return m.kv_lora_rank + m.qk_rope


@dataclass(frozen=True)
class Slice:
    """One GPU's share of one layer under tensor parallelism tp (SGLang's sharding), as (in, out) matrices."""
    model: str
    tp: int
    heads: int  # attention (query) heads on this GPU
    kv_heads: int  # gqa kv heads on this GPU (replicated when tp > kv_heads)
    dense: tuple[tuple[str, int, int], ...]  # projections run once per token: (name, in, out)
    expert_in: int = 0  # routed expert: gate_up is (hidden, 2*moe_ffn/tp), down is (moe_ffn/tp, hidden)
    expert_ffn: int = 0

    def dense_params(self) -> int:
        return sum(i * o for _, i, o in self.dense)

    def expert_params(self) -> int:
        return 3 * self.expert_in * self.expert_ffn


def layer_slice(m: Model, tp: int, moe: bool = True) -> Slice:
    """Per-GPU matrices of one decoder layer at TP tp, as SGLang shards it.

    MLA (DeepseekV2 in SGLang): fused q_a + kv_a (hidden -> q_lora + kv_lora + rope) and the MoE gate are
    replicated; q_b, kv_b are column-parallel over heads, o_proj row-parallel; every routed expert and the shared
    expert are split along their intermediate size (pure TP, no expert parallelism). GQA (Llama): qkv column-
    parallel (kv heads replicated when tp > kv_heads), o row-parallel, gate_up column-, down row-parallel.
    """
    if m.attn == "mla":
        if m.heads % tp or m.moe_ffn % tp:
            raise ValueError(f"{m.name} does not split over tp={tp}")
        h = m.heads // tp
        dense = [
            ("qkv_a", m.hidden, m.q_lora_rank + m.kv_lora_rank + m.qk_rope),
            ("q_b", m.q_lora_rank, h * (m.qk_nope + m.qk_rope)),
            ("kv_b", m.kv_lora_rank, h * (m.qk_nope + m.v_head)),
            ("o", h * m.v_head, m.hidden),
        ]
        if moe and m.experts:
            f = m.moe_ffn // tp
            dense += [("gate", m.hidden, m.experts), ("shared_gate_up", m.hidden, 2 * f * m.shared),
                      ("shared_down", f * m.shared, m.hidden)]
            return Slice(m.name, tp, h, 1, tuple(dense), expert_in=m.hidden, expert_ffn=f)
        f = m.ffn // tp
        dense += [("gate_up", m.hidden, 2 * f), ("down", f, m.hidden)]
        return Slice(m.name, tp, h, 1, tuple(dense))
    if m.heads % tp or m.ffn % tp:
        raise ValueError(f"{m.name} does not split over tp={tp}")
    h = m.heads // tp
    kv = max(1, m.kv_heads // tp)
    f = m.ffn // tp
    dense = [("qkv", m.hidden, (h + 2 * kv) * m.head_dim), ("o", h * m.head_dim, m.hidden),
             ("gate_up", m.hidden, 2 * f), ("down", f, m.hidden)]
    return Slice(m.name, tp, h, kv, tuple(dense))


def draft_slice(target: str, tp: int, vocab: int | None = None) -> Slice:
    """The EAGLE-3 draft's per-GPU matrices: fc (3h -> h, replicated), its layer (qkv reads 2h: the embedding and
    the fused hidden state), and the LM head split over the vocabulary."""
    d = DRAFTS[target]
    hid, hd = d["hidden"], d["head_dim"]
    h, kv, f = d["heads"] // tp, max(1, d["kv_heads"] // tp), d["ffn"] // tp
    v = (vocab or d["vocab"]) // tp
    dense = (("fc", 3 * hid, hid), ("qkv", 2 * hid, (h + 2 * kv) * hd), ("o", h * hd, hid),
             ("gate_up", hid, 2 * f), ("down", f, hid), ("lm_head", hid, v))
    return Slice(f"{target}-eagle3", tp, h, kv, dense)
