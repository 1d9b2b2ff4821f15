"""Row-loop fp32 references of the norms (not exported)."""

from __future__ import annotations

import math

import torch


def naive_rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., D] -> fp32 ``weight * x / sqrt(mean(x^2) + eps)`` row by row."""
    rows = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        out[r] = weight.float() * rows[r] / math.sqrt(float((rows[r] ** 2).mean()) + eps)
    return out.view(x.shape)
