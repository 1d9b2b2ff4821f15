"""Triton MoE routing: sigmoid scores, bias-corrected top-k, renormalize, scale; one program per token.

Same contract as :func:`helixserve.kernels.moe_route` (ids in descending order of the biased score).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_logits, scaling,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    scores = tl.sigmoid(tl.load(logits_ptr + row * stride_logits + offs, mask=mask, other=0.0).to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    choice = tl.where(mask, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 0)
        # lowest index among ties, like a stable sort
        idx = tl.min(tl.where(choice == best, offs, BLOCK_E), 0)
        picked = offs == idx
        w = tl.sum(tl.where(picked, scores, 0.0), 0)
        ids = tl.where(offs_k == j, idx.to(tl.int64), ids)
        weights = tl.where(offs_k == j, w, weights)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + row * TOP_K + offs_k, weights * scaling, mask=mask_k)
    tl.store(ids_ptr + row * TOP_K + offs_k, ids, mask=mask_k)


def moe_route(
    router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None, renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.moe_route`."""
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    BLOCK_E = next_pow2(E)
    _route_kernel[(T,)](
        logits, bias, weights, ids, E, logits.stride(0), float(routed_scaling_factor),
        TOP_K=top_k, BLOCK_E=BLOCK_E, BLOCK_K=next_pow2(top_k),
        HAS_BIAS=correction_bias is not None, RENORMALIZE=bool(renormalize),
        num_warps=4 if BLOCK_E <= 1024 else 8,
    )
    return weights, ids
