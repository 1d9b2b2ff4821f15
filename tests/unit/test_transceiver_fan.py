"""Fan-in shard math: which ctx ranks of a tp N world hold a gen (cp_rank, cp_size) rank's MLA
blocks and KDA heads, at which local indices on both sides (pure)."""

from __future__ import annotations

import itertools

import pytest

from helixserve.transceiver.fan import first_common_block, head_overlap, source, source_blocks, sources

SIZES = (1, 2, 3, 4, 6, 8)


def _cases():
    for ctx_size, cp_size in itertools.product(SIZES, SIZES):
        for num_heads in (24, 48):  # divisible by every size above
            yield ctx_size, cp_size, num_heads


@pytest.mark.parametrize("ctx_size, cp_size, num_heads", list(_cases()))
def test_every_block_and_head_a_gen_rank_needs_comes_from_exactly_one_source(ctx_size, cp_size, num_heads):
    for num_blocks, cp_rank in itertools.product((0, 1, 2, 5, 23, 24, 25), range(cp_size)):
        needed_blocks = [b for b in range(num_blocks) if b % cp_size == cp_rank]
        needed_heads = range(cp_rank * num_heads // cp_size, (cp_rank + 1) * num_heads // cp_size)
        got_blocks, got_heads = [], []
        for src in sources(num_blocks, num_heads, ctx_size, cp_rank, cp_size):
            assert src.blocks or src.num_heads, "a source with nothing to send"
            for b, ctx_k, gen_k in zip(src.blocks, src.ctx_blocks, src.gen_blocks, strict=True):
                assert b % ctx_size == src.ctx_rank, "a block its ctx rank does not hold"
                assert src.ctx_rank + ctx_k * ctx_size == b and cp_rank + gen_k * cp_size == b
            got_blocks += src.blocks
            ctx_h = num_heads // ctx_size
            assert 0 <= src.ctx_head0 and src.ctx_head0 + src.num_heads <= ctx_h
            assert 0 <= src.gen_head0 and src.gen_head0 + src.num_heads <= num_heads // cp_size
            got_heads += range(src.heads[0], src.heads[1])
            assert all(src.ctx_rank * ctx_h <= h < (src.ctx_rank + 1) * ctx_h for h in range(*src.heads))
        assert sorted(got_blocks) == needed_blocks  # each once, nothing extra
        assert sorted(got_heads) == list(needed_heads)


@pytest.mark.parametrize("ctx_size, cp_size, num_heads", list(_cases()))
def test_the_gen_ranks_of_a_group_together_receive_every_ctx_byte_once(ctx_size, cp_size, num_heads):
    """Fan-out seen from a ctx rank: its blocks and heads go to exactly one gen rank each."""
    num_blocks = 25
    for ctx_rank in range(ctx_size):
        sent_blocks = sorted(b for r in range(cp_size) for b in source_blocks(num_blocks, ctx_rank, ctx_size, r, cp_size))
        assert sent_blocks == list(range(ctx_rank, num_blocks, ctx_size))
        sent_heads = sorted(h for r in range(cp_size) for h in range(*head_overlap(num_heads, ctx_rank, ctx_size, r, cp_size)))
        ctx_h = num_heads // ctx_size
        assert sent_heads == list(range(ctx_rank * ctx_h, (ctx_rank + 1) * ctx_h))


def _summary(num_blocks, num_heads, ctx_size, cp_rank, cp_size):
    return [(s.ctx_rank, list(s.blocks), s.ctx_blocks, s.gen_blocks, s.heads, s.ctx_head0, s.gen_head0)
            for s in sources(num_blocks, num_heads, ctx_size, cp_rank, cp_size)]


def test_tp2_to_cp4_blocks_from_one_rank_heads_from_another():
    # gen rank 1 of 4: blocks 1, 5 (odd: ctx 1), heads [2, 4) (ctx 0's [0, 4), from its head 2)
    assert _summary(8, 8, 2, 1, 4) == [(0, [], [], [], (2, 4), 2, 0), (1, [1, 5], [0, 2], [0, 1], (0, 0), 0, 0)]
    assert _summary(8, 8, 2, 2, 4) == [(0, [2, 6], [1, 3], [0, 1], (0, 0), 0, 0), (1, [], [], [], (4, 6), 0, 0)]


def test_tp4_to_cp2_one_gen_rank_gathers_two_ctx_ranks():
    # gen rank 1 of 2: blocks 1, 3, 5, 7 from ctx 1 and 3; heads [4, 8) = ctx 2's [4, 6) + ctx 3's [6, 8)
    assert _summary(8, 8, 4, 1, 2) == [
        (1, [1, 5], [0, 1], [0, 2], (0, 0), 0, 0),
        (2, [], [], [], (4, 6), 0, 0),
        (3, [3, 7], [0, 1], [1, 3], (6, 8), 0, 2)]


def test_tp2_to_dp2_cp2_is_rank_for_rank():
    for cp_rank in range(2):
        (src,) = sources(9, 8, 2, cp_rank, 2)
        assert src.ctx_rank == cp_rank and src.ctx_blocks == src.gen_blocks == list(range(len(src.blocks)))
        assert (src.heads, src.ctx_head0, src.gen_head0) == ((4 * cp_rank, 4 * cp_rank + 4), 0, 0)


def test_tp1_is_the_plain_shard_and_cp1_gathers_every_rank():
    for cp_size in (1, 2, 4):
        for cp_rank in range(cp_size):
            (src,) = sources(23, 8, 1, cp_rank, cp_size)
            assert list(src.blocks) == list(range(cp_rank, 23, cp_size))
            assert src.ctx_blocks == list(src.blocks) and src.gen_blocks == list(range(len(src.blocks)))
            assert src.heads == (cp_rank * 8 // cp_size, (cp_rank + 1) * 8 // cp_size) and src.gen_head0 == 0
    for ctx_size in (2, 4):
        got = sources(10, 8, ctx_size, 0, 1)
        assert [s.ctx_rank for s in got] == list(range(ctx_size))
        assert all(s.gen_blocks == list(s.blocks) and s.gen_head0 == s.heads[0] and s.ctx_head0 == 0 for s in got)


def test_a_short_prompt_asks_only_the_head_holders():
    # 1 block (block 0 on ctx 0): gen rank 1 of 2 from a tp 4 world needs heads of ctx 2 and 3 only
    assert [s.ctx_rank for s in sources(1, 8, 4, 1, 2)] == [2, 3]
    assert [s.ctx_rank for s in sources(0, 8, 4, 0, 1)] == [0, 1, 2, 3]


def test_absurd_geometry_is_refused_with_the_values():
    with pytest.raises(ValueError, match="cannot be split over cp_size=3"):
        source(4, 8, 0, 2, 0, 3)
    with pytest.raises(ValueError, match="ctx_tp_size=3"):
        head_overlap(8, 0, 3, 0, 1)
    with pytest.raises(ValueError, match="ctx rank 2 of 2"):
        first_common_block(2, 2, 0, 1)
    with pytest.raises(ValueError, match="cp rank -1 of 2"):
        source_blocks(4, 0, 1, -1, 2)
    with pytest.raises(ValueError, match="num_blocks_total"):
        source_blocks(-1, 0, 1, 0, 1)
    assert first_common_block(1, 2, 0, 4) is None and first_common_block(3, 6, 1, 4) == 9
