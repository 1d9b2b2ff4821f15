"""The prefix cache's bookkeeping (torch-free): blocks by content, reference counts, LRU eviction
under memory pressure, salts, collisions, checkpoints, and a rollback that unpublishes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helixserve.kvcache.errors import AllocationError
from helixserve.kvcache.manager import NO_HIT
from helixserve.kvcache.prefix_index import PrefixBlockPool, append_block_keys, root_key
from helixserve.kvcache.sizing import pools_from_budget
from helixserve.kvcache.prefix_manager import ChunkPlan, PrefixCachingCacheManager
from helixserve.kvcache.state_checkpoints import StateCheckpointPool

B = 2


def keys_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return append_block_keys([], tokens, B, salt)


def computed(manager: PrefixCachingCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> None:
    manager.commit_computed(rid, keys_of(tokens, salt), lambda a, b: tokens[a:b], salt, len(tokens))


# prompts from a few shared stems, so that hits, partial hits and misses all happen
STEMS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7]]
prompts = st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tail, st.integers(0, 2), st.integers(0, 6),
                    st.lists(st.integers(0, 3), min_size=1, max_size=4))
ops = st.lists(st.one_of(st.tuples(st.just("admit"), prompts, st.sampled_from([None, "a"])),
                         st.tuples(st.just("free"), st.integers(0, 7))), min_size=1, max_size=40)


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops)
def test_eviction_under_pressure_never_takes_a_held_block_and_a_hit_holds_the_requests_tokens(ops):
    manager = PrefixCachingCacheManager(9, 4, B, num_checkpoint_slots=0, checkpoint_interval_blocks=1,
                                        has_kda=False)
    written: dict[int, tuple] = {}  # block -> (salt, the tokens of the prefix through it) last written there
    live: dict[str, list[int]] = {}
    for n, (op, *args) in enumerate(ops):
        if op == "admit":
            tokens, salt = args
            hit = manager.find_prefix(keys_of(tokens, salt), tokens, salt)
            for k, block in enumerate(hit.block_ids):  # a hit never hands over another prefix's tokens
                assert written[block] == (salt, tuple(tokens[:(k + 1) * B]))
            if not manager.can_allocate(len(tokens), hit):
                continue
            held = {b for rid in live for b in manager.get(rid).block_ids}
            handle = manager.allocate(f"r{n}", len(tokens), hit)
            new = handle.block_ids[len(hit.block_ids):]
            assert not held & set(new), "a block some request holds was handed out again"
            for k, block in enumerate(new, start=len(hit.block_ids)):
                written[block] = (salt, tuple(tokens[:(k + 1) * B]))
            computed(manager, f"r{n}", tokens, salt)
            live[f"r{n}"] = tokens
        elif live:
            rid = sorted(live)[args[0] % len(live)]
            manager.free(rid)
            del live[rid]
        holders: dict[int, int] = {}
        for rid in live:
            for block in manager.get(rid).block_ids:
                holders[block] = holders.get(block, 0) + 1
        assert all(manager.blocks.refs(b) == c for b, c in holders.items())
        assert manager.blocks.num_used == len(holders) == manager.stats().num_reserved_blocks
        assert manager.blocks.num_used + manager.blocks.num_free == manager.blocks.capacity


def test_two_salts_never_share_a_block_and_no_salt_is_a_salt_of_its_own():
    manager = PrefixCachingCacheManager(16, 4, B, 0, 1, has_kda=False)
    tokens = [5, 6, 7, 8, 9]
    for rid, salt in (("a", "tenant"), ("b", None)):
        manager.allocate(rid, len(tokens))
        computed(manager, rid, tokens, salt)
    assert manager.find_prefix(keys_of(tokens, "tenant"), tokens, "tenant").num_tokens == 4
    assert manager.find_prefix(keys_of(tokens, None), tokens, None).num_tokens == 4
    for salt in ("other", ""):
        assert manager.find_prefix(keys_of(tokens, salt), tokens, salt) is NO_HIT
    assert not set(manager.get("a").block_ids) & set(manager.get("b").block_ids)
    assert root_key(None) != root_key("")


def test_a_key_collision_with_other_tokens_is_a_miss_not_a_hit():
    """Forge a collision: the request's keys are the cached prompt's, its tokens are not."""
    pool = PrefixBlockPool(4)
    [block] = pool.allocate(1)
    key = keys_of([1, 2])[0]
    assert pool.publish(block, key, root_key(None), [1, 2], None)
    assert pool.match([key], [1, 2, 0], B, None) == [block]
    assert pool.match([key], [1, 3, 0], B, None) == []
    assert pool.match([key], [1, 2, 0], B, "salt") == []
    assert not pool.publish(block, key, root_key(None), [1, 2], None)  # one block per key


def test_a_freed_cached_block_is_evicted_last_used_last_and_only_when_needed():
    pool = PrefixBlockPool(3)
    a, b = pool.allocate(2)
    pool.publish(a, b"ka", root_key(None), [1, 2], None)
    pool.publish(b, b"kb", b"ka", [3, 4], None)
    pool.free([a, b])  # the tail (b) becomes evictable first
    assert (pool.num_free, pool.num_cached, pool.num_evictable) == (3, 2, 2)
    [c] = pool.allocate(1)
    assert c not in (a, b) and pool.num_cached == 2  # a never-cached block first
    [d] = pool.allocate(1)
    assert d == b and pool.is_cached(a) and not pool.is_cached(b) and pool.num_evictions == 1
    with pytest.raises(AllocationError):
        pool.free([d, d])


def test_a_block_two_requests_hold_stays_until_both_free_it():
    manager = PrefixCachingCacheManager(8, 4, B, 0, 1, has_kda=False)
    tokens = [1, 2, 3, 4, 5]
    manager.allocate("a", 5)
    computed(manager, "a", tokens)
    hit = manager.find_prefix(keys_of(tokens), tokens, None)
    manager.allocate("b", 5, hit)
    shared = manager.get("a").block_ids[:2]
    assert manager.get("b").block_ids[:2] == shared and manager.stats().num_used_blocks == 4
    manager.free("a")
    assert all(manager.blocks.refs(b) == 1 for b in shared)
    assert not manager.can_allocate(2 * 5 + 1)  # b holds 3 of the 8 blocks
    manager.allocate("c", 2 * 5)  # takes every other block, a's cached tail included: none of b's
    assert not set(manager.get("c").block_ids) & set(manager.get("b").block_ids)


def test_a_rollback_unpublishes_the_blocks_it_gives_back():
    manager = PrefixCachingCacheManager(8, 4, B, 0, 1, has_kda=False)
    tokens = [1, 2, 3, 4, 5, 6]
    handle = manager.allocate("a", 6)
    computed(manager, "a", tokens)
    tail = handle.block_ids[2]
    assert manager.blocks.is_cached(tail)
    manager.shrink(handle, 4)
    assert not manager.blocks.is_cached(tail) and not manager.blocks.is_allocated(tail)
    assert manager.find_prefix(keys_of(tokens + [0]), tokens + [0], None).num_tokens == 4


def test_a_hit_needs_a_checkpoint_after_its_last_block_and_leaves_one_token_to_compute():
    manager = PrefixCachingCacheManager(16, 4, B, num_checkpoint_slots=2, checkpoint_interval_blocks=2)
    tokens = list(range(10, 19))  # 9 tokens: checkpoints at 4 and 8 (interval), 8 (last full block)
    manager.allocate("a", 9)
    keys = keys_of(tokens)
    plan = manager.plan_chunk("a", keys, 9, 0, 9)  # the chunk is not cut: both taken inside it
    assert plan.stop == 9 and plan.save_checkpoint is None and [p for p, _ in plan.inner_saves] == [4, 8]
    manager.commit_computed("a", keys, lambda a, b: tokens[a:b], None, 9)
    assert manager.plan_chunk("a", keys, 9, 8, 9) == ChunkPlan(9)  # nothing left to take
    hit = manager.find_prefix(keys, tokens, None)
    assert hit.num_tokens == 8 and hit.checkpoint == plan.inner_saves[1][1]
    assert manager.find_prefix(keys[:4], tokens[:8], None).num_tokens == 4  # 8 tokens: resume at 4
    manager.free("a")
    assert manager.find_prefix(keys, tokens, None).num_tokens == 8  # cached after the free


def test_a_chunk_ending_at_a_checkpoint_saves_it_after_the_step():
    manager = PrefixCachingCacheManager(16, 4, B, num_checkpoint_slots=4, checkpoint_interval_blocks=2)
    tokens = list(range(10, 23))  # 13 tokens: checkpoints at 4, 8 (interval), 12 (both)
    manager.allocate("a", 13)
    keys = keys_of(tokens)
    first = manager.plan_chunk("a", keys, 13, 0, 8)  # a budget of 8
    assert first.stop == 8 and [p for p, _ in first.inner_saves] == [4] and first.save_checkpoint is not None
    second = manager.plan_chunk("a", keys, 13, 8, 13)
    assert second.stop == 13 and [p for p, _ in second.inner_saves] == [12] and second.save_checkpoint is None
    reserved = {first.inner_saves[0][1], first.save_checkpoint, second.inner_saves[0][1]}
    assert len(reserved) == 3 and manager.checkpoints.num_reserved == 3


def test_checkpoint_reservations_are_never_evicted_and_go_back_on_drop():
    pool = StateCheckpointPool(2)
    s1, s2 = pool.reserve("a", b"k1"), pool.reserve("b", b"k2")
    assert pool.reserve("c", b"k3") is None  # every slot reserved: nothing to evict
    pool.commit("a")
    assert pool.lookup(b"k1") == s1
    assert pool.reserve("c", b"k3") == s1 and pool.num_evictions == 1 and not pool.has(b"k1")
    pool.drop("b")
    pool.drop("c")
    assert pool.num_reserved == 0 and pool.reserve("d", b"k4") in (s1, s2)


def test_the_checkpoint_pool_comes_out_of_the_budget_beside_the_slots():
    assert pools_from_budget(100, 10, 1000, 2) == (9, 2)  # 20 B of slots: 980 left
    assert pools_from_budget(100, 10, 1000, 2, num_checkpoint_slots=8) == (9, 2)  # 100 B: 900 left
    assert pools_from_budget(100, 10, 1000, 2, num_checkpoint_slots=9) == (8, 2)  # 110 B: 890 left
    pools_from_budget(100, 10, 1000, 2, num_checkpoint_slots=78)  # 800 B: 200 left, a block per sequence
    with pytest.raises(ValueError, match="79 state checkpoints"):
        pools_from_budget(100, 10, 1000, 2, num_checkpoint_slots=79)
    with pytest.raises(ValueError, match="num_checkpoint_slots"):
        pools_from_budget(100, 10, 1000, 2, num_checkpoint_slots=-1)
