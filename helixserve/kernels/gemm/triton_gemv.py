"""Triton matrix-vector product for one-row linears (batch-1 decode): ``out = x @ weight.T``.

x [1, K] (any float dtype), weight [N, K] (any float dtype, unit stride along K) -> [1, N] in the
asked dtype, accumulated in fp32. Each program reads ``BLOCK_N`` rows of the weight
(:func:`~helixserve.kernels.triton_common.gemv_block_n`: enough programs to cover every SM even for
a few thousand outputs), so a small weight is streamed by the whole GPU rather than by the few
tiles a GEMM of one row gets. Mixed dtypes are read as they are stored (an fp32 router against
bf16 activations needs no cast kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import gemv_block_n

_BLOCK_K = 128
_NUM_WARPS = 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [..., K]`` holding one row, ``weight [N, K]`` (unit stride along K) -> ``[..., N]``."""
    N, K = weight.shape
    row = x.reshape(K)
    row = row if row.stride(0) == 1 else row.contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=out_dtype, device=x.device)
    block_n = gemv_block_n(1, N)
    _gemv_kernel[(triton.cdiv(N, block_n),)](row, weight, out, N, K, weight.stride(0), BLOCK_N=block_n,
                                              BLOCK_K=_BLOCK_K, num_warps=_NUM_WARPS)
    return out
