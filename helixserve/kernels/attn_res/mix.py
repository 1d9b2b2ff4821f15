"""Attention residuals (Kimi K3): softmax mix over the block bank and the running prefix.

Shapes: prefix [M, D]; bank [K, M, D] (K >= 0) or None; norm_weight [D]; proj_weight [D] or [1, D]
-> out [M, D] in prefix.dtype. Sources V = [bank_0 .. bank_{K-1}, prefix]; all math in fp32:
    logit_i = sum_d (V_i * rsqrt(mean(V_i^2) + eps))[d] * norm_weight[d] * proj_weight[d]
    out     = sum_i softmax_i(logit)_i * V_i
attn_res_mix_norm: the residual step around a selection site, (rms_norm(mix(prefix + addend, bank)),
    prefix + addend), in one kernel on the device (the prefix stored in ``prefix_out`` when given;
    an optional addend2 added to addend first).
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import check_ndim, check_shape
from helixserve.kernels.norm.rms import add_rms_norm, rms_norm
from helixserve.kernels.triton_common import use_triton


def attn_res_mix(
    prefix: torch.Tensor,
    bank: torch.Tensor | None,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Mix the sources by a learned pseudo-query over RMS-normed keys (see module docstring)."""
    _check_mix_args(prefix, bank, norm_weight, proj_weight, eps)
    if use_triton(prefix) and bank is not None and bank.shape[0] > 0:
        from helixserve.kernels.attn_res import triton_attn_res

        return triton_attn_res.attn_res_mix(prefix, bank, norm_weight, proj_weight, eps)
    return _attn_res_mix_torch(prefix, bank, norm_weight, proj_weight, eps)


def _check_mix_args(
    prefix: torch.Tensor, bank: torch.Tensor | None, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float,
) -> None:
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


def attn_res_mix_norm(
    prefix: torch.Tensor,
    bank: torch.Tensor | None,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    out_norm_weight: torch.Tensor,
    out_norm_eps: float,
    *,
    addend: torch.Tensor | None = None,
    prefix_out: torch.Tensor | None = None,
    addend2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p = prefix + addend`` (``prefix`` without an addend), stored in ``prefix_out [M, D]`` when
    given; returns ``(rms_norm(mix(p, bank), out_norm_weight, out_norm_eps), p)``, the mix being
    ``p`` itself for an empty bank. The prefix sum is rounded to prefix.dtype as ``prefix + addend``."""
    if addend2 is not None and addend is None:
        raise ValueError("addend2 needs addend")
    if addend is not None:
        check_shape("addend", addend, tuple(prefix.shape))
    if addend2 is not None:
        check_shape("addend2", addend2, tuple(prefix.shape))
    if prefix_out is not None:
        check_shape("prefix_out", prefix_out, tuple(prefix.shape))
    has_bank = bank is not None and bank.shape[0] > 0
    if use_triton(prefix) and has_bank and (prefix_out is None or addend is not None and prefix_out.is_contiguous()):
        from helixserve.kernels.attn_res import triton_attn_res

        _check_mix_args(prefix, bank, norm_weight, proj_weight, eps)
        return triton_attn_res.attn_res_mix_norm(prefix, bank, norm_weight, proj_weight, eps, out_norm_weight,
                                                 out_norm_eps, addend, prefix_out, addend2)
    if use_triton(prefix) and not has_bank and addend is not None and prefix_out is None:
        return add_rms_norm(addend, prefix, out_norm_weight, out_norm_eps, addend2)
    if addend2 is not None:
        addend = addend + addend2
    if addend is not None:
        prefix = prefix + addend
    if prefix_out is not None:  # a copy, as an indexed assignment would (autograd follows it)
        prefix_out.copy_(prefix)
    mixed = attn_res_mix(prefix, bank, norm_weight, proj_weight, eps) if has_bank else prefix
    return rms_norm(mixed, out_norm_weight, out_norm_eps), prefix


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
