"""Paged MLA attention against dense softmax attention; helix split + lse combine; sentinels."""

from __future__ import annotations

import pytest
import torch

import helixserve.kernels.mla.paged as paged
from helixserve.kernels import lse_combine, mla_paged_attention, mla_write_kv
from helixserve.kernels.mla.naive import naive_lse_combine, naive_mla_dense
from tests._testing import assert_close

H, DQK, V_DIM, BS = 3, 12, 8, 4
SCALE = DQK ** -0.5


def build_cache(seq_lens: list[int], *, seed: int, num_blocks: int = 24, max_blocks: int = 8,
                fill: float = float("nan"), dtype=torch.float32):
    """Dense latents per sequence written into shuffled physical blocks of a sentinel-filled cache."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(L, DQK, generator=gen).to(dtype) for L in seq_lens]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for i, L in enumerate(seq_lens):
        for b in range(-(-L // BS)):
            tables[i, b] = free.pop()
    cache = torch.full((num_blocks, BS, DQK), fill, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(L) for L in seq_lens])
    mla_write_kv(cache, tables, cu, positions, torch.cat(keys))
    return cache, tables, keys


def queries(q_ranges: list[tuple[int, int]], *, seed: int, dtype=torch.float32):
    """q rows for positions [s, e) of each sequence, with cu_seqlens_q and q_positions."""
    q_positions = torch.cat([torch.arange(s, e) for s, e in q_ranges])
    cu = torch.tensor([0, *torch.tensor([e - s for s, e in q_ranges]).cumsum(0).tolist()])
    q = torch.randn(q_positions.numel(), H, DQK, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return q, cu, q_positions


def dense_reference(q, keys, cu, q_positions, kv_lens):
    return naive_mla_dense(q, [k[:int(n)] for k, n in zip(keys, kv_lens)], cu, q_positions, SCALE, V_DIM)


@pytest.fixture(params=["host_rows", "vectorized"])
def write_path(request, monkeypatch):
    """Both cache-write paths: rows found on the host (decode sizes) and the vectorized one."""
    monkeypatch.setattr(paged, "_HOST_WRITE_ROWS", 64 if request.param == "host_rows" else 0)
    return request.param


def test_full_prefill_matches_dense(write_path):
    seq_lens = [5, 16, 23, 1]
    cache, tables, keys = build_cache(seq_lens, seed=0)
    q, cu, pos = queries([(0, L) for L in seq_lens], seed=1)
    kv_lens = torch.tensor(seq_lens)
    o, lse = mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    o_ref, lse_ref = dense_reference(q, keys, cu, pos, kv_lens)
    assert o.shape == (q.shape[0], H, V_DIM) and lse.dtype == torch.float32
    assert_close("o", o_ref, o, 1e-5)
    assert_close("lse", lse_ref, lse, 1e-6)


def test_chunk_with_context_decode_and_short_kv_len():
    seq_lens = [23, 9, 14]
    cache, tables, keys = build_cache(seq_lens, seed=2)
    # prefill chunk [15, 23) with context, one decode row, and queries past kv_len (keys < kv_len only)
    q, cu, pos = queries([(15, 23), (8, 9), (10, 14)], seed=3)
    kv_lens = torch.tensor([23, 9, 11])
    o, lse = mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    o_ref, lse_ref = dense_reference(q, keys, cu, pos, kv_lens)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("lse", lse_ref, lse, 1e-6)


def test_online_softmax_over_many_steps(monkeypatch):
    monkeypatch.setattr(paged, "_KEYS_PER_STEP", BS)  # one block per step
    seq_lens = [30, 7]
    cache, tables, keys = build_cache(seq_lens, seed=4)
    q, cu, pos = queries([(0, 30), (6, 7)], seed=5)
    kv_lens = torch.tensor(seq_lens)
    o, lse = mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    o_ref, lse_ref = dense_reference(q, keys, cu, pos, kv_lens)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("lse", lse_ref, lse, 1e-6)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_helix_split_and_combine_equals_unsplit(num_ranks):
    seq_lens = [3, 13, 26]  # the 1-block sequence has no key on ranks > 0
    cache, tables, _ = build_cache(seq_lens, seed=6)
    q, cu, pos = queries([(0, 3), (12, 13), (5, 26)], seed=7)
    kv_lens = torch.tensor(seq_lens)
    o_full, lse_full = mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    o_parts, lse_parts = [], []
    logical = torch.arange(tables.shape[1])
    for r in range(num_ranks):
        local = torch.where(logical % num_ranks == r, tables, torch.full_like(tables, -1))
        o_r, lse_r = mla_paged_attention(q, cache, local, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
        o_parts.append(o_r)
        lse_parts.append(lse_r)
    lse_parts = torch.stack(lse_parts)
    no_key = torch.isneginf(lse_parts[1, :3])
    assert no_key.all(), "rank 1 holds no key of the 1-block sequence"
    assert torch.equal(torch.stack(o_parts)[1, :3], torch.zeros(3, H, V_DIM))
    o, lse = lse_combine(torch.stack(o_parts), lse_parts)
    assert_close("o", o_full, o, 1e-5)
    assert_close("lse", lse_full, lse, 1e-6)


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("batched", [True, False])
def test_one_query_per_sequence_batch(monkeypatch, num_ranks, batched):
    """The decode shape (one query per sequence) attends all sequences at once unless the gather is too big."""
    if not batched:
        monkeypatch.setattr(paged, "_SINGLE_QUERY_BATCH_KEYS", 0)
    seq_lens = [6, 1, 23, 11, 4]  # partial last blocks over a NaN-filled cache
    cache, tables, keys = build_cache(seq_lens, seed=14)
    # last-position queries, a query that sees only a prefix (kv_len past it) and one with kv_len 0
    q, cu, pos = queries([(5, 6), (0, 1), (22, 23), (7, 8), (3, 4)], seed=15)
    kv_lens = torch.tensor([6, 1, 23, 11, 0])
    logical = torch.arange(tables.shape[1])
    local = torch.where(logical % num_ranks == 0, tables, torch.full_like(tables, -1))
    o, lse = mla_paged_attention(q, cache, local, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    key_pos = [torch.arange(int(n))[(torch.arange(int(n)) // BS) % num_ranks == 0] for n in kv_lens]
    o_ref, lse_ref = naive_mla_dense(q, [k[p] for k, p in zip(keys, key_pos)], cu, pos, SCALE, V_DIM, key_pos)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("lse", lse_ref, lse, 1e-6)
    assert torch.isneginf(lse[4]).all() and torch.equal(o[4], torch.zeros(H, V_DIM))


@pytest.mark.parametrize("fill", [1e30, float("nan"), float("inf")])
def test_unused_cache_memory_never_leaks(fill):
    seq_lens = [6, 11]  # partially filled last blocks
    cache, tables, keys = build_cache(seq_lens, seed=8, fill=fill)
    q, cu, pos = queries([(0, 6), (0, 11)], seed=9)
    kv_lens = torch.tensor(seq_lens)
    o, lse = mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    o_ref, lse_ref = dense_reference(q, keys, cu, pos, kv_lens)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("lse", lse_ref, lse, 1e-6)


def test_write_skips_blocks_held_elsewhere(write_path):
    cache = torch.full((6, BS, DQK), float("nan"))
    tables = torch.tensor([[4, -1, 1], [-1, 0, -1]])
    latent = torch.randn(12, DQK, generator=torch.Generator().manual_seed(10))
    positions = torch.tensor([0, 1, 4, 5, 8, 9, 3, 2, 5, 6, 7, 11])
    cu = torch.tensor([0, 6, 12])
    mla_write_kv(cache, tables, cu, positions, latent)
    assert torch.equal(cache[4, :2], latent[:2])
    assert torch.equal(cache[1, :2], latent[4:6])
    assert torch.equal(cache[0, 1:4], latent[8:11])
    written = torch.zeros(6, BS, dtype=torch.bool)
    written[4, :2] = written[1, :2] = written[0, 1:4] = True
    assert torch.isnan(cache[~written]).all(), "rows of blocks held elsewhere must not be written"


def test_bf16_keeps_dtypes():
    seq_lens = [9]
    cache, tables, keys = build_cache(seq_lens, seed=11, dtype=torch.bfloat16)
    q, cu, pos = queries([(0, 9)], seed=12, dtype=torch.bfloat16)
    o, lse = mla_paged_attention(q, cache, tables, cu, pos, torch.tensor(seq_lens), scale=SCALE, v_dim=V_DIM)
    o_ref, lse_ref = dense_reference(q, keys, cu, pos, torch.tensor(seq_lens))
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close("o", o_ref, o.float(), 5e-3)
    assert_close("lse", lse_ref, lse, 1e-5)


def test_lse_combine_matches_naive_with_empty_parts():
    gen = torch.Generator().manual_seed(13)
    o_parts = torch.randn(3, 5, H, V_DIM, generator=gen)
    lse_parts = torch.randn(3, 5, H, generator=gen) * 4
    lse_parts[1, 0] = float("-inf")
    o_parts[1, 0] = float("nan")  # a part that saw no key must not leak whatever it holds
    lse_parts[:, 2] = float("-inf")
    o, lse = lse_combine(o_parts, lse_parts)
    o_ref, lse_ref = naive_lse_combine(o_parts, lse_parts)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("lse", lse_ref, lse, 1e-6)
    assert torch.equal(o[2], torch.zeros(H, V_DIM)) and torch.isneginf(lse[2]).all()
    o_one, lse_one = lse_combine(o_parts[:1], lse_parts[:1])
    assert torch.equal(o_one[[0, 1, 3, 4]], o_parts[0, [0, 1, 3, 4]])


def test_rejects_bad_arguments(write_path):
    cache, tables, _ = build_cache([5], seed=0)
    q, cu, pos = queries([(0, 5)], seed=0)
    kv_lens = torch.tensor([5])
    kw = dict(scale=SCALE, v_dim=V_DIM)
    with pytest.raises(ValueError, match="kv_cache last dim"):
        mla_paged_attention(q[..., :-1], cache, tables, cu, pos, kv_lens, **kw)
    with pytest.raises(ValueError, match="v_dim"):
        mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=DQK + 1)
    with pytest.raises(ValueError, match="block_tables must have 2 rows"):
        mla_paged_attention(q, cache, tables, torch.tensor([0, 2, 5]), pos, torch.tensor([5, 5]), **kw)
    with pytest.raises(ValueError, match="kv_lens must have shape"):
        mla_paged_attention(q, cache, tables, cu, pos, torch.tensor([5, 5]), **kw)
    with pytest.raises(ValueError, match="needs 9 blocks"):
        mla_paged_attention(q, cache, tables, cu, pos, torch.tensor([33]), **kw)
    with pytest.raises(ValueError, match="block_tables must be an integer"):
        mla_paged_attention(q, cache, tables.float(), cu, pos, kv_lens, **kw)
    with pytest.raises(ValueError, match="num blocks"):
        mla_paged_attention(q, cache, tables + 100, cu, pos, kv_lens, **kw)
    latent = torch.zeros(5, DQK)
    with pytest.raises(ValueError, match="num blocks"):
        mla_write_kv(cache, tables + 100, cu, pos, latent)
    with pytest.raises(ValueError, match="positions must lie"):
        mla_write_kv(cache, tables, cu, pos + 100, latent)
    with pytest.raises(ValueError, match="latent must have shape"):
        mla_write_kv(cache, tables, cu, pos, torch.zeros(5, DQK + 1))
    with pytest.raises(ValueError, match="cu_seqlens"):
        mla_write_kv(cache, tables, torch.tensor([0, 4]), pos, latent)
    with pytest.raises(ValueError, match="lse_parts must have shape"):
        lse_combine(torch.zeros(2, 3, H, V_DIM), torch.zeros(2, 3, H + 1))
    with pytest.raises(ValueError, match="at least one part"):
        lse_combine(torch.zeros(0, 3, H, V_DIM), torch.zeros(0, 3, H))


@pytest.mark.parametrize("seq_lens", [[23], [6, 6, 6], [8, 8]])
def test_one_query_per_sequence_equal_lengths(seq_lens):
    """Equal key counts, every block held (the unmasked decode path), over a NaN-filled cache."""
    cache, tables, keys = build_cache(seq_lens, seed=16)
    q, cu, pos = queries([(L - 1, L) for L in seq_lens], seed=17)
    kv_lens = torch.tensor(seq_lens)
    o, lse = mla_paged_attention(q, cache, tables, cu, pos, kv_lens, scale=SCALE, v_dim=V_DIM)
    o_ref, lse_ref = dense_reference(q, keys, cu, pos, kv_lens)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("lse", lse_ref, lse, 1e-6)
