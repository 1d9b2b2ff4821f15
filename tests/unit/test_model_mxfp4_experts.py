"""Routed experts held as the checkpoint's MXFP4 bytes (``experts="packed"``): what is loaded, that
the model computes what the dequantized model does (CPU: the reference, dequantize then matmul),
the helix loader's shards, saving them back unchanged, and the ``experts`` option's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helixserve.kernels import MXFP4Weight
from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.checkpoint import CheckpointError, save_checkpoint
from helixserve.models.helix_load import load_helix_model
from helixserve.models.loading import load_model, resolve_expert_format
from helixserve.models.moe import RoutedExperts
from helixserve.models.presets import get_preset, make_checkpoint
from helixserve.parallel import Mapping
from tests._testing import assert_close

PREFIX = "language_model.model.layers.1.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def k3_tiny(tmp_path_factory) -> Path:
    return make_checkpoint("kimi-k3-tiny", tmp_path_factory.mktemp("mx") / "k3", seed=5)


def _logits(model, cfg, tokens: list[int]) -> torch.Tensor:
    batch = build_batch([SeqChunk(tokens, 0, 0)], 16, 4)
    with torch.no_grad():
        return model(batch, allocate_caches(cfg, 8, 16, 2, dtype=model.dtype))


def _experts(model) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def test_packed_load_keeps_the_checkpoint_bytes(k3_tiny: Path) -> None:
    stored = load_file(str(k3_tiny / "model.safetensors"))
    model = load_model(k3_tiny, experts="packed")
    experts = _experts(model)
    assert experts and all(e.is_mxfp4 for e in experts)
    layer1 = model.model.layers[1].block_sparse_moe.experts
    assert not any(n.endswith((".w13", ".w2")) for n, _ in model.named_parameters())
    w13, w2 = layer1.stacks()
    assert isinstance(w13, MXFP4Weight) and w13.packed.dtype == torch.uint8
    E, I = 8, 64
    for e in (0, E - 1):
        assert torch.equal(w13.packed[e, :I], stored[f"{PREFIX}.{e}.w1.weight_packed"])
        assert torch.equal(w13.packed[e, I:], stored[f"{PREFIX}.{e}.w3.weight_packed"])
        assert torch.equal(w13.scale[e, I:], stored[f"{PREFIX}.{e}.w3.weight_scale"])
        assert torch.equal(w2.packed[e], stored[f"{PREFIX}.{e}.w2.weight_packed"])
        assert torch.equal(w2.scale[e], stored[f"{PREFIX}.{e}.w2.weight_scale"])
    assert layer1.stacks()[0] is w13  # made once, not per step
    layer1.w13_packed = w13.packed.clone()  # what a move or a reload does to the buffers
    assert layer1.stacks()[0] is not w13 and layer1.stacks()[0].packed is layer1.w13_packed
    dense = load_model(k3_tiny, experts="dense").model.layers[1].block_sparse_moe.experts
    assert torch.equal(w13.dequantize(), dense.w13) and torch.equal(w2.dequantize(), dense.w2)
    # 4.25 bits a weight: the packed stacks are 17/128 of fp32 ones
    assert w13.nbytes + w2.nbytes == (dense.w13.numel() + dense.w2.numel()) * 17 // 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_model_computes_what_the_dequantized_one_does(k3_tiny: Path, dtype: torch.dtype) -> None:
    cfg = get_preset("kimi-k3-tiny")
    tokens = list(range(30, 57))
    dense = _logits(load_model(k3_tiny, dtype=dtype, experts="dense"), cfg, tokens)
    packed = _logits(load_model(k3_tiny, dtype=dtype, experts="packed"), cfg, tokens)
    if dtype == torch.float32:
        assert_close("logits", dense, packed, 1e-5)
    else:  # bf16 GEMM forms differ (column-major bags vs row-major): rounding, not values
        assert_close("logits", dense.float(), packed.float(), 3e-2)


def test_helix_loader_packed_world_of_one_and_expert_shards(k3_tiny: Path) -> None:
    cfg = get_preset("kimi-k3-tiny")
    one = load_helix_model(k3_tiny, Mapping(1, 0, dp=1, cp=1), experts="packed")
    full = load_model(k3_tiny, experts="packed")
    for a, b in zip(_experts(one), _experts(full), strict=True):
        assert a.is_mxfp4 and torch.equal(a.w13_packed, b.w13_packed) and torch.equal(a.w2_scale, b.w2_scale)
    tokens = list(range(3, 20))
    assert_close("world of one", _logits(full, cfg, tokens), _logits(one, cfg, tokens), 1e-5)
    # a rank of an expert-parallel world of 2 holds experts [4, 8) of every MoE layer, packed
    rank1 = load_helix_model(k3_tiny, Mapping(2, 1, dp=1, cp=2), experts="packed")
    for a, b in zip(_experts(rank1), _experts(full), strict=True):
        assert a.w13_packed.shape[0] == 4
        assert torch.equal(a.w13_packed, b.w13_packed[4:]) and torch.equal(a.w2_scale, b.w2_scale[4:])


def test_packed_model_saves_the_same_bytes(k3_tiny: Path, tmp_path: Path) -> None:
    cfg = get_preset("kimi-k3-tiny")
    model = load_model(k3_tiny, experts="packed")
    save_checkpoint(model, cfg, tmp_path, torch.float32)
    a, b = load_file(str(k3_tiny / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        if ".experts." in name:
            assert torch.equal(a[name], b[name]), name


def test_expert_format_option(k3_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helixserve.models import loading

    k3, linear = get_preset("kimi-k3-tiny"), get_preset("kimi-linear-tiny")
    monkeypatch.setattr(loading, "has_triton", lambda: True)  # as on a GPU machine with the gpu extra
    assert resolve_expert_format("auto", k3, torch.bfloat16, "cuda") == "packed"
    monkeypatch.setattr(loading, "has_triton", lambda: False)
    assert resolve_expert_format("auto", k3, torch.bfloat16, "cuda") == "dense"  # no Triton: dequantized
    # auto: dense on the CPU, in fp32, and for dense checkpoints, whatever the device
    assert resolve_expert_format("auto", k3, torch.bfloat16, "cpu") == "dense"
    assert resolve_expert_format("auto", k3, torch.float32, "cuda") == "dense"
    assert resolve_expert_format("auto", linear, torch.bfloat16, "cuda") == "dense"
    assert resolve_expert_format("packed", k3, torch.float32, "cpu") == "packed"
    assert resolve_expert_format("dense", k3, torch.bfloat16, "cuda") == "dense"
    with pytest.raises(CheckpointError, match="needs a checkpoint with MXFP4 routed experts"):
        resolve_expert_format("packed", linear, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="experts must be 'auto', 'packed' or 'dense', got 'fp4'"):
        load_model(k3_tiny, experts="fp4")
    assert not any(e.is_mxfp4 for e in _experts(load_model(k3_tiny)))  # the CPU default: dequantized


def test_the_deployment_config_chooses_the_expert_format(k3_tiny: Path) -> None:
    """``model.experts`` reaches the loader on the serving paths (single engine and gen world)."""
    from pydantic import ValidationError

    from helixserve.config import DeploymentConfig
    from helixserve.engine.llm import LLM
    from helixserve.serving.world_core import world_options

    llm = LLM(k3_tiny, experts="packed")
    assert all(e.is_mxfp4 for e in _experts(llm.engine.runner.model))
    base = {"model": {"path": str(k3_tiny), "experts": "packed"}, "ctx": [{"port": 8100}], "gen": [{"port": 8200}],
            "transceiver": {"kv_transfer_timeout_ms": 5000}}
    deploy = DeploymentConfig.model_validate(base)
    assert world_options(deploy, deploy.gen[0]).experts == "packed"
    with pytest.raises(ValidationError, match="experts"):
        DeploymentConfig.model_validate({**base, "model": {"path": str(k3_tiny), "experts": "fp4"}})
