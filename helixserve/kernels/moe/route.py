"""MoE routing (DeepSeek-V3 / Kimi: sigmoid scores, bias-corrected top-k selection).

router_logits [T, E] float32 -> (topk_weights [T, k] float32, topk_ids [T, k] int64).
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import as_f32, check_ndim, check_shape
from helixserve.kernels.triton_common import use_triton


def moe_route(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = sigmoid(logits)``; pick top_k of ``s + bias`` (bias: selection only); weights = s gathered,
    optionally ``/ (sum + 1e-20)``, then ``* routed_scaling_factor``."""
    check_ndim("router_logits", router_logits, 2)
    E = router_logits.shape[1]
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must lie in [1, {E}] (num experts), got {top_k}")
    if correction_bias is not None:
        check_shape("correction_bias", correction_bias, (E,))
    if use_triton(router_logits):
        from helixserve.kernels.moe import triton_route

        return triton_route.moe_route(router_logits, top_k, correction_bias, renormalize, routed_scaling_factor)
    return _moe_route_torch(router_logits, top_k, correction_bias, renormalize, routed_scaling_factor)


def _moe_route_torch(
    router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None,
    renormalize: bool, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = as_f32(router_logits).sigmoid()
    choice = scores if correction_bias is None else scores + as_f32(correction_bias)
    topk_ids = torch.topk(choice, top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True).add_(1e-20)
    return topk_weights.mul_(routed_scaling_factor), topk_ids  # topk indices are int64
