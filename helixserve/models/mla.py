"""Multi-head latent attention (full-attention layers), absorbed form over the paged latent cache.

Per token the cache holds ``[c (kv_lora_rank) | k_shared (qk_rope_head_dim)]``: ``c`` is the
normed latent, ``k_shared`` the single-head key part that Kimi leaves unrotated (NoPE). Queries
are absorbed into latent space: ``q_lat[h] = q_nope[h] @ W_UK[h]`` (``W_UK`` = the K rows of head
h in ``kv_b_proj``), concatenated with ``q_rope``; attention over the latents then gives
``o_lat [T, H, kv_lora_rank]`` which each head maps out through its V rows ``W_UV[h]``. The score
scale stays ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.

The three steps (:meth:`absorbed_query`, :meth:`attend`, :meth:`output`) are separate so a helix
rank can combine partial ``(o_lat, lse)`` across ranks before :meth:`output`.
"""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels
from helixserve.cache_layout import ModelCaches
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.mlp import linear
from helixserve.models.norm import RMSNorm
from helixserve.models.packing import column_major, fuse_weights, pack_linears, packed_linear

# q_a_layernorm / kv_a_layernorm use the DeepSeek/Kimi module default eps, not rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(nn.Module):
    def __init__(self, cfg: KimiModelConfig, layer_idx: int, dtype: torch.dtype | None = None,
                 num_heads: int | None = None) -> None:
        """``num_heads``: heads held here (default all; a heads-TP draft rank passes its share:
        its heads' query rows, ``kv_b_proj`` rows, gate rows and o_proj columns)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads if num_heads is None else num_heads
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        hidden, H = cfg.hidden_size, self.num_heads

        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = linear(hidden, H * cfg.qk_head_dim, dtype)
        else:
            self.q_a_proj = linear(hidden, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, H * cfg.qk_head_dim, dtype)
        self.kv_a_proj_with_mqa = linear(hidden, cfg.mla_latent_dim, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, MLA_LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype)
        self.use_output_gate = cfg.mla_use_output_gate
        if cfg.mla_use_output_gate:
            self.g_proj = linear(hidden, H * cfg.v_head_dim, dtype)
        self.o_proj = linear(H * cfg.v_head_dim, hidden, dtype)
        self.register_buffer("in_proj", None, persistent=False)  # set by pack(): [q or q_a | kv_a | g]
        self.register_buffer("in_proj_cols", None, persistent=False)
        self.in_proj_sizes: list[int] = []

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, nope, r]`` and ``W_UV [H, v, r]`` (checkpoint rows are ``[K | V]`` per head)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    @property
    def _input_projections(self) -> list[nn.Linear]:
        q = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return [q, self.kv_a_proj_with_mqa, *([self.g_proj] if self.use_output_gate else [])]

    def pack(self, host_forms: bool = True) -> None:
        """Fuse the projections of ``x`` (q or q_a, kv_a, output gate) into ``in_proj`` (see
        :mod:`helixserve.models.packing`); ``kv_b_proj`` is read as per-head views and stays as is."""
        projections = self._input_projections
        self.in_proj_sizes = [p.out_features for p in projections]
        self.in_proj = fuse_weights([(p, "weight") for p in projections])
        if host_forms:
            self.in_proj_cols = column_major(self.in_proj)
            pack_linears(self, "o_proj", *([] if self.q_lora_rank is None else ["q_b_proj"]))

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, kv_lora_rank + rope]`` cache rows of the new tokens."""
        return self._latent_rows(self.kv_a_proj_with_mqa(x))

    def _latent_rows(self, ckv: torch.Tensor) -> torch.Tensor:
        """``[kv_a_layernorm(c) | k_shared]`` of ``ckv = [c | k_shared]``."""
        return kernels.rms_norm_leading(ckv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)

    def absorbed_query(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H, kv_lora_rank + rope]``."""
        return self._absorb(self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x))

    def _absorb(self, q: torch.Tensor) -> torch.Tensor:
        """``q_proj`` (or ``q_a_proj``) output ``[T, *]`` -> absorbed queries ``[T, H, r + rope]``."""
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(q.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split_with_sizes([self.nope_dim, self.rope_dim], dim=-1)
        w_uk, _ = self._kv_b_heads()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # per head [T, nope] @ [nope, r]
        return torch.cat([q_lat, q_rope], dim=-1)

    def attend(
        self, q: torch.Tensor, batch: ForwardBatch, caches: ModelCaches
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the locally held latents: ``(o_lat [T, H, r], lse [T, H])``; a decode step
        (``batch.is_decode``: one new token per sequence, after its cached context) may take FlashMLA."""
        return kernels.mla_paged_attention(
            q, caches.mla_kv[self.layer_idx], batch.block_tables, batch.cu_seqlens, batch.positions,
            batch.kv_lens, scale=self.scale, v_dim=self.kv_lora_rank, is_decode=batch.is_decode is True,
        )

    def output(self, o_lat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head value projection, optional output gate, o_proj -> ``[T, hidden]``."""
        return self._project_out(o_lat, self.g_proj(x) if self.use_output_gate else None)

    def _project_out(self, o_lat: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        _, w_uv = self._kv_b_heads()
        o = torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        o = o.transpose(0, 1).reshape(o_lat.shape[0], self.num_heads * self.v_head_dim)
        if gate is not None:
            o = kernels.act_and_mul(gate, o, activation="sigmoid")
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """``x``: ``[T, hidden]`` normed layer input; writes the new latents, returns ``[T, hidden]``."""
        kv_cache = caches.mla_kv[self.layer_idx]
        if self.in_proj is None:
            kernels.mla_write_kv(kv_cache, batch.block_tables, batch.cu_seqlens, batch.positions, self.latent(x))
            o_lat, _ = self.attend(self.absorbed_query(x), batch, caches)
            return self.output(o_lat, x)
        q, ckv, *gate = packed_linear(x, self.in_proj, self.in_proj_cols).split_with_sizes(self.in_proj_sizes, dim=-1)
        kernels.mla_write_kv(kv_cache, batch.block_tables, batch.cu_seqlens, batch.positions, self._latent_rows(ckv))
        o_lat, _ = self.attend(self._absorb(q), batch, caches)
        return self._project_out(o_lat, gate[0] if gate else None)
