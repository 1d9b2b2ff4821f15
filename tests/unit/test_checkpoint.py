"""Checkpoint load/save in the original names: round trips, MXFP4, K3 layout, named errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.checkpoint import CheckpointError, save_checkpoint
from helixserve.models.loading import load_model
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from helixserve.models.presets import get_preset, init_random_weights, make_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(name, root / name, seed=3) for name in ("kimi-linear-tiny", "kimi-k3-tiny")}


def _keys(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


# ---------------------------------------------------------------- MXFP4


def test_mxfp4_known_values() -> None:
    # codes 0..15 in one group of 32: byte j holds element 2j (low nibble) and 2j+1 (high nibble)
    codes = torch.arange(32) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, 16)
    for s, factor in ((127, 1.0), (128, 2.0), (125, 0.25)):
        out = dequantize_mxfp4(packed, torch.tensor([[s]], dtype=torch.uint8))
        expected = torch.tensor([E2M1_VALUES[c] * factor for c in codes.tolist()])
        assert torch.equal(out, expected.view(1, 32)), s
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    # a single byte 0x71: low nibble 1 -> 0.5 first, high nibble 7 -> 6.0 second
    one = dequantize_mxfp4(torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
    assert one[0, :2].tolist() == [0.5, 6.0]
    # 0xA9: -0.5 (code 9) then -1.0 (code 10); scale byte 130 = 2^3
    two = dequantize_mxfp4(torch.tensor([[0xA9] + [0] * 15], dtype=torch.uint8), torch.tensor([[130]], dtype=torch.uint8))
    assert two[0, :2].tolist() == [-4.0, -8.0]


def test_mxfp4_e8m0_dtype_and_shape_errors() -> None:
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    if hasattr(torch, "float8_e8m0fnu"):
        scale = torch.full((2, 1), 128, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        assert dequantize_mxfp4(packed | 0x22, scale).unique().tolist() == [2.0]
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))


def test_mxfp4_quantize_round_trip() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (8, 32) and scale.shape == (8, 2) and packed.dtype == scale.dtype == torch.uint8
    deq = dequantize_mxfp4(packed, scale)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(deq)), deq)  # representable values are fixed points
    assert (deq - w).abs().max() <= w.abs().max() / 4  # coarse, but FP4


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
def test_make_checkpoint_round_trip(ckpts: dict[str, Path], preset: str) -> None:
    cfg = get_preset(preset)
    reference = KimiForCausalLM(cfg)
    init_random_weights(reference, seed=3)
    loaded = load_model(ckpts[preset])
    ref_state, got_state = reference.state_dict(), loaded.state_dict()
    assert ref_state.keys() == got_state.keys()
    for name, t in ref_state.items():
        assert torch.equal(t, got_state[name]), name
    for name in ("tokenizer.json", "config.json"):
        assert (ckpts[preset] / name).is_file()


def test_linear_checkpoint_uses_original_names(ckpts: dict[str, Path]) -> None:
    keys = _keys(ckpts["kimi-linear-tiny"])
    assert keys["model.layers.0.self_attn.A_log"] == ((1, 1, 4, 1), "F32")
    assert keys["model.layers.0.self_attn.q_conv1d.weight"][0] == (128, 1, 4)
    assert "model.layers.0.mlp.gate_proj.weight" in keys
    assert keys["model.layers.1.block_sparse_moe.experts.7.w2.weight"][0] == (128, 64)
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight" in keys


def test_k3_checkpoint_layout(ckpts: dict[str, Path]) -> None:
    keys = _keys(ckpts["kimi-k3-tiny"])
    assert all(k.startswith("language_model.") for k in keys)
    p = "language_model.model.layers.1.block_sparse_moe."
    assert keys[p + "experts.0.w1.weight_packed"] == ((64, 32), "U8")
    assert keys[p + "experts.0.w1.weight_scale"] == ((64, 2), "U8")
    assert keys[p + "experts.0.w2.weight_packed"] == ((64, 32), "U8")
    assert p + "experts.0.w1.weight" not in keys
    assert keys[p + "shared_experts.gate_proj.weight"][0] == (128, 128)
    assert keys[p + "routed_expert_down_proj.weight"][0] == (64, 128)
    assert keys["language_model.model.layers.0.self_attn.A_log"] == ((64,), "F32")  # zero-padded 4 -> 64
    assert "language_model.model.output_attn_res_proj.weight" in keys
    assert "language_model.model.layers.3.self_attn.g_proj.weight" in keys  # MLA output gate
    cfg = json.loads((ckpts["kimi-k3-tiny"] / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["attn_res_block_size"] == 2


def test_k3_ignores_vision_and_reads_shards(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["kimi-k3-tiny"]
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    shards["model-00002-of-00002.safetensors"] += ["vision_tower.patch_embed.weight", "mm_projector.proj.0.weight"]
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(3)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(3)
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    a, b = load_model(src), load_model(tmp_path)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_load_logits_match(tmp_path: Path, dtype: torch.dtype) -> None:
    cfg = get_preset("kimi-linear-tiny")
    model = KimiForCausalLM(cfg).eval()
    init_random_weights(model, seed=1)
    save_checkpoint(model, cfg, tmp_path, dtype)
    loaded = load_model(tmp_path, dtype=dtype)
    assert loaded.dtype == dtype and loaded.model.layers[0].self_attn.A_log.dtype == torch.float32
    batch = build_batch([SeqChunk(list(range(40, 60)), 0, 0)], 16, 4)
    with torch.no_grad():
        ref = model(batch, allocate_caches(cfg, 8, 16, 2))
        got = loaded(batch, allocate_caches(cfg, 8, 16, 2, dtype=dtype))
    if dtype == torch.float32:  # the weights round-trip exactly
        loaded_state = loaded.state_dict()
        for name, t in model.state_dict().items():
            assert torch.equal(t, loaded_state[name]), name
    # the CPU load packs the weights (fused GEMMs, column-major storage): fp32 rounding differs a little
    tol = 2e-5 if dtype == torch.float32 else 0.5
    assert (ref - got).abs().max() <= tol


# ---------------------------------------------------------------- errors


def _rewrite(src: Path, dst: Path, edit) -> Path:
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_tensor_is_named(ckpts: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    path = _rewrite(ckpts["kimi-linear-tiny"], tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensors: {name}"):
        load_model(path)


def test_unexpected_tensor_is_named(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _rewrite(ckpts["kimi-linear-tiny"], tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.extra\.weight"):
        load_model(path)


def test_misshaped_tensor_names_both_shapes(ckpts: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.1.block_sparse_moe.gate.weight"
    path = _rewrite(ckpts["kimi-linear-tiny"], tmp_path, lambda t: t.update({name: torch.zeros(7, 128)}))
    with pytest.raises(CheckpointError, match=rf"{name}: checkpoint \(7, 128\) vs model \(8, 128\)"):
        load_model(path)


def test_bad_a_log_and_missing_mxfp4_scale(ckpts: dict[str, Path], tmp_path: Path) -> None:
    a_log = "model.layers.0.self_attn.A_log"
    path = _rewrite(ckpts["kimi-linear-tiny"], tmp_path / "a", lambda t: t.update({a_log: torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=a_log):
        load_model(path)
    scale = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    path = _rewrite(ckpts["kimi-k3-tiny"], tmp_path / "b", lambda t: t.pop(scale))
    with pytest.raises(CheckpointError, match=scale.removeprefix("language_model.")):
        load_model(path)


def test_k3_tensor_outside_prefix_is_rejected(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _rewrite(ckpts["kimi-k3-tiny"], tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(128)}))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(path)


def test_no_weights_file(tmp_path: Path) -> None:
    get_preset("kimi-linear-tiny").save(tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    cfg = get_preset("kimi-linear-tiny").model_copy(update={"tie_word_embeddings": True})
    model = KimiForCausalLM(cfg)
    init_random_weights(model, seed=2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(model, cfg, tmp_path, torch.float32)
    assert "lm_head.weight" not in _keys(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
