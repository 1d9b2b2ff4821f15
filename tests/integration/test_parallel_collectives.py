"""Row gather/scatter, the all-reduce of row-parallel sums, uneven all-to-all and the helix LSE
exchange on real gloo worlds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from helixserve.launch.processes import run_local_world
from helixserve.parallel import (
    Mapping,
    all_gather_counts,
    all_gather_rows,
    all_reduce_sum,
    all_to_all_rows,
    init_parallel,
    lse_all_to_all,
    reduce_scatter_rows,
    split_rows,
)

TOKEN_COUNTS = [0, 1, 3, 8, 33]
TIMEOUT_S = 20.0


def _gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) % (2**31))


def _rows_worker(rank: int, world_size: int, init_method: str, dp: int, cp: int, backend: str = "gloo") -> int:
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend=backend, local_rank=rank, timeout_s=TIMEOUT_S)
    dev = groups.device
    checks = 0
    try:
        for num_tokens in TOKEN_COUNTS:
            # full rows differ per CP group, so a cross-group mix-up would show
            full = torch.randn(num_tokens, 5, generator=_gen(num_tokens, mapping.dp_rank))
            local = split_rows(full, cp, mapping.cp_rank)
            assert torch.equal(all_gather_rows(local.to(dev), num_tokens, groups.cp).cpu(), full)

            partials = [torch.randn(num_tokens, 5, generator=_gen(num_tokens, mapping.dp_rank, c)) for c in range(cp)]
            total = torch.stack(partials).sum(0)
            mine = reduce_scatter_rows(partials[mapping.cp_rank].to(dev), groups.cp).cpu()
            expected = split_rows(total, cp, mapping.cp_rank)
            assert mine.shape == (math.ceil(num_tokens / cp), 5)
            torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-6)
            assert torch.all(mine[expected.abs().sum(1) == 0] == 0)  # padding rows are exactly 0
            gathered = all_gather_rows(mine.to(dev), num_tokens, groups.cp).cpu()
            torch.testing.assert_close(gathered, total, rtol=1e-6, atol=1e-6)
            # a heads-TP draft's row-parallel sums: every rank of the group gets the same full sum
            summed = all_reduce_sum(partials[mapping.cp_rank].to(dev), groups.cp)
            torch.testing.assert_close(summed.cpu(), total, rtol=1e-6, atol=1e-6)
            leaders = summed.clone()
            dist.broadcast(leaders, src=mapping.rank_of(mapping.dp_rank, 0), group=groups.cp)
            assert torch.equal(summed, leaders)
            checks += 1

        assert all_gather_counts(3 * rank + 1, groups.world) == [3 * r + 1 for r in range(world_size)]
        assert all_gather_counts(rank, groups.cp) == mapping.cp_group_ranks

        # uneven all-to-all over the world: rank s sends (s + d) % 3 rows to rank d (0 included)
        send_counts = [(rank + d) % 3 for d in range(world_size)]
        rows = torch.tensor([[rank, d, i] for d in range(world_size) for i in range(send_counts[d])], dtype=torch.float32)
        got = all_to_all_rows(rows.reshape(-1, 3).to(dev), send_counts, groups.world).cpu()
        want = [[s, rank, i] for s in range(world_size) for i in range((s + rank) % 3)]
        assert got.tolist() == want

        # the DP group really holds the ranks with this cp_rank
        member_sum = torch.tensor([float(rank)], device=dev)
        dist.all_reduce(member_sum, group=groups.dp)
        assert member_sum.item() == sum(mapping.dp_group_ranks)
        return checks + 3
    finally:
        groups.destroy()


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 1), (2, 2), (1, 4)])
def test_rows_round_trip_and_uneven_all_to_all(dp: int, cp: int) -> None:
    results = run_local_world(_rows_worker, dp * cp, dp, cp, "gloo", timeout_s=60)
    assert results == [len(TOKEN_COUNTS) + 3] * (dp * cp)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention of q [T, H, D] over k, v [S, H, D]; (o [T, H, D], lse [T, H])."""
    scores = torch.einsum("thd,shd->ths", q, k) * scale
    if k.shape[0] == 0:  # no local KV contributes (-inf, 0)
        return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), dtype=q.dtype)
    return torch.einsum("ths,shd->thd", scores.softmax(-1), v), scores.logsumexp(-1)


def _combine(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> torch.Tensor:
    """O = sum_i O_i exp(lse_i - m) / sum_i exp(lse_i - m) over dim 0."""
    m = lse_parts.amax(0)
    w = torch.exp(lse_parts - m)
    return (o_parts * w[..., None]).sum(0) / w.sum(0)[..., None]


def _lse_worker(rank: int, world_size: int, init_method: str, dp: int, cp: int, backend: str = "gloo") -> float:
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend=backend, local_rank=rank, timeout_s=TIMEOUT_S)
    dev = groups.device
    num_heads, head_dim, block, scale = 8, 4, 2, 0.3
    worst = 0.0
    try:
        for num_tokens, num_keys in [(1, 3), (3, 16), (5, 1), (0, 4)]:
            gen = _gen(num_tokens, num_keys, mapping.dp_rank)
            q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, dtype=torch.float64)
            k = torch.randn(num_keys, num_heads, head_dim, generator=gen, dtype=torch.float64)
            v = torch.randn(num_keys, num_heads, head_dim, generator=gen, dtype=torch.float64)
            # round-robin KV blocks: block b on CP rank b % cp (some ranks may own none)
            mine = [s for s in range(num_keys) if (s // block) % cp == mapping.cp_rank]
            o, lse = _attention(q, k[mine], v[mine], scale)
            heads = mapping.local_heads(num_heads)
            o_ref, _ = _attention(q, k, v, scale)
            for o_dtype in (torch.float64, torch.float32):  # packed path, then two-call path
                o_parts, lse_parts = lse_all_to_all(o.to(dev, o_dtype), lse.to(dev, torch.float64), groups.cp)
                o_parts, lse_parts = o_parts.cpu(), lse_parts.cpu()
                assert o_parts.shape == (cp, num_tokens, num_heads // cp, head_dim)
                assert lse_parts.shape == (cp, num_tokens, num_heads // cp)
                out = _combine(o_parts.double(), lse_parts)
                err = (out - o_ref[:, heads.start : heads.stop]).abs().max().item() if num_tokens else 0.0
                tol = 1e-12 if o_dtype == torch.float64 else 1e-6
                assert err < tol, (num_tokens, num_keys, o_dtype, err)
                worst = max(worst, err)
        return worst
    finally:
        groups.destroy()


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2), (1, 4)])
def test_lse_all_to_all_combine_equals_unsplit_attention(dp: int, cp: int) -> None:
    errs = run_local_world(_lse_worker, dp * cp, dp, cp, "gloo", timeout_s=60)
    assert max(errs) < 1e-6
