"""Kimi Linear / Kimi K3 decoder and causal LM.

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
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from helixserve.cache_layout import ModelCaches
from helixserve.kernels._host import step_host_cache
from helixserve.models.attn_res import AttnResProj, attn_res_mix
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.kda import KimiDeltaAttention
from helixserve.models.mla import MultiLatentAttention
from helixserve.models.mlp import GatedMLP
from helixserve.models.moe import KimiMoE
from helixserve.models.norm import RMSNorm


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: KimiModelConfig, layer_idx: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        mixer_cls = KimiDeltaAttention if self.is_kda else MultiLatentAttention
        self.self_attn = mixer_cls(cfg, layer_idx, dtype)
        if self.is_moe:
            self.block_sparse_moe = KimiMoE(cfg, dtype)
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

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Plain pre-norm residual block."""
        h = h + self.self_attn(self.input_layernorm(h), batch, caches)
        return h + self.ffn(self.post_attention_layernorm(h))

    def forward_attn_res(
        self, prefix: torch.Tensor, bank: torch.Tensor, num_banked: int, batch: ForwardBatch, caches: ModelCaches
    ) -> tuple[torch.Tensor, int]:
        """Block attention-residual step; ``bank [max_blocks, M, D]`` holds ``num_banked`` snapshots."""
        x = attn_res_mix(self.self_attention_res_norm, self.self_attention_res_proj, prefix, bank[:num_banked])
        keep_prefix = not self.starts_block
        if self.starts_block:
            bank[num_banked] = prefix
            num_banked += 1
        a = self.self_attn(self.input_layernorm(x), batch, caches)
        prefix = prefix + a if keep_prefix else a
        x = attn_res_mix(self.mlp_res_norm, self.mlp_res_proj, prefix, bank[:num_banked])
        return prefix + self.ffn(self.post_attention_layernorm(x)), num_banked


class KimiModel(nn.Module):
    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.output_attn_res_proj = AttnResProj(cfg.hidden_size, dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Final normed hidden states ``[T, hidden]``."""
        h = self.embed_tokens(batch.input_ids)
        if self.cfg.attn_res_block_size is None:
            for layer in self.layers:
                h = layer(h, batch, caches)
            return self.norm(h)
        bank = h.new_empty(self.cfg.num_attn_res_blocks, *h.shape)
        num_banked = 0
        for layer in self.layers:
            h, num_banked = layer.forward_attn_res(h, bank, num_banked, batch, caches)
        h = attn_res_mix(self.output_attn_res_norm, self.output_attn_res_proj, h, bank[:num_banked])
        return self.norm(h)


class KimiForCausalLM(nn.Module):
    """``model(batch, caches) -> logits [len(logits_indices) or T, vocab]`` float32 (``[0, vocab]``
    without running the LM head when ``logits_indices`` is empty)."""

    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = KimiModel(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> KimiForCausalLM:
        from helixserve.models.checkpoint import load_model

        return load_model(model_dir, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        with step_host_cache():  # the batch metadata is read on the host once, not once per layer
            hidden = self.model(batch, caches)
        if batch.wants_no_logits:  # the caches are written; no row is sampled
            return hidden.new_zeros(0, self.cfg.vocab_size, dtype=torch.float32)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.lm_head(hidden).float()
