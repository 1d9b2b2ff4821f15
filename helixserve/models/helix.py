"""helix_a2a Kimi model: one rank of a ``dp x cp`` generation world (tp = 1, ep = world).

A CP group holds the same T rows (its requests' new tokens). Per decoder layer::

    mixer input   all T rows (all-gathered from the row slices, or full rows in the dense region)
      KDA         this rank's H/cp heads and their state slots; o_proj partial sums   [T, D]
      MLA         all heads' absorbed queries over the locally held KV blocks (round-robin
                  ownership, ``-1`` entries elsewhere) -> (o_lat, lse) partials; all-to-all over
                  heads; exact LSE combine; this rank's value heads, gate rows, o_proj columns
    o_proj sums   reduce-scattered: CP rank r keeps rows [r*c, (r+1)*c), c = ceil(T/cp)
    residual      AttnRes bank/prefix, norms and the MoE on those c rows; the MoE dispatches
                  only the rank's valid rows to the experts' owners (all-to-all over the world)

Layers before the first MoE layer (layer 0, dense) keep all T rows: their mixer partials are
summed with reduce-scatter + all-gather. Every layer after the first MoE layer must be MoE
(:func:`check_helix_config`). The final norm runs on the slices; the LM head on the gathered
full rows, so every CP rank computes the same logits.

A CP group with no work in a step calls :meth:`HelixKimiForCausalLM.empty_step`: the MoE
all-to-alls with zero rows (its experts still serve the other groups' rows).

Parameters keep the names of :class:`~helixserve.models.kimi.KimiForCausalLM` with sliced
shapes, except that an MLA layer's ``kv_b_proj`` becomes ``w_uk [H, nope, r]`` (all heads, for
the absorbed query) and ``w_uv [H/cp, v, r]`` (this rank's heads);
:mod:`helixserve.models.helix_load` fills them from a checkpoint.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from torch import nn

from helixserve import kernels
from helixserve.cache_layout import ModelCaches
from helixserve.models.attn_res import attn_res_mix
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.kda import KimiDeltaAttention
from helixserve.models.kimi import KimiDecoderLayer, KimiForCausalLM
from helixserve.models.mla import MultiLatentAttention
from helixserve.models.mlp import linear
from helixserve.models.moe import KimiMoE
from helixserve.parallel import (
    Mapping,
    ParallelGroups,
    all_gather_rows,
    lse_all_to_all,
    moe_a2a,
    pad_rows,
    reduce_scatter_rows,
    rows_for_rank,
    split_rows,
)

MoeMode = Literal["sliced", "replicated"]


class HelixConfigError(ValueError):
    """The model cannot be laid out on this world (indivisible heads/experts, layer order)."""


def check_helix_config(cfg: KimiModelConfig, mapping: Mapping) -> None:
    """Raise :class:`HelixConfigError` listing every reason ``cfg`` does not fit ``mapping``."""
    problems = []
    cp, world = mapping.cp, mapping.world_size
    if cfg.kda_layer_ids and cfg.kda_num_heads % cp:
        problems.append(f"KDA num_heads={cfg.kda_num_heads} is not divisible by cp={cp} (KDA heads are sharded over the CP group)")
    if cfg.mla_layer_ids and cfg.num_attention_heads % cp:
        problems.append(
            f"MLA num_attention_heads={cfg.num_attention_heads} is not divisible by cp={cp} "
            "(the helix all-to-all splits heads over the CP group)"
        )
    if cfg.moe_layer_ids and cfg.num_experts % world:
        problems.append(
            f"num_experts={cfg.num_experts} is not divisible by the world size {world} = dp {mapping.dp} x cp {cp} "
            "(experts are partitioned over the whole world)"
        )
    moe_ids = cfg.moe_layer_ids
    if moe_ids:
        dense_after = [i for i in range(moe_ids[0], cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
        if dense_after:
            problems.append(
                f"layers {dense_after} are not MoE but come after the first MoE layer {moe_ids[0]}: helix_a2a "
                "token-slices the residual stream from the first MoE layer on and needs every later layer to be MoE"
            )
    if problems:
        raise HelixConfigError(f"{cfg.model_type} model does not fit dp={mapping.dp} cp={cp}: " + "; ".join(problems))


class PhaseTimer:
    """Wall time per named phase (synchronizing CUDA around each), for benchmarks."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()


class HelixMLA(MultiLatentAttention):
    """MLA whose value heads, output gate rows and o_proj columns are this rank's head slice."""

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


class HelixKimiForCausalLM(KimiForCausalLM):
    """``model(batch, caches) -> logits`` like the single-process model, on one world rank.

    Build it on the meta device and load it with :func:`helixserve.models.helix_load.load_helix_model`
    (or :func:`~helixserve.models.helix_load.shard_state_dict` for in-memory weights); call
    :meth:`bind` with the rank's process groups before the first forward.

    Args:
        moe_mode: ``"sliced"`` (each CP rank routes its c rows) or ``"replicated"`` (each CP rank
            routes all T rows and keeps its slice of the result; the benchmark baseline).
    """

    def __init__(self, cfg: KimiModelConfig, mapping: Mapping, dtype: torch.dtype | None = None,
                 moe_mode: MoeMode = "sliced") -> None:
        check_helix_config(cfg, mapping)
        super().__init__(cfg, dtype)
        if moe_mode not in ("sliced", "replicated"):
            raise ValueError(f"moe_mode must be 'sliced' or 'replicated', got {moe_mode!r}")
        self.mapping = mapping
        self.moe_mode = moe_mode
        self.first_moe_layer = cfg.moe_layer_ids[0] if cfg.moe_layer_ids else cfg.num_hidden_layers
        self.groups: ParallelGroups | None = None
        self.timer: PhaseTimer | None = None
        for layer in self.model.layers:
            _shard_layer(layer, cfg, mapping, dtype)

    # ---- setup

    def bind(self, groups: ParallelGroups) -> HelixKimiForCausalLM:
        if groups.mapping != self.mapping:
            raise ValueError(f"groups are for {groups.mapping}, the model for {self.mapping}")
        self.groups = groups
        return self

    @property
    def kda_num_local_heads(self) -> int:
        return self.cfg.kda_num_heads // self.mapping.cp

    def _phase(self, name: str):
        return self.timer(name) if self.timer is not None else nullcontext()

    # ---- CP-group row movement (no collective when cp == 1)

    def _gather(self, x_local: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self.mapping.cp == 1:
            return x_local[:num_tokens]
        with self._phase("cp_gather"):
            return all_gather_rows(x_local, num_tokens, self._groups.cp)

    def _scatter(self, x_full: torch.Tensor) -> torch.Tensor:
        if self.mapping.cp == 1:
            return x_full
        with self._phase("cp_reduce_scatter"):
            return reduce_scatter_rows(x_full, self._groups.cp)

    @property
    def _groups(self) -> ParallelGroups:
        if self.groups is None:
            raise RuntimeError("HelixKimiForCausalLM.bind(groups) was not called")
        return self.groups

    # ---- forward

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Logits ``[len(logits_indices) or T, vocab]`` float32, identical on every CP rank
        (``[0, vocab]``, with no output gather and no LM head, when ``logits_indices`` is empty)."""
        T = batch.num_tokens
        if T == 0:
            raise ValueError("a forward needs at least one token; call empty_step() for an idle CP group")
        cp, cp_rank = self.mapping.cp, self.mapping.cp_rank
        m = self.model
        h = m.embed_tokens(batch.input_ids)
        has_attn_res = self.cfg.attn_res_block_size is not None
        bank = h.new_zeros(self.cfg.num_attn_res_blocks, *h.shape) if has_attn_res else None
        num_banked = 0
        for layer in m.layers[: self.first_moe_layer]:  # dense region: all T rows
            mixer = lambda x, layer=layer: self._gather(self._scatter(self._mixer(layer, x, batch, caches)), T)
            h, num_banked = _layer_step(layer, h, bank, num_banked, mixer, layer.ffn)
        h = split_rows(h, cp, cp_rank)
        if bank is not None:
            bank = torch.stack([split_rows(b, cp, cp_rank) for b in bank]) if len(bank) else bank[:, :h.shape[0]]
        for layer in m.layers[self.first_moe_layer:]:  # token-sliced region
            mixer = lambda x, layer=layer: self._scatter(self._mixer(layer, self._gather(x, T), batch, caches))
            ffn = lambda x, layer=layer: self._moe(layer.block_sparse_moe, x, T)
            h, num_banked = _layer_step(layer, h, bank, num_banked, mixer, ffn)
        if batch.wants_no_logits:  # the caches are written; every CP rank has the same batch
            return h.new_zeros(0, self.cfg.vocab_size, dtype=torch.float32)
        with self._phase("residual"):
            if has_attn_res:
                h = attn_res_mix(m.output_attn_res_norm, m.output_attn_res_proj, h, bank[:num_banked])
            h = m.norm(h)
        h = self._gather(h, T)
        with self._phase("lm_head"):
            if batch.logits_indices is not None:
                h = h[batch.logits_indices]
            return self.lm_head(h).float()

    def _mixer(self, layer: KimiDecoderLayer, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Head-sharded mixer on all T rows -> o_proj partial sums ``[T, D]``."""
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            with self._phase("kda"):
                return attn(x, batch, caches)
        assert isinstance(attn, HelixMLA)
        with self._phase("mla_attend"):
            kernels.mla_write_kv(
                caches.mla_kv[attn.layer_idx], batch.block_tables, batch.cu_seqlens, batch.positions, attn.latent(x)
            )
            o_lat, lse = attn.attend(attn.absorbed_query(x), batch, caches)
        if self.mapping.cp > 1:
            with self._phase("cp_lse_a2a"):
                o_parts, lse_parts = lse_all_to_all(o_lat, lse, self._groups.cp)
            with self._phase("mla_attend"):
                o_lat, _ = kernels.lse_combine(o_parts, lse_parts)
        with self._phase("mla_output"):
            return attn.output(o_lat, x)

    def _moe(self, moe: KimiMoE, x_local: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """MoE of this rank's row slice ``[c, D]`` (normed); padding rows come back as zeros."""
        cp, cp_rank = self.mapping.cp, self.mapping.cp_rank
        if self.moe_mode == "replicated":
            x = self._gather(x_local, num_tokens)
        else:
            x = x_local[: rows_for_rank(num_tokens, cp, cp_rank).num_valid]
        with self._phase("moe_local"):
            expert_in, weights, ids = moe.route(x)
        routed = self._routed_experts(moe, expert_in, weights, ids)
        with self._phase("moe_local"):
            y = moe.finish(routed, x)
        if self.moe_mode == "replicated":
            return split_rows(y, cp, cp_rank)
        return pad_rows(y, x_local.shape[0])

    def _routed_experts(self, moe: KimiMoE, expert_in: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert-parallel weighted expert sum over the world (``[n, De]``)."""
        if self.mapping.world_size == 1:
            with self._phase("moe_experts"):
                return moe.routed(expert_in, weights, ids)

        def expert_fn(x_recv: torch.Tensor, local_ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            with self._phase("moe_experts"):
                return moe.routed(x_recv, w[:, None], local_ids[:, None])

        with self._phase("moe_a2a"):
            return moe_a2a(expert_in, ids, weights, expert_fn, num_experts=self.cfg.num_experts, group=self._groups.ep)

    @torch.no_grad()
    def empty_step(self) -> None:
        """Take part in every MoE layer's world all-to-all with zero rows (an idle CP group)."""
        device = self.lm_head.weight.device
        top_k = self.cfg.num_experts_per_token
        for layer in self.model.layers[self.first_moe_layer:]:
            moe = layer.block_sparse_moe
            expert_in = torch.zeros(0, self.cfg.expert_dim, dtype=self.dtype, device=device)
            ids = torch.zeros(0, top_k, dtype=torch.int64, device=device)
            weights = torch.zeros(0, top_k, dtype=torch.float32, device=device)
            self._routed_experts(moe, expert_in, weights, ids)


def _layer_step(layer: KimiDecoderLayer, h: torch.Tensor, bank: torch.Tensor | None, num_banked: int,
                mixer, ffn) -> tuple[torch.Tensor, int]:
    """One decoder layer on rows ``h`` (full or sliced) with the given mixer / FFN callables.

    Same order of operations as :class:`~helixserve.models.kimi.KimiDecoderLayer`.
    """
    if bank is None:
        h = h + mixer(layer.input_layernorm(h))
        return h + ffn(layer.post_attention_layernorm(h)), num_banked
    prefix = h
    x = attn_res_mix(layer.self_attention_res_norm, layer.self_attention_res_proj, prefix, bank[:num_banked])
    keep_prefix = not layer.starts_block
    if layer.starts_block:
        bank[num_banked] = prefix
        num_banked += 1
    a = mixer(layer.input_layernorm(x))
    prefix = prefix + a if keep_prefix else a
    x = attn_res_mix(layer.mlp_res_norm, layer.mlp_res_proj, prefix, bank[:num_banked])
    return prefix + ffn(layer.post_attention_layernorm(x)), num_banked


def _shard_layer(layer: KimiDecoderLayer, cfg: KimiModelConfig, mapping: Mapping, dtype: torch.dtype | None) -> None:
    """Swap the full mixer / expert stacks of ``layer`` for this rank's slices (same names)."""
    i = layer.layer_idx
    if layer.is_kda:
        layer.self_attn = KimiDeltaAttention(cfg, i, dtype, num_heads=cfg.kda_num_heads // mapping.cp)
    else:
        layer.self_attn = HelixMLA(cfg, i, mapping.local_heads(cfg.num_attention_heads), dtype)
    if layer.is_moe:
        experts = layer.block_sparse_moe.experts
        num_local = len(mapping.local_experts(cfg.num_experts))
        experts.w13 = nn.Parameter(experts.w13.new_zeros(num_local, *experts.w13.shape[1:]))
        experts.w2 = nn.Parameter(experts.w2.new_zeros(num_local, *experts.w2.shape[1:]))
