"""Row gathers/scatters, the LSE exchange and the equal-split all-to-all into preallocated buffers.

Real gloo worlds. With ``out``/``buffers`` the collectives write into the caller's memory (the
same storage every call, as a CUDA graph needs), give the allocating call's result, and read
nothing on the host (:func:`no_host_reads`); wrong buffers are named errors.
"""

from __future__ import annotations

import pytest
import torch

from helixserve.launch.processes import run_local_world
from helixserve.parallel import (Mapping, all_gather_rows, all_to_all_equal, init_parallel, lse_all_to_all, lse_buffers, reduce_scatter_rows, row_chunk, split_rows)
from tests.integration.host_sync_guard import no_host_reads


def _gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) % (2**31))


def _rows_worker(rank: int, world_size: int, init_method: str, dp: int, cp: int) -> int:
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=20)
    checks = 0
    try:
        for num_tokens in (0, 1, 3, 8, 33):
            chunk = row_chunk(num_tokens, cp)
            gathered = torch.full((cp * chunk, 5), float("nan"))
            scattered = torch.full((chunk, 5), float("nan"))
            for step in range(2):  # the same buffers twice: each call overwrites them
                full = torch.randn(num_tokens, 5, generator=_gen(num_tokens, mapping.dp_rank, step))
                local = split_rows(full, cp, mapping.cp_rank)
                partial = torch.randn(num_tokens, 5, generator=_gen(num_tokens, mapping.dp_rank, step, mapping.cp_rank))
                padded = torch.zeros(cp * chunk, 5)
                padded[:num_tokens] = partial
                with no_host_reads():
                    rows = all_gather_rows(local, num_tokens, groups.cp, out=gathered)
                    mine = reduce_scatter_rows(padded, groups.cp, out=scattered)
                assert torch.equal(rows, full) and (rows.numel() == 0 or rows.data_ptr() == gathered.data_ptr())
                assert mine is scattered and torch.equal(mine, reduce_scatter_rows(partial, groups.cp))
                checks += 1
        with pytest.raises(ValueError, match=rf"all_gather_rows out must be torch.float32 \({2 * cp}, 5\)"):
            all_gather_rows(torch.ones(2, 5), 2 * cp, groups.cp, out=torch.empty(2 * cp, 4))
        with pytest.raises(ValueError, match="reduce_scatter_rows out must be torch.float32"):
            reduce_scatter_rows(torch.ones(2 * cp, 5), groups.cp, out=torch.empty(2, 5, dtype=torch.float64))
        return checks
    finally:
        groups.destroy()


@pytest.mark.parametrize("dp,cp", [(2, 2), (1, 4)])  # CP groups of 2 (two of them) and of 4
def test_rows_into_preallocated_buffers(dp: int, cp: int) -> None:
    assert run_local_world(_rows_worker, dp * cp, dp, cp, timeout_s=60) == [10] * (dp * cp)


def _lse_worker(rank: int, world_size: int, init_method: str) -> int:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=20)
    checks = 0
    try:
        for num_tokens, o_dtype, lse_dtype in ((5, torch.float32, torch.float32), (3, torch.bfloat16, torch.float32),
                                               (0, torch.float32, torch.float32)):
            buffers = lse_buffers(num_tokens, 4 * world_size, 7, world_size, o_dtype, lse_dtype, torch.device("cpu"))
            for step in range(2):
                gen = _gen(rank, num_tokens, step)
                o = torch.randn(num_tokens, 4 * world_size, 7, generator=gen).to(o_dtype)
                lse = torch.randn(num_tokens, 4 * world_size, generator=gen).to(lse_dtype)
                with no_host_reads():
                    o_parts, lse_parts = lse_all_to_all(o, lse, groups.cp, buffers=buffers)
                ref_o, ref_lse = lse_all_to_all(o, lse, groups.cp)
                assert o_parts.dtype == o_dtype and lse_parts.dtype == lse_dtype
                assert torch.equal(o_parts, ref_o) and torch.equal(lse_parts, ref_lse)
                assert o_parts.numel() == 0 or o_parts.data_ptr() == buffers.recv.data_ptr()
                checks += 1
        wrong = lse_buffers(2, 4 * world_size, 7, world_size, torch.float32, torch.float32, torch.device("cpu"))
        with pytest.raises(ValueError, match="lse buffers don't match"):
            lse_all_to_all(torch.ones(3, 4 * world_size, 7), torch.ones(3, 4 * world_size), groups.cp, buffers=wrong)
        with pytest.raises(ValueError, match="lse buffers don't match"):  # packed buffers for unequal dtypes
            lse_all_to_all(torch.ones(2, 4 * world_size, 7, dtype=torch.bfloat16), torch.ones(2, 4 * world_size),
                           groups.cp, buffers=wrong)
        return checks
    finally:
        groups.destroy()


@pytest.mark.parametrize("world_size", [2, 4])
def test_lse_all_to_all_into_buffers(world_size: int) -> None:
    assert run_local_world(_lse_worker, world_size, timeout_s=60) == [6] * world_size


def _equal_a2a_worker(rank: int, world_size: int, init_method: str) -> bool:
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method, backend="gloo", timeout_s=20)
    try:
        # rank r sends rows (r, d, i) to rank d, 3 rows each
        x = torch.tensor([[rank, d, i] for d in range(world_size) for i in range(3)], dtype=torch.float32)
        out = torch.empty_like(x)
        with no_host_reads():
            got = all_to_all_equal(x, groups.ep, out=out)
        expected = torch.tensor([[s, rank, i] for s in range(world_size) for i in range(3)], dtype=torch.float32)
        with pytest.raises(ValueError, match=f"not a multiple of the group size {world_size}"):
            all_to_all_equal(torch.ones(world_size + 1, 2), groups.ep)
        return got is out and torch.equal(got, expected)
    finally:
        groups.destroy()


def test_all_to_all_equal_splits() -> None:
    assert run_local_world(_equal_a2a_worker, 3, timeout_s=60) == [True] * 3
