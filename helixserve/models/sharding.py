"""Which slice of the Kimi model one rank of a ``dp x cp`` world holds (tp = 1, ep = world).

Owned here: the layout checks (:func:`check_helix_config`), and each layer's rank-local modules,
built at their sliced shapes by :func:`build_mixer` / :func:`num_local_experts`:

- KDA: this rank's ``H/cp`` heads (q/k/v/gate rows, conv kernels, o_proj columns) and their state;
- MLA at ``cp == 1``: the plain module (``kv_b_proj`` of every head, as the checkpoint has it);
  at ``cp > 1``: :class:`HeadShardedMLA`, whose ``kv_b_proj`` is split into ``w_uk [H, nope, r]``
  (every head: the absorbed query attends with all heads over this rank's KV blocks) and
  ``w_uv [H/cp, v, r]`` (this rank's value heads), with its gate rows and o_proj columns;
- routed experts ``[rank*E/world, (rank+1)*E/world)``; everything else is replicated.

A draft model's heads-TP mapping (``mapping.heads_tp``, :mod:`helixserve.models.heads_tp`) holds
KDA as above and, for MLA, a :class:`MultiLatentAttention` of its ``H/cp`` heads (their query rows,
``kv_b_proj`` rows, gate rows and o_proj columns; the latent projection whole); every expert.

The collectives that join the slices live in :mod:`helixserve.models.helix_hooks`; the loader that
fills a rank's slice from a checkpoint in :mod:`helixserve.models.helix_load`. At a world of one
every module is the single-process one (same names, shapes and values).
"""

from __future__ import annotations

import torch
from torch import nn

from helixserve.models.config import KimiModelConfig
from helixserve.cache_layout import ModelCaches
from helixserve.models.context import ForwardBatch
from helixserve.models.kda import KimiDeltaAttention
from helixserve.models.mla import MultiLatentAttention
from helixserve.models.mlp import linear
from helixserve.parallel.mapping import Mapping


class HelixConfigError(ValueError):
    """The model cannot be laid out on this world (indivisible heads/experts, layer order)."""


def check_helix_config(cfg: KimiModelConfig, mapping: Mapping) -> None:
    """Raise :class:`HelixConfigError` listing every reason ``cfg`` does not fit ``mapping``."""
    problems = heads_tp_problems(cfg, mapping.cp) if mapping.heads_tp else cfg.helix_mapping_problems(mapping.dp, mapping.cp)
    if problems:
        raise HelixConfigError(f"{cfg.model_type} model does not fit dp={mapping.dp} cp={mapping.cp}: " + "; ".join(problems))


def heads_tp_problems(cfg: KimiModelConfig, cp: int) -> list[str]:
    """Why a draft model's heads cannot be split over a CP group of ``cp`` ranks (empty: they can)."""
    problems = []
    if cfg.kda_layer_ids and cfg.kda_num_heads % cp:
        problems.append(f"KDA num_heads={cfg.kda_num_heads} is not divisible by cp={cp}")
    if cfg.mla_layer_ids and cfg.num_attention_heads % cp:
        problems.append(f"MLA num_attention_heads={cfg.num_attention_heads} is not divisible by cp={cp}")
    return problems


class HeadShardedMLA(MultiLatentAttention):
    """MLA whose value heads, output gate rows and o_proj columns are this rank's head slice.

    Its forward is split by the helix hooks: :meth:`absorbed_query` (all heads) and :meth:`attend`
    over the local KV blocks give ``(o_lat, lse)`` partials, exchanged and combined over the CP
    group, then :meth:`output` maps this rank's heads to an o_proj partial sum.
    """

    def __init__(self, cfg: KimiModelConfig, layer_idx: int, local_heads: range, dtype: torch.dtype | None) -> None:
        super().__init__(cfg, layer_idx, dtype)
        del self.kv_b_proj
        self.local_heads = local_heads
        num_local = len(local_heads)
        self.w_uk = nn.Parameter(torch.zeros(self.num_heads, self.nope_dim, self.kv_lora_rank, dtype=dtype))
        self.w_uv = nn.Parameter(torch.zeros(num_local, self.v_head_dim, self.kv_lora_rank, dtype=dtype))
        if self.use_output_gate:
            self.g_proj = linear(cfg.hidden_size, num_local * self.v_head_dim, dtype)
        self.o_proj = linear(num_local * self.v_head_dim, cfg.hidden_size, dtype)

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w_uk, self.w_uv

    def output(self, o_lat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o_lat [T, H/cp, r]`` combined latents of this rank's heads -> o_proj partial ``[T, D]``."""
        o = torch.einsum("thr,hvr->thv", o_lat.to(self.w_uv.dtype), self.w_uv).reshape(x.shape[0], -1)
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        raise RuntimeError("a head-sharded MLA runs through HelixHooks.mixer (its partials need the CP group)")


def build_mixer(cfg: KimiModelConfig, layer_idx: int, mapping: Mapping, dtype: torch.dtype | None) -> nn.Module:
    """Layer ``layer_idx``'s mixer as this rank holds it (the full module at cp = 1 for MLA)."""
    if cfg.is_kda_layer(layer_idx):
        return KimiDeltaAttention(cfg, layer_idx, dtype, num_heads=cfg.kda_num_heads // mapping.cp)
    if mapping.cp == 1:
        return MultiLatentAttention(cfg, layer_idx, dtype)
    if mapping.heads_tp:
        return MultiLatentAttention(cfg, layer_idx, dtype, num_heads=cfg.num_attention_heads // mapping.cp)
    return HeadShardedMLA(cfg, layer_idx, mapping.local_heads(cfg.num_attention_heads), dtype)


def num_local_experts(cfg: KimiModelConfig, mapping: Mapping) -> int:
    """Routed experts this rank holds (all of them at a world of one)."""
    return len(mapping.local_experts(cfg.num_experts))
