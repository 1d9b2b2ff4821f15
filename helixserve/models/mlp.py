"""Gated MLP (dense FFN and shared experts): ``down(act(gate(x)) * up(x))``, SiLU or SiTU."""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels
from helixserve.models.config import KimiModelConfig
from helixserve.models.packing import column_major, fuse_weights, pack_linears, packed_linear


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
        self.register_buffer("gate_up", None, persistent=False)  # set by pack(): [gate | up] rows
        self.register_buffer("gate_up_cols", None, persistent=False)

    def pack(self, host_forms: bool = True) -> None:
        """Fuse ``gate_proj`` and ``up_proj`` into ``gate_up``; ``host_forms``: also the CPU's
        column-major copies (see :mod:`helixserve.models.packing`)."""
        self.gate_up = fuse_weights([(self.gate_proj, "weight"), (self.up_proj, "weight")])
        if host_forms:
            self.gate_up_cols = column_major(self.gate_up)
            pack_linears(self, "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down(self.gate_proj(x), self.up_proj(x))
        return self.down(*packed_linear(x, self.gate_up, self.gate_up_cols).chunk(2, dim=-1))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``down_proj(act(gate) * up)`` from the gate and up projections ``[T, I]``."""
        h = kernels.act_and_mul(
            gate, up, activation=self.activation, situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
        )
        return self.down_proj(h)
