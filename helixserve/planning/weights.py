"""Weight bytes one rank holds, by component and by storage format (torch-free).

Counted from the model config exactly as :mod:`helixserve.models` builds the modules (the test
checks the counts against a model built on the meta device). A rank of a ``dp x cp`` world
(helix_a2a, :mod:`helixserve.models.sharding`) holds:

- KDA layers: its ``H / cp`` heads (q/k/v/f_b/gate rows, conv kernels, dt_bias, A_log, b_proj
  rows, o_proj columns); ``f_a`` (and ``g_a``) and ``o_norm`` replicated;
- MLA layers: every head's query and ``w_uk``, its ``H / cp`` value heads (``w_uv``, gate rows,
  o_proj columns); at ``cp == 1`` the whole ``kv_b_proj``;
- routed experts: ``E / (dp * cp)`` of them, as MXFP4 (``weight_packed``: 4 bits a value, plus
  one e8m0 ``weight_scale`` byte per 32 values: 17/32 byte a value) or in the model dtype;
- everything else replicated: embeddings, LM head, norms, routers, shared experts, the dense MLP.

A draft model's heads-TP rank (``heads_tp``: its heads over a CP group of ``cp`` ranks,
:mod:`helixserve.models.heads_tp`) holds the KDA heads as above, its ``H / cp`` MLA heads'
query, ``kv_b_proj`` and gate rows and o_proj columns, and every routed expert.

Values are in the model dtype except ``dt_bias``, ``A_log`` and the router's
``e_score_correction_bias`` (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.kvcache.sizing import FP32_BYTES
from helixserve.models.config import KimiModelConfig

MXFP4_GROUP_SIZE = 32


def mxfp4_bytes(num_values: int) -> int:
    """Packed MXFP4 bytes of ``num_values`` values: ``num_values / 2`` + one scale per 32."""
    return num_values // 2 + num_values // MXFP4_GROUP_SIZE


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """One rank's weights: ``dense_bytes`` (model dtype), ``fp32_bytes``, ``expert_bytes`` (routed
    experts in ``expert_format``), and the parameter counts by component."""

    dense_bytes: int
    fp32_bytes: int
    expert_bytes: int
    expert_format: str  # "mxfp4" or the model dtype's name
    params: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.fp32_bytes + self.expert_bytes


def _kda_params(cfg: KimiModelConfig, cp: int) -> tuple[int, int]:
    """(model-dtype values, fp32 values) of one KDA layer on a rank."""
    lin, d = cfg.linear_attn_config, cfg.hidden_size
    heads, k = lin.num_heads // cp, lin.head_dim
    width = heads * k
    gate = d * width if lin.use_full_rank_gate else d * k + k * width
    values = (3 * d * width + 3 * width * lin.short_conv_kernel_size + d * k + k * width + d * heads + gate
              + k + width * d)
    return values, width + heads


def _mla_params(cfg: KimiModelConfig, cp: int, heads_tp: bool = False) -> int:
    d, heads, rank = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    local = heads // cp
    q_out = (local if heads_tp else heads) * cfg.qk_head_dim
    q = d * q_out if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * q_out
    kv_a = d * cfg.mla_latent_dim + rank
    if cp == 1 or heads_tp:
        kv_b = rank * local * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    else:  # HeadShardedMLA: w_uk of every head, w_uv of this rank's heads
        kv_b = heads * cfg.qk_nope_head_dim * rank + local * cfg.v_head_dim * rank
    gate = d * local * cfg.v_head_dim if cfg.mla_use_output_gate else 0
    return q + kv_a + kv_b + gate + local * cfg.v_head_dim * d


def _moe_params(cfg: KimiModelConfig) -> tuple[int, int]:
    """(model-dtype values, fp32 values) of one MoE layer's router, latent projections and
    shared experts (the routed experts are counted apart)."""
    d, de = cfg.hidden_size, cfg.expert_dim
    values = cfg.num_experts * d + 3 * d * cfg.moe_intermediate_size * cfg.num_shared_experts
    if cfg.routed_expert_hidden_size is not None:
        values += 2 * d * de + (de if cfg.latent_moe_use_norm else 0)
    return values, cfg.num_experts


def routed_expert_values(cfg: KimiModelConfig, world_size: int) -> int:
    """Routed expert values (w1, w3 and w2 of every local expert, all MoE layers) on a rank."""
    per_expert = 3 * cfg.moe_intermediate_size * cfg.expert_dim
    return len(cfg.moe_layer_ids) * (cfg.num_experts // world_size) * per_expert


def rank_weight_bytes(cfg: KimiModelConfig, itemsize: int, dp: int = 1, cp: int = 1,
                      expert_format: str | None = None, heads_tp: bool = False) -> WeightBytes:
    """What one rank of a ``dp x cp`` world holds (a world of one: the whole model), or with
    ``heads_tp`` one rank of a draft model's heads over a CP group of ``cp`` (``dp`` 1).

    ``expert_format``: ``"mxfp4"`` (packed) or ``"dense"`` (the model dtype); default: the
    checkpoint's (``cfg.routed_expert_format``)."""
    fmt = expert_format or cfg.routed_expert_format
    if fmt not in ("mxfp4", "dense"):
        raise ValueError(f"expert_format must be 'mxfp4' or 'dense', got {fmt!r}")
    d = cfg.hidden_size
    kda, kda_fp32 = _kda_params(cfg, cp)
    moe, moe_fp32 = _moe_params(cfg)
    num_kda, num_mla, num_moe = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids), len(cfg.moe_layer_ids)
    per_layer_norms = 2 * d + (4 * d if cfg.attn_res_block_size is not None else 0)
    params = {
        "embeddings": cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2),
        "norms": cfg.num_hidden_layers * per_layer_norms + d * (3 if cfg.attn_res_block_size is not None else 1),
        "kda": num_kda * kda,
        "mla": num_mla * _mla_params(cfg, cp, heads_tp),
        "dense_mlp": (cfg.num_hidden_layers - num_moe) * 3 * d * cfg.intermediate_size,
        "moe_shared": num_moe * moe,
        "fp32": num_kda * kda_fp32 + num_moe * moe_fp32,
        "routed_experts": routed_expert_values(cfg, 1 if heads_tp else dp * cp),
    }
    dense = sum(v for k, v in params.items() if k not in ("fp32", "routed_experts"))
    experts = params["routed_experts"]
    expert_bytes = mxfp4_bytes(experts) if fmt == "mxfp4" else experts * itemsize
    return WeightBytes(dense * itemsize, params["fp32"] * FP32_BYTES, expert_bytes,
                       "mxfp4" if fmt == "mxfp4" else _dtype_name(itemsize), params)


def _dtype_name(itemsize: int) -> str:
    return {2: "bf16", 4: "fp32"}.get(itemsize, f"{itemsize}-byte")
