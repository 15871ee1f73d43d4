"""Step-cost model: one SGLang forward's time from model shape, GPU, TP layout and speculative setting.

A forward over T tokens (n requests) costs, per GPU of a TP group of size tp:
    fixed_ms (launch, scheduler, sampling: one per forward) + layer_ms x the layers the pass runs
  + per layer, per block (attention, routed experts, shared expert / dense MLP):
        max(bytes read / (bw_efficiency x datasheet bandwidth), FLOPs / (flops_efficiency x dense bf16 rate))
  + the LM head (the same max)
  + collectives: two all-reduces per layer of T x hidden x 2 bytes (and one all-gather of the logits),
        each latency(tp) + wire bytes / bus bandwidth (see Interconnect)
  + KV reads: every token each request holds, once per layer (bandwidth bound)
and the routed experts' bytes count the DISTINCT experts the T tokens wake: E x (1 - (1 - k/E)^T) under
uniform routing; `expert_reuse` below 1 (skewed routing) counts each token after the first as that fraction
of a uniformly routed one. A speculative step is the draft's passes plus one target verify pass over n x draft tokens.

Every figure is sourced in docs/SIMULATOR.md ("Step-cost model") or named an assumption there; the free
parameters of the box (Calibration) are fitted to both seed rows at once by `fit_seed`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bench.sim.profiles import EAGLE_DEFAULT_MAX_RUNNING, Profile, ProfileError

GIB = float(1 << 30)
BF16 = 2.0
# compressed-tensors int4, group size 32, one bf16 scale per group: 4 bits + 16/32 bits per weight
INT4_G32 = 0.5 + 2.0 / 32


class ShapeError(ValueError):
    """A shape file or preset that cannot be used; the message is one line for the CLI."""


class DraftShape(BaseModel):
    """An EAGLE-3 draft head (or an MTP layer): what one draft pass reads and computes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: float = Field(gt=0, description="dense parameters of its layer(s): fc, attention, MLP")
    bytes_per_param: float = Field(default=BF16, gt=0)
    layers: int = Field(default=1, ge=1)
    lm_head_params: float = Field(default=0.0, ge=0, description="draft vocab x hidden; 0: it shares the target's")
    moe: bool = Field(default=False, description="its layer also has the target's routed experts (an MTP layer)")

    def weight_bytes(self, target: ModelShape) -> float:
        moe = target.routed_experts * target.expert_params * target.expert_bytes_per_param if self.moe else 0.0
        return self.params * self.bytes_per_param + self.lm_head_params * BF16 + moe * self.layers


class ModelShape(BaseModel):
    """A model's shape as a step reads it; every per-layer figure is for the whole layer (all TP ranks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    model_path: str = ""
    source: str = ""
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    vocab: int = Field(ge=1)
    attn_params: float = Field(gt=0, description="attention projection parameters per layer")
    attn_bytes_per_param: float = Field(default=BF16, gt=0)
    attn_replicated_params: float = Field(default=0.0, ge=0, description="the part of attn_params every TP rank "
                                          "holds whole (SGLang replicates MLA's q/kv down projections)")
    # attention FLOPs per query token per cached token per layer (scores + values, all heads)
    attn_flops_per_ctx_token: float = Field(default=0.0, ge=0)
    # the same in prefill, per causal query-key pair (MLA prefill runs un-absorbed: heads x 2 x (qk + v) dims);
    # None: attn_flops_per_ctx_token
    prefill_attn_flops_per_pair: float | None = Field(default=None, ge=0)
    moe_layers: int = Field(default=0, ge=0, description="layers with routed experts; the others have a dense MLP")
    dense_mlp_params: float = Field(default=0.0, ge=0, description="MLP parameters of one dense layer")
    dense_bytes_per_param: float = Field(default=BF16, gt=0)
    routed_experts: int = Field(default=0, ge=0)
    experts_per_token: int = Field(default=0, ge=0)
    expert_params: float = Field(default=0.0, ge=0, description="parameters of one routed expert")
    expert_bytes_per_param: float = Field(default=BF16, gt=0)
    shared_params: float = Field(default=0.0, ge=0, description="shared-expert parameters per MoE layer")
    shared_bytes_per_param: float = Field(default=BF16, gt=0)
    embed_params: float = Field(default=0.0, ge=0)
    lm_head_params: float = Field(default=0.0, ge=0)
    other_weight_bytes: float = Field(default=0.0, ge=0, description="loaded but not on the decode path (vision)")
    kv_bytes_per_token_layer: float = Field(gt=0, description="KV cache bytes per token per layer (whole model)")
    kv_heads: int | None = Field(default=None, ge=1, description="GQA KV heads (split over TP); None: MLA latent")
    draft: DraftShape | None = None
    eos_token_id: int = 2
    context_len: int = Field(default=131072, ge=1)

    def check(self) -> ModelShape:
        if self.moe_layers > self.layers:
            raise ShapeError(f"{self.name}: moe_layers {self.moe_layers} > layers {self.layers}")
        if self.moe_layers and not (self.routed_experts and self.experts_per_token and self.expert_params):
            raise ShapeError(f"{self.name}: moe_layers needs routed_experts, experts_per_token and expert_params")
        if self.experts_per_token > self.routed_experts:
            raise ShapeError(f"{self.name}: experts_per_token > routed_experts")
        return self

    @property
    def mla(self) -> bool:
        return self.kv_heads is None

    def weight_bytes(self) -> float:
        """The target's weights as loaded (its checkpoint's precision), all GPUs together."""
        dense = self.layers - self.moe_layers
        return (self.layers * self.attn_params * self.attn_bytes_per_param
                + dense * self.dense_mlp_params * self.dense_bytes_per_param
                + self.moe_layers * (self.routed_experts * self.expert_params * self.expert_bytes_per_param
                                     + self.shared_params * self.shared_bytes_per_param
                                     + self.routed_experts * self.hidden * BF16)  # the router's gate
                + (self.embed_params + self.lm_head_params) * BF16 + self.other_weight_bytes)

    def replicated_bytes(self) -> float:
        """Weights every TP rank holds whole: MLA's down projections and the routers' gates."""
        return self.layers * self.attn_replicated_params * self.attn_bytes_per_param + \
            self.moe_layers * self.routed_experts * self.hidden * BF16

    def draft_weight_bytes(self) -> float:
        return self.draft.weight_bytes(self) if self.draft else 0.0

    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes_per_token_layer * self.layers

    def active_params_per_token(self) -> float:
        dense = self.layers - self.moe_layers
        return (self.layers * self.attn_params + dense * self.dense_mlp_params
                + self.moe_layers * (self.experts_per_token * self.expert_params + self.shared_params)
                + self.lm_head_params)


class Gpu(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_gib: float = Field(gt=0)
    bandwidth_gbs: float = Field(gt=0, description="datasheet memory bandwidth, GB/s")
    bf16_tflops: float = Field(gt=0, description="datasheet dense BF16 tensor rate (no sparsity), TFLOPS")
    source: str = ""


class Interconnect(BaseModel):
    """All-reduce cost over a TP group: latency(tp) = base_us + hop_us x 2 (tp - 1) (a ring's steps), plus
    2 (tp - 1) / tp x message bytes / bus_gbs (NCCL's bus-bandwidth convention)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    base_us: float = Field(default=0.0, ge=0)
    hop_us: float = Field(ge=0)
    bus_gbs: float = Field(gt=0)
    source: str = ""

    def allreduce_ms(self, tp: int, message_bytes: float) -> float:
        if tp <= 1:
            return 0.0
        return (self.base_us + self.hop_us * 2 * (tp - 1)) / 1000 + \
            2 * (tp - 1) / tp * message_bytes / (self.bus_gbs * 1e9) * 1000

    def allgather_ms(self, tp: int, total_bytes: float) -> float:
        if tp <= 1:
            return 0.0
        return (self.base_us + self.hop_us * (tp - 1)) / 1000 + (tp - 1) / tp * total_bytes / (self.bus_gbs * 1e9) * 1000


class Calibration(BaseModel):
    """The few free parameters of one box, each with a physical meaning (fitted by fit_seed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed_ms: float = Field(ge=0, description="per forward pass: kernel launches, scheduler, sampling")
    layer_ms: float = Field(default=0.0, ge=0, description="per layer a pass runs: kernel latency beyond the bytes "
                            "(0: all in fixed_ms, as the seed fit has it; a 1-layer draft pass then pays a full "
                            "fixed_ms); measured on Hopper by `spec-bench gpu step`")
    bw_efficiency: float = Field(gt=0, le=1, description="fraction of datasheet bandwidth the weight reads reach")
    flops_efficiency: float = Field(default=0.042, gt=0, le=1, description="fraction of the bf16 rate the routed experts' "
                                    "grouped GEMMs reach (small per-expert batches, int4 dequantisation)")
    dense_flops_efficiency: float = Field(default=0.64, gt=0, le=1,
                                          description="the same for dense GEMMs (attention, shared expert, dense "
                                                      "MLP, LM head); both measured on an H200, not fitted")
    per_request_ms: float = Field(default=0.0, ge=0, description="per request per decode step: sampling, "
                                  "scheduler bookkeeping, output processing")
    expert_reuse: float = Field(default=1.0, gt=0, le=1,
                                description="1: distinct experts at the uniform-routing bound; <1: skewed routing")


@dataclass(frozen=True)
class Layout:
    gpu: Gpu
    tp: int
    link: Interconnect


@dataclass(frozen=True)
class Speculative:
    """none (steps 0, draft False); EAGLE with topk/steps/draft tokens; steps 0 with draft True: adaptive's 'off'
    (the draft still runs its extend pass to keep its KV in step)."""

    name: str
    steps: int = 0
    topk: int = 1
    draft_tokens: int = 1
    accept_length: float = 1.0
    draft: bool = False

    @property
    def speculative(self) -> bool:
        return self.steps > 0


BASELINE = Speculative("baseline")


def tree(steps: int = 2, topk: int = 4, draft_tokens: int = 16, accept_length: float = 2.5) -> Speculative:
    return Speculative(f"tree{topk}x{steps}", steps, topk, draft_tokens, accept_length, True)


def chain(steps: int, accept_length: float) -> Speculative:
    return Speculative(f"chain{steps}", steps, 1, steps + 1, accept_length, True)


def chain_accept_length(steps: int, alpha: float) -> float:
    """A topk-1 chain: each drafted token accepted with probability alpha given the ones before it."""
    return sum(alpha**i for i in range(steps + 1))


def distinct_experts(tokens: float, experts: int, per_token: int, reuse: float = 1.0) -> float:
    """Experts a batch of `tokens` wakes in one layer. Uniform routing (reuse 1): E (1 - (1 - k/E)^T), exact for
    k distinct experts per token. Skewed routing shares experts more: `reuse` < 1 counts each token after the
    first as `reuse` of a uniformly routed one, E (1 - (1 - k/E)^(1 + reuse (T - 1))), so one token still wakes
    k and a large batch still wakes them all (as the GPU benchmark's Zipf routing does; docs/SIMULATOR.md)."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1 - (1 - per_token / experts) ** (1 + reuse * (tokens - 1)))


@dataclass(frozen=True)
class Breakdown:
    """One forward on one GPU: bytes read, FLOPs, and where its milliseconds go."""

    tokens: int
    weight_bytes: float
    flops: float
    experts_touched: float
    compute_ms: float  # the per-block max(bytes, FLOPs) terms and the LM head
    collective_ms: float
    kv_ms: float
    fixed_ms: float

    @property
    def ms(self) -> float:
        return self.compute_ms + self.collective_ms + self.kv_ms + self.fixed_ms


def _block(bytes_: float, flops: float, gpu: Gpu, cal: Calibration, experts: bool = False) -> float:
    eff = cal.flops_efficiency if experts else cal.dense_flops_efficiency
    return max(bytes_ / (cal.bw_efficiency * gpu.bandwidth_gbs * 1e9), flops / (eff * gpu.bf16_tflops * 1e12)) * 1000


def forward(shape: ModelShape, lay: Layout, cal: Calibration, tokens: int, ctx_tokens: float = 0.0,
            logits_tokens: int | None = None) -> Breakdown:
    """The target model over `tokens` tokens whose requests hold `ctx_tokens` cached tokens in all."""
    tp, gpu = lay.tp, lay.gpu
    t = max(tokens, 1)
    ms = nbytes = flops = 0.0
    rep = shape.attn_replicated_params
    attn_p = (shape.attn_params - rep) / tp + rep  # parameters one GPU holds and reads
    attn_b = attn_p * shape.attn_bytes_per_param
    attn_f = 2 * attn_p * t + shape.attn_flops_per_ctx_token * ctx_tokens / tp
    ms += shape.layers * _block(attn_b, attn_f, gpu, cal)
    nbytes += shape.layers * attn_b
    flops += shape.layers * attn_f
    dense = shape.layers - shape.moe_layers
    if dense and shape.dense_mlp_params:
        b = shape.dense_mlp_params * shape.dense_bytes_per_param / tp
        f = 2 * shape.dense_mlp_params * t / tp
        ms += dense * _block(b, f, gpu, cal)
        nbytes, flops = nbytes + dense * b, flops + dense * f
    touched = 0.0
    if shape.moe_layers:
        touched = distinct_experts(t, shape.routed_experts, shape.experts_per_token, cal.expert_reuse)
        b = touched * shape.expert_params * shape.expert_bytes_per_param / tp
        f = 2 * t * shape.experts_per_token * shape.expert_params / tp
        gate = shape.routed_experts * shape.hidden  # the router, replicated on every rank
        sb = shape.shared_params * shape.shared_bytes_per_param / tp + gate * BF16
        sf = 2 * t * (shape.shared_params / tp + gate)
        ms += shape.moe_layers * (_block(b, f, gpu, cal, experts=True) + _block(sb, sf, gpu, cal))
        nbytes += shape.moe_layers * (b + sb)
        flops += shape.moe_layers * (f + sf)
    lt = t if logits_tokens is None else logits_tokens
    hb = shape.lm_head_params * BF16 / tp
    hf = 2 * shape.lm_head_params * lt / tp
    ms += _block(hb, hf, gpu, cal)
    nbytes, flops = nbytes + hb, flops + hf
    coll = 2 * shape.layers * lay.link.allreduce_ms(tp, t * shape.hidden * BF16)
    coll += lay.link.allgather_ms(tp, lt * shape.vocab * BF16)
    kv = kv_ms_per_token(shape, lay, cal) * ctx_tokens
    return Breakdown(t, nbytes, flops, touched, ms, coll, kv, cal.fixed_ms + shape.layers * cal.layer_ms)


def draft_forward(shape: ModelShape, lay: Layout, cal: Calibration, tokens: int, logits_tokens: int) -> Breakdown:
    """One pass of the draft head over `tokens` tokens (its own KV is one layer: left out, a few percent)."""
    d = shape.draft
    if d is None:
        raise ShapeError(f"{shape.name}: no draft in this shape")
    tp, gpu, t = lay.tp, lay.gpu, max(tokens, 1)
    b = d.params * d.bytes_per_param / tp
    f = 2 * d.params * t / tp
    ms = _block(b, f, gpu, cal)
    nbytes, flops, touched = b, f, 0.0
    if d.moe and shape.routed_experts:
        touched = distinct_experts(t, shape.routed_experts, shape.experts_per_token, cal.expert_reuse)
        eb = touched * shape.expert_params * shape.expert_bytes_per_param / tp
        ef = 2 * t * shape.experts_per_token * shape.expert_params / tp
        ms += d.layers * _block(eb, ef, gpu, cal, experts=True)
        nbytes, flops = nbytes + d.layers * eb, flops + d.layers * ef
    head = d.lm_head_params or shape.lm_head_params
    hb, hf = head * BF16 / tp, 2 * head * logits_tokens / tp
    ms += _block(hb, hf, gpu, cal)
    vocab = head / shape.hidden
    coll = 2 * d.layers * lay.link.allreduce_ms(tp, t * shape.hidden * BF16)
    coll += lay.link.allgather_ms(tp, logits_tokens * vocab * BF16)
    return Breakdown(t, nbytes + hb, flops + hf, touched, ms, coll, 0.0, draft_fixed_ms(shape, cal))


def draft_fixed_ms(shape: ModelShape, cal: Calibration) -> float:
    """A draft pass's fixed cost: the per-pass part plus its own layers' kernel latency."""
    return cal.fixed_ms + (shape.draft.layers if shape.draft else 0) * cal.layer_ms


def kv_ms_per_token(shape: ModelShape, lay: Layout, cal: Calibration) -> float:
    """Reading one cached token in every layer on one GPU (MLA: each rank reads the whole latent)."""
    per_gpu = shape.kv_bytes_per_token_layer / (1 if shape.kv_heads is None else min(lay.tp, shape.kv_heads))
    return shape.layers * per_gpu / (cal.bw_efficiency * lay.gpu.bandwidth_gbs * 1e9) * 1000


def step_passes(shape: ModelShape, lay: Layout, cal: Calibration, spec: Speculative, n: int) -> list[Breakdown]:
    """The forwards of one decode step of n requests, KV reads left out (the profile adds them per token held).
    EAGLE in SGLang: the draft extends over the tokens the last verify accepted (padded to steps + 1 per
    request), drafts steps - 1 more passes over n x topk tokens, then the target verifies n x draft_tokens."""
    passes = []
    if spec.draft and shape.draft is None:
        raise ShapeError(f"{shape.name} has no draft head: speculative settings need one")
    if spec.steps == 0:
        passes.append(forward(shape, lay, cal, n))
        if spec.draft:
            passes.append(draft_forward(shape, lay, cal, n, n))
        return passes
    passes.append(draft_forward(shape, lay, cal, n * (spec.steps + 1), n))
    for _ in range(spec.steps - 1):
        passes.append(draft_forward(shape, lay, cal, n * spec.topk, n * spec.topk))
    passes.append(forward(shape, lay, cal, n * spec.draft_tokens))
    return passes


def step_ms(shape: ModelShape, lay: Layout, cal: Calibration, spec: Speculative, n: int) -> float:
    return sum(p.ms for p in step_passes(shape, lay, cal, spec, n)) + n * cal.per_request_ms


def prefill_ms(shape: ModelShape, lay: Layout, cal: Calibration, spec: Speculative, tokens: int) -> float:
    """A prompt's prefill without its attention core (prefill_attention_ms_per_mpair adds that by query-key
    pairs): the target over its tokens (logits for the last), and the draft's extend with it."""
    ms = forward(shape, lay, cal, tokens, logits_tokens=1).ms
    if spec.draft:
        ms += draft_forward(shape, lay, cal, tokens, 1).ms
    return ms


# --- derived profiles ---------------------------------------------------------------------------------------

STEP_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 30, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256)


@dataclass(frozen=True)
class Box:
    """A preset: a model on a set of GPUs, with the calibration that holds for it."""

    name: str
    shape: ModelShape
    gpu: Gpu
    gpus: int
    link: Interconnect
    cal: Calibration
    baseline_cap: int = 64
    description: str = ""

    def layout(self, tp: int | None = None) -> Layout:
        return Layout(self.gpu, tp or self.gpus, self.link)


def derive_profile(box: Box, spec: Speculative, tp: int | None = None, *, prompt_tokens: float = 23.0,
                   cap: int | None = None, max_total_num_tokens: int | None = None,
                   accept_length_spread: float = 0.3, name: str | None = None) -> Profile:
    """The simulator profile this model gives: the step at each batch size (KV reads apart, as
    `kv_ms_per_ktoken`), prefill linear through the model's cost at `prompt_tokens` and at 8192 tokens."""
    lay = box.layout(tp)
    cap = cap or (EAGLE_DEFAULT_MAX_RUNNING if spec.draft else box.baseline_cap)
    grid = sorted({n for n in STEP_GRID if n <= cap} | {cap})
    points = [(n, round(step_ms(box.shape, lay, box.cal, spec, n), 4)) for n in grid]
    p0 = max(int(round(prompt_tokens)), 1)
    c0, c1 = prefill_ms(box.shape, lay, box.cal, spec, p0), prefill_ms(box.shape, lay, box.cal, spec, 8192)
    per_token = max((c1 - c0) / (8192 - p0), 0.0) if p0 < 8192 else 0.0
    base = max(c0 - per_token * p0, 0.0)
    if max_total_num_tokens is None:
        from bench.sim import memory

        fit = memory.fit_deployment(memory.TP_EAGLE3 if spec.draft else memory.TP_BASELINE, memory_model(box.shape),
                                    memory.Hardware(lay.tp, box.gpu.memory_gib))
        max_total_num_tokens = max(fit.servers[0].max_total_num_tokens, 1) if fit.servers else 1
    length = min(spec.accept_length, spec.steps + 1) if spec.speculative else 1.0
    label = name or f"{box.name}.{spec.name}-tp{lay.tp}"
    return Profile(
        name=label, speculative=spec.speculative,
        description=f"derived by bench.sim.stepcost: {box.shape.name} on {lay.tp}x {box.gpu.name} ({box.link.name}), "
                    f"{spec.name}" + (f", accept length {length:g}" if spec.speculative else ""),
        decode_a_ms=points[0][1], decode_b_ms=0.0, step_points_ms=points,
        prefill_base_ms=round(base, 4), prefill_ms_per_token=round(per_token, 6),
        kv_ms_per_ktoken=round(1000 * kv_ms_per_token(box.shape, lay, box.cal), 6),
        prefill_attention_ms_per_mpair=round(prefill_attention_ms_per_mpair(box.shape, lay, box.cal), 6),
        max_running_requests=cap, accept_length_general=length, accept_length_coding=length,
        accept_length_spread=accept_length_spread if spec.speculative else 0.0,
        speculative_num_steps=max(spec.steps, 1), speculative_eagle_topk=spec.topk,
        speculative_num_draft_tokens=spec.draft_tokens, model_path=box.shape.model_path or box.shape.name,
        tp_size=lay.tp, context_len=box.shape.context_len, max_total_num_tokens=max_total_num_tokens,
        eos_token_id=box.shape.eos_token_id, fitted_from=f"stepcost:{box.name}")


def prefill_attention_ms_per_mpair(shape: ModelShape, lay: Layout, cal: Calibration) -> float:
    """A million causal query-key pairs of prefill attention in every layer, compute bound, on one GPU."""
    per_pair = shape.attn_flops_per_ctx_token if shape.prefill_attn_flops_per_pair is None \
        else shape.prefill_attn_flops_per_pair
    flops = 1e6 * per_pair * shape.layers / lay.tp
    return flops / (cal.dense_flops_efficiency * lay.gpu.bf16_tflops * 1e12) * 1000


def memory_model(shape: ModelShape):
    from bench.sim import memory

    return memory.ModelMemory(shape.name, weights_gib=shape.weight_bytes() / GIB,
                              replicated_gib=shape.replicated_bytes() / GIB,
                              kv_bytes_per_token=shape.kv_bytes_per_token(), layers=shape.layers,
                              kv_heads=shape.kv_heads, draft_weights_gib=shape.draft_weight_bytes() / GIB,
                              draft_layers=shape.draft.layers if shape.draft else 1, mla=shape.mla)


def seed_adaptive_profile(good: bool = False) -> Profile:
    """The built-in `adaptive-tp8` / `adaptive-good-tp8`: the seed box's step curves from this model (fitted to both
    seed rows within 5.5%), prefill and KV-read terms and KV capacity from the fitted `eagle3-tp8` (a measured
    server with a draft model), so it sits beside the fitted seed profiles on long prompts too."""
    from bench.sim import presets
    from bench.sim.profiles import load_profile_file

    fitted = load_profile_file(Path(__file__).parent / "profiles" / "eagle3-tp8.json")
    name = "adaptive-good-tp8" if good else "adaptive-tp8"
    alpha = GOOD_CHAIN_ALPHA if good else CHAIN_ALPHA
    drafter = ("the better drafter (eagle3-good-tp8's acceptance: ILLUSTRATIVE)" if good else
               "the seed drafter as a topk-1 chain (per-token acceptance 0.7: an ASSUMPTION, range 0.55-0.8)")
    prof = derive_adaptive_profile(presets.BOXES[presets.SEED_BOX_NAME], alpha, name=name,
                                   coding_ratio=CODING_RATIO["good" if good else "seed"],
                                   max_total_num_tokens=fitted.max_total_num_tokens,
                                   description=f"SGLang --speculative-adaptive (topk 1, default table), Kimi K2.5 on 8x "
                                               f"RTX PRO 6000 Blackwell (TP8), {drafter}; step curves from the "
                                               "step-cost model, prefill and KV terms from eagle3-tp8")
    keep = ("prefill_base_ms", "prefill_ms_per_token", "prefill_attention_ms_per_mpair", "kv_ms_per_ktoken",
            "chunked_prefill_size", "context_len", "eos_token_id", "natural_output_tokens", "model_path")
    return prof.model_copy(update={k: getattr(fitted, k) for k in keep} | {
        "fitted_from": f"stepcost:{presets.SEED_BOX_NAME} (steps), eagle3-tp8 (prefill, KV)"})


def write_seed_adaptive_profiles() -> list[Path]:
    out = []
    for good in (False, True):
        prof = seed_adaptive_profile(good)
        path = Path(__file__).parent / "profiles" / f"{prof.name}.json"
        path.write_text(json.dumps(prof.model_dump(mode="json"), indent=2) + "\n")
        out.append(path)
    return out


# --- shape files ----------------------------------------------------------------------------------------------

def load_shape_file(path: str | Path) -> ModelShape:
    """A user's model shape (YAML or JSON, the ModelShape fields); ShapeError with one line when unusable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShapeError(f"shape file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ShapeError(f"cannot read shape file {path}: {exc}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - yaml and json raise their own kinds; all mean "not parseable"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ShapeError(f"shape file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {first}") from None
    if not isinstance(data, dict):
        raise ShapeError(f"shape file {path} must hold a mapping of ModelShape fields")
    data.setdefault("name", path.stem)
    try:
        return ModelShape.model_validate(data).check()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "shape"
        raise ShapeError(f"invalid shape file {path}: {where}: {err['msg']}") from None
    except ShapeError as exc:
        raise ShapeError(f"invalid shape file {path}: {exc}") from None


# --- fitting the seed's box ---------------------------------------------------------------------------------

def seed_rows(path: Path | None = None) -> dict[str, list[tuple[int, float]]]:
    from bench.sim.fit import read_table

    path = path or Path(__file__).resolve().parents[1] / "data" / "seed_benchmark.csv"
    return {"baseline": read_table(path, "baseline_tok_s"), "eagle3": read_table(path, "eagle3_tok_s")}


def seed_errors(box: Box, rows: dict[str, list[tuple[int, float]]] | None = None,
                accept_length: float = 2.5) -> dict[str, list[tuple[int, float, float]]]:
    """(concurrency, measured, model) for both seed rows, through the fitted profiles' closed-loop predictor."""
    from bench.sim.fit import predict

    rows = rows or seed_rows()
    out = {}
    for key, spec in (("baseline", BASELINE), ("eagle3", tree(accept_length=accept_length))):
        prof = derive_profile(box, spec, max_total_num_tokens=1_000_000)
        out[key] = [(c, v, predict(prof, c, 512, 23.0)) for c, v in rows[key]]
    return out


def worst_error(errs: dict[str, list[tuple[int, float, float]]]) -> float:
    return max(abs(p / v - 1) for rows in errs.values() for _, v, p in rows)


# The free parameters fit_seed varies (log scale), each with its physical meaning (docs/SIMULATOR.md):
# fixed_ms, per_request_ms, bw_efficiency, expert_reuse (Calibration); hop_us, bus_gbs (the link). The GEMM
# efficiencies are measured on an H200 (presets.SEED_CAL): the seed rows cannot tell per-token GEMM time from
# per-token wire time, so they are not fitted.
FREE = ("fixed_ms", "per_request_ms", "bw_efficiency", "expert_reuse", "hop_us", "bus_gbs")
_CAL_KEYS = ("fixed_ms", "per_request_ms", "bw_efficiency", "flops_efficiency", "expert_reuse")
# Upper bounds the fit respects: weight-streaming kernels reach at most ~85% of datasheet bandwidth (a stated
# prior; without it the fit runs to 100%); fractions stay fractions.
BOUNDS = {"bw_efficiency": 0.85, "flops_efficiency": 1.0, "expert_reuse": 1.0}
# two starting values per free parameter: fit_seed runs a short Nelder-Mead from every corner, then refines the best
START_GRID = {"fixed_ms": (0.3, 1.5), "per_request_ms": (0.05, 0.3), "bw_efficiency": (0.5, 0.8),
              "flops_efficiency": (0.03, 0.15), "expert_reuse": (0.5, 0.9), "hop_us": (2.0, 5.0),
              "bus_gbs": (12.0, 40.0)}


def _with(box: Box, x: dict[str, float]) -> Box:
    cal = box.cal.model_copy(update={k: v for k, v in x.items() if k in _CAL_KEYS})
    link = box.link.model_copy(update={k: v for k, v in x.items() if k in ("hop_us", "bus_gbs", "base_us")})
    return replace(box, cal=cal, link=link)


def _current(box: Box, key: str) -> float:
    return getattr(box.cal, key) if key in _CAL_KEYS else getattr(box.link, key)


def fit_seed(box: Box, rows: dict[str, list[tuple[int, float]]] | None = None, *, free: tuple[str, ...] = FREE,
             multistart: bool = True, iters: int = 600) -> Box:
    """Fit the box's free parameters to both seed rows at once: the smallest worst relative error over every
    cell of both rows. Deterministic: a short Nelder-Mead (log values) from each corner of START_GRID (or from
    the box's own values when multistart is False), then the best one refined."""
    import itertools

    from bench.sim.fit import _nelder_mead

    rows = rows or seed_rows()

    def unpack(v: list[float]) -> dict[str, float] | None:
        x = {k: math.exp(a) for k, a in zip(free, v, strict=True)}
        return None if any(x[k] > BOUNDS[k] for k in BOUNDS if k in x) else x

    def objective(v: list[float]) -> float:
        x = unpack(v)
        return 1e9 if x is None else worst_error(seed_errors(_with(box, x), rows))

    if multistart:
        starts = [[math.log(c) for c in combo] for combo in itertools.product(*(START_GRID[k] for k in free))]
        starts.append([math.log(max(_current(box, k), 1e-3)) for k in free])  # the box's own values too
        runs = [_nelder_mead(objective, v, [0.3] * len(free), iters=150) for v in starts]
        v = min(runs, key=objective)
    else:
        v = [math.log(max(_current(box, k), 1e-3)) for k in free]
    for _ in range(2):
        v = _nelder_mead(objective, v, [0.1] * len(free), iters=iters)
    x = unpack(v) or {k: _current(box, k) for k in free}
    return _with(box, {k: float(f"{val:.4g}") for k, val in x.items()})


# --- derived profiles by name ---------------------------------------------------------------------------------

# Per-token acceptance of a topk-1 chain (each drafted token accepted with this probability given the ones before
# it): an assumption, central value of the stated range CHAIN_ALPHA_RANGE (docs/SIMULATOR.md).
CHAIN_ALPHA = 0.7
CHAIN_ALPHA_RANGE = (0.55, 0.8)
SEED_TREE_ACCEPT = 2.5  # measured: the seed's topk-4, 2-step, 16-token tree on its prompts


# The better drafter (`eagle3-good-tp8`: topk 1, 3 steps, accept length 3.0 general / 3.3 coding) as a chain's
# per-token acceptance: 1 + a + a^2 + a^3 = 3.0 at a = 0.8105 (3.3: 0.8664). Illustrative, as that profile is.
GOOD_CHAIN_ALPHA = 0.8105
# coding prompts accept more: the seed tree's 2.61 / 2.5 (eagle3-tp8), eagle3-good's 3.3 / 3.0
CODING_RATIO = {"seed": 2.61 / 2.5, "good": 3.3 / 3.0}
# SGLang --speculative-adaptive: the step counts an adaptive profile carries curves for (its default table uses
# 0, 1, 3, 5, 7; a --speculative-adaptive-config may allow any of 0..8), and the step count it starts at and
# states its accept length for (SGLang's default speculative_num_steps: the middle of the table's 0, 1, 3, 5, 7)
ADAPTIVE_CURVE_STEPS = tuple(range(0, 9))
ADAPTIVE_NOMINAL_STEPS = 3
ADAPTIVE_OFF = Speculative("adaptive-off", 0, 1, 1, 1.0, True)


def setting(text: str, alpha: float = CHAIN_ALPHA, tree_accept: float = SEED_TREE_ACCEPT) -> Speculative:
    """baseline | tree (the seed's: topk 4, 2 steps, 16 draft tokens) | chainK (topk 1, K steps, K+1 tokens) |
    chainK-good (the same at the better drafter's acceptance, GOOD_CHAIN_ALPHA)."""
    if text == "baseline":
        return BASELINE
    if text == "tree":
        return tree(accept_length=tree_accept)
    text, alpha = _alpha_suffix(text, alpha)
    if text.endswith("-good"):
        text, alpha = text.removesuffix("-good"), GOOD_CHAIN_ALPHA
        if not text.startswith("chain"):
            raise ShapeError(f"unknown speculative setting {text + '-good'!r}: only chainK-good and adaptive-good")
    if text.startswith("chain") and text[5:].isdigit() and 1 <= int(text[5:]) <= 16:
        k = int(text[5:])
        spec = chain(k, chain_accept_length(k, alpha))
        if alpha == CHAIN_ALPHA:
            return spec
        return replace(spec, name=f"{spec.name}-good" if alpha == GOOD_CHAIN_ALPHA else f"{spec.name}-a{alpha * 100:02.0f}")
    raise ShapeError(f"unknown speculative setting {text!r}: baseline, tree, chainK, chainK-good (K = 1..16), "
                     "adaptive or adaptive-good")


def _alpha_suffix(text: str, alpha: float) -> tuple[str, float]:
    """`chain3-a55`, `adaptive-a80`: a chain's per-token acceptance given in hundredths (sensitivity runs)."""
    head, sep, tail = text.rpartition("-a")
    if sep and tail.isdigit() and len(tail) == 2 and 1 <= int(tail) <= 99:
        return head, int(tail) / 100
    return text, alpha


def chain_alpha(length: float, steps: int) -> float:
    """The per-token acceptance a with 1 + a + ... + a^steps == length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_accept_length(steps, mid) < length else (lo, mid)
    return (lo + hi) / 2


def derive_adaptive_profile(box: Box, alpha: float = CHAIN_ALPHA, tp: int | None = None, *,
                            coding_ratio: float = CODING_RATIO["seed"], name: str | None = None,
                            max_total_num_tokens: int | None = None, description: str = "",
                            extend_fixed: bool = True) -> Profile:
    """SGLang --speculative-adaptive on one server (topk 1): a step curve per draft step count (0: the target
    decodes and the draft runs its extend pass), accept lengths stated at ADAPTIVE_NOMINAL_STEPS from a chain's
    per-token acceptance `alpha` (coding prompts: `coding_ratio` x that length). `extend_fixed` False: the 0-step
    extend pass without the per-forward fixed_ms (kernels only: the low end of its cost, docs/SIMULATOR.md)."""
    lay = box.layout(tp)
    k0 = ADAPTIVE_NOMINAL_STEPS
    base = derive_profile(box, chain(k0, chain_accept_length(k0, alpha)), tp,
                          max_total_num_tokens=max_total_num_tokens, name=name)
    cap = base.max_running_requests
    grid = sorted({n for n in STEP_GRID if n <= cap} | {cap})
    curves = {}
    for k in ADAPTIVE_CURVE_STEPS:
        spec = ADAPTIVE_OFF if k == 0 else chain(k, 1.0)
        cut = draft_fixed_ms(box.shape, box.cal) if k == 0 and not extend_fixed else 0.0
        curves[k] = [(n, round(step_ms(box.shape, lay, box.cal, spec, n) - cut, 4)) for n in grid]
    general = round(chain_accept_length(k0, alpha), 4)
    coding = round(min(general * coding_ratio, k0 + 1.0), 4)
    return base.model_copy(update={
        "speculative_adaptive": True, "adaptive_step_points_ms": curves,
        "accept_length_general": general, "accept_length_coding": coding,
        "description": description or (f"derived by bench.sim.stepcost: {box.shape.name} on {lay.tp}x {box.gpu.name} "
                                        f"({box.link.name}), SGLang --speculative-adaptive (topk 1), chain "
                                        f"acceptance {alpha:g} per token ({general:g} at {k0} steps)"),
    })


def profile_by_name(name: str) -> Profile:
    """`PRESET.SETTING-tpN` (e.g. kimi-k25-rtxpro6000-pcie.chain3-tp8): the profile the step-cost model derives.
    ProfileError (one line) for an unknown name or a deployment whose weights do not fit its GPUs."""
    from bench.sim import memory, presets

    head, _, rest = name.partition(".")
    what, _, tp_text = rest.rpartition("-tp")
    try:
        box = presets.box(head)
        kernels_only = what.endswith("-xk")  # the 0-step extend pass at its low-end cost (sensitivity)
        what_alpha, alpha = _alpha_suffix(what.removesuffix("-xk"), CHAIN_ALPHA)
        adaptive = what_alpha in ("adaptive", "adaptive-good")
        spec = chain(ADAPTIVE_NOMINAL_STEPS, 1.0) if adaptive else setting(what)
        tp = int(tp_text) if tp_text.isdigit() else 0
        if tp < 1 or tp > box.gpus:
            raise ShapeError(f"{name}: the TP size after '-tp' must be 1..{box.gpus}")
        if adaptive:
            fit = memory.fit_deployment(memory.TP_ADAPTIVE, memory_model(box.shape),
                                        memory.Hardware(tp, box.gpu.memory_gib))
            if not fit.fits:
                raise ShapeError(f"{name}: {fit.reason}")
            good = what_alpha == "adaptive-good"
            return derive_adaptive_profile(box, GOOD_CHAIN_ALPHA if good else alpha, tp, name=name,
                                           coding_ratio=CODING_RATIO["good" if good else "seed"],
                                           extend_fixed=not kernels_only)
        kind = memory.TP_EAGLE3 if spec.draft else memory.TP_BASELINE
        fit = memory.fit_deployment(kind, memory_model(box.shape), memory.Hardware(tp, box.gpu.memory_gib))
        if not fit.fits:
            raise ShapeError(f"{name}: {fit.reason}")
        return derive_profile(box, spec, tp, name=name)
    except (ShapeError, memory.MemoryFitError) as exc:
        raise ProfileError(str(exc)) from None


# Held-out rows (bench/data/published_specdec.csv) this model can express: SGLang's DeepSeek-V3 MTP on 8x H200
# TP8 (default chain: 3 steps, topk 1, 4 draft tokens; acceptance not published) and TensorRT-LLM's Llama-3.3-70B
# FP8 baseline on one H200. The rest are other shapes, GPUs or drafters, or per-GPU throughput at matched
# per-user speed rather than at a batch size (docs/SIMULATOR.md, "Held-out evidence").
HELD_OUT_DEEPSEEK = {1: 1.8, 32: 1.5}
HELD_OUT_LLAMA_FP8_TOK_S = 51.14


def spec_speedup(box: Box, spec: Speculative, n: int, tp: int | None = None) -> float:
    """Decode tokens/s with `spec` over the baseline at n requests, step against step (KV reads left out)."""
    lay = box.layout(tp)
    return spec.accept_length * step_ms(box.shape, lay, box.cal, BASELINE, n) / step_ms(box.shape, lay, box.cal,
                                                                                          spec, n)


def alpha_for_speedup(box: Box, steps: int, n: int, target: float) -> float | None:
    """The per-token acceptance at which a `steps` chain reaches `target` at n requests (bisection), or None."""
    lo, hi = 0.05, 0.99
    f = lambda a: spec_speedup(box, chain(steps, chain_accept_length(steps, a)), n) - target  # noqa: E731
    if f(hi) < 0 or f(lo) > 0:
        return None
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def held_out_report(boxes: dict[str, Box]) -> list[str]:
    """Each calibration's held-out errors: `boxes` maps a label to the DeepSeek-V3 H200 box under it; the Llama
    FP8 single-GPU baseline is the Llama-70B shape in FP8 on one H200 under the same calibration."""
    from bench.sim import presets

    out = []
    for label, box in boxes.items():
        out.append(f"{label}: {box.cal.model_dump()}")
        for alpha in (0.7, 0.85):
            sp = chain(3, chain_accept_length(3, alpha))
            cells = [f"batch {n}: {spec_speedup(box, sp, n):.2f}x (published {v}x, "
                     f"{100 * (spec_speedup(box, sp, n) / v - 1):+.0f}%)" for n, v in HELD_OUT_DEEPSEEK.items()]
            out.append(f"  DeepSeek-V3 8x H200 TP8, chain3 at acceptance {alpha}: " + "; ".join(cells))
        a1 = alpha_for_speedup(box, 3, 1, HELD_OUT_DEEPSEEK[1])
        if a1 is None:
            out.append("  acceptance fitted to batch 1's 1.8x: none in 0.05-0.99 reaches it")
        else:
            pred = spec_speedup(box, chain(3, chain_accept_length(3, a1)), 32)
            out.append(f"  acceptance fitted to batch 1's 1.8x: {a1:.3f} (accept length "
                       f"{chain_accept_length(3, a1):.2f}); then batch 32: {pred:.2f}x against 1.5x "
                       f"({100 * (pred / HELD_OUT_DEEPSEEK[32] - 1):+.0f}%)")
        fp8 = presets.LLAMA_70B.model_copy(update={"attn_bytes_per_param": 1.0, "dense_bytes_per_param": 1.0})
        cal = box.cal if box.cal.layer_ms == 0 else presets.HOPPER_DENSE_CAL
        ms = step_ms(fp8, Layout(presets.H200, 1, box.link), cal, BASELINE, 1)
        out.append(f"  Llama-3.3-70B FP8 on one H200, batch 1 baseline: {1000 / ms:.1f} tok/s (published "
                   f"{HELD_OUT_LLAMA_FP8_TOK_S}, {100 * (1000 / ms / HELD_OUT_LLAMA_FP8_TOK_S - 1):+.0f}%)")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.sim.stepcost`: the stored calibration's parameters and its table against both seed rows
    (what docs/SIMULATOR.md shows); `--refit` fits again first (from the start grid and the stored values)."""
    import sys

    from bench.sim import presets

    argv = sys.argv[1:] if argv is None else argv
    if "--write-adaptive" in argv:  # regenerate bench/sim/profiles/adaptive{,-good}-tp8.json
        for path in write_seed_adaptive_profiles():
            print(f"wrote {path}")
        return 0
    if "--held-out" in argv:  # bench/results/stepcost/held_out.txt
        ds = presets.BOXES["deepseek-v3-h200-nvlink"]
        print("\n".join(held_out_report({"borrowed (the seed box's calibration)": replace(ds, cal=presets.SEED_CAL),
                                          "measured (Hopper, bench/results/gpu/step-h100.json)": ds})))
        return 0
    box = presets.BOXES[presets.SEED_BOX_NAME]
    if "--refit" in argv:
        box = fit_seed(box)
    print(f"calibration: {box.cal.model_dump()}")
    print(f"link: hop_us={box.link.hop_us} bus_gbs={box.link.bus_gbs}")
    errs = seed_errors(box)
    print("concurrency  baseline measured  model  error   eagle3 measured  model  error")
    for (c, v, p), (_, v2, p2) in zip(errs["baseline"], errs["eagle3"], strict=True):
        print(f"{c:>11}  {v:>17.1f}  {p:>5.1f}  {100 * (p / v - 1):+5.1f}%  {v2:>15.1f}  {p2:>5.1f}  "
              f"{100 * (p2 / v2 - 1):+5.1f}%")
    print(f"worst: {100 * worst_error(errs):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
