import pytest

from helixserve.kvcache import (
    block_owner,
    local_logical_blocks,
    num_local_blocks,
    num_logical_blocks,
    token_owner,
)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("tpb", [1, 3, 16])
def test_ranks_partition_the_blocks(cp, tpb):
    for num_tokens in range(0, 5 * cp * tpb + 2):
        total = num_logical_blocks(num_tokens, tpb)
        seen = []
        for rank in range(cp):
            local = local_logical_blocks(num_tokens, tpb, rank, cp)
            assert len(local) == num_local_blocks(num_tokens, tpb, rank, cp)
            assert all(block_owner(b, cp) == rank for b in local)
            assert local == sorted(local)
            seen += local
        assert sorted(seen) == list(range(total))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_token_owner_round_robin_by_block(cp):
    tpb = 4
    for pos in range(64):
        assert token_owner(pos, tpb, cp) == (pos // tpb) % cp
    # rank 0 always holds at least as many blocks as any other rank
    for n in range(64):
        counts = [num_local_blocks(n, tpb, r, cp) for r in range(cp)]
        assert counts[0] == max(counts) and counts[0] - min(counts) <= 1


def test_examples_and_errors():
    assert local_logical_blocks(10, 2, 1, 2) == [1, 3]  # blocks 0..4
    assert local_logical_blocks(10, 2, 0, 2) == [0, 2, 4]
    assert num_local_blocks(1, 16, 3, 4) == 0
    for args in [(4, 0, 0, 1), (4, 2, 2, 2), (4, 2, 0, 0), (-1, 2, 0, 1)]:
        with pytest.raises(ValueError):
            num_local_blocks(*args)


@pytest.mark.parametrize("sources", [1, 2, 3, 4])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_arranged_blocks_give_each_ctx_rank_one_run(cp, sources):
    """A rank's fresh run of physical blocks, arranged for a ctx world of `sources` ranks: the same
    set, local order kept per ctx rank, and each ctx rank's part one ascending run."""
    from helixserve.kvcache.helix import arrange_by_source

    for rank in range(cp):
        for n in (0, 1, 5, 12, 13):
            fresh = list(range(40, 40 + n))
            arranged = arrange_by_source(fresh, rank, cp, sources)
            assert sorted(arranged) == fresh
            if cp % sources == 0:
                assert arranged == fresh
            parts = {}
            for k, block in enumerate(arranged):
                parts.setdefault((rank + k * cp) % sources, []).append(block)
            for part in parts.values():
                assert part == list(range(part[0], part[0] + len(part)))
    with pytest.raises(ValueError, match="num_sources"):
        arrange_by_source([1], 0, 1, 0)


def test_a_groups_full_row_tables_name_distinct_pages_and_follow_the_ranks_blocks():
    """Full-row tables (a draft model's pages on a CP group's leader) of live requests: every block
    of each request, page (rank, block) -> rank * num_blocks + block, no page shared; a freed
    request's blocks, taken by a new one, give it the same pages."""
    from helixserve.kvcache.group_cache import GroupCacheManager

    cp, tpb, num_blocks = 2, 4, 8
    group = GroupCacheManager(num_blocks, 4, tpb, cp)
    group.allocate("a", 9)  # blocks 0, 1, 2: ranks 0, 1, 0
    group.allocate("b", 13)  # blocks 0..3
    tables = {rid: group.full_row_table(rid) for rid in ("a", "b")}
    for rid, table in tables.items():
        for b, page in enumerate(table):
            assert page == (b % cp) * num_blocks + group.handle_on(b % cp, rid).block_table()[b]
    assert [len(t) for t in tables.values()] == [3, 4]
    pages = tables["a"] + tables["b"]
    assert len(set(pages)) == len(pages) and all(0 <= p < cp * num_blocks for p in pages)
    assert group.full_row_table("b") is tables["b"]  # built again only when a rank's blocks change
    group.extend(group.get("b"), 17)
    assert group.full_row_table("b")[:4] == tables["b"] and len(group.full_row_table("b")) == 5
    group.free("a")
    group.allocate("c", 9)
    assert sorted(group.full_row_table("c")) == sorted(tables["a"])
