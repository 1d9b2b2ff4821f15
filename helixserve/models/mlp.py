"""Gated MLP (dense FFN and shared experts): ``down(act(gate(x)) * up(x))``, SiLU or SiTU."""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels
from helixserve.models.config import KimiModelConfig


def linear(in_features: int, out_features: int, dtype: torch.dtype | None) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


class GatedMLP(nn.Module):
    def __init__(self, cfg: KimiModelConfig, intermediate_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_proj = linear(cfg.hidden_size, intermediate_size, dtype)
        self.up_proj = linear(cfg.hidden_size, intermediate_size, dtype)
        self.down_proj = linear(intermediate_size, cfg.hidden_size, dtype)
        self.activation = cfg.hidden_act
        self.situ_beta = cfg.activation_situ_beta
        self.situ_linear_beta = cfg.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = kernels.act_and_mul(
            self.gate_proj(x), self.up_proj(x), activation=self.activation,
            situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
        )
        return self.down_proj(h)
