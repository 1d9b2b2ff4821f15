"""The batch-invariant GEMMs (``model.deterministic``): the fixed-tile Triton GEMM and grouped GEMM
against PyTorch under Triton's interpreter, a row's result the same alone and in any batch, and
the device-side tile schedule of the grouped GEMM covering every row once.

The interpreted kernels run in a child pytest with ``TRITON_INTERPRET=1`` (as the other kernel
tests, see test_gpu_kernels_interpret.py); the CUDA runs are in test_determinism.py.
"""

from __future__ import annotations


import pytest
import torch

from tests._testing import assert_close, needs_interpreter, run_under_triton_interpreter, triton_interpreter_patches



def test_gemm_kernels_under_triton_interpreter():
    run_under_triton_interpreter(__file__)


@pytest.fixture(scope="module")
def tg():
    pytest.importorskip("triton")
    with triton_interpreter_patches():
        from helixserve.kernels.gemm import triton_gemm

        yield triton_gemm


@needs_interpreter
@pytest.mark.parametrize("M,N,K", [(1, 3, 1), (5, 65, 33), (70, 64, 100), (64, 1, 32)])
def test_bmm_matches_torch_fp32(tg, M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    a, w = torch.randn(2, M, K, generator=gen), torch.randn(2, N, K, generator=gen)
    out = tg.bmm_nt(a, w.transpose(1, 2))  # the weight as nn.Linear holds it: [N, K], read transposed
    assert out.shape == (2, M, N)
    assert_close(f"bmm {M}x{N}x{K}", torch.bmm(a, w.transpose(1, 2)), out, 1e-5)


@needs_interpreter
def test_bmm_empty_shapes(tg):
    assert tg.bmm_nt(torch.randn(1, 0, 4), torch.randn(1, 4, 3)).shape == (1, 0, 3)
    assert torch.equal(tg.bmm_nt(torch.randn(1, 2, 0), torch.randn(1, 0, 3)), torch.zeros(1, 2, 3))


@needs_interpreter
def test_a_row_is_the_same_alone_and_in_any_batch(tg):
    """The property the mode exists for: a row's output bits do not depend on the other rows."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 200, generator=gen).t()
    rows = torch.randn(130, 200, generator=gen)
    alone = tg.bmm_nt(rows[None, 17:18], w[None])[0, 0]
    for batch in (2, 64, 65, 130):  # one tile of rows, one row past it, three tiles
        start = max(0, 18 - batch)
        out = tg.bmm_nt(rows[None, start:start + batch], w[None])[0]
        assert torch.equal(out[17 - start], alone), batch


def _grouped_reference(a: torch.Tensor, w: torch.Tensor, ends: list[int]) -> torch.Tensor:
    out, start = torch.zeros(a.shape[0], w.shape[2]), 0
    for g, end in enumerate(ends):
        out[start:end] = a[start:end] @ w[g]
        start = end
    return out


@needs_interpreter
def test_grouped_mm_matches_per_group_products(tg):
    gen = torch.Generator().manual_seed(3)
    counts = [0, 1, 63, 64, 65, 0, 2]  # empty groups, a block -1 / +1, a group after an empty one
    ends = torch.tensor(counts).cumsum(0).tolist()
    P = ends[-1] + 5  # rows past the last group (expert-parallel pairs held elsewhere): unwritten
    a, w = torch.randn(P, 40, generator=gen), torch.randn(len(counts), 40, 24, generator=gen)
    out = tg.grouped_mm(a, w, torch.tensor(ends, dtype=torch.int32))
    assert_close("grouped", _grouped_reference(a, w, ends)[:ends[-1]], out[:ends[-1]], 1e-5)


@pytest.mark.parametrize("counts", [[0], [1], [64], [65, 0, 0, 3], [0, 0, 128], [5, 64, 1, 63]])
def test_group_tiles_cover_every_row_once(counts):
    """The device-side schedule (plain torch, no Triton needed beyond the constants)."""
    pytest.importorskip("triton")
    from helixserve.kernels.gemm import triton_gemm

    ends = torch.tensor(counts).cumsum(0)
    P = int(ends[-1]) + 3
    group, first, end = triton_gemm.group_tiles(ends.to(torch.int32), P)
    seen = torch.zeros(P, dtype=torch.int64)
    starts = [0, *ends.tolist()[:-1]]
    for g, f, e in zip(group.tolist(), first.tolist(), end.tolist()):
        if g == len(counts):
            continue
        rows = range(f, min(f + triton_gemm.BLOCK_M, e))
        assert all(starts[g] <= r < ends[g] for r in rows), (g, f, e)
        for r in rows:
            seen[r] += 1
    assert seen[:int(ends[-1])].eq(1).all() and seen[int(ends[-1]):].eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_linear_and_grouped_rows_batch_invariant_bf16():
    """On CUDA with the mode on, ``nn.Linear`` (aten addmm/mm, replaced) and the grouped expert GEMM
    give a row the same bits alone and in batches of other sizes; off, the mode restores cuBLAS."""
    pytest.importorskip("triton")
    from helixserve.kernels.gemm import batch_invariant_gemms, grouped_mm, set_batch_invariant

    gen = torch.Generator(device="cuda").manual_seed(5)
    lin = torch.nn.Linear(1024, 768, bias=False, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1030, 1024, dtype=torch.bfloat16, device="cuda", generator=gen)
    w = torch.randn(4, 1024, 256, dtype=torch.bfloat16, device="cuda", generator=gen)
    assert set_batch_invariant(True) and batch_invariant_gemms()
    try:
        alone = lin(x[:1])
        assert_close("linear", x[:1].float() @ lin.weight.float().t(), alone.float(), 2e-2)
        ends = lambda n: torch.tensor([n, n, n, n], dtype=torch.int32, device="cuda")  # noqa: E731 (one group used)
        g_alone = grouped_mm(x[:1], w, ends(1))
        for batch in (2, 7, 64, 65, 513, 1030):
            assert torch.equal(lin(x[:batch])[:1], alone), batch
            assert torch.equal(grouped_mm(x[:batch], w, ends(batch))[:1], g_alone), batch
    finally:
        set_batch_invariant(False)
    assert not batch_invariant_gemms()
