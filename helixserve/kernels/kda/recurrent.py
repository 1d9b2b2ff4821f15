"""KDA decode step: one token per sequence against a pooled recurrent state.

Shapes: q, k [B, H, K]; v [B, H, V]; g [B, H, K] float32 log-decay; beta [B, H];
state_pool [S, H, K, V] float32 (updated in place at slot_ids [B] int64); returns o [B, H, V] in v.dtype.
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import check_dtype, check_ndim, check_slot_ids
from helixserve.kernels.kda.chunk import check_kda_shapes
from helixserve.kernels.kda.naive import l2norm_fp32


def kda_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """``S <- diag(exp g) S; S <- S + beta k (v - S^T k)^T; o = S^T q`` for each sequence's slot."""
    B, H, K, V = check_kda_shapes(q, k, v, g, beta)
    check_ndim("state_pool", state_pool, 4)
    if tuple(state_pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool must be [S, {H}, {K}, {V}], got {tuple(state_pool.shape)}")
    check_dtype("state_pool", state_pool, torch.float32)
    scale = K ** -0.5 if scale is None else float(scale)
    return _recurrent_step_torch(q, k, v, g, beta, state_pool, slot_ids, scale, use_qk_l2norm)


def _recurrent_step_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slot_ids: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    check_slot_ids("slot_ids", slot_ids, q.shape[0], state_pool.shape[0])
    q, k = (l2norm_fp32(q), l2norm_fp32(k)) if use_qk_l2norm else (q.float(), k.float())
    slot_ids = slot_ids.to(torch.int64)
    S = state_pool[slot_ids] * g.float().exp()[..., None]
    residual = v.float() - torch.einsum("bhk,bhkv->bhv", k, S)
    S = S + (beta.float()[..., None] * k)[..., None] * residual[..., None, :]
    state_pool.index_copy_(0, slot_ids, S)
    return torch.einsum("bhk,bhkv->bhv", q * scale, S).to(v.dtype)
