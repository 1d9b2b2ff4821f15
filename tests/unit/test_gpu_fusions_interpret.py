"""The fused Triton kernels of the decode step (norms, gated activation, KDA gate, MoE pair glue)
under Triton's interpreter, each against its PyTorch reference on the same inputs."""

from __future__ import annotations

import pytest
import torch

from helixserve import kernels
from helixserve.kernels.moe.experts import _act_and_mul_torch
from helixserve.kernels.norm.rms import _gated_rms_norm_torch, _rms_norm_torch
from tests._testing import assert_close, needs_interpreter, run_under_triton_interpreter, triton_interpreter_patches


def test_fusions_under_triton_interpreter():
    run_under_triton_interpreter(__file__)


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    with triton_interpreter_patches():
        from helixserve.kernels.attn_res import triton_attn_res
        from helixserve.kernels.kda import triton_gate
        from helixserve.kernels.moe import triton_act
        from helixserve.kernels.norm import triton_norm

        yield {"norm": triton_norm, "act": triton_act, "gate": triton_gate, "attn_res": triton_attn_res}


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_rms_norm(interp, x_dtype, w_dtype):
    wide = _rand(5, 3 * 40, seed=0, dtype=x_dtype)
    weight = (1 + _rand(40, seed=1) / 10).to(w_dtype)
    for x in (wide[:, 40:80], wide.view(5, 3, 40)):  # strided rows (a split's slice), leading dims
        ref = _rms_norm_torch(x, weight, 1e-6)
        out = interp["norm"].rms_norm(x, weight, 1e-6)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert_close(f"rms_norm {x_dtype} {w_dtype}", ref.float(), out.float(), 1e-2 if x_dtype == torch.bfloat16 else 1e-6)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(interp, dtype):
    x, gate = _rand(3, 4, 32, seed=2, dtype=dtype), _rand(3, 4, 32, seed=3, dtype=dtype)
    weight = 1 + _rand(32, seed=4) / 10
    ref = _gated_rms_norm_torch(x, gate, weight, 1e-5)
    out = interp["norm"].gated_rms_norm(x, gate, weight, 1e-5)
    assert out.dtype == ref.dtype == dtype
    assert_close(f"gated_rms_norm {dtype}", ref.float(), out.float(), 1e-2 if dtype == torch.bfloat16 else 1e-6)


@needs_interpreter
@pytest.mark.parametrize("activation", ["silu", "situ", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_and_mul(interp, activation, dtype):
    h = _rand(6, 2 * 1100, seed=5, dtype=dtype)  # two column blocks of 1024
    gate, up = h[:, :1100], h[:, 1100:]
    ref = _act_and_mul_torch(gate, up, activation, 4.0, 25.0).to(dtype)
    out = interp["act"].act_and_mul(gate, up, activation, 4.0, 25.0)
    assert out.dtype == dtype
    assert_close(f"act_and_mul {activation} {dtype}", ref.float(), out.float(), 1e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_interpreter
@pytest.mark.parametrize("expert_offset", [0, 50])
def test_moe_pair_sort_and_combine(interp, expert_offset):
    """Pairs over several sort blocks and expert blocks (P = 246, E = 150), ties, and (offset 50)
    pairs of experts held elsewhere, whose never-written rows hold NaN."""
    from helixserve.kernels.moe import gpu as moe_gpu
    from helixserve.kernels.moe import triton_pairs

    T, top_k, E, D = 41, 6, 150, 1100
    gen = torch.Generator().manual_seed(7)
    topk_ids = torch.stack([torch.randperm(200, generator=gen)[:top_k] for _ in range(T)])
    topk_ids[3] = topk_ids[4]  # ties between tokens
    weights = torch.rand(T, top_k, generator=gen)
    x = _rand(T, 300, seed=16, dtype=torch.bfloat16)
    ref = moe_gpu.sort_pairs(topk_ids, E, expert_offset, x)  # the PyTorch path (CPU tensors)
    assert ref.rank is None
    order, sorted_ids, valid, rows, rank, offs, gathered = triton_pairs.sort_pairs(topk_ids, E, expert_offset, x)
    for name, a, b in (("order", ref.order, order), ("sorted_ids", ref.sorted_ids, sorted_ids),
                       ("valid", ref.valid, valid), ("rows", ref.rows, rows), ("offs", ref.offs, offs),
                       ("gathered", ref.gathered, gathered)):
        assert torch.equal(a, b), name
    assert triton_pairs.sort_pairs(topk_ids, E, expert_offset)[-1] is None
    assert torch.equal(order[rank], torch.arange(T * top_k))
    y = _rand(T * top_k, D, seed=8, dtype=torch.bfloat16)
    y[~valid] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        expected = moe_gpu.combine_pairs(y, ref, topk_ids, weights, E, expert_offset, dtype)
        out = triton_pairs.combine_pairs(y, rank, topk_ids, weights, E, expert_offset, dtype)
        if dtype == torch.float32:
            assert torch.equal(expected, out)  # the same fp32 sums in the same order
        else:  # the interpreter's bf16 store may round otherwise than PyTorch's cast
            assert_close("combine bf16", expected.float(), out.float(), 1e-2)


@needs_interpreter
@pytest.mark.parametrize("dtype,activation", [(torch.float32, "silu"), (torch.bfloat16, "situ")])
def test_moe_pair_gemv(interp, dtype, activation, monkeypatch):
    """The few-pairs expert sum (the pair matrix-vector kernels) against the PyTorch reference: widths
    that no block divides, 1 and 3 tokens, ties between tokens, pairs of experts held elsewhere
    (3 tokens: offset 3, experts 3..8 local, column-major stacks; 1 token: row-major), a K loop of two
    blocks. A token's row is the same bits alone as in a batch whose tiles are wider."""
    from helixserve.kernels.moe import triton_gemv
    from helixserve.kernels.moe.experts import _moe_experts_torch

    D, I, E, top_k = 140, 20, 6, 3
    w13, w2 = (_rand(E, 2 * I, D, seed=20) / 40).to(dtype), (_rand(E, D, I, seed=21) / 30).to(dtype)
    column_major = (w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2))
    for T in (1, 3):
        x = _rand(T, D, seed=22 + T, dtype=dtype) / 3
        gen = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(10, generator=gen)[:top_k] for _ in range(T)])
        ids[-1] = ids[0]  # two tokens with the same experts
        weights = torch.rand(T, top_k, generator=gen)
        offset, stacks = (0, (w13, w2)) if T == 1 else (3, column_major)
        ref = _moe_experts_torch(x, ids, weights, w13, w2, offset, activation, 4.0, 25.0)
        out = triton_gemv.pair_experts(x, ids, weights, *stacks, offset, activation, 4.0, 25.0)
        assert out.dtype == dtype and out.shape == (T, D)
        assert_close(f"pair gemv T={T} offset={offset} {activation} {dtype}", ref.float(), out.float(),
                     2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert triton_gemv.block_n(1, 1024) == 8 and triton_gemv.block_n(64, 4096) == 64
    # fewer target programs: 3 tokens' tiles (16 / 64 columns) are wider than 1 token's (8 / 8)
    monkeypatch.setattr(triton_gemv, "_TARGET_PROGRAMS", 16)
    assert triton_gemv.block_n(9, I) > triton_gemv.block_n(3, I) and triton_gemv.block_n(9, D) > triton_gemv.block_n(3, D)
    batched = triton_gemv.pair_experts(x, ids, weights, w13, w2, 0, activation, 4.0, 25.0)
    alone = triton_gemv.pair_experts(x[1:2], ids[1:2], weights[1:2], w13, w2, 0, activation, 4.0, 25.0)
    assert torch.equal(alone[0], batched[1])


@needs_interpreter
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gate_beta(interp, lower_bound, dtype):
    """f spans softplus's linear range (> 20); b is a strided column block of a wider projection;
    A_log padded past H (K3)."""
    T, H, K = 5, 3, 24
    f = (_rand(T, H * K, seed=9) * 4).to(dtype)
    b = _rand(T, 40, seed=10, dtype=dtype)[:, 7:7 + H]
    A_log, dt_bias = _rand(8, seed=11) / 3, _rand(H * K, seed=12) / 3
    g_ref, beta_ref = kernels.kda_gate_beta(f, b, A_log, dt_bias, num_heads=H, head_dim=K, lower_bound=lower_bound)
    g, beta = interp["gate"].kda_gate_beta(f, b, A_log, dt_bias, H, K, lower_bound)
    assert g.dtype == beta.dtype == torch.float32
    assert_close(f"g {lower_bound} {dtype}", g_ref, g, 1e-6)
    assert_close(f"beta {lower_bound} {dtype}", beta_ref, beta, 1e-6)


@needs_interpreter
@pytest.mark.parametrize("with_x2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(interp, dtype, with_x2):
    """The sums as PyTorch rounds them (bf16: x + x2, then the residual add, rounded before the
    norm reads it), and the norm of it."""
    x, residual = _rand(7, 48, seed=13, dtype=dtype), _rand(7, 48, seed=14, dtype=dtype)
    x2 = _rand(7, 48, seed=23, dtype=dtype) if with_x2 else None
    weight = (1 + _rand(48, seed=15) / 10).to(dtype)
    normed_ref, summed_ref = kernels.add_rms_norm(x, residual, weight, 1e-5, x2)
    normed, summed = interp["norm"].add_rms_norm(x, residual, weight, 1e-5, x2)
    assert normed.dtype == normed_ref.dtype and summed.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert_close(f"sum {dtype}", summed_ref.float(), summed.float(), tol)
    assert_close(f"normed {dtype}", normed_ref.float(), normed.float(), tol)


@needs_interpreter
@pytest.mark.parametrize("with_addend,with_prefix_out", [(False, False), (True, False), (True, True), ("pair", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_norm(interp, dtype, with_addend, with_prefix_out):
    """The residual add (stored where asked), the selection over a 3-deep bank and the norm after it."""
    M, D = 5, 96
    prefix, bank = _rand(M, D, seed=17, dtype=dtype), _rand(4, M, D, seed=18, dtype=dtype)[:3]
    addend = _rand(M, D, seed=19, dtype=dtype) if with_addend else None
    addend2 = _rand(M, D, seed=24, dtype=dtype) if with_addend == "pair" else None
    norm_w, proj_w = 1 + _rand(D, seed=20) / 10, _rand(1, D, seed=21) / 3
    out_w = (1 + _rand(D, seed=22) / 10).to(dtype)
    slot_ref, slot = (torch.zeros(M, D, dtype=dtype) for _ in range(2)) if with_prefix_out else (None, None)
    x_ref, p_ref = kernels.attn_res_mix_norm(prefix, bank, norm_w, proj_w, 1e-5, out_w, 1e-6, addend=addend,
                                             prefix_out=slot_ref, addend2=addend2)
    x, p = interp["attn_res"].attn_res_mix_norm(prefix, bank, norm_w, proj_w, 1e-5, out_w, 1e-6, addend, slot,
                                                addend2)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert x.dtype == x_ref.dtype
    assert_close(f"x {dtype}", x_ref.float(), x.float(), tol)
    assert_close(f"prefix {dtype}", p_ref.float(), p.float(), tol)
    if with_prefix_out:
        assert torch.equal(slot_ref, p_ref) and torch.equal(slot, p)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_leading(interp, dtype):
    """MLA's latent rows: the first 40 of 48 columns normed, the rest copied; strided rows."""
    x = _rand(6, 100, seed=25, dtype=dtype)[:, 10:58]
    weight = (1 + _rand(40, seed=26) / 10).to(dtype)
    ref = kernels.rms_norm_leading(x, weight, 1e-6)
    out = interp["norm"].rms_norm_leading(x, weight, 1e-6)
    assert out.dtype == dtype and torch.equal(out[:, 40:], x[:, 40:])
    assert_close(f"rms_norm_leading {dtype}", ref.float(), out.float(), 1e-2 if dtype == torch.bfloat16 else 1e-6)
