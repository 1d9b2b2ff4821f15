"""Kimi Delta Attention mixer (linear-attention layers).

Per token: q/k/v = SiLU(short causal conv(q/k/v_proj(x))); forget gate g from the low-rank f_a/f_b
projection (softplus, or K3's lower-bound sigmoid); beta = sigmoid(b_proj(x)); the delta-rule
recurrence with q/k L2-normalized inside the kernel; a gated RMSNorm per head (gate = g_b(g_a(x)),
or K3's full-rank g_proj(x)); o_proj.

Heads are indexed explicitly through ``num_heads`` (the heads this module holds), so a head-sharded
copy only needs smaller weights and caches.
"""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch, ModelCaches
from helixserve.models.mlp import linear
from helixserve.models.norm import RMSNorm


class KimiDeltaAttention(nn.Module):
    def __init__(
        self, cfg: KimiModelConfig, layer_idx: int, dtype: torch.dtype | None = None, num_heads: int | None = None
    ) -> None:
        """``num_heads``: heads held here (default all; a head-sharded rank passes its share)."""
        super().__init__()
        lin = cfg.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads = lin.num_heads if num_heads is None else num_heads
        self.head_dim = lin.head_dim
        self.lower_bound = lin.gate_lower_bound
        hidden, width, kernel = cfg.hidden_size, self.num_heads * lin.head_dim, lin.short_conv_kernel_size

        self.q_proj = linear(hidden, width, dtype)
        self.k_proj = linear(hidden, width, dtype)
        self.v_proj = linear(hidden, width, dtype)
        self.q_conv1d = _Conv(width, kernel, dtype)
        self.k_conv1d = _Conv(width, kernel, dtype)
        self.v_conv1d = _Conv(width, kernel, dtype)
        self.f_a_proj = linear(hidden, lin.head_dim, dtype)
        self.f_b_proj = linear(lin.head_dim, width, dtype)
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.b_proj = linear(hidden, self.num_heads, dtype)
        self.use_full_rank_gate = lin.use_full_rank_gate
        if lin.use_full_rank_gate:
            self.g_proj = linear(hidden, width, dtype)
        else:
            self.g_a_proj = linear(hidden, lin.head_dim, dtype)
            self.g_b_proj = linear(lin.head_dim, width, dtype)
        self.o_norm = RMSNorm(lin.head_dim, cfg.rms_norm_eps, dtype)
        self.o_proj = linear(width, hidden, dtype)

    def conv_weight(self) -> torch.Tensor:
        """``[3*H*K, W]``: the q, k, v depthwise kernels in the conv-state section order."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """``x``: ``[T, hidden]`` normed layer input -> ``[T, hidden]``."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = kernels.kda_gate(
            self.f_b_proj(self.f_a_proj(x)), self.A_log, self.dt_bias,
            num_heads=H, head_dim=K, lower_bound=self.lower_bound,
        )
        beta = torch.sigmoid(self.b_proj(x).float())
        conv_pool = caches.conv_state[self.layer_idx]
        state_pool = caches.kda_state[self.layer_idx]
        slots = batch.state_slots.to(torch.int64)

        if _is_pure_decode(batch):
            qkv = kernels.short_conv_step(qkv, self.conv_weight(), conv_pool, slots, activation="silu")
            q, k, v = (t.reshape(T, H, K) for t in qkv.split(H * K, dim=-1))
            o = kernels.kda_recurrent_step(
                q, k, v, g, beta, state_pool, slots, scale=K**-0.5, use_qk_l2norm=True
            )
        else:
            has_context = (batch.context_lens > 0).view(-1, 1, 1)
            conv_init = torch.where(has_context, conv_pool[slots], torch.zeros_like(conv_pool[slots]))
            qkv, conv_new = kernels.short_conv_prefill(
                qkv, self.conv_weight(), conv_state=conv_init, cu_seqlens=batch.cu_seqlens, activation="silu"
            )
            conv_pool[slots] = conv_new.to(conv_pool.dtype)
            q, k, v = (t.reshape(T, H, K) for t in qkv.split(H * K, dim=-1))
            state_init = state_pool[slots] * has_context.unsqueeze(-1)
            o, state_new = kernels.kda_chunk_prefill(
                q, k, v, g, beta, scale=K**-0.5, initial_state=state_init,
                cu_seqlens=batch.cu_seqlens, use_qk_l2norm=True,
            )
            state_pool[slots] = state_new.to(state_pool.dtype)

        if self.use_full_rank_gate:
            gate = self.g_proj(x)
        else:
            gate = self.g_b_proj(self.g_a_proj(x))
        o = kernels.gated_rms_norm(o, gate.view(T, H, K), self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(o.reshape(T, H * K).to(x.dtype))


class _Conv(nn.Module):
    """Holds one depthwise conv kernel ``[D, 1, W]`` under the checkpoint name ``*_conv1d.weight``."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=dtype))


def _is_pure_decode(batch: ForwardBatch) -> bool:
    """Every sequence adds one token on top of existing state: the recurrent-step path applies."""
    if batch.is_decode is not None:
        return batch.is_decode
    return bool(batch.num_seqs > 0 and (batch.seq_lens == 1).all() and (batch.context_lens > 0).all())
