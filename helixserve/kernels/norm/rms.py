"""RMS norms (HF Kimi/DeepSeek conventions).

rms_norm:       x [..., D], weight [D] -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
                (variance in fp32; result dtype = promote(weight, x) as in HF).
add_rms_norm:   x, residual [..., D] (same dtype), weight [D] -> (rms_norm(residual + x), residual + x):
                the pre-norm residual step, the sum rounded to x.dtype before the norm reads it; an
                optional x2 is added to x first (x + x2 rounded, as two PyTorch adds).
rms_norm_leading: x [M, W], weight [D] (D <= W, x's dtype) -> [M, W]: rms_norm of the first D
                columns, the others copied (MLA's latent rows: the normed latent, then the rope key).
gated_rms_norm: x [..., D], gate [..., D], weight [D] -> (weight * norm(x) * sigmoid(gate)) all fp32,
                cast to x.dtype (HF KimiLinearRMSNormGated; KDA output norm per head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helixserve.kernels._checks import as_f32, check_ndim, check_shape
from helixserve.kernels.triton_common import use_triton


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim, got shape {tuple(x.shape)}")
    check_shape("weight", weight, (x.shape[-1],))
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: fp32 variance, ``weight * x_normed.to(x.dtype)``."""
    _check_norm_args(x, weight, eps)
    if use_triton(x):  # one kernel in place of the casts, the norm and the weight product
        from helixserve.kernels.norm import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return _rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, x2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + (x + x2)`` (``x2`` optional); ``(rms_norm(h), h)`` (one kernel on the device)."""
    _check_norm_args(x, weight, eps)
    for name, t in (("residual", residual), ("x2", x2)):
        if t is not None:
            check_shape(name, t, tuple(x.shape))
            if t.dtype != x.dtype:
                raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if use_triton(x):
        from helixserve.kernels.norm import triton_norm

        return triton_norm.add_rms_norm(x, residual, weight, eps, x2)
    summed = residual + (x if x2 is None else x + x2)
    return _rms_norm_torch(summed, weight, eps), summed


def rms_norm_leading(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``cat([rms_norm(x[:, :D], weight, eps), x[:, D:]], -1)`` for ``weight [D]`` (one kernel on the device)."""
    check_ndim("x", x, 2)
    D = weight.shape[0] if weight.dim() == 1 else -1
    if not 0 < D <= x.shape[1]:
        raise ValueError(f"weight must be [D] with 0 < D <= {x.shape[1]}, got {tuple(weight.shape)}")
    if use_triton(x) and weight.dtype == x.dtype:
        from helixserve.kernels.norm import triton_norm

        return triton_norm.rms_norm_leading(x, weight, eps)
    head, tail = x.split_with_sizes([D, x.shape[1] - D], dim=-1)
    return torch.cat([rms_norm(head, weight, eps), tail], dim=-1)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm over the last dim: ``weight * norm(x) * sigmoid(gate)`` in fp32, cast to x.dtype."""
    _check_norm_args(x, weight, eps)
    check_shape("gate", gate, tuple(x.shape))
    if use_triton(x):
        from helixserve.kernels.norm import triton_norm

        return triton_norm.gated_rms_norm(x, gate, weight, eps)
    return _gated_rms_norm_torch(x, gate, weight, eps)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps), one call instead of five
    if x.dtype == weight.dtype == torch.float32:  # weight applied inside: same product, one op fewer
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)  # F.rms_norm's op without its Python wrapper
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        normed = torch.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        normed = weight.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    out = normed * torch.sigmoid(as_f32(gate))
    return out if out.dtype == x.dtype else out.to(x.dtype)
