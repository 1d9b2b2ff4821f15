"""Packed MXFP4 expert GEMM on CUDA (Triton, weights dequantized in registers) == dequantize-then-bf16.

Decode shapes (<= 64 rows per expert, the 16-row tiles) and prefill shapes (the 64-row tiles), K a
multiple of 32 but not of the K tile, experts with no rows or one, pairs routed elsewhere; then the
whole ``kernels.moe_experts`` with MXFP4Weight stacks against the same call on the dequantized bf16
stacks (``torch._grouped_mm``), and the CUDA-graph capture the decode step needs. Then every
decode of :mod:`helixserve.kernels.moe.mxfp4_decode` (the inline-PTX ones run only here): every code
at every nibble times every scale byte, bit-exact; one-hot GEMMs (exact, both MMA orientations);
decode-size GEMMs over several tile configs.
"""

from __future__ import annotations

import pytest
import torch

from helixserve import kernels
from helixserve.kernels import MXFP4Weight
from helixserve.models.mxfp4 import E2M1_VALUES, quantize_mxfp4
from tests._testing import assert_close

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def packed(E: int, N: int, K: int, seed: int) -> MXFP4Weight:
    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_mxfp4(torch.randn(E, N, K, generator=gen) / K**0.5)
    return MXFP4Weight(q.to(CUDA), s.to(CUDA))


def ref_grouped(a: torch.Tensor, w: MXFP4Weight, sorted_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 products of the bf16 rows and the dequantized (bf16-exact) weights, per local row."""
    local = sorted_ids < w.shape[0]
    dense = w.dequantize(torch.bfloat16)
    out = torch.zeros(sorted_ids.numel(), w.shape[1], device=a.device)
    for e in sorted_ids[local].unique().tolist():
        sel = sorted_ids == e
        out[sel] = a[rows[sel]].float() @ dense[e].float().t()
    return out[local]


@pytest.mark.parametrize(("counts", "N", "K"), [
    ([1, 0, 8, 64, 3, 0, 16, 2], 384, 256),  # decode: <= 64 rows per expert
    ([0, 1, 2, 0], 200, 96),  # K % 64 and % 128 != 0, N % 64 != 0
    ([30, 40, 0, 25], 128, 160),  # the 32-row tiles
    ([700, 0, 1, 513, 64, 65], 256, 224),  # prefill: the 64-row tiles
    ([300, 257, 1, 0], 3072, 2048),  # K3-like widths
])
def test_grouped_gemm_mxfp4_matches_dequantize_then_bf16(counts, N, K):
    from helixserve.kernels.moe import triton_mxfp4

    E = len(counts)
    w = packed(E, N, K, seed=N + K)
    sorted_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)] + [torch.full((5,), E)]).to(CUDA)
    P = sorted_ids.numel()
    gen = torch.Generator(device=CUDA).manual_seed(1)
    a = torch.randn(max(1, P // 2), K, device=CUDA, generator=gen).bfloat16()
    rows = torch.randint(0, a.shape[0], (P,), device=CUDA, generator=gen)
    block_m = triton_mxfp4.choose_block_m(P, E)
    out = triton_mxfp4.grouped_gemm_mxfp4(a, w, triton_mxfp4.block_schedule(sorted_ids, E, block_m), P, rows=rows)
    ref = ref_grouped(a, w, sorted_ids, rows)
    assert_close(f"block_m={block_m}", ref, out[sorted_ids < E].float(), 5e-3)


@pytest.mark.parametrize("T", [1, 7, 64, 1500])  # 1500 x 4 / 16: rows enough for the dequantize path
@pytest.mark.parametrize("expert_offset", [0, 8])
def test_moe_experts_packed_matches_dequantized_bf16(T, expert_offset):
    D, I, E_local, top_k = 512, 192, 16, 4
    w13, w2 = packed(E_local, 2 * I, D, 21), packed(E_local, D, I, 22)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=gen).bfloat16().to(CUDA)
    weights, ids = kernels.moe_route(torch.randn(T, 32, generator=gen).to(CUDA), top_k=top_k, correction_bias=None,
                                     renormalize=True, routed_scaling_factor=1.0)
    ref = kernels.moe_experts(x, ids, weights, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16),
                              expert_offset=expert_offset, activation="situ")
    out = kernels.moe_experts(x, ids, weights, w13, w2, expert_offset=expert_offset, activation="situ")
    assert_close(f"T={T}", ref.float(), out.float(), 1.5e-2)


def test_dequantize_bf16_matches_the_reference():
    from helixserve.kernels.moe import triton_mxfp4

    w = packed(5, 300, 544, seed=41)  # K % 256 != 0, rows % 32 != 0
    assert torch.equal(triton_mxfp4.dequantize_bf16(w), w.dequantize(torch.bfloat16))


def test_moe_experts_packed_captures_in_a_cuda_graph():
    """No host sync on the packed path: a decode-sized call captures and replays with new routing."""
    D, I, E, top_k, T = 256, 64, 8, 2, 5
    w13, w2 = packed(E, 2 * I, D, 31), packed(E, D, I, 32)
    x = torch.randn(T, D, device=CUDA).bfloat16()
    logits = torch.randn(T, E, device=CUDA)
    weights, ids = kernels.moe_route(logits, top_k=top_k, correction_bias=None, renormalize=True,
                                     routed_scaling_factor=1.0)
    kernels.moe_experts(x, ids, weights, w13, w2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(x, ids, weights, w13, w2)
    new_w, new_ids = kernels.moe_route(torch.randn(T, E, device=CUDA), top_k=top_k, correction_bias=None,
                                       renormalize=True, routed_scaling_factor=1.0)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    ref = kernels.moe_experts(x, ids, weights, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16))
    assert_close("graph replay", ref.float(), out.float(), 1.5e-2)


def test_k3_tiny_loads_packed_on_cuda_and_matches_dense(tmp_path):
    """``experts="auto"`` on CUDA in bf16 keeps an MXFP4 checkpoint packed; each MoE layer computes
    what the dequantized (dense bf16) model's does on the same input (whole-model logits are not
    compared: random-weight K3 routing flips on bf16 rounding), and the packed model runs a step."""
    from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
    from helixserve.models.loading import load_model
    from helixserve.models.moe import KimiMoE, RoutedExperts
    from helixserve.models.presets import get_preset, make_checkpoint

    cfg = get_preset("kimi-k3-tiny")
    path = make_checkpoint("kimi-k3-tiny", tmp_path / "k3", seed=5)
    packed = load_model(path, dtype=torch.bfloat16, device=CUDA)
    dense = load_model(path, dtype=torch.bfloat16, device=CUDA, experts="dense")
    assert all(m.is_mxfp4 for m in packed.modules() if isinstance(m, RoutedExperts))
    assert not any(m.is_mxfp4 for m in dense.modules() if isinstance(m, RoutedExperts))
    moes = [(a, b) for a, b in zip(dense.modules(), packed.modules()) if isinstance(a, KimiMoE)]
    assert moes
    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16().to(CUDA)
    with torch.no_grad():
        for i, (a, b) in enumerate(moes):
            assert_close(f"moe {i}", a(x).float(), b(x).float(), 1.5e-2)
        batch = build_batch([SeqChunk(list(range(30, 90)), 0, 0)], 16, 8, device=CUDA)
        logits = packed(batch, allocate_caches(cfg, 8, 16, 2, dtype=torch.bfloat16, device=CUDA))
    assert logits.shape[-1] == cfg.vocab_size and torch.isfinite(logits.float()).all()


# ------------------------------------------------ every decode (mxfp4_decode), on the hardware

DECODES = ["fp32", "bf16x2", "lut"]


def kernel_values(w: MXFP4Weight, decode: str) -> torch.Tensor:
    """What the kernels give, in fp32: the reference except scale byte 0 (-> 0) and the bytes whose
    scale overflows (-> inf: 255 for the PTX decodes, > 240 for fp32's fp32 scale; zero codes NaN)."""
    table = torch.tensor(E2M1_VALUES, device=w.device)
    values = table[torch.stack((w.packed & 0xF, w.packed >> 4), dim=-1).flatten(-2).long()]
    s = w.scale.to(torch.int32)
    factor = torch.pow(2.0, (s - 127).float())
    factor = torch.where(s == 0, 0.0, torch.where(s >= (241 if decode == "fp32" else 255), float("inf"), factor))
    return (values.unflatten(-1, (-1, 32)) * factor[..., None]).flatten(-2).bfloat16().float()


def assert_same_values(name: str, want: torch.Tensor, got: torch.Tensor, zero_signs: bool = True) -> None:
    """Equal values (NaN where NaN; with ``zero_signs`` the sign of every zero too)."""
    want, got = want.float(), got.float()
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got)), f"{name}: NaN pattern differs"
    bad = (want != got) & ~nan
    assert not bad.any(), f"{name}: {int(bad.sum())} differ, e.g. {want[bad][:4].tolist()} vs {got[bad][:4].tolist()}"
    zero = want == 0
    if zero_signs:
        assert torch.equal(torch.signbit(want[zero]), torch.signbit(got[zero])), f"{name}: signs of zeros differ"


@pytest.mark.parametrize("decode", DECODES)
def test_decode_every_code_at_every_nibble_and_every_scale_byte(decode):
    """dequantize_bf16 runs the GEMM's decodes: rows of every scale byte 0..255 (1, 126..128, 200,
    254 among them), each code at each nibble of a word (code (j + i) % 16 at nibble i of word j),
    then random codes; bit-equal to the e2m1 table times the scale (edge bytes as documented)."""
    from helixserve.kernels.moe import triton_mxfp4

    K = 128  # 16 words a row
    j, i = torch.arange(16)[:, None], torch.arange(8)[None, :]
    codes = ((j + i) % 16).to(torch.uint8).flatten()  # [128] in K order
    row = codes[0::2] | (codes[1::2] << 4)
    packed = torch.cat([row.repeat(256, 1), torch.randint(0, 256, (256, K // 2), dtype=torch.uint8)])
    scale = torch.arange(256, dtype=torch.uint8).repeat(2)[:, None].expand(512, K // 32).contiguous()
    w = MXFP4Weight(packed[None].to(CUDA), scale[None].to(CUDA))
    want, got = kernel_values(w, decode), triton_mxfp4.dequantize_bf16(w, decode=decode).float()
    if decode == "fp32":  # its fp32 -> bf16 conversion may flush 0.5 * 2^-126 (s = 1); the PTX decodes may not
        want = torch.where((want.abs() < 2.0**-126) & (got == 0), got, want)
    assert_same_values(decode, want, got)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize(("block_m", "swap"), [(16, False), (16, True), (64, False), (64, True)])
def test_grouped_gemm_every_decode_is_exact_on_one_hot_rows(decode, block_m, swap):
    """One-hot activations make every output one weight: the GEMM reproduces the decoded weights
    exactly (the K order of each decode, both MMA orientations), scales 2, 126, 127, 128, 200 (none
    subnormal: whether the MMA keeps those is not the decode's business); zeros' signs aside."""
    from helixserve.kernels.moe import triton_mxfp4 as tm

    E, N, K = 2, 160, 256  # N: not a multiple of the 64/128 column tiles
    gen = torch.Generator().manual_seed(block_m)
    packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    pick = torch.randint(0, 5, (E, N, K // 32), generator=gen)
    scale = torch.tensor([2, 126, 127, 128, 200], dtype=torch.uint8)[pick]
    w = MXFP4Weight(packed.to(CUDA), scale.to(CUDA))
    a = torch.eye(K, device=CUDA).bfloat16()
    sorted_ids = torch.arange(E, device=CUDA).repeat_interleave(K)
    rows = torch.arange(K, device=CUDA).repeat(E)
    t = tm._tiles(block_m)._replace(swap=swap)
    out = tm.grouped_gemm_mxfp4(a, w, tm.block_schedule(sorted_ids, E, block_m), E * K, rows=rows, decode=decode,
                                tiles=t)
    want = kernel_values(w, decode).transpose(1, 2).reshape(E * K, N)
    assert_same_values(f"{decode} {t}", want, out, zero_signs=False)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("tiles", [None, (64, 128, 4, 3, True), (128, 128, 4, 4, False), (64, 256, 4, 3, False)])
def test_grouped_gemm_decode_sizes_every_decode(decode, tiles):
    """Decode sizes (<= 64 rows per expert, K3-like widths): every decode, default and other tiles."""
    from helixserve.kernels.moe import triton_mxfp4 as tm

    counts, N, K = [1, 0, 8, 64, 3, 0, 16, 2], 3072, 2048
    E = len(counts)
    w = packed(E, N, K, seed=7)
    sorted_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)] + [torch.full((5,), E)]).to(CUDA)
    P = sorted_ids.numel()
    gen = torch.Generator(device=CUDA).manual_seed(2)
    a = torch.randn(40, K, device=CUDA, generator=gen).bfloat16()
    rows = torch.randint(0, 40, (P,), device=CUDA, generator=gen)
    schedule = tm.block_schedule(sorted_ids, E, tm.choose_block_m(P, E))
    out = tm.grouped_gemm_mxfp4(a, w, schedule, P, rows=rows, decode=decode,
                                tiles=tm.Tiles(*tiles) if tiles else None)
    assert_close(f"{decode} {tiles}", ref_grouped(a, w, sorted_ids, rows), out[sorted_ids < E].float(), 5e-3)
