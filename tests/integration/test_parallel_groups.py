"""Process-group setup and failure behaviour: a missing or dead peer is an error, never a hang."""

from __future__ import annotations

import time

import pytest
import torch

from helixserve.launch.processes import LocalWorldError, run_local_world
from helixserve.parallel import (
    CollectiveError,
    Mapping,
    all_gather_rows,
    init_parallel,
    reduce_scatter_rows,
)

COLLECTIVE_TIMEOUT_S = 2.0


def _groups_worker(rank: int, world_size: int, init_method: str) -> tuple[list[int], list[int], str, str]:
    mapping = Mapping(world_size, rank, dp=2, cp=2)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=10)
    try:
        assert groups.backend == "gloo" and groups.device == torch.device("cpu")
        assert groups.ep is groups.world and groups.cpu is groups.world
        import torch.distributed as dist

        return (
            dist.get_process_group_ranks(groups.cp),
            dist.get_process_group_ranks(groups.dp),
            str(groups.timeout),
            str(dist.get_world_size(groups.world)),
        )
    finally:
        groups.destroy()


def test_groups_membership_and_timeout() -> None:
    results = run_local_world(_groups_worker, 4, timeout_s=60)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r[2] == "0:00:10" and r[3] == "4" for r in results)


def _skipping_peer_worker(rank: int, world_size: int, init_method: str) -> float:
    """Rank 1 stays alive but never enters the collective rank 0 is waiting in."""
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        if rank == 1:
            time.sleep(COLLECTIVE_TIMEOUT_S + 2.0)
            return 0.0
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=r"all_gather_rows over ranks \[0, 1\] failed on rank 0"):
            all_gather_rows(torch.ones(2, 4), 4, groups.cp)
        return time.monotonic() - start
    finally:
        groups.destroy()


def test_skipped_collective_raises_within_timeout() -> None:
    elapsed = run_local_world(_skipping_peer_worker, 2, timeout_s=30)[0]
    assert COLLECTIVE_TIMEOUT_S * 0.5 <= elapsed < COLLECTIVE_TIMEOUT_S + 3.0


def _dead_peer_worker(rank: int, world_size: int, init_method: str) -> float:
    """Rank 1 leaves the world (process exits) before the collective."""
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    if rank == 1:
        groups.destroy()
        return 0.0
    time.sleep(0.5)
    start = time.monotonic()
    try:
        with pytest.raises(CollectiveError, match="reduce_scatter_rows"):
            reduce_scatter_rows(torch.ones(3, 4), groups.cp)
        return time.monotonic() - start
    finally:
        groups.destroy()


def test_dead_peer_raises_within_timeout() -> None:
    elapsed = run_local_world(_dead_peer_worker, 2, timeout_s=30)[0]
    assert elapsed < COLLECTIVE_TIMEOUT_S + 3.0


def _failing_rank_worker(rank: int, world_size: int, init_method: str) -> None:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        if rank == 1:
            raise ValueError("rank 1 broke on purpose")
        all_gather_rows(torch.ones(1, 2), 2, groups.cp)  # times out: rank 1 never joins
    finally:
        groups.destroy()


def test_local_world_reports_failing_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(LocalWorldError) as info:
        run_local_world(_failing_rank_worker, 2, timeout_s=30, grace_s=5)
    message = str(info.value)
    assert "failed on ranks [0, 1]" in message
    assert "ValueError: rank 1 broke on purpose" in message and "CollectiveError" in message
    assert time.monotonic() - start < 15


def _hanging_worker(rank: int, world_size: int, init_method: str) -> None:
    time.sleep(60)


def test_local_world_timeout_kills_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(LocalWorldError, match="still running after timeout_s=1"):
        run_local_world(_hanging_worker, 2, timeout_s=1.0)
    assert time.monotonic() - start < 5
