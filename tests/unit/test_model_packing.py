"""CPU weight packing (fused input projections, GEMM forms by row count): same names, shapes and
values; the same logits up to fp32 rounding; parameters stay views of the fused weights; saving works."""

from __future__ import annotations

import pytest
import torch

from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.checkpoint import save_checkpoint
from helixserve.models.loading import load_model
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.packing import PackedLinear, _pack_tree, pack_for_cpu, packed_linear
from helixserve.models.presets import get_preset, init_random_weights
from tests._testing import _err_ratio, assert_close

PRESETS = ["kimi-linear-tiny", "kimi-k3-tiny"]
TPB, BLOCKS_PER_SEQ = 8, 8


def _pair(preset: str, dtype: torch.dtype = torch.float32,
          host_forms: bool = True) -> tuple[KimiForCausalLM, KimiForCausalLM]:
    plain = KimiForCausalLM(get_preset(preset)).eval().requires_grad_(False)
    init_random_weights(plain, seed=5)
    plain = plain.to(dtype)
    packed = KimiForCausalLM(get_preset(preset), dtype=dtype).eval().requires_grad_(False)
    packed.load_state_dict(plain.state_dict())
    if host_forms:
        return plain, pack_for_cpu(packed)
    with torch.no_grad():
        _pack_tree(packed, is_root=True, host_forms=False)
    return plain, packed


def _steps(model: KimiForCausalLM) -> list[torch.Tensor]:
    """A prefill of three sequences, a decode step, then a 3-token continuation chunk."""
    caches = allocate_caches(model.cfg, 4 * BLOCKS_PER_SEQ, TPB, 4, dtype=model.dtype)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (29, 4, 17)]
    outs = []
    with torch.no_grad():
        for chunks in (
            [SeqChunk(p, 0, s) for s, p in enumerate(prompts)],
            [SeqChunk([7], len(p), s) for s, p in enumerate(prompts)],
            [SeqChunk([9, 10, 11], len(p) + 1, s) for s, p in enumerate(prompts)],
        ):
            outs.append(model(build_batch(chunks, TPB, BLOCKS_PER_SEQ), caches))
    return outs


@pytest.mark.parametrize("host_forms", [True, False])
@pytest.mark.parametrize("preset", PRESETS)
def test_packing_keeps_names_shapes_values_and_logits(preset: str, host_forms: bool) -> None:
    """``host_forms=False``: the device's packing (fused projections only), run here on the CPU."""
    plain, packed = _pair(preset, host_forms=host_forms)
    want, got = plain.state_dict(), packed.state_dict()
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert got[name].shape == t.shape and torch.equal(got[name], t), name
    # fp32 rounding of the plain model itself is ~1e-5 (relative RMS) on kimi-k3-tiny: judge the packed
    # model against a float64 run (KDA states stay fp32 by layout), next to the plain model
    exact = KimiForCausalLM(get_preset(preset), dtype=torch.float64).eval().requires_grad_(False)
    exact.load_state_dict({k: v.double() for k, v in want.items()})
    for step, (ref, a, b) in enumerate(zip(_steps(exact), _steps(plain), _steps(packed), strict=True)):
        assert_close(f"step {step} packed vs plain", a, b, 5e-5)
        assert _err_ratio(ref, b) <= 2 * _err_ratio(ref, a) + 1e-6, f"step {step}: packed drifts from float64"


@pytest.mark.parametrize("preset", PRESETS)
def test_parameters_are_views_of_the_fused_weights(preset: str) -> None:
    _, packed = _pair(preset)
    layers = packed.model.layers
    kda = next(layer.self_attn for layer in layers if layer.is_kda)
    mla = next(layer.self_attn for layer in layers if not layer.is_kda)
    moe = next(layer.block_sparse_moe for layer in layers if layer.is_moe)
    assert kda.in_proj is not None and mla.in_proj is not None and moe.in_proj is not None
    with torch.no_grad():
        kda.k_proj.weight.mul_(2.0)
        kda.v_conv1d.weight.add_(1.0)
        moe.gate.weight.zero_()
    width = kda.num_heads * kda.head_dim
    assert torch.equal(kda.in_proj[width:2 * width], kda.k_proj.weight)
    assert torch.equal(kda.conv_weight()[2 * width:], kda.v_conv1d.weight.squeeze(1))
    assert moe.is_router_packed and torch.equal(moe.in_proj[:moe.gate.weight.shape[0]], moe.gate.weight)
    assert isinstance(kda.o_proj, PackedLinear) and torch.equal(kda.o_proj.weight_cols, kda.o_proj.weight)
    plain_names = {name for name, _ in _pair(preset)[0].named_parameters()}
    assert {name for name, _ in packed.named_parameters()} == plain_names
    assert set(packed.state_dict()) == set(_pair(preset)[0].state_dict())


@pytest.mark.parametrize("rows", [1, 5])
def test_kda_gate_projections_as_one_bmm_match_the_linears(rows: int) -> None:
    """Packed low-rank gates: f_b_proj and g_b_proj run as one bmm over the adjacent f_a | g_a columns
    (several rows) or as the two packed linears (one row); both give the unpacked projections, and
    the linears' column-major copies are views of the bmm's stack (held once)."""
    plain, packed = _pair("kimi-linear-tiny")
    i = next(i for i, layer in enumerate(packed.model.layers) if layer.is_kda)
    kda, ref = packed.model.layers[i].self_attn, plain.model.layers[i].self_attn
    assert kda.f_g_b_stack is not None
    assert kda.f_b_proj.weight_cols.untyped_storage().data_ptr() == kda.f_g_b_stack.untyped_storage().data_ptr()
    assert torch.equal(kda.g_b_proj.weight_cols, kda.g_b_proj.weight)
    x = torch.randn(rows, packed.cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        for name, want, got in zip(("qkv", "f", "b", "gate"), ref._project(x), kda._project(x), strict=True):
            assert_close(name, want, got, 1e-6)


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 200])
def test_packed_linear_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=gen)
    x = torch.randn(rows, 80, generator=gen)[:, ::2]  # a strided input, like a split projection
    cols = weight.t().contiguous().t()
    out = packed_linear(x, weight, cols)
    assert out.shape == (rows, 48) and out.is_contiguous()
    assert_close("packed_linear", torch.nn.functional.linear(x, weight), out, 1e-6)


def test_bf16_router_stays_separate() -> None:
    plain, packed = _pair("kimi-linear-tiny", torch.bfloat16)
    moe = next(layer.block_sparse_moe for layer in packed.model.layers if layer.is_moe)
    assert not moe.is_router_packed and moe.in_proj is not None  # the shared experts' gate and up only
    for ref, out in zip(_steps(plain), _steps(packed), strict=True):
        assert torch.corrcoef(torch.stack([ref.flatten(), out.flatten()]))[0, 1] > 0.99


def test_packed_model_saves_and_loads_packed(tmp_path) -> None:
    cfg = get_preset("kimi-k3-tiny")
    _, packed = _pair("kimi-k3-tiny")
    save_checkpoint(packed, cfg, tmp_path, torch.float32)  # views of fused weights: no shared storage error
    loaded = load_model(tmp_path)
    assert next(layer.self_attn for layer in loaded.model.layers if layer.is_kda).in_proj is not None
    for ref, out in zip(_steps(packed), _steps(loaded), strict=True):
        assert_close("reloaded", ref, out, 1e-5)
