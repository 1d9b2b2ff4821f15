"""Packed MXFP4 expert stacks: the reference (dequantize, then the dense expert sum) on CPU, and the
Triton grouped GEMM that dequantizes in registers, under Triton's interpreter (child pytest, as in
test_gpu_kernels_interpret.py), against dequantize-then-bf16. Edge shapes: K a multiple of 32 but
not of the K tile, experts with no rows, one row, pairs routed to experts held elsewhere, and
sentinel scale bytes (255: NaN) past every weight row and group so an out-of-range read shows."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helixserve import kernels
from helixserve.kernels import MXFP4Weight
from helixserve.kernels.moe.experts import _act_and_mul_torch, _moe_experts_torch
from helixserve.models.mxfp4 import E2M1_VALUES, quantize_mxfp4
from tests._testing import INTERPRETING, assert_close, needs_interpreter, run_under_triton_interpreter



def packed_stack(E: int, N: int, K: int, seed: int, sentinel: bool = True) -> MXFP4Weight:
    """Random ``[E, N, K]`` weights rounded to MXFP4; with ``sentinel`` the bytes are views into
    larger buffers whose extra rows and scale groups are 255 (NaN if ever read)."""
    gen = torch.Generator().manual_seed(seed)
    packed, scale = quantize_mxfp4(torch.randn(E, N, K, generator=gen) / K**0.5)
    if not sentinel:
        return MXFP4Weight(packed, scale)
    big_packed = torch.full((E, N + 3, K // 2 + 16), 0x77, dtype=torch.uint8)
    big_scale = torch.full((E, N + 3, K // 32 + 2), 255, dtype=torch.uint8)
    big_packed[:, :N, :K // 2] = packed
    big_scale[:, :N, :K // 32] = scale
    return MXFP4Weight(big_packed[:, :N, :K // 2], big_scale[:, :N, :K // 32])


def test_dequantize_matches_the_e2m1_table_and_scales():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(4).view(1, 32)  # 64 values, 2 groups
    scale = torch.tensor([[127 - 3, 127 + 2]], dtype=torch.uint8)
    values = kernels.dequantize_mxfp4(packed, scale)
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(values[0, :32], table.repeat(2) * 2.0**-3)
    assert torch.equal(values[0, 32:], table.repeat(2) * 2.0**2)
    assert torch.isnan(kernels.dequantize_mxfp4(packed, torch.tensor([[255, 127]], dtype=torch.uint8))[0, :32]).all()


def test_mxfp4_weight_checks_its_bytes():
    with pytest.raises(ValueError, match="must be uint8"):
        MXFP4Weight(torch.zeros(2, 4, 16, dtype=torch.int8), torch.zeros(2, 4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not match weight_packed"):
        MXFP4Weight(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[E, N, K/2\]"):
        MXFP4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    e8m0 = torch.full((2, 4, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = MXFP4Weight(torch.zeros(2, 4, 16, dtype=torch.uint8), e8m0)
    assert w.shape == (2, 4, 32) and w.scale.dtype == torch.uint8 and w.nbytes == 2 * 4 * 17


@pytest.mark.parametrize("T", [1, 5, 40])
def test_moe_experts_packed_is_dequantize_then_dense(T):
    """CPU: two MXFP4Weight stacks give exactly what the dequantized stacks give (the reference)."""
    D, I, E, top_k = 64, 32, 6, 2
    w13, w2 = packed_stack(E, 2 * I, D, 1), packed_stack(E, D, I, 2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, D, generator=gen)
    weights, ids = kernels.moe_route(torch.randn(T, 9, generator=gen), top_k=top_k, correction_bias=None,
                                     renormalize=True, routed_scaling_factor=1.0)
    for offset in (0, 3):  # 3: experts 3..8 local, ids 0..2 held elsewhere
        ref = kernels.moe_experts(x, ids, weights, w13.dequantize(), w2.dequantize(), expert_offset=offset,
                                  activation="situ")
        out = kernels.moe_experts(x, ids, weights, w13, w2, expert_offset=offset, activation="situ")
        assert torch.equal(ref, out)


def test_moe_experts_rejects_mixed_or_misshaped_packed_stacks():
    w13, w2 = packed_stack(4, 32, 64, 1, sentinel=False), packed_stack(4, 64, 16 * 2, 2, sentinel=False)
    x, ids, weights = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)
    with pytest.raises(ValueError, match="both be MXFP4Weight or both tensors"):
        kernels.moe_experts(x, ids, weights, w13, w2.dequantize())
    with pytest.raises(ValueError, match="w2 must have shape"):
        kernels.moe_experts(x, ids, weights, w13, packed_stack(4, 64, 64, 2, sentinel=False))
    with pytest.raises(ValueError, match="w13 must be"):
        kernels.moe_experts(torch.randn(3, 32), ids, weights, w13, w2)


# ---------------------------------------------------------------- the Triton kernel, interpreted


def test_mxfp4_kernel_under_triton_interpreter():
    """Triton decides at import whether kernels are interpreted: the tests below run in a child
    pytest with ``TRITON_INTERPRET=1`` (Triton from ``HELIXSERVE_TRITON_INTERP`` or the env)."""
    run_under_triton_interpreter(__file__)


@pytest.fixture(scope="module")
def tm():
    """``triton_mxfp4``, interpreted; the numpy-2 scalar patch the other interpreter tests use."""
    pytest.importorskip("triton")
    import numpy as np
    import triton.runtime.interpreter as interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched_lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched_lang_tensor
    from helixserve.kernels.moe import triton_mxfp4

    try:
        yield triton_mxfp4
    finally:
        interpreter._patch_lang_tensor = patch_lang_tensor


@needs_interpreter
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_block_schedule_covers_each_expert_group(tm, block_m):
    counts = [0, 1, 17, 0, 64, 33, 0]  # none, one, past a block, exactly blocks, one over
    E = len(counts) - 1  # the last id: pairs held elsewhere, sorted last
    sorted_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    s = tm.block_schedule(sorted_ids, E, block_m)
    starts = [sum(counts[:e]) for e in range(len(counts))]
    want = [(e, starts[e] + j, starts[e] + counts[e]) for e in range(E) for j in range(0, counts[e], block_m)]
    real = [(int(e), int(b), int(end)) for e, b, end in zip(s.expert, s.row_begin, s.row_end) if e >= 0]
    assert real == want
    assert (s.expert[len(want):] == -1).all() and s.expert.numel() >= len(want)


@needs_interpreter
@pytest.mark.parametrize("block_m", [16, 64])  # the decode tiles (K tile 128) and the prefill ones (64)
@pytest.mark.parametrize("K", [96, 160])  # multiples of 32, of neither K tile
def test_grouped_gemm_matches_dequantize_then_bf16(tm, block_m, K):
    E, N = 5, 72  # N: not a multiple of the column tile
    weight = packed_stack(E, N, K, seed=K)
    counts = [3, 0, 1, 40, 0]  # experts with no rows, with one, over two blocks of 16
    sorted_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)] + [torch.full((2,), E)])
    P = sorted_ids.numel()
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(11, K, generator=gen).bfloat16()
    rows = torch.randint(0, 11, (P,), generator=gen)
    ref_w = weight.dequantize(torch.bfloat16).float()
    s = tm.block_schedule(sorted_ids, E, block_m)
    for gather in (True, False):
        src = a[rows] if not gather else a
        out = tm.grouped_gemm_mxfp4(src, weight, s, P, rows=rows if gather else None)
        local = sorted_ids < E
        ref = torch.einsum("pk,pnk->pn", a[rows][local].float(), ref_w[sorted_ids[local]])
        assert out.dtype == torch.bfloat16
        assert_close(f"gather={gather}", ref, out[local].float(), 4e-3)


@needs_interpreter
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize(("N", "K"), [(64, 128), (72, 160)])  # tiles dividing both (no masks), and not
def test_grouped_gemm_tile_overrides_match(tm, swap, N, K):
    """``tiles=``: other column / K tiles, the transposed product (``swap``), unmasked loads where
    the tiles divide N and K; every one the same values."""
    E = 3
    weight = packed_stack(E, N, K, seed=N + K)
    counts = [5, 0, 19]
    sorted_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)] + [torch.full((3,), E)])
    P = sorted_ids.numel()
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(7, K, generator=gen).bfloat16()
    rows = torch.randint(0, 7, (P,), generator=gen)
    local = sorted_ids < E
    dense = weight.dequantize(torch.bfloat16).float()
    ref = torch.einsum("pk,pnk->pn", a[rows][local].float(), dense[sorted_ids[local]])
    s = tm.block_schedule(sorted_ids, E, 16)
    for tiles in (tm.Tiles(32, 64, 4, 2, swap), tm.Tiles(64, 32, 4, 1, swap)):
        out = tm.grouped_gemm_mxfp4(a, weight, s, P, rows=rows, decode="fp32", tiles=tiles)
        assert_close(f"{tiles}", ref, out[local].float(), 4e-3)
    with pytest.raises(ValueError, match="decode must be one of"):
        tm.grouped_gemm_mxfp4(a, weight, s, P, rows=rows, decode="bf16x2")  # inline PTX: GPU only
    with pytest.raises(ValueError, match="multiple of 32"):
        tm.grouped_gemm_mxfp4(a, weight, s, P, rows=rows, tiles=tm.Tiles(32, 48, 4, 2))


@needs_interpreter
@pytest.mark.parametrize("T", [1, 6, 48])
def test_mxfp4_experts_match_the_reference(tm, T):
    """The whole CUDA expert sum (sort, schedule, two MXFP4 GEMMs, act, weighted sum) on CPU tensors."""
    from helixserve.kernels.moe import gpu as moe_gpu

    D, I, E, top_k = 96, 32, 6, 3
    w13, w2 = packed_stack(E, 2 * I, D, 11), packed_stack(E, D, I, 12)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=gen).bfloat16()
    weights, ids = kernels.moe_route(torch.randn(T, 10, generator=gen), top_k=top_k, correction_bias=None,
                                     renormalize=True, routed_scaling_factor=1.0)

    def act(gate, up):
        return _act_and_mul_torch(gate, up, "situ", 4.0, 25.0)

    for offset in (0, 4):
        ref = _moe_experts_torch(x, ids, weights, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16),
                                 offset, "situ", 4.0, 25.0)
        out = moe_gpu.mxfp4_experts(x, ids, weights, w13, w2, offset, act)
        assert_close(f"T={T} offset={offset}", ref.float(), out.float(), 2e-2)


@needs_interpreter
def test_dequantize_bf16_kernel_matches_the_reference(tm):
    """The prefill path's streaming decode: K not a multiple of its 256-wide tile, rows past 32."""
    weight = packed_stack(3, 45, 288, seed=4)
    out = tm.dequantize_bf16(weight)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out.float(), weight.dequantize(torch.bfloat16).float())


@needs_interpreter
def test_mxfp4_experts_prefill_sizes_take_the_dequantize_path(tm, monkeypatch):
    """From MXFP4_DEQUANT_MIN_ROWS_PER_EXPERT rows per expert, the bf16 grouped GEMMs over the
    dequantized stacks: the same sum (forced low here so the shapes stay small)."""
    from helixserve.kernels.moe import gpu as moe_gpu

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    D, I, E, top_k, T = 64, 32, 4, 2, 24
    w13, w2 = packed_stack(E, 2 * I, D, 21), packed_stack(E, D, I, 22)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=gen).bfloat16()
    weights, ids = kernels.moe_route(torch.randn(T, E, generator=gen), top_k=top_k, correction_bias=None,
                                     renormalize=True, routed_scaling_factor=1.0)

    def act(gate, up):
        return _act_and_mul_torch(gate, up, "silu", 4.0, 25.0)

    calls = []
    monkeypatch.setattr(moe_gpu, "MXFP4_DEQUANT_MIN_ROWS_PER_EXPERT", T * top_k // E)
    monkeypatch.setattr(tm, "dequantize_bf16", lambda w, f=tm.dequantize_bf16: calls.append(w) or f(w))
    ref = _moe_experts_torch(x, ids, weights, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16),
                             0, "silu", 4.0, 25.0)
    out = moe_gpu.mxfp4_experts(x, ids, weights, w13, w2, 0, act)
    assert len(calls) == 2
    assert_close("prefill path", ref.float(), out.float(), 2e-2)


def test_mxfp4_kernels_compile_for_hopper():
    """Both kernels, every decode at every default tile config, through Triton's sm_90 compiler
    (ptxas) without a GPU: no spills (local memory), registers within the per-thread limit."""
    if INTERPRETING:
        pytest.skip("compiles in a non-interpreted child")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    extra = os.environ.get("HELIXSERVE_TRITON_INTERP")
    if extra and (Path(extra) / "triton").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(extra).resolve()), env.get("PYTHONPATH")) if p)
    elif importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(root)) if p)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_mxfp4_sm90_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 40, proc.stdout
    for line in lines:
        regs, local = (int(v) for v in re.search(r"regs=(\d+) local=(\d+)", line).groups())
        assert local == 0 and regs <= 255, line
        # at K3's sizes below 64 rows each thread decodes whole words in the MMA operand's layout
        # (mma.sync): a decoded tile stored to shared memory there costs ~30% (a layout regression)
        if re.search(r"block_m=(16|32) .*hints=16", line):
            assert "smem_tile=0" in line, line
