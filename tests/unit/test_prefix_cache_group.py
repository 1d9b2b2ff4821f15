"""A helix CP group's prefix cache (:class:`~helixserve.kvcache.group_prefix.GroupPrefixCacheManager`):
each rank holds, matches and evicts its own blocks (``b % cp``), the group's checkpoints are one pool.

- with room for everything, a group of 2 or 3 ranks finds exactly the hits one process finds;
- under memory pressure (each rank evicting from its own LRU), a hit never hands a rank a block
  holding another prefix's tokens, a held block is never handed out again, and the group's hit
  is held on every rank or not at all;
- a hit needs every rank's blocks and a checkpoint after the last one;
- the group's one event log (what a ctx world publishes to the router) names the blocks one
  process caches, and a block evicted on its rank leaves it.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helixserve.kvcache.group_prefix import GroupPrefixCacheManager
from helixserve.kvcache.manager import NO_HIT
from helixserve.kvcache.prefix_events import PrefixEventKind, PrefixEventLog
from helixserve.kvcache.prefix_index import append_block_keys
from helixserve.kvcache.prefix_manager import PrefixCachingCacheManager

B = 2
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9, 9], [7, 7, 7, 7, 7, 7]]
prompts = st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tail, st.integers(0, 2), st.integers(0, 9),
                    st.lists(st.integers(0, 3), min_size=1, max_size=4))
ops = st.lists(st.one_of(st.tuples(st.just("admit"), prompts, st.sampled_from([None, "a"])),
                         st.tuples(st.just("free"), st.integers(0, 7))), min_size=1, max_size=30)


def keys_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return append_block_keys([], tokens, B, salt)


def admit(manager, rid: str, tokens: list[int], salt: str | None):
    """Find, allocate, plan one whole-prompt chunk and publish it; the hit (None if no room)."""
    keys = keys_of(tokens, salt)
    hit = manager.find_prefix(keys, tokens, salt)
    if not manager.can_allocate(len(tokens), hit):
        return None
    manager.allocate(rid, len(tokens), hit)
    start = hit.num_tokens
    while start < len(tokens):  # chunks stop at checkpoint positions
        start = manager.plan_chunk(rid, keys, len(tokens), start, len(tokens)).stop
        manager.commit_computed(rid, keys, lambda a, b: tokens[a:b], salt, start)
    return hit


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops, cp=st.sampled_from([2, 3]))
def test_with_room_a_group_hits_what_one_process_hits(ops, cp):
    single = PrefixCachingCacheManager(200, 8, B, num_checkpoint_slots=64, checkpoint_interval_blocks=2)
    group = GroupPrefixCacheManager(200, 8, B, cp, num_checkpoint_slots=64, checkpoint_interval_blocks=2)
    live: list[str] = []
    for n, (op, *args) in enumerate(ops):
        if op == "admit" and len(live) < 8:
            hits = [admit(m, f"r{n}", *args) for m in (single, group)]
            assert hits[0].num_tokens == hits[1].num_tokens
            assert hits[0].checkpoint == hits[1].checkpoint
            live.append(f"r{n}")
        elif op == "free" and live:
            rid = live.pop(args[0] % len(live))
            single.free(rid)
            group.free(rid)
    for rid in live:
        group.free(rid)
    assert all(s.num_used_blocks == 0 and s.num_used_slots == 0 for s in group.rank_stats())


@settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops, cp=st.sampled_from([2, 3]))
def test_the_groups_event_log_names_the_blocks_one_process_caches(ops, cp):
    single = PrefixCachingCacheManager(200, 8, B, num_checkpoint_slots=64, checkpoint_interval_blocks=2,
                                       events=PrefixEventLog(1000))
    group = GroupPrefixCacheManager(200, 8, B, cp, num_checkpoint_slots=64, checkpoint_interval_blocks=2,
                                    events=PrefixEventLog(1000))
    live: list[str] = []
    for n, (op, *args) in enumerate(ops):
        if op == "admit" and len(live) < 8:
            for m in (single, group):
                admit(m, f"r{n}", *args)
            live.append(f"r{n}")
        elif op == "free" and live:
            rid = live.pop(args[0] % len(live))
            single.free(rid)
            group.free(rid)
    named = [set(m.events.since(None).blocks) for m in (single, group)]
    assert named[0] == named[1] == {k for r in group.prefix_ranks for k in r.blocks._by_key}  # noqa: SLF001


def test_a_block_evicted_on_its_rank_leaves_the_groups_event_log():
    group = GroupPrefixCacheManager(1, 4, B, 2, num_checkpoint_slots=2, checkpoint_interval_blocks=1,
                                    events=PrefixEventLog(100))
    first, second = [1, 2, 3, 4], [6, 7, 8, 9]  # two blocks: one on each rank, each rank's only one
    admit(group, "a", first, None)
    group.free("a")
    stored = [e.key for e in group.events.since(0).events if e.kind is PrefixEventKind.STORED]
    assert stored == keys_of(first)  # block 0 on rank 0, block 1 on rank 1, one log
    seq = group.events.seq
    admit(group, "b", second, None)  # each rank evicts its own block for the new prompt's
    removed = {e.key for e in group.events.since(seq).events if e.kind is PrefixEventKind.REMOVED}
    assert removed == set(keys_of(first))
    assert set(group.events.since(None).blocks) == set(keys_of(second))


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops)
def test_under_pressure_each_rank_evicts_its_own_and_never_a_held_block(ops):
    cp = 2
    group = GroupPrefixCacheManager(5, 4, B, cp, num_checkpoint_slots=3, checkpoint_interval_blocks=1)
    written: list[dict[int, tuple]] = [{} for _ in range(cp)]  # per rank: block -> (salt, prefix tokens)
    live: set[str] = set()
    for n, (op, *args) in enumerate(ops):
        if op == "free":
            if live:
                rid = sorted(live)[args[0] % len(live)]
                group.free(rid)
                live.discard(rid)
            continue
        tokens, salt = args
        held = [{b for rid in live for b in group.handle_on(r, rid).block_ids} for r in range(cp)]
        hit = admit(group, f"r{n}", tokens, salt)
        if hit is None:
            continue
        live.add(f"r{n}")
        for r in range(cp):
            handle = group.handle_on(r, f"r{n}")
            mine = hit.rank_block_ids[r] if hit is not NO_HIT else ()
            assert tuple(handle.block_ids[:len(mine)]) == mine  # every rank holds its part of the hit
            for k, block in enumerate(handle.block_ids):
                logical = r + k * cp
                prefix = (salt, tuple(tokens[:(logical + 1) * B]))
                if k < len(mine):
                    assert written[r][block] == prefix, "a hit handed over another prefix's tokens"
                else:
                    assert block not in held[r], "a block some request holds was handed out again"
                    written[r][block] = prefix
    for rid in live:
        group.free(rid)
    assert all(s.num_used_blocks == 0 and s.num_used_slots == 0 for s in group.rank_stats())


def test_a_hit_needs_every_ranks_blocks_and_a_checkpoint():
    group = GroupPrefixCacheManager(20, 4, B, 2, num_checkpoint_slots=4, checkpoint_interval_blocks=2)
    tokens = list(range(10, 21))  # 11 tokens: checkpoints at 4 and 8 (every 2 blocks), 10 (last full block)
    assert admit(group, "a", tokens, None) is NO_HIT
    group.free("a")
    hit = admit(group, "b", tokens, None)
    assert hit.num_tokens == 10 and len(hit.rank_block_ids[0]) == 3 and len(hit.rank_block_ids[1]) == 2
    # rank 1 forgets logical block 3 (its second block): the group's hit stops at 3 blocks, and
    # with no checkpoint at 6 tokens it resumes at 4
    group.prefix_ranks[1].blocks.unpublish(group.handle_on(1, "b").block_ids[1])
    group.free("b")
    hit = group.find_prefix(keys_of(tokens), tokens, None)
    assert hit.num_tokens == 4 and hit.block_ids == hit.rank_block_ids[0]
    assert len(hit.rank_block_ids[0]) == 1 and len(hit.rank_block_ids[1]) == 1
    assert group.prefix_stats.num_hit_tokens == 10
