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
from helixserve.cache_layout import ModelCaches
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.kda_checkpoints import segmented_prefill
from helixserve.models.kda_spec import KdaRecord, replay, verify_rows
from helixserve.models.mlp import linear
from helixserve.models.norm import RMSNorm
from helixserve.models.packing import column_major, fuse_weights, pack_linears, packed_linear


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
        # set by pack(): [q | k | v | f_a | g_a or g | b] rows of one weight, the fused conv kernels and
        # (low-rank gate) f_b | g_b as one [2, K, H*K] stack of their transposed weights
        self.register_buffer("in_proj", None, persistent=False)
        self.register_buffer("in_proj_cols", None, persistent=False)
        self.register_buffer("packed_conv_weight", None, persistent=False)
        self.register_buffer("f_g_b_stack", None, persistent=False)
        self.in_proj_sizes: list[int] = []

    @property
    def _input_projections(self) -> list[nn.Linear]:
        gate = self.g_proj if self.use_full_rank_gate else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate]

    def pack(self, host_forms: bool = True) -> None:
        """Fuse the projections of ``x`` into ``in_proj`` and the conv kernels into one weight
        (see :mod:`helixserve.models.packing`); with the low-rank output gate, ``f_a`` and ``g_a`` are
        adjacent in ``in_proj`` and ``f_b_proj``/``g_b_proj`` run as one bmm on a few rows (two GEMMs
        of a [T, K] input cost ~2.5x one bmm over both at 8 rows; one row keeps the two linears)."""
        q, k, v, f_a, b, gate = self._input_projections
        projections = [q, k, v, f_a, gate, b]
        self.in_proj_sizes = [3 * q.out_features, f_a.out_features, gate.out_features, b.out_features]
        self.in_proj = fuse_weights([(p, "weight") for p in projections])
        self.in_proj_cols = column_major(self.in_proj) if host_forms else None
        convs = [self.q_conv1d, self.k_conv1d, self.v_conv1d]
        for conv in convs:  # fused as [rows, W]; the views keep the checkpoint's [rows, 1, W] shape
            conv.weight = nn.Parameter(conv.weight.detach().squeeze(1), requires_grad=False)
        # CPU: column-major, the decode step reads it as [W, rows] rows; device: the Triton step's rows
        self.packed_conv_weight = fuse_weights([(c, "weight") for c in convs], is_column_major=host_forms)
        for conv in convs:
            conv.weight = nn.Parameter(conv.weight.unsqueeze(1), requires_grad=False)
        if not host_forms:
            return
        pack_linears(self, "f_b_proj", "o_proj", *([] if self.use_full_rank_gate else ["g_b_proj"]))
        if not self.use_full_rank_gate:  # the linears' column-major copies become views of the stack
            self.f_g_b_stack = torch.stack([self.f_b_proj.weight_cols.t(), self.g_b_proj.weight_cols.t()])
            self.f_b_proj.weight_cols, self.g_b_proj.weight_cols = (w.t() for w in self.f_g_b_stack)

    def conv_weight(self) -> torch.Tensor:
        """``[3*H*K, W]``: the q, k, v depthwise kernels in the conv-state section order."""
        if self.packed_conv_weight is not None:
            return self.packed_conv_weight
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qkv [T, 3HK], f_b output [T, HK], b_proj output [T, H], output gate [T, HK])``."""
        if self.in_proj is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            f_a, b, g = self.f_a_proj(x), self.b_proj(x), self._input_projections[-1](x)
        else:
            qkv, f_a, g, b = packed_linear(x, self.in_proj, self.in_proj_cols).split_with_sizes(self.in_proj_sizes, dim=-1)
            if self.f_g_b_stack is not None and x.shape[0] > 1:  # f_a | g_a adjacent: [2, T, K] view
                f, gate = torch.bmm(f_a.as_strided((2, x.shape[0], f_a.shape[1]), (f_a.shape[1], f_a.stride(0), 1)),
                                    self.f_g_b_stack).unbind(0)
                return qkv, f, b, gate
        return qkv, self.f_b_proj(f_a), b, g if self.use_full_rank_gate else self.g_b_proj(g)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """``x``: ``[T, hidden]`` normed layer input -> ``[T, hidden]``."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        qkv, f, b, gate = self._project(x)
        g, beta = kernels.kda_gate_beta(f, b, self.A_log, self.dt_bias, num_heads=H, head_dim=K,
                                        lower_bound=self.lower_bound)
        conv_pool = caches.conv_state[self.layer_idx]
        state_pool = caches.kda_state[self.layer_idx]
        slots = batch.state_slots
        slots = slots if slots.dtype == torch.int64 else slots.to(torch.int64)

        if _is_pure_decode(batch):
            qkv = kernels.short_conv_step(qkv, self.conv_weight(), conv_pool, slots, activation="silu")
            q, k, v = qkv.reshape(T, 3, H, K).unbind(1)
            o = kernels.kda_recurrent_step(
                q, k, v, g, beta, state_pool, slots, scale=K**-0.5, use_qk_l2norm=True
            )
        elif batch.kda_record is not None and batch.kda_record.steps is not None:  # decodes and verify rows
            o = verify_rows(self, qkv, g, beta, conv_pool, state_pool, batch.kda_record).view(T, H, K)
        else:
            has_context = (batch.context_lens > 0).view(-1, 1, 1)
            conv_init = torch.where(has_context, conv_pool[slots], torch.zeros_like(conv_pool[slots]))
            state_init = state_pool[slots] * has_context.unsqueeze(-1)
            if batch.kda_record is not None:  # a verify step: keep what a rollback replays
                batch.kda_record.save(self.layer_idx, qkv, g, beta, conv_init, state_init)
            if batch.state_saves is not None:  # prefix caching: checkpoints inside the chunks
                o, conv_new, state_new = segmented_prefill(self, batch.state_saves, qkv, g, beta, conv_init, state_init)
            else:
                qkv, conv_new = kernels.short_conv_prefill(
                    qkv, self.conv_weight(), conv_state=conv_init, cu_seqlens=batch.cu_seqlens, activation="silu"
                )
                q, k, v = (t.reshape(T, H, K) for t in qkv.split(H * K, dim=-1))
                o, state_new = kernels.kda_chunk_prefill(
                    q, k, v, g, beta, scale=K**-0.5, initial_state=state_init,
                    cu_seqlens=batch.cu_seqlens, use_qk_l2norm=True,
                )
            conv_pool[slots] = conv_new.to(conv_pool.dtype)
            state_pool[slots] = state_new.to(state_pool.dtype)

        o = kernels.gated_rms_norm(o, gate.view(T, H, K), self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(o.reshape(T, H * K).to(x.dtype))


    def rollback(self, caches: ModelCaches, record: KdaRecord, keep: dict[int, int]) -> None:
        """Roll the speculating slots ``keep`` names back to their kept rows (see :mod:`.kda_spec`)."""
        replay(self, record.layers[self.layer_idx], caches.conv_state[self.layer_idx],
               caches.kda_state[self.layer_idx], record, keep)


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
