"""Named model configs and random-weight checkpoints for tests and demos.

``kimi-linear-48b`` and ``kimi-k3`` are the published shapes (configs only); ``kimi-linear-tiny``
and ``kimi-k3-tiny`` are small enough for CPU tests yet exercise every layer kind: KDA and MLA
mixers, a dense layer 0 and MoE layers; K3-tiny adds q-LoRA MLA with output gate, the lower-bound
KDA gate with full-rank output gate, SiTU, latent MoE, three attention-residual blocks and MXFP4
routed experts in its checkpoint. ``kimi-linear-tiny-draft`` / ``kimi-k3-tiny-draft`` are their
two-layer cuts (:data:`DRAFT_PRESETS`), draft models for speculative decoding;
``kimi-linear-tiny-hidden`` / ``kimi-k3-tiny-hidden`` are one-layer hidden-state drafters reading
three of their layers (:data:`HIDDEN_PRESETS`, :mod:`.hidden_drafter`). Tiny vocabularies
match the byte-level tokenizer (256 bytes + specials, bos 256, eos 257, pad 258).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from helixserve.models.checkpoint import save_checkpoint
from helixserve.models.config import KimiModelConfig
from helixserve.models.hidden_drafter import HiddenDrafter, save_hidden_drafter
from helixserve.models.hidden_drafter_config import HIDDEN_DRAFTER_KEY, HiddenDrafterSpec, hidden_drafter_config
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

_KIMI_LINEAR_48B: dict[str, Any] = {
    "model_type": "kimi_linear",
    "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "hidden_size": 2304, "num_hidden_layers": 27, "intermediate_size": 9216, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
    "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
        "kda_layers": [i for i in range(1, 28) if i % 4 != 0 and i != 27],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
    },
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 2.446, "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1,
}

_K3_FULL_ATTN = [*range(4, 93, 4), 93]
_KIMI_K3: dict[str, Any] = {
    **_KIMI_LINEAR_48B,
    "model_type": "kimi_k3",
    "hidden_size": 7168, "num_hidden_layers": 93, "intermediate_size": 33792, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "mla_use_output_gate": True,
    "linear_attn_config": {
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True, "full_attn_layers": _K3_FULL_ATTN,
        "kda_layers": [i for i in range(1, 94) if i not in _K3_FULL_ATTN],
    },
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "routed_scaling_factor": 1.0,
    "attn_res_block_size": 12, "routed_expert_format": "mxfp4",
}

_TINY_TOKENS = {"vocab_size": 512, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}

_KIMI_LINEAR_TINY: dict[str, Any] = {
    **_KIMI_LINEAR_48B, **_TINY_TOKENS,
    "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256, "max_position_embeddings": 4096,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 64,
}

_KIMI_K3_TINY: dict[str, Any] = {
    **_KIMI_K3, **_TINY_TOKENS,
    "hidden_size": 128, "num_hidden_layers": 6, "intermediate_size": 256, "max_position_embeddings": 4096,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True, "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6]},
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 64, "attn_res_block_size": 2,
}

# kimi-k3-shaped at about 0.8B parameters, for GPU tests and benches: K3's head dims (MLA latent
# 512 + 64, KDA K = V = 128), layer pattern (every 4th layer MLA), q-LoRA, gates, SiTU, latent MoE
# and attention residuals; bf16 routed experts (MXFP4 rounding of 0.5B weights is slow on CPU, and
# the GPU runs bf16 experts either way); fewer heads, layers and experts, byte tokens.
_KIMI_K3_MID: dict[str, Any] = {
    **_KIMI_K3, **_TINY_TOKENS,
    "hidden_size": 2048, "num_hidden_layers": 8, "intermediate_size": 6144, "max_position_embeddings": 65536,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 768,
    "linear_attn_config": {"num_heads": 16, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True, "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
    "num_experts": 32, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 768,
    "routed_expert_hidden_size": 1024, "attn_res_block_size": 2, "routed_expert_format": "dense",
}


def two_layer_draft(target: dict[str, Any]) -> dict[str, Any]:
    """``target`` cut to two layers, a KDA layer (dense MLP) then an MLA layer (MoE): the same
    vocabulary and layer kinds, for a speculative draft model."""
    return {**target, "num_hidden_layers": 2,
            "linear_attn_config": {**target["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]}}


def hidden_drafter_preset(target: dict[str, Any], hidden_layers: list[int]) -> dict[str, Any]:
    """A one-layer MLA drafter (dense MLP, plain residual) reading ``target``'s layers
    ``hidden_layers``: the same vocabulary and MLA shapes (:mod:`.hidden_drafter`)."""
    return {**target, "model_type": "kimi_linear", "num_hidden_layers": 1, "attn_res_block_size": None,
            "routed_expert_format": "dense",
            "linear_attn_config": {**target["linear_attn_config"], "kda_layers": [], "full_attn_layers": [1]},
            HIDDEN_DRAFTER_KEY: {"hidden_layers": hidden_layers, "target_hidden_size": target["hidden_size"]}}


PRESETS: dict[str, dict[str, Any]] = {
    "kimi-linear-48b": _KIMI_LINEAR_48B,
    "kimi-k3": _KIMI_K3,
    "kimi-linear-tiny": _KIMI_LINEAR_TINY,
    "kimi-k3-tiny": _KIMI_K3_TINY,
    "kimi-k3-mid": _KIMI_K3_MID,
    "kimi-linear-tiny-draft": two_layer_draft(_KIMI_LINEAR_TINY),
    "kimi-k3-tiny-draft": two_layer_draft(_KIMI_K3_TINY),
    "kimi-linear-tiny-hidden": hidden_drafter_preset(_KIMI_LINEAR_TINY, [0, 2, 3]),
    "kimi-k3-tiny-hidden": hidden_drafter_preset(_KIMI_K3_TINY, [1, 3, 5]),
}
# the drafter presets ``make-checkpoint --train-on`` trains beside each target preset by default
DRAFT_PRESETS: dict[str, str] = {"kimi-linear-tiny": "kimi-linear-tiny-draft", "kimi-k3-tiny": "kimi-k3-tiny-draft"}
HIDDEN_PRESETS: dict[str, str] = {"kimi-linear-tiny": "kimi-linear-tiny-hidden", "kimi-k3-tiny": "kimi-k3-tiny-hidden"}


def get_preset(name: str) -> KimiModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return KimiModelConfig.model_validate(PRESETS[name])


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded init (:func:`random_value` per parameter, in ``named_parameters`` order from one
    CPU generator). MXFP4 configs round routed experts to FP4 so that a saved checkpoint reloads
    exactly."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(random_value(name, p.shape, gen).to(p.dtype))
    round_to_stored_format(model)


@torch.no_grad()
def round_to_stored_format(model: torch.nn.Module) -> None:
    """Round what the checkpoint stores in a narrower format in place (MXFP4 routed experts), so
    that ``model`` computes what its saved checkpoint will."""
    if model.cfg.routed_expert_format == "mxfp4":
        for name, p in model.named_parameters():
            if name.endswith((".experts.w13", ".experts.w2")):
                p.copy_(dequantize_mxfp4(*quantize_mxfp4(p.float())).to(p.dtype))


def random_value(name: str, shape: torch.Size | tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp32 values for parameter ``name`` on ``gen``'s device, with scales that keep activations
    O(1) and logits peaked enough to be non-degenerate.

    Linear weights ~ N(0, 1/fan_in); embeddings ~ N(0, 1); norm weights ~ 1 + N(0, 0.1); KDA A_log =
    log U(1, 16) and dt_bias = softplus^-1(U(1e-3, 1e-1)) (the fla init); router bias ~ N(0, 0.01);
    attention-residual queries ~ N(0, 0.5).
    """
    device = gen.device

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    if name.endswith(".A_log"):
        return torch.log(torch.rand(shape, generator=gen, device=device) * 15 + 1)
    if name.endswith(".dt_bias"):
        log_dt = torch.rand(shape, generator=gen, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
        dt = torch.exp(log_dt)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith(".e_score_correction_bias"):
        return normal(0.01)
    if name.endswith("_res_proj.weight"):
        return normal(0.5)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if len(shape) == 1:
        return 1.0 + normal(0.1)
    return normal(1.0 / math.sqrt(shape[-1]))


TOKENIZER_FORMATS = ("hf", "kimi")


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32",
                    tokenizer: str = "hf") -> Path:
    """Random-weight checkpoint of ``preset``: config.json, model.safetensors, tokenizer files
    (see :func:`write_tokenizer`)."""
    cfg = get_preset(preset)
    check_tokenizer_format(tokenizer, preset, cfg)
    torch_dtype = getattr(torch, dtype)
    if is_hidden_preset(preset):
        drafter = new_hidden_drafter(preset, seed)
        out = save_hidden_drafter(drafter, out_dir, torch_dtype)
        write_tokenizer(out, tokenizer, cfg)
        return out
    model = KimiForCausalLM(cfg, dtype=torch.float32)
    init_random_weights(model, seed)
    out = save_checkpoint(model, cfg, out_dir, torch_dtype)
    write_tokenizer(out, tokenizer, cfg)
    return out


def is_hidden_preset(name: str) -> bool:
    """Whether preset ``name`` is a hidden-state drafter (:mod:`.hidden_drafter`)."""
    return HIDDEN_DRAFTER_KEY in PRESETS.get(name, {})


def hidden_preset_config(preset: str) -> tuple[KimiModelConfig, HiddenDrafterSpec]:
    """Hidden drafter preset ``preset``'s layer config and what it reads (``ValueError``: not one)."""
    get_preset(preset)  # a named error for an unknown preset
    if not is_hidden_preset(preset):
        raise ValueError(f"preset {preset!r} is not a hidden-state drafter")
    return hidden_drafter_config(PRESETS[preset])


def new_hidden_drafter(preset: str, seed: int = 0) -> HiddenDrafter:
    """Hidden drafter preset ``preset`` in fp32 with seeded random weights (:func:`init_random_weights`)."""
    drafter = HiddenDrafter(*hidden_preset_config(preset), dtype=torch.float32)
    init_random_weights(drafter, seed)
    return drafter


def check_tokenizer_format(tokenizer: str, preset: str, cfg: KimiModelConfig) -> None:
    """Refuse an unknown format, or a vocabulary the format's tokenizer does not fit in."""
    if tokenizer not in TOKENIZER_FORMATS:
        raise ValueError(f"unknown tokenizer format {tokenizer!r}; choose one of {list(TOKENIZER_FORMATS)}")
    if tokenizer != "kimi":
        return
    from helixserve.models.tokenizer_tiktoken import tiny_ranks

    if max(tiny_ranks().values()) >= cfg.vocab_size:
        raise ValueError(f"the tiny kimi tokenizer needs vocab_size > {max(tiny_ranks().values())}, "
                         f"preset {preset!r} has {cfg.vocab_size}")


def write_tokenizer(out_dir: str | Path, tokenizer: str, cfg: KimiModelConfig) -> None:
    """The tiny vocabulary's tokenizer files in ``out_dir``. ``tokenizer``: ``"hf"`` writes
    ``tokenizer.json`` (byte-level); ``"kimi"`` writes the layout Moonshot publishes
    (``tiktoken.model``, ``tokenizer_config.json`` with ``added_tokens_decoder``,
    ``chat_template.jinja``, ``generation_config.json``)."""
    from helixserve.models.tokenizer_hf import write_tokenizer_files
    from helixserve.models.tokenizer_tiktoken import write_kimi_tokenizer_files

    if tokenizer == "kimi":
        write_kimi_tokenizer_files(out_dir, cfg.max_position_embeddings)
    else:
        write_tokenizer_files(out_dir)
