"""KDA forget gate: raw ``f_b_proj`` output -> per-channel log-decay.

Shapes: f [T, H*K]; A_log any shape with >= H elements (first H used); dt_bias [H*K];
returns g [T, H, K] float32, g <= 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helixserve.kernels._checks import as_f32, check_ndim
from helixserve.kernels.triton_common import use_triton


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
    _check_gate_args(f, A_log, dt_bias, num_heads, head_dim, lower_bound)
    return _kda_gate_torch(f, A_log, dt_bias, num_heads, head_dim, lower_bound)


def kda_gate_beta(
    f: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    num_heads: int,
    head_dim: int,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's gates: ``(kda_gate(f, ...) [T, H, K], sigmoid(b) [T, H])``, both float32 (one
    Triton kernel on the device).

    Args:
        b: [T, H] raw ``b_proj`` output (any float dtype).
    """
    _check_gate_args(f, A_log, dt_bias, num_heads, head_dim, lower_bound)
    if b.dim() != 2 or tuple(b.shape) != (f.shape[0], num_heads):
        raise ValueError(f"b must be [{f.shape[0]}, {num_heads}], got {tuple(b.shape)}")
    if use_triton(f):
        from helixserve.kernels.kda import triton_gate

        return triton_gate.kda_gate_beta(f, b, A_log, dt_bias, num_heads, head_dim, lower_bound)
    return _kda_gate_torch(f, A_log, dt_bias, num_heads, head_dim, lower_bound), torch.sigmoid(as_f32(b))


def _check_gate_args(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int, head_dim: int,
    lower_bound: float | None,
) -> None:
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


def _kda_gate_torch(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    head_dim: int,
    lower_bound: float | None,
) -> torch.Tensor:
    x = as_f32(f).view(-1, num_heads, head_dim) + as_f32(dt_bias).view(num_heads, head_dim)
    a_log = A_log if A_log.shape == (num_heads,) else A_log.flatten()[:num_heads]
    decay_rate = as_f32(a_log).exp().view(num_heads, 1)
    if lower_bound is None:  # -(rate * softplus): the same bits as (-rate) * softplus
        return F.softplus(x).mul_(decay_rate).neg_()
    return torch.sigmoid(x.mul_(decay_rate)).mul_(lower_bound)
