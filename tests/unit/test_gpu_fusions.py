"""The decode step's fused Triton kernels on CUDA == their PyTorch references on CPU (the public
``helixserve.kernels`` functions on CPU and CUDA copies of the same inputs), and a bf16 decode step
of a model on CUDA with them == the same step on CPU, loosely (bf16)."""

from __future__ import annotations

import pytest
import torch

from helixserve import kernels
from tests._testing import assert_close

pytestmark = pytest.mark.gpu


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _both(fn, *args, **kwargs):  # noqa: ANN001, ANN202
    on_cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    return fn(*args, **kwargs), fn(*on_cuda, **{k: v.cuda() if isinstance(v, torch.Tensor) else v
                                                for k, v in kwargs.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_activation_and_gates(dtype):
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    x, r, w = _rand(9, 200, seed=0, dtype=dtype), _rand(9, 200, seed=1, dtype=dtype), (1 + _rand(200, seed=2) / 10).to(dtype)
    pairs = {
        "rms_norm": _both(kernels.rms_norm, x, w, 1e-6),
        "add_rms_norm": _both(kernels.add_rms_norm, x, r, w, 1e-6, r * 0.5),
        "rms_norm_leading": _both(kernels.rms_norm_leading, x, w[:150], 1e-6),
        "gated_rms_norm": _both(kernels.gated_rms_norm, x.view(9, 4, 50), r.view(9, 4, 50), w[:50].float(), 1e-5),
        "situ": _both(kernels.act_and_mul, x, r, activation="situ"),
        "sigmoid": _both(kernels.act_and_mul, x, r, activation="sigmoid"),
        "kda_gate_beta": _both(kernels.kda_gate_beta, x[:, :192], r[:, :4], _rand(4, seed=3) / 3,
                               _rand(192, seed=4) / 3, num_heads=4, head_dim=48, lower_bound=-5.0),
        "attn_res_mix_norm": _both(kernels.attn_res_mix_norm, x, _rand(3, 9, 200, seed=5, dtype=dtype),
                                   1 + _rand(200, seed=6) / 10, _rand(1, 200, seed=7) / 3, 1e-5, w, 1e-6, addend=r),
    }
    for name, (ref, out) in pairs.items():
        for i, (a, b) in enumerate(zip(ref if isinstance(ref, tuple) else (ref,), out if isinstance(out, tuple) else (out,))):
            assert_close(f"{name}[{i}]", a.float(), b.float().cpu(), tol)


def test_moe_pairs_on_cuda():
    """The grouped expert sum with the Triton pair sort / gather / combine == the PyTorch path on CPU."""
    from helixserve.kernels.moe import gpu as moe_gpu

    T, D, I, E, top_k = 13, 64, 32, 6, 3
    x = _rand(T, D, seed=8, dtype=torch.bfloat16)
    w13, w2 = (_rand(E, 2 * I, D, seed=9) / 20).to(torch.bfloat16), (_rand(E, D, I, seed=10) / 15).to(torch.bfloat16)
    weights, ids = kernels.moe_route(_rand(T, 10, seed=11), top_k=top_k, correction_bias=None, renormalize=True,
                                     routed_scaling_factor=1.0)
    for offset in (0, 4):
        ref = moe_gpu.grouped_experts(x, ids, weights, w13, w2, offset, lambda g, u: g.float() * u.float())
        out = moe_gpu.grouped_experts(x.cuda(), ids.cuda(), weights.cuda(), w13.cuda(), w2.cuda(), offset,
                                      lambda g, u: g.float() * u.float())
        assert_close(f"offset {offset}", ref.float(), out.float().cpu(), 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_pair_gemv_on_cuda(dtype):
    """Decode-sized batches (1 and 8 tokens, top 8 of 64 experts, widths of 48B's experts) take the
    pair matrix-vector kernels, which equal the CPU reference and the grouped path on CUDA; 64 pairs
    take them and 65 do not; the same call twice gives the same bits, and a token's row is the same
    bits alone as batched with 7 others (the tile width changes with the batch, the sums' order not)."""
    from helixserve.kernels.moe import gpu as moe_gpu
    from helixserve.kernels.moe.experts import _device_act

    D, I, E, top_k = 2304, 1024, 64, 8
    w13, w2 = (_rand(E, 2 * I, D, seed=12) / 150).to(dtype), (_rand(E, D, I, seed=13) / 100).to(dtype)
    cuda_w13, cuda_w2 = w13.cuda(), w2.cuda()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for T, offset in ((1, 0), (8, 0), (8, 16)):
        x = _rand(T, D, seed=14 + T, dtype=dtype) / 3
        weights, ids = kernels.moe_route(_rand(T, E, seed=15), top_k=top_k, correction_bias=None,
                                         renormalize=True, routed_scaling_factor=1.0)
        cuda = [t.cuda() for t in (x, ids, weights)]
        assert moe_gpu.can_pair_gemv(cuda[0], cuda[1], cuda_w13)
        ref = kernels.moe_experts(x, ids, weights, w13, w2, expert_offset=offset, activation="situ")
        out = kernels.moe_experts(*cuda, cuda_w13, cuda_w2, expert_offset=offset, activation="situ")
        assert torch.equal(out, kernels.moe_experts(*cuda, cuda_w13, cuda_w2, expert_offset=offset, activation="situ"))
        assert_close(f"pairs T={T} offset={offset} vs cpu", ref.float(), out.float().cpu(), tol)
        if dtype == torch.bfloat16:
            grouped = moe_gpu.grouped_experts(*cuda, cuda_w13, cuda_w2, offset, _device_act("situ", 4.0, 25.0))
            assert_close(f"pairs T={T} offset={offset} vs grouped", grouped.float(), out.float(), tol)
        if T == 8:
            alone = [kernels.moe_experts(*(t[i:i + 1] for t in cuda), cuda_w13, cuda_w2, expert_offset=offset,
                                         activation="situ") for i in (0, 7)]
            assert torch.equal(torch.cat(alone), out[[0, 7]]), "a token's row depends on its batch"
    for pairs, taken in ((moe_gpu.MAX_GEMV_PAIRS, True), (moe_gpu.MAX_GEMV_PAIRS + 1, False)):  # the limit, one past
        ids = torch.zeros(pairs, 1, dtype=torch.int64, device="cuda")
        assert moe_gpu.can_pair_gemv(torch.zeros(pairs, D, dtype=dtype, device="cuda"), ids, cuda_w13) == taken
