"""Loading a model from a checkpoint directory: the expert format resolved, the model built on the
meta device, the checkpoint's tensors read, canonicalized, checked and assigned.

Above both :mod:`~helixserve.models.checkpoint` (names, tensors, saving) and
:mod:`~helixserve.models.kimi` (the model), which import neither this nor each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from helixserve.kernels.triton_common import has_triton
from helixserve.models.checkpoint import (CheckpointError, ExpertFormat, canonicalize, check_tensors, expected_shapes,
                                          read_checkpoint_tensors, to_internal)
from helixserve.models.config import KimiModelConfig
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.moe import RoutedExperts
from helixserve.models.packing import pack_for_inference
from helixserve.models.quantization import check_checkpoint_quantization


def resolve_expert_format(experts: ExpertFormat, cfg: KimiModelConfig, dtype: torch.dtype,
                          device: str | torch.device) -> Literal["packed", "dense"]:
    """How routed experts are held: ``"packed"`` (the checkpoint's MXFP4 bytes, dequantized inside
    the expert GEMM) or ``"dense"`` (dequantized to ``dtype`` at load). ``"auto"``: packed when the
    checkpoint is MXFP4 and the model runs in bf16 on CUDA with the Triton kernels, else dense (the
    CPU, fp32 models and dense checkpoints). ``"packed"`` of a dense checkpoint is an error."""
    if experts not in ("auto", "packed", "dense"):
        raise ValueError(f"experts must be 'auto', 'packed' or 'dense', got {experts!r}")
    is_mxfp4 = cfg.routed_expert_format == "mxfp4"
    if experts == "packed" and not is_mxfp4:
        raise CheckpointError("experts='packed' needs a checkpoint with MXFP4 routed experts "
                              f"(quantization_config); this one's are {cfg.routed_expert_format!r}")
    if experts != "auto":
        return experts
    on_cuda = torch.device(device).type == "cuda"
    return "packed" if is_mxfp4 and on_cuda and dtype == torch.bfloat16 and has_triton() else "dense"


def use_mxfp4_experts(model: torch.nn.Module) -> None:
    """Every routed-expert stack of ``model`` held as MXFP4 bytes (:meth:`RoutedExperts.use_mxfp4`)."""
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.use_mxfp4()


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``load_state_dict`` fills: parameters (tied ones under each name) and persistent buffers."""
    return {**model.state_dict(keep_vars=True), **dict(model.named_parameters(remove_duplicate=False))}


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    experts: ExpertFormat = "auto",
) -> torch.nn.Module:
    """Build :class:`~helixserve.models.kimi.KimiForCausalLM` from an HF-format checkpoint dir.

    ``experts``: see :func:`resolve_expert_format`. Its weights are packed for inference
    (:func:`~helixserve.models.packing.pack_for_inference`: fused input projections, on the CPU
    column-major storage too; same names, shapes and values)."""
    cfg = KimiModelConfig.from_pretrained(model_dir)
    check_checkpoint_quantization(model_dir, cfg)
    is_packed = resolve_expert_format(experts, cfg, dtype, device) == "packed"
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype=dtype)
    if is_packed:
        use_mxfp4_experts(model)
    canonical = canonicalize(read_checkpoint_tensors(model_dir, cfg), cfg, keep_mxfp4=is_packed)
    check_tensors(canonical, expected_shapes(model))
    internal = to_internal(canonical, cfg)
    params = model_tensors(model)
    state = {name: internal[name].to(device=device, dtype=params[name].dtype) for name in params}
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return pack_for_inference(model.eval().requires_grad_(False))
