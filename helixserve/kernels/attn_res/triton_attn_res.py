"""Triton attention-residual mix: one program per row, one pass over the sources (online softmax).

Same contract as :func:`helixserve.kernels.attn_res_mix` (prefix [M, D], bank [K, M, D], K >= 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2


@triton.jit
def _mix_source(src_ptr, offs, mask, query, D, eps, m, denom, acc):
    vals = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(vals * vals, 0) / D + eps)
    logit = tl.sum(vals * query, 0) * inv_rms
    m_new = tl.maximum(m, logit)
    alpha = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, denom * alpha + p, acc * alpha + p * vals


@triton.jit(do_not_specialize=["M", "stride_bank_k"])  # rows follow the batch: no variant per count
def _attn_res_kernel(
    prefix_ptr, bank_ptr, norm_ptr, proj_ptr, out_ptr,
    K, M, D, stride_prefix, stride_bank_k, stride_bank_m, stride_out, eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    query = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(proj_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(K):
        m, denom, acc = _mix_source(bank_ptr + i * stride_bank_k + row * stride_bank_m, offs, mask, query, D, eps,
                                    m, denom, acc)
    m, denom, acc = _mix_source(prefix_ptr + row * stride_prefix, offs, mask, query, D, eps, m, denom, acc)
    tl.store(out_ptr + row * stride_out + offs, (acc / denom).to(out_ptr.dtype.element_ty), mask=mask)


def attn_res_mix(
    prefix: torch.Tensor, bank: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Triton :func:`~helixserve.kernels.attn_res_mix` for a non-empty bank."""
    M, D = prefix.shape
    if prefix.stride(1) != 1:
        prefix = prefix.contiguous()
    if bank.stride(2) != 1:
        bank = bank.contiguous()
    out = torch.empty_like(prefix, memory_format=torch.contiguous_format)
    if M == 0:
        return out
    BLOCK_D = next_pow2(D)
    _attn_res_kernel[(M,)](
        prefix, bank, norm_weight.contiguous(), proj_weight.reshape(-1).contiguous(), out,
        bank.shape[0], M, D, prefix.stride(0), bank.stride(0), bank.stride(1), out.stride(0), float(eps),
        BLOCK_D=BLOCK_D, num_warps=8 if BLOCK_D >= 4096 else 4,
    )
    return out
