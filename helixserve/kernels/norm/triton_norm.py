"""Triton RMS norms: one program per row, fp32 math, the rounding of the PyTorch references.

Same contracts as :func:`helixserve.kernels.rms_norm`, :func:`helixserve.kernels.gated_rms_norm` and
:func:`helixserve.kernels.add_rms_norm` (rows of ``x [..., D]`` with a unit last stride; the leading
dims are flattened as a view).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2


@triton.jit(do_not_specialize=["M", "stride_x", "stride_g", "stride_out"])  # rows follow the batch
def _rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, residual_ptr, sum_ptr, x2_ptr, M, D, stride_x, stride_g, stride_out, eps,
    HAS_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_X2: tl.constexpr, ROUND_NORMED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_X2:  # x + x2 rounded to x's dtype first, as PyTorch's two adds
        x = (x + tl.load(x2_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        x = x.to(tl.float32)
    if HAS_RESIDUAL:  # the sum is rounded to its dtype, stored, and normed as stored
        x += tl.load(residual_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + offs, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if ROUND_NORMED:  # HF: the normed row is cast to x's dtype before the weight multiplies it
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    out = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * normed
    if HAS_GATE:
        out = out * tl.sigmoid(tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    D = t.shape[-1]
    rows = t if t.dim() == 2 else t.reshape(-1, D)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out_dtype: torch.dtype, round_normed: bool, residual: torch.Tensor | None = None,
            summed: torch.Tensor | None = None, x2: torch.Tensor | None = None) -> torch.Tensor:
    D = x.shape[-1]
    rows = _rows(x)
    gate_rows = _rows(gate) if gate is not None else rows
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    M = rows.shape[0]
    if M == 0:
        return out
    BLOCK_D = next_pow2(D)
    _rms_norm_kernel[(M,)](
        rows, gate_rows, weight if weight.is_contiguous() else weight.contiguous(), out,
        residual if residual is not None else rows, summed if summed is not None else out,
        x2 if x2 is not None else rows, M, D, rows.stride(0), gate_rows.stride(0), D, float(eps),
        HAS_GATE=gate is not None, HAS_RESIDUAL=residual is not None, HAS_X2=x2 is not None,
        ROUND_NORMED=round_normed, BLOCK_D=BLOCK_D,
        num_warps=8 if BLOCK_D >= 4096 else 4,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`~helixserve.kernels.rms_norm`: ``weight * normed.to(x.dtype)`` in the promoted dtype."""
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    return _launch(x, None, weight, eps, out_dtype, round_normed=x.dtype != torch.float32)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`~helixserve.kernels.gated_rms_norm`: ``weight * norm(x) * sigmoid(gate)`` in fp32,
    stored in x.dtype."""
    return _launch(x, gate, weight, eps, x.dtype, round_normed=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 x2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.add_rms_norm`: ``h = residual + (x + x2)``, ``(rms_norm(h), h)``."""
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = residual if residual.is_contiguous() else residual.contiguous()
    x = x if x.is_contiguous() else x.contiguous()
    x2 = x2 if x2 is None or x2.is_contiguous() else x2.contiguous()
    normed = _launch(x, None, weight, eps, torch.promote_types(x.dtype, weight.dtype),
                     round_normed=x.dtype != torch.float32, residual=res, summed=summed, x2=x2)
    return normed, summed


@triton.jit(do_not_specialize=["stride_x"])
def _rms_norm_leading_kernel(x_ptr, w_ptr, out_ptr, D, W, stride_x, eps, ROUND_NORMED: tl.constexpr,
                             BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_W)
    raw = tl.load(x_ptr + row * stride_x + offs, mask=offs < W, other=0.0)
    x = tl.where(offs < D, raw.to(tl.float32), 0.0)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if ROUND_NORMED:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    normed = tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32) * normed
    tl.store(out_ptr + row * W + offs, tl.where(offs < D, normed.to(out_ptr.dtype.element_ty), raw), mask=offs < W)


def rms_norm_leading(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`~helixserve.kernels.rms_norm_leading` (x 2-D, weight of x's dtype)."""
    M, W = x.shape
    rows = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(M, W, dtype=x.dtype, device=x.device)
    if M:
        _rms_norm_leading_kernel[(M,)](
            rows, weight if weight.is_contiguous() else weight.contiguous(), out, weight.shape[0], W, rows.stride(0),
            float(eps), ROUND_NORMED=x.dtype != torch.float32, BLOCK_W=next_pow2(W), num_warps=4,
        )
    return out
