"""Checkpoint metadata: ``quantization_config`` checked against the tensors, vision tensors skipped
with one log line."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helixserve.models.checkpoint import CheckpointError
from helixserve.models.loading import load_model
from helixserve.models.helix_load import load_helix_model
from helixserve.models.presets import make_checkpoint
from helixserve.models.quantization import check_checkpoint_quantization, parse_quantization_config
from helixserve.models.config import KimiModelConfig
from helixserve.parallel import Mapping

EXPERT = "model.layers.1.block_sparse_moe.experts.0.w1"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(name, root / name, seed=5) for name in ("kimi-linear-tiny", "kimi-k3-tiny")}


def _copy(src: Path, dst: Path, edit_quant=None, edit_tensors=None) -> Path:
    """``src`` with its (top-level) quantization_config and tensors edited."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_quant:
        config["quantization_config"] = edit_quant(copy.deepcopy(config.get("quantization_config")))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _check(path: Path) -> None:
    check_checkpoint_quantization(path, KimiModelConfig.from_pretrained(path))


def test_published_mxfp4_config_matches_its_tensors(ckpts):
    _check(ckpts["kimi-k3-tiny"])
    _check(ckpts["kimi-linear-tiny"])  # no quantization_config, no packed tensors


def test_group_size_other_than_32_is_named(ckpts, tmp_path):
    def group_16(q):
        q["config_groups"]["group_0"]["weights"]["group_size"] = 16
        return q

    path = _copy(ckpts["kimi-k3-tiny"], tmp_path, group_16)
    with pytest.raises(CheckpointError, match=r"config_groups\.group_0\.weights\.group_size is 16"):
        load_model(path)
    with pytest.raises(CheckpointError, match="group_size is 16"):  # the sharded loader checks too
        load_helix_model(path, Mapping(world_size=1, rank=0, dp=1, cp=1))


def test_int4_and_other_methods_are_refused():
    int4 = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}
    with pytest.raises(CheckpointError, match=r"g\.weights\.type is 'int'"):
        parse_quantization_config(int4)
    with pytest.raises(CheckpointError, match="quant_method 'gptq'"):
        parse_quantization_config({"quant_method": "gptq"})
    assert parse_quantization_config(None) is None


def test_listed_module_without_packed_tensors_is_named(ckpts, tmp_path):
    def also_attention(q):
        q["config_groups"]["group_0"]["targets"].append("re:.*layers\\.3\\.self_attn\\.q_a_proj$")
        q["ignore"] = [i for i in q["ignore"] if "self_attn" not in i]
        return q

    path = _copy(ckpts["kimi-k3-tiny"], tmp_path, also_attention)
    with pytest.raises(CheckpointError, match=r"language_model\.model\.layers\.3\.self_attn\.q_a_proj is listed "
                                              r"as quantized \(MXFP4\) but has no weight_packed"):
        _check(path)


def test_dense_experts_under_an_mxfp4_config_are_named(ckpts, tmp_path):
    from helixserve.models.config import mxfp4_quantization_config

    path = _copy(ckpts["kimi-linear-tiny"], tmp_path, lambda q: mxfp4_quantization_config())
    with pytest.raises(CheckpointError, match=rf"{EXPERT} is listed as quantized"):
        load_model(path)


def test_packed_module_not_listed_is_named(ckpts, tmp_path):
    def ignore_layer_2(q):
        q["ignore"].append("re:.*layers\\.2\\.block_sparse_moe.*")
        return q

    path = _copy(ckpts["kimi-k3-tiny"], tmp_path, ignore_layer_2)
    with pytest.raises(CheckpointError, match=r"layers\.2\.block_sparse_moe\.experts\.0\.w1 has weight_packed but "
                                              r"quantization_config does not list it"):
        _check(path)


def test_class_target_with_k2_style_ignore_list(ckpts, tmp_path):
    def linear_target(q):
        q["config_groups"]["group_0"]["targets"] = ["Linear"]
        q["ignore"] = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
                       "re:.*routed_expert_(up|down)_proj.*"]
        return q

    _check(_copy(ckpts["kimi-k3-tiny"], tmp_path / "ok", linear_target))
    scale = f"language_model.{EXPERT}.weight_scale"
    path = _copy(ckpts["kimi-k3-tiny"], tmp_path / "bad", linear_target, lambda t: t.pop(scale))
    with pytest.raises(CheckpointError, match=f"missing tensor {scale}"):
        _check(path)


def test_vision_tensors_are_skipped_with_one_log_line(ckpts, tmp_path, caplog):
    extra = {"vision_tower.patch_embed.weight": torch.zeros(3), "mm_projector.proj.0.weight": torch.zeros(3),
             "vision_tower.blocks.0.attn.qkv.weight_packed": torch.zeros(2, dtype=torch.uint8)}
    path = _copy(ckpts["kimi-k3-tiny"], tmp_path, edit_tensors=lambda t: t.update(extra))
    with caplog.at_level(logging.INFO, logger="helixserve.models.checkpoint"):
        model = load_model(path)
    lines = [r.getMessage() for r in caplog.records if "vision_tower" in r.getMessage()]
    assert lines == [f"{path}: skipped 3 vision_tower.* / mm_projector.* tensors (text serving)"]
    reference = load_model(ckpts["kimi-k3-tiny"])
    for name, t in reference.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name
