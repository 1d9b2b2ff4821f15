"""Kimi checkpoints' tensors in the original (published) names: read, canonicalized and checked
for loading (:mod:`~helixserve.models.loading` builds the model from them), and saved.

Accepted on load:

- ``model.safetensors`` or ``model.safetensors.index.json`` + shards;
- K3: names under ``language_model.`` (``vision_tower.*`` / ``mm_projector.*`` are skipped);
- routed experts as ``.weight`` or MXFP4 ``.weight_packed`` + ``.weight_scale``: dequantized here, or
  kept as MXFP4 bytes (``experts="packed"``, the default on CUDA in bf16 with Triton; see
  :func:`~helixserve.models.loading.resolve_expert_format`);
- ``A_log`` as ``[1, 1, H, 1]``, ``[H]``, or K3's zero-padded ``[>= H]`` (first H kept);
- what transformers' ``save_pretrained`` writes for ``KimiLinearForCausalLM``: the original names,
  except that its reverse mapping puts the dense layer-0 FFN under ``block_sparse_moe.*``; also
  transformers' in-memory names (``forget_gate.*``, fused ``conv1d``, ``mlp.experts.gate_up_proj``).

Every check failure raises :class:`CheckpointError` naming the tensors and shapes.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helixserve.models.config import KimiModelConfig
from helixserve.kernels.moe.mxfp4 import scale_bytes
from helixserve.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
FP32_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias")
_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w1|w2|w3)\.weight(_packed|_scale)?$")
# stacked dense experts, or (suffix _packed / _scale) their MXFP4 bytes
_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w13|w2)(_packed|_scale)?$")
ExpertFormat = Literal["auto", "packed", "dense"]


class CheckpointError(ValueError):
    """A checkpoint does not match the model config (missing / unexpected / mis-shaped tensors)."""


# ---------------------------------------------------------------- reading


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json found")


def iter_checkpoint_keys(model_dir: str | Path, cfg: KimiModelConfig,
                         log_skipped: bool = True) -> Iterator[tuple[Path, Any, str, str]]:
    """``(shard path, open shard, stored key, name)`` of every language-model tensor of ``model_dir``;
    ``name`` is the key without the K3 ``language_model.`` prefix. The shard stays open (for
    ``get_tensor`` / ``get_slice``) until the next shard's keys start. ``vision_tower.*`` /
    ``mm_projector.*`` are skipped, with one log line (``log_skipped``) once all keys were read."""
    prefix = cfg.weight_prefix
    skipped = 0
    for path in _shard_files(Path(model_dir)):
        if not path.is_file():
            raise CheckpointError(f"shard {path.name} listed in the index is missing from {model_dir}")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(SKIPPED_PREFIXES):
                    skipped += 1
                    continue
                if prefix and not key.startswith(prefix):
                    raise CheckpointError(f"unexpected tensor {key!r}: K3 weights must start with {prefix!r}")
                yield path, f, key, key[len(prefix):]
    if skipped and log_skipped:
        logger.info("%s: skipped %d vision_tower.* / mm_projector.* tensors (text serving)", model_dir, skipped)


def read_checkpoint_tensors(model_dir: str | Path, cfg: KimiModelConfig,
                            log_skipped: bool = True) -> dict[str, torch.Tensor]:
    """Every language-model tensor of ``model_dir``, with the K3 ``language_model.`` prefix removed."""
    keys = iter_checkpoint_keys(model_dir, cfg, log_skipped)
    return {name: f.get_tensor(key) for _, f, key, name in keys}


# ---------------------------------------------------------------- canonical (original-name) form


def _rename_hf_runtime(name: str) -> str:
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    for part in ("gate.", "experts.", "shared_experts.", "routed_expert_"):
        name = name.replace(f".mlp.{part}", f".block_sparse_moe.{part}")
    return name


def canonicalize(tensors: dict[str, torch.Tensor], cfg: KimiModelConfig,
                 keep_mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """Original names, unquantized routed experts (``keep_mxfp4``: their ``weight_packed`` /
    ``weight_scale`` bytes as stored, scales as uint8), ``A_log`` as ``[H]``."""
    out: dict[str, torch.Tensor] = {}
    for raw_name, t in tensors.items():
        name = _rename_hf_runtime(raw_name)
        m = re.match(r"^model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m and not cfg.is_moe_layer(int(m.group(1))):
            name = f"model.layers.{m.group(1)}.mlp.{m.group(2)}.weight"
        if keep_mxfp4 and name.endswith((".weight_packed", ".weight_scale")):
            out[name] = scale_bytes(t) if name.endswith(".weight_scale") else t
        elif name.endswith(".weight_scale"):
            continue
        elif name.endswith(".weight_packed"):
            out[name.removesuffix("_packed")] = _dequantize(raw_name, t, tensors)
        elif name.endswith(".self_attn.conv1d.weight"):
            for part, w in zip("qkv", t.chunk(3, dim=0)):
                out[name.replace(".conv1d.", f".{part}_conv1d.")] = w
        elif name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            for e, w in enumerate(t):
                w1, w3 = w.chunk(2, dim=0)
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = w1, w3
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e, w in enumerate(t):
                out[f"{base}.{e}.w2.weight"] = w
        elif name.endswith(".self_attn.A_log"):
            out[name] = _normalize_a_log(name, t, cfg.kda_num_heads)
        else:
            out[name] = t
    return out


def _dequantize(packed_name: str, packed: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    scale_name = packed_name.removesuffix("_packed") + "_scale"
    if scale_name not in tensors:
        raise CheckpointError(f"missing tensor {scale_name!r} (MXFP4 scale for {packed_name!r})")
    try:
        return dequantize_mxfp4(packed, tensors[scale_name])
    except ValueError as exc:
        raise CheckpointError(f"{packed_name!r}: {exc}") from exc


def _normalize_a_log(name: str, t: torch.Tensor, num_heads: int) -> torch.Tensor:
    if t.numel() == num_heads and t.shape in ((num_heads,), (1, 1, num_heads, 1)):
        return t.reshape(num_heads)
    if t.dim() == 1 and t.numel() > num_heads:
        return t[:num_heads]  # K3 pads A_log with a zero tail (96 -> 128)
    raise CheckpointError(
        f"tensor {name!r} has shape {tuple(t.shape)}, expected (1, 1, {num_heads}, 1), ({num_heads},) "
        f"or a padded 1-D tensor of at least {num_heads}"
    )


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Canonical names and shapes the model needs (tied ``lm_head`` excluded)."""
    cfg: KimiModelConfig = model.cfg
    out: dict[str, tuple[int, ...]] = {}
    for name, t in _internal_tensors(model):
        m = _STACKED_RE.match(name)
        if m is None:
            out[name] = tuple(t.shape)
            continue
        E, rows, cols = t.shape
        suffix = m.group(3) or ""
        for e in range(E):
            if m.group(2) == "w2":
                out[f"{m.group(1)}.{e}.w2.weight{suffix}"] = (rows, cols)
            else:
                out[f"{m.group(1)}.{e}.w1.weight{suffix}"] = (rows // 2, cols)
                out[f"{m.group(1)}.{e}.w3.weight{suffix}"] = (rows // 2, cols)
    return out if not cfg.tie_word_embeddings else {k: v for k, v in out.items() if k != "lm_head.weight"}


def check_tensors(canonical: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(canonical))
    unexpected = sorted(set(canonical) - set(expected))
    misshaped = [
        f"{k}: checkpoint {tuple(canonical[k].shape)} vs model {expected[k]}"
        for k in sorted(set(expected) & set(canonical)) if tuple(canonical[k].shape) != expected[k]
    ]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label} tensors: {shown}")
    if problems:
        raise CheckpointError("; ".join(problems))


def to_internal(canonical: dict[str, torch.Tensor], cfg: KimiModelConfig) -> dict[str, torch.Tensor]:
    """Stack per-expert weights into ``experts.w13 [E, 2I, De]`` / ``experts.w2 [E, De, I]`` (MXFP4
    bytes kept by :func:`canonicalize`: into ``experts.w13_packed`` / ``w13_scale`` / ...)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[str, list[torch.Tensor | None]]] = {}
    for name, t in canonical.items():
        m = _EXPERT_RE.match(name)
        if m is None:
            out[name] = t
            continue
        per_kind = experts.setdefault((m.group(1), m.group(4) or ""),
                                      {k: [None] * cfg.num_experts for k in ("w1", "w2", "w3")})
        per_kind[m.group(3)][int(m.group(2))] = t
    for (base, suffix), per_kind in experts.items():
        out[f"{base}.w13{suffix}"] = torch.stack([torch.cat([a, b]) for a, b in zip(per_kind["w1"], per_kind["w3"])])
        out[f"{base}.w2{suffix}"] = torch.stack(per_kind["w2"])
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---------------------------------------------------------------- model load


# ---------------------------------------------------------------- save


def _internal_tensors(model_or_state: torch.nn.Module | dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(model_or_state, dict):
        yield from model_or_state.items()
    else:
        yield from model_or_state.state_dict().items()


def to_checkpoint_tensors(
    model_or_state: torch.nn.Module | dict[str, torch.Tensor], cfg: KimiModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Original names (with the K3 prefix); routed experts as MXFP4 when ``cfg.routed_expert_format``."""
    out: dict[str, torch.Tensor] = {}
    quantize = cfg.routed_expert_format == "mxfp4"
    cast: Callable[[str, torch.Tensor], torch.Tensor] = lambda n, t: (
        t.float() if n.endswith(FP32_SUFFIXES) else t.to(dtype)
    ).contiguous()
    for name, t in _internal_tensors(model_or_state):
        t = t.detach().cpu()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = _STACKED_RE.match(name)
        if m is None:
            if name.endswith(".self_attn.A_log"):
                t = _a_log_for_save(t, cfg)
            out[name] = cast(name, t)
            continue
        if m.group(3):  # MXFP4 bytes held as loaded: saved as they are
            for e, w in enumerate(t):
                parts = {"w2": w} if m.group(2) == "w2" else dict(zip(("w1", "w3"), w.chunk(2, dim=0)))
                for kind, wk in parts.items():
                    out[f"{m.group(1)}.{e}.{kind}.weight{m.group(3)}"] = wk.contiguous()
            continue
        for e, w in enumerate(t):
            parts = {"w2": w} if m.group(2) == "w2" else dict(zip(("w1", "w3"), w.chunk(2, dim=0)))
            for kind, wk in parts.items():
                base = f"{m.group(1)}.{e}.{kind}"
                if quantize:
                    out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = quantize_mxfp4(wk)
                else:
                    out[f"{base}.weight"] = cast(base, wk)
    return {cfg.weight_prefix + k: v for k, v in out.items()}


def _a_log_for_save(t: torch.Tensor, cfg: KimiModelConfig) -> torch.Tensor:
    H = t.numel()
    if cfg.model_type == "kimi_linear":
        return t.reshape(1, 1, H, 1)
    padded = t.new_zeros(-(-H // 64) * 64)  # K3 layout: zero tail to a multiple of 64 (96 -> 128)
    padded[:H] = t
    return padded


def save_checkpoint(
    model_or_state: torch.nn.Module | dict[str, torch.Tensor],
    cfg: KimiModelConfig,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the original names; returns ``out_dir``.

    MXFP4 (``cfg.routed_expert_format == "mxfp4"``) rounds routed expert weights to FP4.
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out)
    tensors = to_checkpoint_tensors(model_or_state, cfg, dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
