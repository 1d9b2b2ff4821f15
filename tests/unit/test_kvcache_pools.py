import pytest
import torch

from helixserve.kvcache.pools import (
    CacheSpec,
    allocate_model_caches,
    bytes_per_block,
    bytes_per_slot,
    reset_slots,
    size_from_budget,
)
from helixserve.models.context import ModelCaches


def _spec(**kw):
    args = dict(
        mla_layer_ids=(1, 3),
        kda_layer_ids=(0, 2),
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        kda_num_heads=2,
        kda_head_dim=4,
        conv_kernel_size=4,
        dtype=torch.bfloat16,
        tokens_per_block=16,
    )
    return CacheSpec(**(args | kw))


def test_layouts_match_context_contract():
    spec = _spec()
    caches = allocate_model_caches(spec, num_blocks=5, num_slots=3, device="cpu")
    assert isinstance(caches, ModelCaches) and caches.tokens_per_block == 16
    assert set(caches.mla_kv) == {1, 3} and set(caches.kda_state) == set(caches.conv_state) == {0, 2}
    assert caches.mla_kv[1].shape == (5, 16, 12) and caches.mla_kv[1].dtype == torch.bfloat16
    assert caches.kda_state[0].shape == (3, 2, 4, 4) and caches.kda_state[0].dtype == torch.float32
    assert caches.conv_state[2].shape == (3, 24, 3) and caches.conv_state[2].dtype == torch.bfloat16
    assert all(not t.any() for t in [*caches.kda_state.values(), *caches.conv_state.values()])


def test_bytes_and_budget():
    spec = _spec()
    assert bytes_per_block(spec) == 2 * 16 * 12 * 2
    assert bytes_per_slot(spec) == 2 * (2 * 4 * 4 * 4 + 24 * 3 * 2)
    caches = allocate_model_caches(spec, 7, 2)
    total = sum(t.numel() * t.element_size() for d in (caches.mla_kv, caches.kda_state, caches.conv_state) for t in d.values())
    assert total == 7 * bytes_per_block(spec) + 2 * bytes_per_slot(spec)
    budget = 4 * bytes_per_slot(spec) + 10 * bytes_per_block(spec) + 5
    assert size_from_budget(spec, budget, max_num_seqs=4) == (10, 4)
    with pytest.raises(ValueError, match="too small"):
        size_from_budget(spec, 4 * bytes_per_slot(spec) + 3 * bytes_per_block(spec), 4)
    assert size_from_budget(_spec(mla_layer_ids=()), 10**6, 2) == (0, 2)


def test_reset_slots_zeroes_only_those():
    caches = allocate_model_caches(_spec(), 2, 4)
    for t in [*caches.kda_state.values(), *caches.conv_state.values()]:
        t.fill_(1)
    reset_slots(caches, [1, 3])
    for t in [*caches.kda_state.values(), *caches.conv_state.values()]:
        assert not t[[1, 3]].any() and (t[[0, 2]] == 1).all()
    reset_slots(caches, [])


def test_spec_validation():
    with pytest.raises(ValueError, match="both MLA and KDA"):
        _spec(kda_layer_ids=(1,))
    with pytest.raises(ValueError, match="tokens_per_block"):
        _spec(tokens_per_block=0)
    with pytest.raises(ValueError, match="dtype"):
        _spec(dtype="bf16")
