import random

import pytest

from helixserve.kvcache import (
    AllocationError,
    CacheCapacityError,
    CacheManager,
    KVCacheError,
    local_logical_blocks,
)
from helixserve.kvcache.group_cache import GroupCacheManager


def test_allocate_extend_free_single_rank():
    mgr = CacheManager(num_blocks=10, num_slots=2, tokens_per_block=4)
    h = mgr.allocate("a", 5)
    assert h.slot is not None and len(h.block_ids) == 2
    assert h.block_table(4) == h.block_ids + [-1, -1]
    mgr.extend(h, 8)  # still 2 blocks
    assert len(h.block_ids) == 2
    mgr.extend(h, 9)  # crosses into block 2
    assert len(h.block_ids) == 3 and h.num_tokens == 9
    s = mgr.stats()
    assert (s.num_used_blocks, s.num_free_blocks, s.num_used_slots, s.num_requests) == (3, 7, 1, 1)
    mgr.free("a")
    s = mgr.stats()
    assert (s.num_used_blocks, s.num_used_slots, s.num_requests, s.num_reserved_blocks) == (0, 0, 0, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_handles_hold_only_owned_blocks(cp):
    tpb = 4
    mgrs = [CacheManager(64, 4, tpb, cp_rank=r, cp_size=cp) for r in range(cp)]
    handles = [m.allocate("r", 23) for m in mgrs]
    for rank, (m, h) in enumerate(zip(mgrs, handles)):
        for n in [23, 24, 25, 40, 57]:
            m.extend(h, n)
            table = h.block_table(16)
            owned = local_logical_blocks(n, tpb, rank, cp)
            assert [b for b in range(16) if table[b] >= 0] == owned
            assert len(h.block_ids) == len(owned) == m.stats().num_used_blocks
    # every rank answers capacity checks identically (CP-group-uniform charge)
    for n in range(0, 300, 7):
        assert len({m.can_allocate(n) for m in mgrs}) == 1
        assert len({m.can_extend(h, n) for m, h in zip(mgrs, handles)}) == 1


def test_capacity_errors_are_typed_with_numbers():
    mgr = CacheManager(num_blocks=4, num_slots=1, tokens_per_block=4)
    assert not mgr.can_allocate(17)
    with pytest.raises(CacheCapacityError, match=r"need 5 blocks.*4 of 4 blocks"):
        mgr.allocate("big", 17)
    h = mgr.allocate("a", 4)
    assert not mgr.can_allocate(1)  # no slot left
    with pytest.raises(CacheCapacityError, match="0 of 1 slots"):
        mgr.allocate("b", 1)
    assert mgr.can_extend(h, 16) and not mgr.can_extend(h, 17)
    with pytest.raises(CacheCapacityError) as info:
        mgr.extend(h, 17)
    assert isinstance(info.value, KVCacheError)
    assert h.num_tokens == 4 and mgr.stats().num_used_blocks == 1
    assert mgr.can_ever_fit(16) and not mgr.can_ever_fit(17)


def test_id_errors():
    mgr = CacheManager(num_blocks=4, num_slots=2, tokens_per_block=4)
    h = mgr.allocate("a", 1)
    with pytest.raises(AllocationError, match="already holds"):
        mgr.allocate("a", 1)
    with pytest.raises(AllocationError, match="no cache handle"):
        mgr.free("zzz")
    with pytest.raises(ValueError, match="shrink"):
        mgr.extend(h, 0)
    with pytest.raises(ValueError):
        h.block_table(0)
    mgr.free("a")
    with pytest.raises(AllocationError):
        mgr.free("a")
    with pytest.raises(AllocationError):
        mgr.extend(h, 8)  # stale handle


def test_without_kda_or_mla():
    no_kda = CacheManager(4, 0, 4, has_kda=False)
    assert no_kda.allocate("a", 4).slot is None
    no_mla = CacheManager(0, 2, 4, has_mla=False)
    h = no_mla.allocate("a", 1000)
    assert h.block_ids == [] and h.slot is not None
    no_mla.extend(h, 5000)
    no_mla.free("a")


@pytest.mark.parametrize("cp_rank,cp_size", [(0, 1), (1, 2), (0, 4), (3, 4)])
def test_random_sequence_returns_everything(cp_rank, cp_size):
    rng = random.Random(cp_rank * 10 + cp_size)
    mgr = CacheManager(40, 6, 3, cp_rank=cp_rank, cp_size=cp_size)
    live: dict[str, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(0, 40)
            if mgr.can_allocate(n):
                mgr.allocate(f"r{step}", n)
                live[f"r{step}"] = n
            else:
                with pytest.raises(CacheCapacityError):
                    mgr.allocate(f"r{step}", n)
        elif op < 0.75 and live:
            rid = rng.choice(sorted(live))
            h = mgr.get(rid)
            n = h.num_tokens + rng.randint(0, 8)
            if mgr.can_extend(h, n):
                mgr.extend(h, n)
            else:
                with pytest.raises(CacheCapacityError):
                    mgr.extend(h, n)
        elif live:
            rid = rng.choice(sorted(live))
            del live[rid]
            mgr.free(rid)
        s = mgr.stats()
        assert s.num_used_blocks + s.num_free_blocks == 40
        assert s.num_used_blocks <= s.num_reserved_blocks <= 40
        assert s.num_requests == len(live) == s.num_used_slots
    for rid in list(live):
        mgr.free(rid)
    s = mgr.stats()
    assert (s.num_used_blocks, s.num_reserved_blocks, s.num_used_slots, s.num_requests) == (0, 0, 0, 0)


@pytest.mark.parametrize("cp_rank,cp_size", [(0, 1), (1, 2), (2, 3)])
def test_try_extend_and_the_reused_block_table_match_extend(cp_rank, cp_size):
    """``try_extend`` grows a handle exactly as ``extend`` does (blocks, charge), and the default
    block table is the same list object until a block is added, always equal to a fresh build."""
    tpb = 4
    fast, slow = (CacheManager(12, 2, tpb, cp_rank=cp_rank, cp_size=cp_size) for _ in range(2))
    hf, hs = fast.allocate("r", 3), slow.allocate("r", 3)
    table = hf.block_table()
    for n in range(3, 200):
        grew = fast.try_extend(hf, n)
        assert grew == slow.can_extend(hs, n)
        if not grew:
            assert hf.num_tokens == n - 1  # nothing changed on a refusal
            break
        slow.extend(hs, n)
        assert (hf.block_ids, hf.num_tokens) == (hs.block_ids, hs.num_tokens)
        assert fast.stats() == slow.stats()
        same_blocks = -(-n // tpb) == -(-(n - 1) // tpb)
        new = hf.block_table()
        assert (new is table) == same_blocks
        assert new == hs.block_table(len(new)) and len(new) == -(-n // tpb)
        table = new
    else:
        pytest.fail("the cache never filled")
    fast.free("r")
    with pytest.raises(AllocationError, match="'r' is not live"):
        fast.try_extend(hf, hf.num_tokens + 1)


def test_shrink_gives_back_the_blocks_past_the_span_on_every_cp_rank():
    group = GroupCacheManager(16, 4, 4, cp_size=2)
    other = group.allocate("other", 1)
    handle = group.allocate("r", 9)  # logical blocks 0, 1, 2: rank 0 holds 0 and 2, rank 1 holds 1
    group.extend(handle, 17)  # blocks 3, 4: rank 1 gets 3, rank 0 gets 4
    assert [len(m.get("r").block_ids) for m in group.ranks] == [3, 2]
    group.shrink(handle, 12)  # blocks 0..2 stay: rank 0 keeps 0, 2; rank 1 keeps 1
    assert [len(m.get("r").block_ids) for m in group.ranks] == [2, 1]
    assert [m.get("r").num_tokens for m in group.ranks] == [12, 12]
    assert group.stats().num_reserved_blocks == 2 * (2 + 1)  # r: 2 blocks of rank 0's share, other: 1
    before = group.handle_on(1, "r").block_table()
    group.allocate("taker", 4)  # takes the freed blocks
    group.extend(handle, 16)  # back to block 3 on rank 1, another physical block
    table = group.handle_on(1, "r").block_table()
    assert table[:3] == before[:3] and table[3] == group.handle_on(1, "r").block_ids[-1] != -1
    with pytest.raises(ValueError, match="cannot shrink"):
        group.shrink(handle, 17)
    assert other.num_tokens == 1
