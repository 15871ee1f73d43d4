"""Memory fit: whether each deployment of the same GPUs holds the model, and how many KV tokens each server gets.

Pure arithmetic, after SGLang 0.5.23 (paths below are in `python/sglang/srt/` of its source):
- `mem_fraction_static` (the share of each GPU for weights + KV pool) defaults to
  `(gpu_mem - reserved) / gpu_mem` (`arg_groups/memory_hook.py`, `handle_gpu_memory_settings`), see
  `default_mem_fraction_static`;
- the KV pool gets what the static share leaves after the weights (`mem_cache/kv_cache_configurator.py`,
  `_profile_available_bytes`: `rest = free after loading - pre_load * (1 - mem_fraction_static)`), and
  `max_total_num_tokens = rest // cell_size` (`model_executor/pool_configurator.py`,
  `DefaultPoolConfigurator.calculate_pool_sizes`);
- the cell is the KV bytes of one token on one GPU: MLA keeps the whole latent on every TP rank, GQA splits
  its KV heads over the ranks; an EAGLE server adds its draft's layers at the target's per-layer size
  (the same `DefaultPoolConfigurator.__init__`).

Every size here is in GiB (2**30 bytes), the unit SGLang's memory log and nvidia-smi (MiB / 1024) use;
Hugging Face lists checkpoint sizes in decimal GB (1 GB = 0.931 GiB).
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)
MIB_PER_GIB = 1024.0

# The five deployments of the same GPUs that `bench plan` weighs (names as plan prints them).
TP_BASELINE = "tp-baseline"
TP_EAGLE3 = "tp-eagle3"
TP_ADAPTIVE = "tp-adaptive"
SPLIT = "split"
COLOCATED = "colocated"
DEPLOYMENTS = (TP_BASELINE, TP_EAGLE3, TP_ADAPTIVE, SPLIT, COLOCATED)


class MemoryFitError(ValueError):
    """Inputs the fit cannot use; the message is one line for the CLI."""


def _prefill_graph_sizes(max_bs: int) -> int:
    """How many prefill CUDA-graph sizes SGLang captures up to max_bs (cuda_graph_hook.py)."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return sum(1 for s in sizes if s <= max_bs)


def sglang_gpu_defaults(gpu_memory_gib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA-graph max batch) SGLang picks from one GPU's memory and the TP size."""
    mib = gpu_memory_gib * MIB_PER_GIB
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mib < 160 * 1024:  # H100/A100 80 GB and H20/H200/RTX PRO 6000: the same two values
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def default_mem_fraction_static(gpu_memory_gib: float, tp: int, *, mla: bool,
                                chunked_prefill_size: int | None = None,
                                cuda_graph_max_bs: int | None = None) -> float:
    """SGLang 0.5.23's default --mem-fraction-static on CUDA (no pipeline parallelism, no DP attention, no
    DeepEP, not a VLM's image tower, post-capture KV sizing off as by default): reserved MiB =
    512 + 1.5 x max(chunked_prefill, 2048) + 1024 x tp/8 + decode graphs (2 x max_bs) + prefill graphs
    (1.5 GiB for MLA, else 8 MiB per captured size), at least 10 GiB on GPUs above 60 GiB."""
    if gpu_memory_gib <= 0 or tp < 1:
        raise MemoryFitError("GPU memory and TP size must be positive")
    cps, max_bs = sglang_gpu_defaults(gpu_memory_gib, tp)
    cps = chunked_prefill_size or cps
    max_bs = cuda_graph_max_bs or max_bs
    mib = gpu_memory_gib * MIB_PER_GIB
    reserved = 512 + max(cps, 2048) * 1.5 + tp / 8 * 1024 + max_bs * 2
    reserved += 1.5 * 1024 if mla else _prefill_graph_sizes(cps if not mla else min(8192, cps)) * 8
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


@dataclass(frozen=True)
class ModelMemory:
    """What one copy of a model needs, whole (all GPUs together); sizes in GiB and bytes."""

    name: str
    weights_gib: float  # the target model's weights as loaded (its checkpoint's precision)
    kv_bytes_per_token: float  # all layers of the target, as one unsharded copy holds them
    layers: int
    kv_heads: int | None = None  # GQA: KV heads split over TP ranks; None: MLA (every rank holds the latent)
    draft_weights_gib: float = 0.0  # the EAGLE-3 draft (0: no draft known; speculative deployments use 0)
    draft_layers: int = 1
    mla: bool = False
    replicated_gib: float = 0.0  # part of weights_gib every TP rank holds whole (MLA down projections, gates)

    def weights_per_gpu_gib(self, tp: int, draft: bool) -> float:
        whole = self.weights_gib + (self.draft_weights_gib if draft else 0.0)
        return (whole - self.replicated_gib) / tp + self.replicated_gib

    def kv_cell_bytes(self, tp: int, draft: bool) -> float:
        """KV bytes one token takes on ONE GPU of a TP group (with the draft's layers for an EAGLE server)."""
        per_gpu = self.kv_bytes_per_token if self.kv_heads is None else \
            self.kv_bytes_per_token / min(tp, self.kv_heads)
        if draft:
            per_gpu *= 1 + self.draft_layers / self.layers
        return per_gpu


@dataclass(frozen=True)
class ServerFit:
    """One SGLang server of a deployment."""

    role: str  # "baseline" | "eagle3" | "adaptive"
    tp: int
    weights_per_gpu_gib: float
    static_per_gpu_gib: float  # its share of each GPU for weights + KV
    kv_cell_bytes: float
    max_total_num_tokens: int  # 0 when it does not fit

    @property
    def fits(self) -> bool:
        return self.max_total_num_tokens > 0


@dataclass(frozen=True)
class DeploymentFit:
    name: str
    gpus: int
    servers: tuple[ServerFit, ...]
    reason: str  # one line: why it does not fit, or how many KV tokens each server gets

    @property
    def fits(self) -> bool:
        return bool(self.servers) and all(s.fits for s in self.servers)

    def as_dict(self) -> dict:
        return {"fits": self.fits, "gpus": self.gpus, "reason": self.reason,
                "servers": [{"role": s.role, "tp": s.tp, "weights_per_gpu_gib": round(s.weights_per_gpu_gib, 3),
                             "static_per_gpu_gib": round(s.static_per_gpu_gib, 3),
                             "kv_cell_bytes": round(s.kv_cell_bytes, 1),
                             "max_total_num_tokens": s.max_total_num_tokens} for s in self.servers]}


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_memory_gib: float
    mem_fraction_static: float | None = None  # None: SGLang's default rule for each server's TP size

    def fraction(self, tp: int, mla: bool) -> float:
        return self.mem_fraction_static if self.mem_fraction_static is not None else \
            default_mem_fraction_static(self.gpu_memory_gib, tp, mla=mla)


def _server(model: ModelMemory, hw: Hardware, role: str, tp: int, static_gib: float) -> ServerFit:
    draft = role != "baseline"
    weights = model.weights_per_gpu_gib(tp, draft)
    cell = model.kv_cell_bytes(tp, draft)
    rest = (static_gib - weights) * GIB
    tokens = int(rest // cell) if rest > 0 and cell > 0 else 0
    return ServerFit(role, tp, weights, static_gib, cell, max(tokens, 0))


def _gib(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}k" if n >= 10_000 else str(n)


def fit_deployment(name: str, model: ModelMemory, hw: Hardware, kv_share: float = 0.5) -> DeploymentFit:
    """One deployment of hw.gpus GPUs. The split: two servers of half the GPUs each (EAGLE-3 and baseline).
    The co-located pair: two servers on all GPUs, each with a full copy of the weights; both processes keep
    their own non-static reserve, so together they get `2 x mem_fraction_static - 1` of each GPU, shared
    `kv_share` : `1 - kv_share` (a rule of this model, stated in docs/SIMULATOR.md)."""
    if name not in DEPLOYMENTS:
        raise MemoryFitError(f"unknown deployment {name!r}; choose from {', '.join(DEPLOYMENTS)}")
    if hw.gpus < 1 or hw.gpu_memory_gib <= 0:
        raise MemoryFitError("--gpus and --gpu-memory-gb must be positive")
    if model.weights_gib <= 0 or model.kv_bytes_per_token <= 0:
        raise MemoryFitError("--model-weights-gb and --kv-bytes-per-token must be positive")
    if hw.mem_fraction_static is not None and not 0 < hw.mem_fraction_static < 1:
        raise MemoryFitError("--mem-fraction-static must be between 0 and 1")
    n, mem = hw.gpus, hw.gpu_memory_gib
    if name in (TP_BASELINE, TP_EAGLE3, TP_ADAPTIVE):
        role = {TP_BASELINE: "baseline", TP_EAGLE3: "eagle3", TP_ADAPTIVE: "adaptive"}[name]
        f = hw.fraction(n, model.mla)
        servers = (_server(model, hw, role, n, f * mem),)
    elif name == SPLIT:
        if n < 2 or n % 2:
            return DeploymentFit(name, n, (), f"the split needs an even number of GPUs, not {n}")
        half = n // 2
        f = hw.fraction(half, model.mla)
        servers = (_server(model, hw, "eagle3", half, f * mem), _server(model, hw, "baseline", half, f * mem))
    else:
        f = hw.fraction(n, model.mla)
        pair = max(2 * f - 1, 0.0) * mem
        servers = (_server(model, hw, "eagle3", n, kv_share * pair),
                   _server(model, hw, "baseline", n, (1 - kv_share) * pair))
    return DeploymentFit(name, n, servers, _reason(name, model, hw, servers, f))


def label(name: str, gpus: int) -> str:
    """How plan names a deployment of `gpus` GPUs in a sentence."""
    return {TP_BASELINE: f"TP{gpus} baseline", TP_EAGLE3: f"TP{gpus} EAGLE-3",
            TP_ADAPTIVE: f"TP{gpus} adaptive speculation", SPLIT: f"the TP{gpus // 2}+TP{gpus // 2} split",
            COLOCATED: "the co-located pair"}[name]


def _reason(name: str, model: ModelMemory, hw: Hardware, servers: tuple[ServerFit, ...], f: float) -> str:
    mem = _gib(hw.gpu_memory_gib)
    bad = [s for s in servers if not s.fits]
    if not bad:
        each = ", ".join(f"{s.role} {_tokens(s.max_total_num_tokens)}" for s in servers)
        return f"{label(name, hw.gpus)} fits: KV tokens per server (max_total_num_tokens) {each}"
    s = bad[0]
    copies = 2 if name == COLOCATED else 1
    weights = (model.weights_gib + (model.draft_weights_gib if s.role != "baseline" else 0.0)) * copies
    if name == COLOCATED:
        return (f"the co-located pair does not fit: two copies of the weights ({_gib(weights)} GiB) on "
                f"{hw.gpus} x {mem} GiB ({_gib(s.weights_per_gpu_gib)} GiB per GPU per copy against "
                f"{_gib(s.static_per_gpu_gib)} GiB each server may hold at mem_fraction_static {f:.3f})")
    return (f"{label(name, hw.gpus)} does not fit: {_gib(weights)} GiB of weights on {s.tp} x {mem} GiB "
            f"({_gib(s.weights_per_gpu_gib)} GiB per GPU against {_gib(s.static_per_gpu_gib)} GiB static at "
            f"mem_fraction_static {f:.3f})")


def fit_all(model: ModelMemory, hw: Hardware, kv_share: float = 0.5) -> dict[str, DeploymentFit]:
    """Every deployment of the same GPUs, in DEPLOYMENTS order."""
    return {name: fit_deployment(name, model, hw, kv_share) for name in DEPLOYMENTS}


def summary_line(fits: dict[str, DeploymentFit]) -> str:
    """The first thing `bench plan` says: what does not fit (and why), else that everything fits."""
    bad = [f for f in fits.values() if not f.fits]
    if not bad:
        return "memory: every deployment fits; " + "; ".join(
            f"{label(f.name, f.gpus)} " + "/".join(_tokens(s.max_total_num_tokens) for s in f.servers)
            for f in fits.values()) \
            + " KV tokens per server"
    return "memory: " + "; ".join(f.reason for f in bad)


# --- presets (sources in docs/SIMULATOR.md, "Memory fit") -----------------------------------------------------

# nvidia-smi totals: RTX PRO 6000 Blackwell 97887 MiB, H200 143771 MiB (public nvidia-smi outputs).
RTX_PRO_6000_GIB = 97887 / 1024
H200_GIB = 143771 / 1024


def mla_kv_bytes(layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int) -> int:
    """MLA's cache: the compressed latent plus the decoupled rope key, per layer, per token."""
    return layers * (kv_lora_rank + rope_dim) * dtype_bytes


def gqa_kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every KV head of every layer, per token."""
    return layers * kv_heads * head_dim * 2 * dtype_bytes


# Kimi K2.5 (moonshotai/Kimi-K2.5 config.json text_config): 61 layers, MLA kv_lora_rank 512 + rope 64.
# SGLang's default --kv-cache-dtype auto keeps the model dtype, bf16 (2 bytes): 70,272 bytes per token;
# --kv-cache-dtype fp8_e4m3 halves it. Weights: int4 routed experts (group 32, bf16 scales), bf16 rest,
# 554.4 GiB (595 GB) computed from the config (bench.sim.presets); NVIDIA's NIM matrix lists 650 GB on disk.
# Draft: an EAGLE-3 head of ~0.99B parameters, 1.84 GiB (bench.sim.presets, an assumed shape).
# Every TP rank holds MLA's q/kv down projections (SGLang's ReplicatedLinear) and the routers whole: 2.03 GiB.
KIMI_K25 = ModelMemory("Kimi K2.5", weights_gib=554.1, kv_bytes_per_token=mla_kv_bytes(61, 512, 64, 2), layers=61,
                       kv_heads=None, draft_weights_gib=1.84, draft_layers=1, mla=True, replicated_gib=2.03)
# Llama-3.3-70B-Instruct: 80 layers, 8 KV heads x 128, bf16: 327,680 bytes per token; 70.55B parameters bf16
# = 131.4 GiB; its EAGLE-3 draft (one layer, 32k draft vocabulary) about 1.4B parameters = 2.6 GiB.
LLAMA_70B = ModelMemory("Llama-3.3-70B", weights_gib=131.4, kv_bytes_per_token=gqa_kv_bytes(80, 8, 128, 2),
                        layers=80, kv_heads=8, draft_weights_gib=2.6, draft_layers=1, mla=False)

SEED_BOX = Hardware(gpus=8, gpu_memory_gib=RTX_PRO_6000_GIB)
H200_BOX = Hardware(gpus=8, gpu_memory_gib=H200_GIB)
