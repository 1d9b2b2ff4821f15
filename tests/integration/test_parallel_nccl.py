"""The same collective and MoE checks over NCCL, one process per GPU (needs 2 GPUs)."""

from __future__ import annotations

import time

import pytest
import torch

from helixserve.launch.processes import run_local_world
from helixserve.parallel import CollectiveError, Mapping, all_gather_rows, init_parallel
from tests.integration.test_parallel_collectives import TOKEN_COUNTS, _lse_worker, _rows_worker
from tests.integration.test_parallel_moe import _moe_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 1)])
def test_nccl_rows_and_lse(dp: int, cp: int) -> None:
    assert run_local_world(_rows_worker, 2, dp, cp, "nccl", timeout_s=120) == [len(TOKEN_COUNTS) + 3] * 2
    if cp > 1:
        assert max(run_local_world(_lse_worker, 2, dp, cp, "nccl", timeout_s=120)) < 1e-6


def test_nccl_moe_a2a() -> None:
    errors = run_local_world(_moe_worker, 2, [[5, 0], [0, 4], [7, 3], [0, 0]], "nccl", timeout_s=120)
    assert max(max(e) for e in errors) < 1e-12


def _nccl_skipping_peer_worker(rank: int, world_size: int, init_method: str) -> tuple[str, float]:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="nccl", local_rank=rank, timeout_s=3)
    rows = torch.ones(2, 4, device=groups.device)
    all_gather_rows(rows, 4, groups.cp)  # communicator up, so the timeout covers the skipped call only
    if rank == 1:
        time.sleep(8)
        return "skipped", 0.0
    start = time.monotonic()
    try:
        all_gather_rows(rows, 4, groups.cp)
    except CollectiveError as exc:
        return f"raised: {exc}", time.monotonic() - start
    return "no error", time.monotonic() - start


def test_nccl_skipped_collective_raises_within_timeout() -> None:
    """With the default host-blocking wait, a missing NCCL peer raises after the group timeout."""
    outcome, elapsed = run_local_world(_nccl_skipping_peer_worker, 2, timeout_s=60)[0]
    assert outcome.startswith("raised: all_gather_rows over ranks [0, 1] failed on rank 0"), outcome
    assert 2.0 < elapsed < 8.0
