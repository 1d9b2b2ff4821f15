"""Kimi Linear / Kimi K3 model configuration, parsed from a checkpoint's ``config.json``.

Two layouts are accepted:

- ``model_type: kimi_linear``: the text config at the top level, weights named ``model.*`` / ``lm_head.*``.
- ``model_type: kimi_k3``: the text config nested under ``text_config``, weights prefixed with
  ``language_model.`` (``vision_tower.*`` / ``mm_projector.*`` are ignored).

Layer lists in ``linear_attn_config`` are 1-based (as in the published configs); every helper here
takes and returns 0-based layer indices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

K3_WEIGHT_PREFIX = "language_model."


class LinearAttnConfig(BaseModel):
    """KDA (linear attention) settings; ``kda_layers`` / ``full_attn_layers`` are 1-based."""

    model_config = ConfigDict(extra="ignore")

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    short_conv_kernel_size: int = Field(default=4, ge=1)
    kda_layers: list[int]
    full_attn_layers: list[int]
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False

    @model_validator(mode="after")
    def _check_gate(self) -> LinearAttnConfig:
        if self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be < 0, got {self.gate_lower_bound}")
        return self


class KimiModelConfig(BaseModel):
    """Text-model configuration shared by Kimi Linear and Kimi K3."""

    model_config = ConfigDict(extra="ignore")

    model_type: Literal["kimi_linear", "kimi_k3"] = "kimi_linear"

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    hidden_act: Literal["silu", "situ"] = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576

    # MLA
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = Field(default=512, gt=0)
    qk_nope_head_dim: int = Field(default=128, gt=0)
    qk_rope_head_dim: int = Field(default=64, ge=0)
    v_head_dim: int = Field(default=128, gt=0)
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    rope_theta: float = 10000.0

    linear_attn_config: LinearAttnConfig

    # MoE
    num_experts: int = Field(gt=0)
    num_experts_per_token: int = Field(gt=0)
    num_shared_experts: int = Field(default=1, ge=0)
    moe_intermediate_size: int = Field(gt=0)
    first_k_dense_replace: int = Field(default=1, ge=0)
    moe_layer_freq: int = Field(default=1, ge=1)
    moe_router_activation_func: Literal["sigmoid"] = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # K3 latent MoE: experts run in this smaller dim (None = experts in hidden_size).
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    # "mxfp4": routed expert weights stored as weight_packed/weight_scale in the checkpoint.
    routed_expert_format: Literal["dense", "mxfp4"] = "dense"

    # Attention residuals (None = plain residual stream).
    attn_res_block_size: int | None = None

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _validate(self) -> KimiModelConfig:
        n = self.num_hidden_layers
        lin = self.linear_attn_config
        for name, layers in (("kda_layers", lin.kda_layers), ("full_attn_layers", lin.full_attn_layers)):
            bad = [x for x in layers if not 1 <= x <= n]
            if bad:
                raise ValueError(f"linear_attn_config.{name} has layers {bad} outside 1..{n} (1-based)")
        both = sorted(set(lin.kda_layers) & set(lin.full_attn_layers))
        if both:
            raise ValueError(f"layers {both} are in both kda_layers and full_attn_layers")
        missing = sorted(set(range(1, n + 1)) - set(lin.kda_layers) - set(lin.full_attn_layers))
        if missing:
            raise ValueError(f"layers {missing} are in neither kda_layers nor full_attn_layers")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token={self.num_experts_per_token} exceeds num_experts={self.num_experts}"
            )
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError(
                f"grouped top-k with num_expert_group={self.num_expert_group}, topk_group={self.topk_group} "
                "is not supported (Kimi uses 1/1)"
            )
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise ValueError(f"attn_res_block_size must be > 0 or null, got {self.attn_res_block_size}")
        if self.num_key_value_heads is not None and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must equal "
                f"num_attention_heads={self.num_attention_heads} for MLA"
            )
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope=false (rotary MLA) is not supported")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            raise ValueError(f"routed_expert_hidden_size must be > 0, got {self.routed_expert_hidden_size}")
        return self

    # ---- layer predicates (0-based) ----

    def is_kda_layer(self, i: int) -> bool:
        return (i + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def weight_prefix(self) -> str:
        return K3_WEIGHT_PREFIX if self.model_type == "kimi_k3" else ""

    def helix_mapping_problems(self, dp: int, cp: int) -> list[str]:
        """Why this model cannot be laid out on a ``dp x cp`` helix_a2a world (empty: it can)."""
        problems, world = [], dp * cp
        if self.kda_layer_ids and self.kda_num_heads % cp:
            problems.append(f"KDA num_heads={self.kda_num_heads} is not divisible by cp={cp} (KDA heads are sharded over the CP group)")
        if self.mla_layer_ids and self.num_attention_heads % cp:
            problems.append(f"MLA num_attention_heads={self.num_attention_heads} is not divisible by cp={cp} "
                            "(the helix all-to-all splits heads over the CP group)")
        if self.moe_layer_ids and self.num_experts % world:
            problems.append(f"num_experts={self.num_experts} is not divisible by the world size {world} = dp {dp} x cp {cp} "
                            "(experts are partitioned over the whole world)")
        moe_ids = self.moe_layer_ids
        dense_after = [i for i in range(moe_ids[0], self.num_hidden_layers) if not self.is_moe_layer(i)] if moe_ids else []
        if dense_after:
            problems.append(f"layers {dense_after} are not MoE but come after the first MoE layer {moe_ids[0]}: helix_a2a "
                            "token-slices the residual stream from the first MoE layer on and needs every later layer to be MoE")
        return problems

    # ---- derived dims ----

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Per-token MLA cache width: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_num_heads(self) -> int:
        return self.linear_attn_config.num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def conv_kernel_size(self) -> int:
        return self.linear_attn_config.short_conv_kernel_size

    @property
    def expert_dim(self) -> int:
        """Input/output dim of routed experts (latent dim under K3 latent MoE)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        if self.attn_res_block_size is None:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    # ---- (de)serialization ----

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> KimiModelConfig:
        """Parse a ``config.json`` dict (either model type)."""
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            text = dict(raw.get("text_config") or {})
            if not text:
                raise ValueError("kimi_k3 config has no text_config")
            for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config",
                        "tie_word_embeddings"):
                if key not in text and key in raw:
                    text[key] = raw[key]
        elif model_type == "kimi_linear":
            text = dict(raw)
        else:
            raise ValueError(f"unsupported model_type {model_type!r} (expected 'kimi_linear' or 'kimi_k3')")
        return cls.model_validate(_normalize_text_config(text, model_type))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> KimiModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict in the published layout (round-trips through :meth:`from_hf_dict`)."""
        text = self.model_dump(exclude={"model_type", "routed_expert_format"})
        text["model_type"] = "kimi_linear"
        text["architectures"] = ["KimiLinearForCausalLM"]
        text["num_key_value_heads"] = self.num_attention_heads
        text["model_max_length"] = self.max_position_embeddings
        text["torch_dtype"] = "bfloat16"
        if self.routed_expert_format == "mxfp4":
            text["quantization_config"] = mxfp4_quantization_config()
        if self.model_type == "kimi_linear":
            return text
        top = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if "quantization_config" in text:
            top["quantization_config"] = text.pop("quantization_config")
        return top

    def save(self, out_dir: str | Path) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


def mxfp4_quantization_config() -> dict[str, Any]:
    """compressed-tensors style description of MXFP4 routed experts (group 32, e8m0 scales)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["re:.*block_sparse_moe\\.experts\\..*"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False},
                "format": "mxfp4-pack-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*shared_experts.*", "re:.*self_attn.*", "re:.*mlp\\..*"],
    }


def _is_mxfp4(quant: dict[str, Any] | None) -> bool:
    if not quant:
        return False
    if "mxfp4" in str(quant.get("format", "")).lower() or quant.get("quant_method") == "mxfp4":
        return True
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits") == 4 and weights.get("type") == "float" and weights.get("group_size") == 32:
            return True
    return False


def _normalize_text_config(text: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Map transformers' aliases and derived fields onto the published field names."""
    out = dict(text)
    out["model_type"] = model_type
    aliases = {
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
        "model_max_length": "max_position_embeddings",
    }
    for alias, name in aliases.items():
        if alias in out and name not in out:
            out[name] = out[alias]
    if isinstance(out.get("eos_token_id"), list):
        out["eos_token_id"] = out["eos_token_id"][0] if out["eos_token_id"] else None
    if "linear_attn_config" not in out and "layer_types" in out:
        # transformers-only layout: derive the 1-based layer lists from layer_types.
        types = out["layer_types"]
        out["linear_attn_config"] = {
            "num_heads": out.get("linear_num_heads", 32),
            "head_dim": out.get("linear_head_dim", 128),
            "short_conv_kernel_size": out.get("linear_conv_kernel_dim", 4),
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        }
    if "first_k_dense_replace" not in out and "mlp_layer_types" in out:
        kinds = out["mlp_layer_types"]
        out["first_k_dense_replace"] = next((i for i, k in enumerate(kinds) if k != "dense"), len(kinds))
    if "routed_expert_format" not in out:
        out["routed_expert_format"] = "mxfp4" if _is_mxfp4(out.get("quantization_config")) else "dense"
    return out
