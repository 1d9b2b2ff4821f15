"""Exact merge of partial attention outputs by their log-sum-exp (helix all-to-all combine).

Shapes: o_parts [P, T, H, D]; lse_parts [P, T, H] float32 (-inf = part saw no key)
-> o [T, H, D] in o_parts.dtype, lse [T, H] float32.
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import check_ndim, check_shape
from helixserve.kernels.triton_common import use_triton


def lse_combine(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``O = sum_i O_i exp(lse_i - m) / sum_i exp(lse_i - m)``; rows with every part -inf give O=0, lse=-inf."""
    check_ndim("o_parts", o_parts, 4)
    check_shape("lse_parts", lse_parts, tuple(o_parts.shape[:3]))
    if o_parts.shape[0] == 0:
        raise ValueError(f"o_parts needs at least one part, got shape {tuple(o_parts.shape)}")
    if use_triton(o_parts):
        from helixserve.kernels.mla import triton_mla

        return triton_mla.lse_combine(o_parts, lse_parts)
    return _lse_combine_torch(o_parts, lse_parts)


def _lse_combine_torch(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse_parts = lse_parts.float()
    m = lse_parts.amax(0)
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    weights = (lse_parts - m_safe).exp()
    denom = weights.sum(0)
    # a part with weight 0 must not contribute even if its O is not finite
    weighted = torch.where(weights[..., None] > 0, o_parts.float() * weights[..., None], 0.0)
    has_any = denom > 0
    o = torch.where(has_any[..., None], weighted.sum(0) / denom.clamp_min(1e-30)[..., None], 0.0)
    lse = torch.where(has_any, m_safe + denom.clamp_min(1e-30).log(), float("-inf"))
    return o.to(o_parts.dtype), lse
