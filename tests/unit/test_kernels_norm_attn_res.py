"""RMS norms against transformers' Kimi Linear modules; attn_res_mix against fla's naive_attnres."""

from __future__ import annotations

import pytest
import torch

from helixserve.kernels import attn_res_mix, gated_rms_norm, rms_norm
from helixserve.kernels.attn_res.naive import naive_attn_res_mix
from helixserve.kernels.norm.naive import naive_rms_norm_fp32
from tests._testing import assert_close, load_module_by_path

D, EPS = 16, 1e-5


def rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def hf_modeling():
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(hf_modeling, dtype):
    norm = hf_modeling.KimiLinearRMSNorm(D, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(D, seed=0))
        x = rand(3, 5, D, seed=1, dtype=dtype) * 7
        ref = norm(x)
    out = rms_norm(x, norm.weight.detach(), EPS)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)
    assert_close("vs loop", naive_rms_norm_fp32(x, norm.weight, EPS), out.float(), 5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(hf_modeling, dtype):
    norm = hf_modeling.KimiLinearRMSNormGated(D, eps=EPS)  # fp32 weight, as loaded
    with torch.no_grad():
        norm.weight.copy_(rand(D, seed=2))
        x, gate = rand(4, 2, D, seed=3, dtype=dtype), rand(4, 2, D, seed=4, dtype=dtype)
        ref = norm(x, gate)
    out = gated_rms_norm(x, gate, norm.weight.detach(), EPS)
    assert out.dtype == dtype
    assert torch.equal(out, ref)
    loop = naive_rms_norm_fp32(x, norm.weight, EPS) * torch.sigmoid(gate.float())
    assert_close("vs loop", loop, out.float(), 5e-3)


def test_norms_reject_bad_arguments():
    x = rand(2, D, seed=0)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(D + 1), EPS)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(D), -1.0)
    with pytest.raises(ValueError, match="gate must have shape"):
        gated_rms_norm(x, x[:1], torch.ones(D), EPS)


@pytest.fixture(scope="module")
def fla_attnres():
    return load_module_by_path("fla", "ops/attnres/naive.py")


@pytest.mark.parametrize("num_blocks", [1, 3, 8])
@pytest.mark.parametrize("proj_shape", [(D,), (1, D)])
def test_attn_res_mix_matches_fla(fla_attnres, num_blocks, proj_shape):
    M = 6
    prefix = rand(M, D, seed=5) * 3
    bank = rand(num_blocks, M, D, seed=6)
    norm_weight, proj_weight = rand(D, seed=7), rand(*proj_shape, seed=8)
    out = attn_res_mix(prefix, bank, norm_weight, proj_weight, EPS)
    ref = fla_attnres.naive_attnres(proj_weight, [*bank, prefix], norm_weight, rms_eps=EPS)
    assert_close("vs fla", ref, out, 1e-6)
    assert_close("vs loop", naive_attn_res_mix(prefix, bank, norm_weight, proj_weight, EPS), out, 1e-6)


def test_attn_res_mix_bf16_prefix_fp32_bank(fla_attnres):
    prefix = rand(5, D, seed=9, dtype=torch.bfloat16)
    bank = rand(2, 5, D, seed=10)  # HF keeps the bank in fp32
    norm_weight, proj_weight = rand(D, seed=11), rand(1, D, seed=12)
    out = attn_res_mix(prefix, bank, norm_weight, proj_weight, EPS)
    ref = fla_attnres.naive_attnres(proj_weight, [*bank, prefix.float()], norm_weight, rms_eps=EPS)
    assert out.dtype == torch.bfloat16
    assert_close("bf16", ref, out.float(), 5e-3)


@pytest.mark.parametrize("bank", [None, torch.zeros(0, 4, D)])
def test_attn_res_mix_empty_bank_is_identity(bank):
    prefix = rand(4, D, seed=13, dtype=torch.bfloat16)
    out = attn_res_mix(prefix, bank, rand(D, seed=14), rand(D, seed=15), EPS)
    assert torch.equal(out, prefix)


def test_attn_res_mix_rejects_bad_arguments():
    prefix, bank = rand(4, D, seed=0), rand(2, 4, D, seed=1)
    w = torch.ones(D)
    with pytest.raises(ValueError, match="bank must be"):
        attn_res_mix(prefix, bank[:, :3], w, w, EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res_mix(prefix, bank, torch.ones(D - 1), w, EPS)
    with pytest.raises(ValueError, match="proj_weight"):
        attn_res_mix(prefix, bank, w, torch.ones(2, D), EPS)
    with pytest.raises(ValueError, match="prefix must be 2-D"):
        attn_res_mix(prefix[None], bank, w, w, EPS)
