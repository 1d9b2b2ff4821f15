"""Loop-over-sources fp32 reference of attn_res_mix (not exported)."""

from __future__ import annotations

import torch


def naive_attn_res_mix(
    prefix: torch.Tensor, bank: torch.Tensor | None, norm_weight: torch.Tensor,
    proj_weight: torch.Tensor, eps: float,
) -> torch.Tensor:
    """prefix [M, D]; bank [K, M, D] or None -> [M, D] fp32."""
    sources = ([] if bank is None else [bank[i].float() for i in range(bank.shape[0])]) + [prefix.float()]
    logits = []
    for src in sources:
        keys = src / torch.sqrt((src * src).mean(-1, keepdim=True) + eps) * norm_weight.float()
        logits.append(keys @ proj_weight.float().flatten())
    weights = torch.softmax(torch.stack(logits), 0)
    out = torch.zeros_like(sources[0])
    for i, src in enumerate(sources):
        out += weights[i][:, None] * src
    return out
