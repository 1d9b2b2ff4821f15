"""RMSNorm holding its weight; the math is ``helixserve.kernels.rms_norm``."""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x`` (``x`` a pair: ``x[0] + x[1]`` first); ``(norm(h), h)`` (the residual
        adds and the norm in one kernel on a GPU)."""
        x, x2 = x if isinstance(x, tuple) else (x, None)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, x2)
