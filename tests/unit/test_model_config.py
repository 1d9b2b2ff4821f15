"""KimiModelConfig: parsing both model types, layer predicates, validation errors."""

from __future__ import annotations

import copy
import json

import pytest
from pydantic import ValidationError

from helixserve.models.config import KimiModelConfig
from helixserve.models.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_dict_round_trip(name: str) -> None:
    cfg = get_preset(name)
    again = KimiModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


def test_kimi_linear_48b_layers() -> None:
    cfg = get_preset("kimi-linear-48b")
    assert cfg.weight_prefix == ""
    assert cfg.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert len(cfg.kda_layer_ids) == 20 and cfg.is_kda_layer(0) and not cfg.is_kda_layer(3)
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 27))
    assert cfg.q_lora_rank is None and cfg.mla_latent_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.routed_expert_format == "dense" and cfg.attn_res_block_size is None


def test_kimi_k3_layers_and_nesting() -> None:
    cfg = get_preset("kimi-k3")
    raw = cfg.to_hf_dict()
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["model_type"] == "kimi_linear"
    assert raw["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert cfg.weight_prefix == "language_model."
    assert len(cfg.mla_layer_ids) == 24 and len(cfg.kda_layer_ids) == 69
    assert cfg.mla_layer_ids[-2:] == [91, 92]  # two consecutive MLA layers at the end (1-based 92, 93)
    assert cfg.num_attn_res_blocks == 8 and cfg.expert_dim == 3584
    assert cfg.linear_attn_config.gate_lower_bound == -5.0 and cfg.linear_attn_config.use_full_rank_gate
    assert cfg.routed_expert_format == "mxfp4"


def test_k3_top_level_token_ids_and_quantization() -> None:
    raw = get_preset("kimi-k3-tiny").to_hf_dict()
    for key in ("bos_token_id", "eos_token_id"):
        raw["text_config"].pop(key, None)
    raw["bos_token_id"], raw["eos_token_id"] = 1, 2
    cfg = KimiModelConfig.from_hf_dict(raw)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.routed_expert_format == "mxfp4"


def test_transformers_saved_config_is_accepted() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = get_preset("kimi-linear-tiny")
    hf = transformers.KimiLinearConfig.from_dict(cfg.to_hf_dict()).to_dict()
    assert KimiModelConfig.from_hf_dict(hf) == cfg
    # transformers-only layout: layer_types / mlp_layer_types and its attribute aliases
    for key in ("linear_attn_config", "first_k_dense_replace", "num_experts", "num_experts_per_token"):
        hf.pop(key, None)
    hf.update(num_local_experts=8, num_experts_per_tok=2)
    assert KimiModelConfig.from_hf_dict(hf) == cfg


def _raw(**changes):
    raw = copy.deepcopy(get_preset("kimi-linear-tiny").to_hf_dict())
    for key, value in changes.items():
        if key.startswith("lin_"):
            raw["linear_attn_config"][key[4:]] = value
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model_type": "llama"}, "llama"),
        ({"lin_kda_layers": [1, 2, 5]}, "[5]"),
        ({"lin_kda_layers": [1, 2, 3, 4]}, "both"),
        ({"lin_kda_layers": [1, 2]}, "neither"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"num_experts_per_token": 9}, "num_experts_per_token=9"),
        ({"lin_gate_lower_bound": 1.0}, "1.0"),
        ({"num_expert_group": 4}, "num_expert_group=4"),
        ({"attn_res_block_size": 0}, "attn_res_block_size"),
        ({"hidden_size": -1}, "hidden_size"),
    ],
)
def test_validation_errors_name_the_value(changes: dict, needle: str) -> None:
    with pytest.raises((ValueError, ValidationError)) as info:
        KimiModelConfig.from_hf_dict(_raw(**changes))
    assert needle in str(info.value)


def test_k3_without_text_config_fails() -> None:
    with pytest.raises(ValueError, match="text_config"):
        KimiModelConfig.from_hf_dict({"model_type": "kimi_k3"})
