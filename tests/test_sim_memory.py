"""Memory fit (bench.sim.memory): SGLang's default mem_fraction_static and the KV tokens of every deployment,
checked on hand-computed tables."""
from __future__ import annotations

import pytest

from bench.sim import memory as m

MIB = 1 / 1024  # GiB per MiB


@pytest.mark.parametrize("mib, tp, mla, want, kw", [
    # RTX PRO 6000 (97887 MiB), MLA, TP8: 512 + 1.5*8192 + 1024 + 2*512 + 1536 = 16384 MiB reserved
    (97887, 8, True, round((97887 - 16384) / 97887, 3), {}),
    # the same at TP4: the tp/8 term halves -> 15872
    (97887, 4, True, round((97887 - 15872) / 97887, 3), {}),
    # GQA (no MLA): 58 prefill graph sizes up to 8192 at 8 MiB = 464 -> 15312
    (97887, 8, False, round((97887 - 15312) / 97887, 3), {}),
    # H200 (143771 MiB), MLA, TP8: same 16384
    (143771, 8, True, round((143771 - 16384) / 143771, 3), {}),
    # a 24 GiB GPU at TP1: chunked prefill 4096, graphs up to 48: 512 + 6144 + 128 + 96 + 50*8 = 7280, no floor
    (24576, 1, False, round((24576 - 7280) / 24576, 3), {}),
    # a 64 GiB GPU at TP1 (8192 / 256): 512 + 12288 + 128 + 512 + 464 = 13904
    (65536, 1, False, round((65536 - 13904) / 65536, 3), {}),
    # the same with --chunked-prefill-size 2048 and graphs up to 8: 512 + 3072 + 128 + 16 + 42*8 = 4064,
    # below the 10 GiB floor of GPUs above 60 GiB -> 10240
    (65536, 1, False, round((65536 - 10240) / 65536, 3), {"chunked_prefill_size": 2048, "cuda_graph_max_bs": 8}),
])
def test_default_mem_fraction_static(mib, tp, mla, want, kw):
    assert m.default_mem_fraction_static(mib * MIB, tp, mla=mla, **kw) == want


def test_seed_box_fraction_is_sglangs():
    assert m.default_mem_fraction_static(m.RTX_PRO_6000_GIB, 8, mla=True) == 0.833


# A round-number model: 400 GiB of weights, 1 MiB of MLA KV per token over 64 layers, an 8 GiB draft.
TOY = m.ModelMemory("toy", weights_gib=400.0, kv_bytes_per_token=1 << 20, layers=64, kv_heads=None,
                    draft_weights_gib=8.0, draft_layers=1, mla=True)
BOX = m.Hardware(gpus=8, gpu_memory_gib=100.0, mem_fraction_static=0.9)


@pytest.mark.parametrize("name, fits, tokens", [
    # static 90 GiB per GPU, weights 50: 40 GiB / 1 MiB = 40960 tokens
    ("tp-baseline", True, [40960]),
    # + draft: 408/8 = 51 GiB; 39 GiB / (1 MiB x 65/64) = 39321.6
    ("tp-eagle3", True, [39321]),
    ("tp-adaptive", True, [39321]),
    # 4 GPUs: 100 (+2) GiB per GPU > 90
    ("split", False, [0, 0]),
    # two processes: (2 x 0.9 - 1) x 100 = 80 GiB, 40 each < 51 and 50
    ("colocated", False, [0, 0]),
])
def test_toy_table(name, fits, tokens):
    f = m.fit_deployment(name, TOY, BOX)
    assert f.fits is fits
    assert [s.max_total_num_tokens for s in f.servers] == tokens


def test_reasons_are_one_line_with_the_figures():
    fits = m.fit_all(TOY, BOX)
    assert fits["split"].reason == ("the TP4+TP4 split does not fit: 408 GiB of weights on 4 x 100 GiB (102 GiB per GPU "
                                    "against 90.0 GiB static at mem_fraction_static 0.900)")
    assert fits["colocated"].reason.startswith("the co-located pair does not fit: two copies of the weights "
                                               "(816 GiB) on 8 x 100 GiB")
    assert fits["tp-baseline"].reason == "TP8 baseline fits: KV tokens per server (max_total_num_tokens) baseline 41k"
    line = m.summary_line(fits)
    assert line.startswith("memory: the TP4+TP4 split does not fit") and "co-located pair does not fit" in line
    assert "\n" not in line


def test_smaller_model_fits_everywhere_and_the_pair_halves_the_kv():
    small = m.ModelMemory("small", weights_gib=80.0, kv_bytes_per_token=1 << 20, layers=64, mla=True)
    fits = m.fit_all(small, BOX)
    assert all(f.fits for f in fits.values())
    # split: 4 GPUs, 20 GiB weights each: 70 GiB -> 71680 tokens (the EAGLE-3 server's cell also holds its
    # draft layer: x 64/65 -> 70577)
    assert [s.max_total_num_tokens for s in fits["split"].servers] == [70577, 71680]
    # pair: 40 GiB each, 10 GiB weights: 30 GiB -> 30720 (30247 with the draft layer)
    assert [s.max_total_num_tokens for s in fits["colocated"].servers] == [30247, 30720]
    assert m.summary_line(fits).startswith("memory: every deployment fits")


def test_gqa_splits_kv_heads_up_to_their_count_mla_does_not():
    gqa = m.ModelMemory("g", weights_gib=1.0, kv_bytes_per_token=8192, layers=8, kv_heads=8)
    assert gqa.kv_cell_bytes(4, draft=False) == 2048
    assert gqa.kv_cell_bytes(8, draft=False) == 1024
    assert gqa.kv_cell_bytes(16, draft=False) == 1024  # beyond 8 ranks each rank keeps one whole head
    assert gqa.kv_cell_bytes(8, draft=True) == 1024 * (1 + 1 / 8)
    assert TOY.kv_cell_bytes(8, draft=False) == TOY.kv_cell_bytes(2, draft=False) == 1 << 20


def test_kv_bytes_per_token_of_the_presets():
    assert m.mla_kv_bytes(61, 512, 64, 2) == 70272  # Kimi K2.5 at bf16 (SGLang's default kv dtype)
    assert m.mla_kv_bytes(61, 512, 64, 1) == 35136  # --kv-cache-dtype fp8_e4m3
    assert m.gqa_kv_bytes(80, 8, 128, 2) == 327680  # Llama-3.3-70B at bf16


def test_seed_box_split_and_pair_do_not_fit_kimi():
    fits = m.fit_all(m.KIMI_K25, m.SEED_BOX)
    assert not fits["split"].fits and not fits["colocated"].fits
    assert fits["tp-baseline"].fits and fits["tp-eagle3"].fits
    # 0.833 x 95.59 GiB - ((554.1 - 2.03)/8 + 2.03) GiB = 8.59 GiB per GPU for KV, at 70272 bytes per token
    want = int((0.833 * m.RTX_PRO_6000_GIB - ((554.1 - 2.03) / 8 + 2.03)) * (1 << 30) // 70272)
    assert fits["tp-baseline"].servers[0].max_total_num_tokens == want


def test_compose_default_fits_everything_on_the_seed_box():
    fits = m.fit_all(m.LLAMA_70B, m.SEED_BOX)
    assert all(f.fits for f in fits.values())
    split = fits["split"].servers[1]
    want = int((0.849 * m.RTX_PRO_6000_GIB - 131.4 / 4) * (1 << 30) // (327680 / 4))
    assert split.tp == 4 and split.max_total_num_tokens == want


@pytest.mark.parametrize("kwargs, msg", [
    ({"mem_fraction_static": 1.2}, "between 0 and 1"),
    ({"gpus": 0}, "must be positive"),
])
def test_bad_inputs(kwargs, msg):
    hw = m.Hardware(**{"gpus": 8, "gpu_memory_gib": 96.0, **kwargs})
    with pytest.raises(m.MemoryFitError, match=msg):
        m.fit_deployment("tp-baseline", TOY, hw)


def test_odd_gpu_count_cannot_split():
    f = m.fit_deployment("split", TOY, m.Hardware(gpus=3, gpu_memory_gib=500.0, mem_fraction_static=0.9))
    assert not f.fits and "even number" in f.reason


def test_replicated_weights_count_whole_on_every_rank():
    mod = m.ModelMemory("r", weights_gib=80.0, kv_bytes_per_token=1 << 20, layers=64, mla=True, replicated_gib=8.0)
    assert mod.weights_per_gpu_gib(8, draft=False) == pytest.approx(72 / 8 + 8)
    f = m.fit_deployment("tp-baseline", mod, BOX)
    assert f.servers[0].max_total_num_tokens == int((90 - 17) * 1024)
