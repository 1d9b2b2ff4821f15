"""KDA decode step: one token per sequence against a pooled recurrent state.

Shapes: q, k [B, H, K]; v [B, H, V]; g [B, H, K] float32 log-decay; beta [B, H];
state_pool [S, H, K, V] float32 (updated in place at slot_ids [B] int64); returns o [B, H, V] in v.dtype.
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import as_f32, check_dtype, check_ndim, check_slot_ids
from helixserve.kernels._slots import slot_rows
from helixserve.kernels.kda import gpu as kda_gpu
from helixserve.kernels.kda.chunk import check_kda_shapes
from helixserve.kernels.triton_common import gpu_check_slot_ids, use_fla

_L2NORM_EPS = 1e-6


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
    if use_fla(q) and state_pool.is_contiguous():  # fla fused recurrent, in place at the slots
        gpu_check_slot_ids("slot_ids", slot_ids, B, state_pool.shape[0])
        return kda_gpu.recurrent_step(q, k, v, g, beta, state_pool, slot_ids, scale, use_qk_l2norm)
    return _recurrent_step_torch(q, k, v, g, beta, state_pool, slot_ids, scale, use_qk_l2norm)


def _recurrent_step_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slot_ids: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    check_slot_ids("slot_ids", slot_ids, q.shape[0], state_pool.shape[0])
    B, H, K = k.shape
    V = v.shape[-1]
    if use_qk_l2norm:
        q, k = _l2norm_qk(q, k, scale)
    else:
        q, k = q.float() * scale, as_f32(k)
    S, write_back = slot_rows(state_pool, slot_ids)
    # S <- diag(exp g) S;  r = beta (v - S^T k);  S <- S + k r^T;  o = S^T (scale q), in place on S
    S.mul_(as_f32(g).exp().unsqueeze(-1))
    S_flat = S.view(B * H, K, V)
    k_rows = k.reshape(B * H, 1, K)
    residual = (as_f32(v) - torch.bmm(k_rows, S_flat).view(B, H, V)).mul_(as_f32(beta).unsqueeze(-1))
    S_flat.addcmul_(k_rows.transpose(1, 2), residual.view(B * H, 1, V))  # outer products, one pass
    if write_back is not None:
        state_pool.index_copy_(0, write_back, S)
    o = torch.bmm(q.reshape(B * H, 1, K), S_flat).view(B, H, V)
    return o if o.dtype == v.dtype else o.to(v.dtype)


def _l2norm_qk(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale * l2norm(q), l2norm(k))`` in fp32; one pass over both when k directly follows q in
    memory (the q | k | v sections of one projection), with the same per-row arithmetic."""
    B, H, K = q.shape
    is_adjacent = (  # data_ptr includes the storage offset: no storage objects to build
        k.shape == q.shape and k.stride() == q.stride() and q.stride(2) == 1 and q.stride(1) == K
        and k.dtype == q.dtype and k.data_ptr() == q.data_ptr() + H * K * q.element_size()
    )
    if not is_adjacent:
        return _l2norm_scaled(q, scale), _l2norm_scaled(k, 1.0)
    x = as_f32(q.as_strided((B, 2, H, K), (q.stride(0), H * K, K, 1)))
    factor = (x * x).sum(-1, keepdim=True).add_(_L2NORM_EPS).rsqrt_()
    if scale != 1.0:
        factor[:, 0].mul_(scale)
    # written as [2, B, H, K] so that q and k each come out contiguous (row views, no copies later)
    out = torch.empty(2, B, H, K, dtype=x.dtype, device=x.device)
    torch.mul(x.transpose(0, 1), factor.transpose(0, 1), out=out)
    return out[0], out[1]


def _l2norm_scaled(x: torch.Tensor, scale: float, eps: float = _L2NORM_EPS) -> torch.Tensor:
    """``scale * l2norm_fp32(x)`` with the scale folded into the per-row factor."""
    x = as_f32(x)
    factor = (x * x).sum(-1, keepdim=True).add_(eps).rsqrt_()
    return x * (factor if scale == 1.0 else factor.mul_(scale))
