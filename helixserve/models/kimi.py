"""Kimi Linear / Kimi K3 decoder and causal LM: the one model forward, for one process or one rank
of a ``dp x cp`` helix_a2a world.

Layer ``i`` mixes with KDA when ``(i + 1) in kda_layers`` and with MLA otherwise; its FFN is a MoE
when ``i >= first_k_dense_replace and i % moe_layer_freq == 0`` and a dense gated MLP otherwise.
Parameter names follow the checkpoint (``model.layers.{i}.self_attn.*``, ``.mlp.*`` /
``.block_sparse_moe.*``), except that routed experts are stacked into ``experts.w13`` /
``experts.w2`` and ``A_log`` is ``[H]``; :mod:`helixserve.models.checkpoint` maps between the two.

Residual stream: plain pre-norm, or (``attn_res_block_size`` set, K3) block attention residuals:

    prefix = h;  x = AttnRes(prefix, bank) if bank else prefix
    if i % block_size == 0: bank.append(prefix); prefix = None
    a = mixer(input_layernorm(x));  prefix = a if prefix is None else prefix + a
    x = AttnRes(prefix, bank);  prefix = prefix + ffn(post_attention_layernorm(x))

and after the last layer ``h = AttnRes(prefix, bank)`` (output site), then ``norm`` and ``lm_head``.

Who owns what: the model takes a :class:`~helixserve.parallel.Mapping` (default: a world of one).
:mod:`helixserve.models.sharding` decides each layer's rank-local modules (KDA heads, MLA value
heads, experts); :class:`~helixserve.models.helix_hooks.HelixHooks` (``model.helix``) moves rows
and runs the collectives around each mixer and MoE, the row slicing at the first MoE layer and the
gather before the LM head. At a world of one the layers call their modules directly (the hooks
would be identities) and the model is the single-process model: same names, shapes and ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from helixserve.cache_layout import ModelCaches
from helixserve.kernels._host import step_host_cache
from helixserve.models.attn_res import AttnResProj, attn_res_norm
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.heads_tp import HeadsTPHooks
from helixserve.models.helix_hooks import NO_PHASE, HelixHooks, MoeMode, PhaseTimer
from helixserve.models.mlp import GatedMLP
from helixserve.models.moe import KimiMoE
from helixserve.models.norm import RMSNorm
from helixserve.models.sharding import build_mixer, check_helix_config, num_local_experts
from helixserve.parallel.mapping import Mapping

if TYPE_CHECKING:
    from helixserve.parallel.groups import ParallelGroups

WORLD_OF_ONE = Mapping(1, 0, dp=1, cp=1)
# a layer's FFN output not yet added to the residual stream: a tensor, or a MoE's (routed, shared)
Pending = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None


def with_pending(h: torch.Tensor, pending: Pending) -> torch.Tensor:
    """A layer's whole output: ``h`` with its FFN output ``pending`` added (the next layer's norm
    adds it otherwise)."""
    return h if pending is None else h + _summed(pending)


def _summed(pending: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    if not isinstance(pending, tuple):
        return pending
    return pending[0] if pending[1] is None else pending[0] + pending[1]


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: KimiModelConfig, layer_idx: int, dtype: torch.dtype | None = None,
                 mapping: Mapping = WORLD_OF_ONE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.self_attn = build_mixer(cfg, layer_idx, mapping, dtype)
        if self.is_moe:
            self.block_sparse_moe = KimiMoE(cfg, dtype, num_local_experts(cfg, mapping))
        else:
            self.mlp = GatedMLP(cfg, cfg.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn_res_block_size = cfg.attn_res_block_size
        if cfg.attn_res_block_size is not None:
            self.self_attention_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.self_attention_res_proj = AttnResProj(cfg.hidden_size, dtype)
            self.mlp_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.mlp_res_proj = AttnResProj(cfg.hidden_size, dtype)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    @property
    def starts_block(self) -> bool:
        return self.attn_res_block_size is not None and self.layer_idx % self.attn_res_block_size == 0

    def forward(
        self, h: torch.Tensor, bank: torch.Tensor | None, num_banked: int, batch: ForwardBatch, caches: ModelCaches,
        hooks: HelixHooks | None = None, pending: Pending = None,
    ) -> tuple[torch.Tensor, int, Pending]:
        """One layer on the rank's rows ``h``; ``bank [max_blocks, M, D]`` holds ``num_banked``
        AttnRes snapshots (``None``: plain pre-norm residual). ``hooks`` (a world of more than
        one rank, or a phase timer) wrap the mixer and the FFN; ``None`` calls them directly.
        Returns ``(h, num_banked, pending)``: the FFN output is ``pending`` (a MoE's routed and shared
        outputs as a pair), added to ``h`` by the next layer's first norm or selection site (or the
        model's last), in the same kernel."""
        if bank is None:
            x, h = self.input_layernorm.add_forward(pending, h) if pending is not None else (self.input_layernorm(h), h)
            a = self.self_attn(x, batch, caches) if hooks is None else hooks.mixer(self, x, batch, caches)
            x, h = self.post_attention_layernorm.add_forward(a, h)
            return h, num_banked, self._ffn(x, batch, hooks)
        # AttnRes: the residual adds, the selection sites and the norms after them fused in twos
        snapshot = bank[num_banked] if self.starts_block else None  # the prefix is stored there
        x, prefix = attn_res_norm(self.self_attention_res_norm, self.self_attention_res_proj, h, bank[:num_banked],
                                  self.input_layernorm, pending, snapshot)
        num_banked += snapshot is not None
        a = self.self_attn(x, batch, caches) if hooks is None else hooks.mixer(self, x, batch, caches)
        x, prefix = attn_res_norm(self.mlp_res_norm, self.mlp_res_proj, a if snapshot is not None else prefix,
                                  bank[:num_banked], self.post_attention_layernorm,
                                  None if snapshot is not None else a)
        return prefix, num_banked, self._ffn(x, batch, hooks)

    def _ffn(self, x: torch.Tensor, batch: ForwardBatch, hooks: HelixHooks | None) -> Pending:
        if hooks is not None:
            return hooks.ffn(self, x, batch.num_tokens)
        return self.block_sparse_moe.forward_parts(x) if self.is_moe else self.mlp(x)


class KimiModel(nn.Module):
    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None, mapping: Mapping = WORLD_OF_ONE) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, i, dtype, mapping) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.output_attn_res_proj = AttnResProj(cfg.hidden_size, dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches, hooks: HelixHooks | None = None) -> torch.Tensor:
        """Final normed hidden states of the rank's rows: ``[T, hidden]``, or ``[c, hidden]`` with
        ``hooks`` slicing rows over the CP group from its first MoE layer on. With
        ``batch.hidden_capture`` the outputs of its layers are kept there, for all T rows of the step
        (in a world the CP group's, :mod:`.hidden_capture`)."""
        h = self.embed_tokens(batch.input_ids)
        bank = h.new_empty(self.cfg.num_attn_res_blocks, *h.shape) if self.cfg.attn_res_block_size is not None else None
        num_banked = 0
        pending = None  # the last FFN output, not yet added to h
        first_sliced = -1 if hooks is None else hooks.first_sliced_layer
        capture = batch.hidden_capture
        for layer in self.layers:
            if layer.layer_idx == first_sliced:
                if pending is not None:
                    h, pending = h + _summed(pending), None
                h, bank = hooks.slice_rows(h, bank, num_banked)
            # no per-layer Module.__call__
            h, num_banked, pending = layer.forward(h, bank, num_banked, batch, caches, hooks, pending)
            if capture is not None:  # the layer's output: its FFN's too
                capture.take(layer.layer_idx, with_pending(h, pending))
        if capture is not None and hooks is not None and hooks.mapping.cp > 1:  # sliced layers: gather the group's rows
            capture.gather_sliced(first_sliced, lambda x: hooks.gather(x, batch.num_tokens))
        with NO_PHASE if hooks is None else hooks.phase("residual"):
            if bank is not None:
                return attn_res_norm(self.output_attn_res_norm, self.output_attn_res_proj, h, bank[:num_banked],
                                     self.norm, pending)[0]
            return self.norm(h) if pending is None else self.norm.add_forward(pending, h)[0]


class KimiForCausalLM(nn.Module):
    """``model(batch, caches) -> logits [len(logits_indices) or T, vocab]`` float32 (``[0, vocab]``
    without running the LM head when ``logits_indices`` is empty), identical on every CP rank.

    ``mapping`` places the model in a ``dp x cp`` world (default: a world of one, the
    single-process model), or, with ``mapping.heads_tp``, a draft model's heads over a CP group
    (:mod:`.heads_tp`). A rank of a larger world holds its slice (:mod:`.sharding`; build it on
    the meta device and load it with :func:`helixserve.models.helix_load.load_helix_model` or
    :func:`~helixserve.models.helix_load.shard_state_dict`), and needs :meth:`bind` with its
    process groups before the first forward; its idle steps call :meth:`empty_step`.

    Args:
        moe_mode: ``"sliced"`` (each CP rank routes its c rows) or ``"replicated"`` (each CP rank
            routes all T rows and keeps its slice of the result; the benchmark baseline).

    Raises:
        HelixConfigError: the model does not fit a world of more than one rank.
    """

    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None, mapping: Mapping | None = None,
                 moe_mode: MoeMode = "sliced") -> None:
        super().__init__()
        mapping = WORLD_OF_ONE if mapping is None else mapping
        if mapping.world_size > 1:
            check_helix_config(cfg, mapping)
        self.cfg = cfg
        self.mapping = mapping
        self.helix = HeadsTPHooks(cfg, mapping) if mapping.heads_tp else HelixHooks(cfg, mapping, moe_mode)
        self.model = KimiModel(cfg, dtype, mapping)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # ---- the world this rank sits in

    def bind(self, groups: ParallelGroups) -> KimiForCausalLM:
        """Attach this rank's process groups (``groups.mapping`` must be the model's)."""
        self.helix.bind(groups)
        return self

    @property
    def kda_num_local_heads(self) -> int:
        return self.cfg.kda_num_heads // self.mapping.cp

    @property
    def moe_mode(self) -> MoeMode:
        return self.helix.moe_mode

    @moe_mode.setter
    def moe_mode(self, mode: MoeMode) -> None:
        self.helix.moe_mode = mode

    @property
    def timer(self) -> PhaseTimer | None:
        """Per-phase wall time of the forward when set (benchmarks; the hooks run at any world size)."""
        return self.helix.timer

    @timer.setter
    def timer(self, timer: PhaseTimer | None) -> None:
        self.helix.timer = timer

    # ---- forward

    def kda_mixers(self) -> list[nn.Module]:
        """The KDA mixers (:class:`~helixserve.models.kda.KimiDeltaAttention`), in layer order."""
        return [layer.self_attn for layer in self.model.layers if layer.is_kda]

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        helix = self.helix
        hooks = None if helix.is_world_of_one and helix.timer is None else helix
        if hooks is not None and not helix.is_world_of_one and batch.num_tokens == 0:
            raise ValueError("a forward needs at least one token; call empty_step() for an idle CP group")
        with step_host_cache():  # the batch metadata is read on the host once, not once per layer
            hidden = self.model(batch, caches, hooks)
        if batch.wants_no_logits:  # the caches are written; no row is sampled (same batch on every CP rank)
            return hidden.new_zeros(0, self.cfg.vocab_size, dtype=torch.float32)
        if hooks is not None:
            hidden = hooks.gather(hidden, batch.num_tokens)
        with NO_PHASE if hooks is None else hooks.phase("lm_head"):
            if batch.logits_indices is not None:
                hidden = hidden[batch.logits_indices]
            return self.lm_head(hidden).float()

    def empty_step(self) -> None:
        """An idle CP group's step: every MoE layer's world all-to-all with zero rows (a no-op at a
        world of one)."""
        self.helix.empty_step(self.model.layers, self.dtype, self.lm_head.weight.device)
