"""Per-(token, k) loop fp32 references of routing and the expert sum (not exported)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, expert_offset: int = 0, activation: str = "silu",
    situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """x [T, D] -> y [T, D] fp32, one (token, k) pair at a time."""
    T, D = x.shape
    I = w13.shape[1] // 2
    y = torch.zeros(T, D)
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - expert_offset
            if not 0 <= e < w13.shape[0]:
                continue
            gate = w13[e, :I].float() @ x[t].float()
            up = w13[e, I:].float() @ x[t].float()
            if activation == "silu":
                act = F.silu(gate) * up
            else:
                act = situ_beta * torch.tanh(gate / situ_beta) * torch.sigmoid(gate) \
                    * situ_linear_beta * torch.tanh(up / situ_linear_beta)
            y[t] += float(topk_weights[t, j]) * (w2[e].float() @ act)
    return y


def naive_moe_route(
    router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None,
    renormalize: bool, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token greedy selection; returns (weights [T, k] fp32, ids [T, k] int64) in selection order."""
    T, E = router_logits.shape
    weights = torch.zeros(T, top_k)
    ids = torch.zeros(T, top_k, dtype=torch.int64)
    for t in range(T):
        scores = torch.sigmoid(router_logits[t].float())
        choice = (scores + (0 if correction_bias is None else correction_bias.float())).tolist()
        remaining = list(range(E))
        for j in range(top_k):
            best = max(remaining, key=lambda e: choice[e])
            remaining.remove(best)
            ids[t, j] = best
            weights[t, j] = scores[best]
        if renormalize:
            weights[t] = weights[t] / (weights[t].sum() + 1e-20)
    return weights * routed_scaling_factor, ids
