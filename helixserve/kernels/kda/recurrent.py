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
    B, H, K = k.shape
    V = v.shape[-1]
    q, k = (l2norm_fp32(q), l2norm_fp32(k)) if use_qk_l2norm else (q.float(), k.float())
    S, write_back = _slot_states(state_pool, slot_ids)
    # S <- diag(exp g) S;  S <- S + (beta k) (v - S^T k)^T;  o = S^T (scale q), in place on S
    S.mul_(g.float().exp().unsqueeze(-1))
    S_flat = S.view(B * H, K, V)
    residual = v.float().reshape(B * H, 1, V) - torch.bmm(k.reshape(B * H, 1, K), S_flat)
    S_flat.baddbmm_((beta.float().unsqueeze(-1) * k).reshape(B * H, K, 1), residual)
    if write_back is not None:
        state_pool.index_copy_(0, write_back, S)
    return torch.bmm((q * scale).reshape(B * H, 1, K), S_flat).view(B, H, V).to(v.dtype)


def _slot_states(pool: torch.Tensor, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``pool[slot_ids]`` as a view when the slots are consecutive (update in place), else a copy plus
    the int64 ids to write it back to."""
    ids = slot_ids.tolist()
    first = ids[0] if ids else 0
    if ids == list(range(first, first + len(ids))):
        return pool[first:first + len(ids)], None
    index = slot_ids.to(pool.device, torch.int64)
    return pool.index_select(0, index), index
