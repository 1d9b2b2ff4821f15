"""Attention residuals (Kimi K3): softmax mix over the block bank and the running prefix.

Shapes: prefix [M, D]; bank [K, M, D] (K >= 0) or None; norm_weight [D]; proj_weight [D] or [1, D]
-> out [M, D] in prefix.dtype. Sources V = [bank_0 .. bank_{K-1}, prefix]; all math in fp32:
    logit_i = sum_d (V_i * rsqrt(mean(V_i^2) + eps))[d] * norm_weight[d] * proj_weight[d]
    out     = sum_i softmax_i(logit)_i * V_i
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import check_ndim
from helixserve.kernels.triton_common import use_triton


def attn_res_mix(
    prefix: torch.Tensor,
    bank: torch.Tensor | None,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Mix the sources by a learned pseudo-query over RMS-normed keys (see module docstring)."""
    check_ndim("prefix", prefix, 2)
    M, D = prefix.shape
    if bank is not None:
        check_ndim("bank", bank, 3)
        if tuple(bank.shape[1:]) != (M, D):
            raise ValueError(f"bank must be [K, {M}, {D}], got {tuple(bank.shape)}")
    if norm_weight.numel() != D or norm_weight.dim() != 1:
        raise ValueError(f"norm_weight must be [{D}], got {tuple(norm_weight.shape)}")
    if proj_weight.numel() != D or proj_weight.dim() not in (1, 2):
        raise ValueError(f"proj_weight must be [{D}] or [1, {D}], got {tuple(proj_weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if use_triton(prefix) and bank is not None and bank.shape[0] > 0:
        from helixserve.kernels.attn_res import triton_attn_res

        return triton_attn_res.attn_res_mix(prefix, bank, norm_weight, proj_weight, eps)
    return _attn_res_mix_torch(prefix, bank, norm_weight, proj_weight, eps)


def _attn_res_mix_torch(
    prefix: torch.Tensor, bank: torch.Tensor | None, norm_weight: torch.Tensor,
    proj_weight: torch.Tensor, eps: float,
) -> torch.Tensor:
    if bank is None or bank.shape[0] == 0:
        return prefix.clone()
    sources = torch.cat([bank.float(), prefix.float()[None]])  # [K+1, M, D]
    query = norm_weight.float() * proj_weight.float().flatten()
    inv_rms = torch.rsqrt(sources.pow(2).mean(-1) + eps)  # [K+1, M]
    probs = ((sources @ query) * inv_rms).softmax(0)
    return (probs[..., None] * sources).sum(0).to(prefix.dtype)
