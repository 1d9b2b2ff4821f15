"""The padded (static-shape, no host read) MoE all-to-all == the host-split path, bit for bit.

Real gloo worlds of 1, 2 and 4 ranks, fp32, seeded random routings; also the worst case (every row
to one rank's experts, capacity exactly the max rows per rank), top_k > experts_per_rank, 0 rows
on a rank, dropped ids, duplicate ids, overflow flagged on every rank, and a guard that fails any
host read inside the padded call (and does fail on the host-split path).
"""

from __future__ import annotations

import pytest
import torch

from helixserve.launch.processes import run_local_world
from helixserve.parallel import (Mapping, MoeCapacityError, init_parallel, moe_a2a, moe_dispatch, moe_dispatch_padded, raise_if_overflow)
from tests.integration.host_sync_guard import HostReadError, no_host_reads

HIDDEN, OUT = 6, 5
# (num_experts, top_k, rows per rank (one list per world size), routing); routing "one_rank": every
# row picks only experts of the last rank (the worst case for a capacity)
CASES = [
    (8, 3, "random"), (8, 2, "one_rank"), (4, 3, "random"), (8, 8, "random"), (16, 4, "one_rank"), (4, 1, "random"),
]
ROWS = {1: [[5], [0], [9]], 2: [[5, 0], [0, 4], [7, 3], [0, 0], [1, 9]], 4: [[3, 0, 7, 1], [0, 0, 0, 2], [4, 4, 4, 4], [0, 0, 0, 0]]}


def _routing(total: int, num_experts: int, top_k: int, kind: str, ep: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "one_rank":
        per_rank = num_experts // ep
        scores = torch.randn(total, per_rank, generator=gen).softmax(-1)
        k = min(top_k, per_rank)
        weights, ids = scores.topk(k, dim=-1)
        ids = ids + num_experts - per_rank
        if k < top_k:  # pad with dropped slots
            ids = torch.cat([ids, torch.full((total, top_k - k), -1)], 1)
            weights = torch.cat([weights, torch.zeros(total, top_k - k)], 1)
        return ids, weights
    weights, ids = torch.randn(total, num_experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    if total > 1:
        ids[1, 0] = -1  # a dropped assignment
    return ids, weights


def _expert_fn(w_local: torch.Tensor, calls: list[int]):
    def fn(x_recv: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        calls.append(x_recv.shape[0])
        assert local_ids.dtype == torch.int64 and x_recv.shape[0] == local_ids.shape[0] == weights.shape[0]
        is_local = (local_ids < len(w_local))[:, None]  # padded path: masked slots are out of range
        y = torch.einsum("rd,rdo->ro", x_recv, w_local[local_ids.clamp(max=len(w_local) - 1)]) * weights[:, None]
        return torch.where(is_local, y, float("nan"))  # a masked slot's output must never reach a sum
    return fn


def _equal_worker(rank: int, world_size: int, init_method: str) -> int:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=20)
    checks = 0
    try:
        for case_id, (num_experts, top_k, kind) in enumerate(CASES):
            for seed, rows_per_rank in enumerate(ROWS[world_size]):
                gen = torch.Generator().manual_seed(1000 * case_id + seed)
                total = sum(rows_per_rank)
                x = torch.randn(total, HIDDEN, generator=gen)
                ids, weights = _routing(total, num_experts, top_k, kind, world_size, gen)
                w = torch.randn(num_experts, HIDDEN, OUT, generator=gen)
                per_rank = num_experts // world_size
                w_local = w[rank * per_rank : (rank + 1) * per_rank]
                start = sum(rows_per_rank[:rank])
                mine = slice(start, start + rows_per_rank[rank])
                args = (x[mine], ids[mine], weights[mine])
                host_calls: list[int] = []
                ref = moe_a2a(*args, _expert_fn(w_local, host_calls), num_experts=num_experts, group=groups.ep)
                exact_capacity = max(max(rows_per_rank), 1)
                for capacity, flag in ((exact_capacity, None), (exact_capacity + 3, None),
                                       (exact_capacity, torch.zeros((), dtype=torch.bool))):
                    calls: list[int] = []
                    out = moe_a2a(*args, _expert_fn(w_local, calls), num_experts=num_experts, group=groups.ep,
                                  capacity=capacity, overflow=flag)
                    assert out.dtype == ref.dtype and torch.equal(out, ref), (case_id, seed, capacity, flag)
                    slots = min(top_k, per_rank) if flag is not None else top_k
                    assert calls == [world_size * capacity * slots]  # static, whatever the routing
                    if flag is not None:
                        assert not bool(flag)
                    checks += 1
                dispatch = moe_dispatch(*args, num_experts, groups.ep)
                padded = moe_dispatch_padded(*args, num_experts, groups.ep, capacity=exact_capacity)
                assert padded.send_counts.tolist() == dispatch.send_counts
                assert padded.recv_counts.tolist() == dispatch.recv_counts
                assert int(padded.valid.sum()) == host_calls[0] and not bool(padded.overflow)
                if kind == "one_rank" and rank == world_size - 1:  # the exact capacity is reached
                    assert max(dispatch.recv_counts) == max(rows_per_rank)
        return checks
    finally:
        groups.destroy()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_padded_moe_equals_host_split_bit_for_bit(world_size: int) -> None:
    checks = run_local_world(_equal_worker, world_size, timeout_s=120)
    assert checks == [3 * len(CASES) * len(ROWS[world_size])] * world_size


def _overflow_worker(rank: int, world_size: int, init_method: str) -> dict[str, object]:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=20)
    result: dict[str, object] = {}
    try:
        fn = lambda x, i, w: x * w[:, None]  # noqa: E731
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(rank))
        # rank 0's 4 rows all go to rank 1's experts; capacity 3 < 4 rows: overflow on rank 0 only,
        # flagged on every rank (the flag travels with the counts)
        ids = torch.full((4, 1), 7 if rank == 0 else 0)
        flag = torch.zeros((), dtype=torch.bool)
        moe_a2a(x, ids, torch.ones(4, 1), fn, num_experts=8, group=groups.ep, capacity=3, overflow=flag)
        with pytest.raises(MoeCapacityError, match="overflowed its capacity"):
            raise_if_overflow(flag)
        # capacity < rows, but the routing fits: no flag and the host path's result
        ids = torch.tensor([[0], [7], [1], [6]])
        flag = torch.zeros((), dtype=torch.bool)
        out = moe_a2a(x, ids, torch.ones(4, 1), fn, num_experts=8, group=groups.ep, capacity=2, overflow=flag)
        raise_if_overflow(flag)
        assert torch.equal(out, moe_a2a(x, ids, torch.ones(4, 1), fn, num_experts=8, group=groups.ep))
        # a row listing one expert twice, experts_per_rank 1 < top_k 2: compacted slots overflow on
        # rank 0 (flag); without a flag the path keeps top_k slots and equals the host path
        ids = torch.tensor([[rank, rank]] * 4)
        flag = torch.zeros((), dtype=torch.bool)
        moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep, capacity=4, overflow=flag)
        result["duplicate_flag"] = bool(flag)
        out = moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep, capacity=4)
        assert torch.equal(out, moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep))
        # an expert id >= num_experts is flagged, never silently dropped
        flag = torch.zeros((), dtype=torch.bool)
        bad = torch.full((4, 1), 8 if rank == 1 else 0)
        moe_a2a(x, bad, torch.ones(4, 1), fn, num_experts=8, group=groups.ep, capacity=4, overflow=flag)
        result["bad_id_flag"] = bool(flag)
        # caller errors, named with their values (no collective entered, so every rank raises alike)
        with pytest.raises(ValueError, match="capacity=3 < 4 rows can overflow"):
            moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep, capacity=3)
        with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
            moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep, capacity=0, overflow=flag)
        with pytest.raises(ValueError, match="overflow must be a 0-dim bool tensor"):
            moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep, capacity=4, overflow=torch.zeros(1))
        with pytest.raises(ValueError, match="pass capacity too"):
            moe_a2a(x, ids, torch.ones(4, 2), fn, num_experts=2, group=groups.ep, overflow=flag)
        return result
    finally:
        groups.destroy()


def test_padded_moe_overflow_is_flagged_on_every_rank() -> None:
    results = run_local_world(_overflow_worker, 2, timeout_s=60)
    assert results == [{"duplicate_flag": True, "bad_id_flag": True}] * 2


def _no_host_read_worker(rank: int, world_size: int, init_method: str) -> str:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=20)
    try:
        gen = torch.Generator().manual_seed(rank)
        rows = [5, 0][rank]
        x = torch.randn(rows, HIDDEN, generator=gen)
        weights, ids = torch.randn(rows, 8, generator=gen).softmax(-1).topk(3, dim=-1)
        w_local = torch.randn(4, HIDDEN, OUT, generator=gen)
        fn = _expert_fn(w_local, [])
        flag = torch.zeros((), dtype=torch.bool)
        with no_host_reads():
            padded = moe_a2a(x, ids, weights, fn, num_experts=8, group=groups.ep, capacity=5)
            padded_flagged = moe_a2a(x, ids, weights, fn, num_experts=8, group=groups.ep, capacity=2, overflow=flag)
        host = moe_a2a(x, ids, weights, fn, num_experts=8, group=groups.ep)
        assert torch.equal(padded, host)
        assert bool(flag) and padded_flagged.shape == host.shape  # 5 rows in capacity 2 overflow
        # the guard is real: the host-split path fails it (both ranks, so no peer waits)
        with pytest.raises(HostReadError), no_host_reads():
            moe_a2a(x, ids, weights, fn, num_experts=8, group=groups.ep)
        return "ok"
    finally:
        groups.destroy()


def test_padded_moe_reads_nothing_on_the_host() -> None:
    assert run_local_world(_no_host_read_worker, 2, timeout_s=60) == ["ok"] * 2


def _kernel_worker(rank: int, world_size: int, init_method: str) -> int:
    """The kernels' grouped experts as expert_fn (the lambda of moe_a2a's docstring): masked slots'
    out-of-range ids are skipped by the kernel, so both paths give the same layer output."""
    from helixserve.kernels.moe.experts import moe_experts

    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=20)
    checks = 0
    try:
        for num_experts, top_k, rows_per_rank in ((8, 3, [5, 0]), (4, 3, [7, 3]), (8, 2, [40, 33])):
            gen = torch.Generator().manual_seed(num_experts * 100 + sum(rows_per_rank))
            per_rank = num_experts // world_size
            w13 = torch.randn(num_experts, 2 * 16, HIDDEN, generator=gen) / HIDDEN**0.5
            w2 = torch.randn(num_experts, HIDDEN, 16, generator=gen) / 4
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            fn = lambda x, ids, w: moe_experts(x, ids[:, None], w[:, None], w13[mine], w2[mine])  # noqa: E731
            x = torch.randn(rows_per_rank[rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
            weights, ids = torch.randn(x.shape[0], num_experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
            ref = moe_a2a(x, ids, weights, fn, num_experts=num_experts, group=groups.ep)
            out = moe_a2a(x, ids, weights, fn, num_experts=num_experts, group=groups.ep, capacity=max(rows_per_rank))
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            assert out.shape == (x.shape[0], HIDDEN) and torch.isfinite(out).all()
            checks += 1
        return checks
    finally:
        groups.destroy()


def test_padded_moe_with_the_grouped_expert_kernel() -> None:
    assert run_local_world(_kernel_worker, 2, timeout_s=60) == [3, 3]
