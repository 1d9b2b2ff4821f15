"""Triton attention-residual mix: one program per row, one pass over the sources (online softmax).

Same contracts as :func:`helixserve.kernels.attn_res_mix` and :func:`helixserve.kernels.attn_res_mix_norm`
(prefix [M, D], bank [K, M, D], K >= 1): the residual add before the mix and the RMS norm after it
run in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2


@triton.jit
def _mix_source(src_ptr, offs, mask, query, D, eps, m, denom, acc):
    vals = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return _mix_values(vals, query, D, eps, m, denom, acc)


@triton.jit
def _mix_values(vals, query, D, eps, m, denom, acc):
    inv_rms = tl.rsqrt(tl.sum(vals * vals, 0) / D + eps)
    logit = tl.sum(vals * query, 0) * inv_rms
    m_new = tl.maximum(m, logit)
    alpha = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, denom * alpha + p, acc * alpha + p * vals


@triton.jit(do_not_specialize=["M", "stride_bank_k"])  # rows follow the batch: no variant per count
def _attn_res_kernel(
    prefix_ptr, bank_ptr, norm_ptr, proj_ptr, out_ptr, addend_ptr, addend2_ptr, prefix_out_ptr, out_norm_ptr,
    K, M, D, stride_prefix, stride_bank_k, stride_bank_m, stride_out, eps, out_eps,
    BLOCK_D: tl.constexpr, HAS_ADDEND: tl.constexpr, HAS_ADDEND2: tl.constexpr, HAS_OUT_NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
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
    prefix = tl.load(prefix_ptr + row * stride_prefix + offs, mask=mask, other=0.0)
    if HAS_ADDEND:  # prefix + addend, rounded to the prefix's dtype and stored, is the last source
        addend = tl.load(addend_ptr + row * D + offs, mask=mask, other=0.0)
        if HAS_ADDEND2:  # addend + addend2 rounded first, as PyTorch's two adds
            addend = (addend.to(tl.float32) + tl.load(addend2_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
                      ).to(addend_ptr.dtype.element_ty)
        prefix = (prefix.to(tl.float32) + addend.to(tl.float32)).to(prefix_out_ptr.dtype.element_ty)
        tl.store(prefix_out_ptr + row * D + offs, prefix, mask=mask)
    m, denom, acc = _mix_values(prefix.to(tl.float32), query, D, eps, m, denom, acc)
    mixed = acc / denom
    if HAS_OUT_NORM:  # rms_norm of the mix as stored in the prefix's dtype (rms_norm's rounding)
        mixed = mixed.to(prefix_ptr.dtype.element_ty).to(tl.float32)
        normed = mixed * tl.rsqrt(tl.sum(mixed * mixed, 0) / D + out_eps)
        if ROUND_NORMED:
            normed = normed.to(prefix_ptr.dtype.element_ty).to(tl.float32)
        mixed = tl.load(out_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32) * normed
    tl.store(out_ptr + row * stride_out + offs, mixed.to(out_ptr.dtype.element_ty), mask=mask)


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
    _launch(prefix, bank, norm_weight, proj_weight, eps, out)
    return out


def _launch(prefix: torch.Tensor, bank: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
            eps: float, out: torch.Tensor, addend: torch.Tensor | None = None, prefix_out: torch.Tensor | None = None,
            out_norm_weight: torch.Tensor | None = None, out_norm_eps: float = 0.0,
            addend2: torch.Tensor | None = None) -> None:
    M, D = prefix.shape
    if M == 0:
        return
    BLOCK_D = next_pow2(D)
    _attn_res_kernel[(M,)](
        prefix, bank, norm_weight.contiguous(), proj_weight.reshape(-1).contiguous(), out,
        addend if addend is not None else prefix, addend2 if addend2 is not None else prefix,
        prefix_out if prefix_out is not None else out,
        out_norm_weight.contiguous() if out_norm_weight is not None else norm_weight,
        bank.shape[0], M, D, prefix.stride(0), bank.stride(0), bank.stride(1), out.stride(0), float(eps),
        float(out_norm_eps), BLOCK_D=BLOCK_D, HAS_ADDEND=addend is not None, HAS_ADDEND2=addend2 is not None, HAS_OUT_NORM=out_norm_weight is not None,
        ROUND_NORMED=prefix.dtype != torch.float32, num_warps=8 if BLOCK_D >= 4096 else 4,
    )


def attn_res_mix_norm(
    prefix: torch.Tensor, bank: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float,
    out_norm_weight: torch.Tensor, out_norm_eps: float, addend: torch.Tensor | None,
    prefix_out: torch.Tensor | None, addend2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.attn_res_mix_norm` for a non-empty bank (``prefix_out``
    only with ``addend``; contiguous rows)."""
    if prefix.stride(1) != 1:
        prefix = prefix.contiguous()
    if bank.stride(2) != 1:
        bank = bank.contiguous()
    out = torch.empty(prefix.shape, dtype=torch.promote_types(prefix.dtype, out_norm_weight.dtype),
                      device=prefix.device)
    if addend is not None:
        addend = addend if addend.is_contiguous() else addend.contiguous()
        addend2 = addend2 if addend2 is None or addend2.is_contiguous() else addend2.contiguous()
        if prefix_out is None:
            prefix_out = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
    _launch(prefix, bank, norm_weight, proj_weight, eps, out, addend, prefix_out, out_norm_weight, out_norm_eps,
            addend2)
    return out, prefix_out if addend is not None else prefix
