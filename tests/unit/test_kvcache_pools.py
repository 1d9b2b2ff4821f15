from pathlib import Path

import pytest
import torch

from helixserve.cache_layout import CacheSpec, ModelCaches
from helixserve.kvcache.pools import (
    allocate_model_caches,
    bytes_per_block,
    bytes_per_slot,
    reset_slots,
    size_from_budget,
)


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
    for t in caches.kda_state.values():
        t.fill_(1)
    reset_slots(caches, torch.tensor([0, 2]))
    for t in caches.kda_state.values():
        assert not t[[0, 2]].any() and (t[[1, 3]] == 1).all()


def test_spec_validation():
    with pytest.raises(ValueError, match="both MLA and KDA"):
        _spec(kda_layer_ids=(1,))
    with pytest.raises(ValueError, match="tokens_per_block"):
        _spec(tokens_per_block=0)
    with pytest.raises(ValueError, match="dtype"):
        _spec(dtype="bf16")


def test_host_pools_are_disjoint_page_aligned_views_of_one_arena():
    caches = allocate_model_caches(_spec(), num_blocks=5, num_slots=3, device="cpu")
    pools = [*caches.mla_kv.values(), *caches.kda_state.values(), *caches.conv_state.values()]
    base = pools[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base and p.is_contiguous() for p in pools)
    assert all(p.data_ptr() % 4096 == base % 4096 for p in pools)  # page-aligned inside the arena
    for i, pool in enumerate(pools):  # writing one pool leaves every other one zero
        pool.fill_(1)
        assert all(not q.any() for j, q in enumerate(pools) if j != i)
        pool.zero_()


def test_host_zeros_large_buffers_are_advised_for_huge_pages():
    from helixserve.kvcache.pools import host_zeros

    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        pytest.skip("no /proc/self/smaps (not Linux)")
    small, large = host_zeros((1024,), torch.float32), host_zeros((3, 1 << 20), torch.bfloat16)
    assert small.shape == (1024,) and large.shape == (3, 1 << 20) and large.dtype == torch.bfloat16
    assert not large.any()

    def vm_flags(ptr: int) -> list[str]:
        lines = smaps.read_text().splitlines()
        for i, line in enumerate(lines):
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= ptr < hi:
                    return next(item.split()[1:] for item in lines[i + 1:] if item.startswith("VmFlags"))
        raise AssertionError(f"{ptr:#x} is in no mapping")

    # madvise(MADV_HUGEPAGE) on the buffer's whole pages (the first, partial one keeps its flags)
    assert "hg" in vm_flags(large.data_ptr() + large.nbytes // 2)
