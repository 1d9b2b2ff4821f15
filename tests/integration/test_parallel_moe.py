"""MoE all-to-all dispatch/combine over real gloo worlds == single-process per-expert compute."""

from __future__ import annotations

import pytest
import torch

from helixserve.launch.processes import run_local_world
from helixserve.parallel import Mapping, init_parallel, moe_a2a, moe_dispatch

NUM_EXPERTS, TOP_K, HIDDEN, OUT = 8, 3, 6, 5


def _problem(rows_per_rank: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """Global rows, routing and expert weights, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(rows_per_rank)
    x = torch.randn(total, HIDDEN, generator=gen, dtype=torch.float64)
    scores = torch.randn(total, NUM_EXPERTS, generator=gen, dtype=torch.float64)
    topk_weights, topk_ids = scores.softmax(-1).topk(TOP_K, dim=-1)
    if total:
        topk_ids[0, -1] = -1  # a dropped assignment contributes nothing
    w = torch.randn(NUM_EXPERTS, HIDDEN, OUT, generator=gen, dtype=torch.float64)
    return x, topk_ids, topk_weights, w


def _reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Single process: out[t] = sum_k weight[t, k] * x[t] @ W[id[t, k]]."""
    out = torch.zeros(x.shape[0], OUT, dtype=x.dtype)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            if topk_ids[t, j] >= 0:
                out[t] += topk_weights[t, j] * (x[t] @ w[topk_ids[t, j]])
    return out


def _moe_worker(rank: int, world_size: int, init_method: str, cases: list[list[int]], backend: str = "gloo") -> list[float]:
    mapping = Mapping(world_size, rank, cp=world_size)
    groups = init_parallel(mapping, init_method, backend=backend, local_rank=rank, timeout_s=20)
    dev = groups.device
    experts = mapping.local_experts(NUM_EXPERTS)
    errors = []
    try:
        for seed, rows_per_rank in enumerate(cases):
            x, topk_ids, topk_weights, w = _problem(rows_per_rank, seed)
            w_local = w[experts.start : experts.stop].to(dev)
            calls = []

            def expert_fn(x_recv: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
                calls.append(x_recv.shape[0])
                assert local_ids.dtype == torch.int64 and weights.dtype == topk_weights.dtype
                assert x_recv.shape[0] == 0 or 0 <= int(local_ids.min()) <= int(local_ids.max()) < len(experts)
                return torch.einsum("rd,rdo->ro", x_recv, w_local[local_ids]) * weights[:, None]

            start = sum(rows_per_rank[:rank])
            mine = slice(start, start + rows_per_rank[rank])
            out = moe_a2a(
                x[mine].to(dev), topk_ids[mine].to(dev), topk_weights[mine].to(dev), expert_fn,
                num_experts=NUM_EXPERTS, group=groups.ep,
            ).cpu()
            assert out.shape == (rows_per_rank[rank], OUT) and out.dtype == x.dtype
            # the expert side received exactly the assignments routed to its experts
            routed_here = ((topk_ids >= experts.start) & (topk_ids < experts.stop)).sum().item()
            assert calls == [routed_here]
            ref = _reference(x[mine], topk_ids[mine], topk_weights[mine], w)
            errors.append((out - ref).abs().max().item() if out.numel() else 0.0)

        # fp32 rows with bf16 weights: dtypes preserved through dispatch
        x32 = torch.randn(2, HIDDEN, device=dev)
        ids = torch.tensor([[0, NUM_EXPERTS - 1], [1, 2]])
        weights = torch.ones(2, 2, dtype=torch.bfloat16, device=dev)
        dispatch = moe_dispatch(x32, ids.to(dev), weights, NUM_EXPERTS, groups.ep)
        assert dispatch.x.dtype == torch.float32 and dispatch.weights.dtype == torch.bfloat16
        num_mine = sum(int(i) in experts for i in ids.flatten())
        rows_mine = sum(any(int(i) in experts for i in row) for row in ids)  # a row travels once per rank
        assert dispatch.recv_counts == [rows_mine] * world_size and dispatch.x.shape[0] == world_size * num_mine
        per_rank = NUM_EXPERTS // world_size
        assert dispatch.send_counts == [sum(any(int(i) // per_rank == r for i in row) for row in ids)
                                        for r in range(world_size)]
        return errors
    finally:
        groups.destroy()


@pytest.mark.parametrize(
    "world_size,cases",
    [
        (2, [[5, 0], [0, 4], [7, 3], [0, 0]]),
        (4, [[3, 0, 7, 1], [0, 0, 0, 2], [4, 4, 4, 4], [0, 0, 0, 0]]),
    ],
)
def test_moe_a2a_equals_single_process(world_size: int, cases: list[list[int]]) -> None:
    errors = run_local_world(_moe_worker, world_size, cases, "gloo", timeout_s=60)
    assert max(max(e) for e in errors) < 1e-12


def _bad_ids_worker(rank: int, world_size: int, init_method: str) -> str:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=10)
    try:
        with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
            moe_dispatch(torch.ones(1, 2), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), 6, groups.ep)
        with pytest.raises(ValueError, match="expert 8 >= num_experts=8"):
            moe_dispatch(torch.ones(1, 2), torch.full((1, 1), 8), torch.ones(1, 1), 8, groups.ep)
        return "ok"
    finally:
        groups.destroy()


def test_moe_dispatch_errors_name_values() -> None:
    assert run_local_world(_bad_ids_worker, 4, timeout_s=30) == ["ok"] * 4
