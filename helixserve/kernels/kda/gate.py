"""KDA forget gate: raw ``f_b_proj`` output -> per-channel log-decay.

Shapes: f [T, H*K]; A_log any shape with >= H elements (first H used); dt_bias [H*K];
returns g [T, H, K] float32, g <= 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helixserve.kernels._checks import check_ndim


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    num_heads: int,
    head_dim: int,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Per-channel log-decay of KDA.

    Kimi Linear (``lower_bound=None``): ``g = -exp(A_log[h]) * softplus(f + dt_bias)``.
    Kimi K3 (``lower_bound < 0``): ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``.

    Args:
        f: [T, H*K] raw ``f_b_proj`` output (any float dtype).
        A_log: tensor with at least H elements; the first H are used (K3 pads to 128).
        dt_bias: [H*K].
    Returns:
        g: [T, H, K] float32.
    """
    if num_heads <= 0 or head_dim <= 0:
        raise ValueError(f"num_heads and head_dim must be positive, got {num_heads}, {head_dim}")
    check_ndim("f", f, 2)
    width = num_heads * head_dim
    if f.shape[1] != width:
        raise ValueError(f"f must be [T, {width}] (num_heads*head_dim), got {tuple(f.shape)}")
    if A_log.numel() < num_heads:
        raise ValueError(f"A_log must hold >= {num_heads} elements, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != width:
        raise ValueError(f"dt_bias must hold {width} elements, got shape {tuple(dt_bias.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative or None, got {lower_bound}")
    return _kda_gate_torch(f, A_log, dt_bias, num_heads, head_dim, lower_bound)


def _kda_gate_torch(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    head_dim: int,
    lower_bound: float | None,
) -> torch.Tensor:
    x = f.float().view(-1, num_heads, head_dim) + dt_bias.float().view(num_heads, head_dim)
    decay_rate = A_log.float().flatten()[:num_heads].exp().view(num_heads, 1)
    if lower_bound is None:
        return -decay_rate * F.softplus(x)
    return lower_bound * torch.sigmoid(decay_rate * x)
