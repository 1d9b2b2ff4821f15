"""Batch-invariant Triton GEMMs: one tile shape for every problem size, no split-K.

A row's outputs are computed by one program from its own row and the weights, over K in one fixed
order (``BLOCK_K`` chunks ascending, fp32 accumulation), whatever the other rows are: so a
request's result does not depend on the batch it runs in. cuBLAS and CUTLASS pick their tiles,
split-K and stream-K plans from the problem's shape, so the same row can be summed in a different
order when the batch grows. See :mod:`helixserve.kernels.gemm` for where these replace them.

- :func:`bmm_nt`: ``c[b] = a[b] @ w[b]`` for any strides (mm is a batch of one);
- :func:`grouped_mm`: ``torch._grouped_mm``'s contract for a ``[P, K]`` left operand whose rows
  are sorted by group, ``w [G, K, N]`` and ``offs [G]`` int32 group ends, with the tile of each
  program found on the device (no host read: a decode step captures in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


@triton.jit
def _tile(a_ptr, w_ptr, rows, row_mask, K, s_am, s_ak, s_wk, s_wn, offs_n, n_mask,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * s_am + k[None, :] * s_ak,
                    mask=row_mask[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + k[:, None] * s_wk + offs_n[None, :] * s_wn,
                    mask=(k[:, None] < K) & n_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _bmm_kernel(a_ptr, w_ptr, c_ptr, M, N, K, s_ab, s_am, s_ak, s_wb, s_wk, s_wn, s_cb, s_cm, s_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, n_mask = rows < M, offs_n < N
    acc = _tile(a_ptr + b * s_ab, w_ptr + b * s_wb, rows, row_mask, K, s_am, s_ak, s_wk, s_wn, offs_n, n_mask,
                BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    c = c_ptr + b * s_cb + rows[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, c_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, N, K, G,
                    s_am, s_ak, s_wg, s_wk, s_wn, s_cm, s_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.load(tile_group_ptr + t)
    if g < G:
        row0 = tl.load(tile_row_ptr + t)
        row_end = tl.load(tile_end_ptr + t)
        rows = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, n_mask = rows < row_end, offs_n < N
        acc = _tile(a_ptr, w_ptr + g.to(tl.int64) * s_wg, rows.to(tl.int64), row_mask, K, s_am, s_ak, s_wk, s_wn,
                    offs_n, n_mask, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        c = c_ptr + rows[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def bmm_nt(a: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a [B, M, K] @ w [B, K, N]`` -> ``[B, M, N]`` (``out_dtype``, default ``a``'s), any strides."""
    B, M, K = a.shape
    N = w.shape[2]
    c = torch.empty((B, M, N), dtype=out_dtype or a.dtype, device=a.device)
    if B == 0 or M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), B)
    _bmm_kernel[grid](a, w, c, M, N, K, *a.stride(), *w.stride(), *c.stride(),
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=a.dtype == torch.float32,
                      num_warps=NUM_WARPS)
    return c


def group_tiles(offs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per program (an upper bound ``ceil(P / BLOCK_M) + G`` of them): its group (``G``: none),
    first row and its group's end, all computed on the device from the group ends ``offs``."""
    G = offs.numel()
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = torch.div(ends - starts + BLOCK_M - 1, BLOCK_M, rounding_mode="floor").clamp_(min=0)
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(max(num_rows, 1), BLOCK_M) + G, device=offs.device)
    group = torch.searchsorted(tile_ends, t, right=True)
    safe = group.clamp(max=G - 1)
    first = starts[safe] + (t - (tile_ends[safe] - tiles[safe])) * BLOCK_M
    return group, first, ends[safe]


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a [P, K], w [G, K, N], offs=offs)`` -> ``[P, N]``; rows past ``offs[-1]``
    are left unwritten (as there)."""
    P, K = a.shape
    G, _, N = w.shape
    c = torch.empty((P, N), dtype=a.dtype, device=a.device)
    if P == 0 or N == 0 or G == 0:
        return c
    group, first, end = group_tiles(offs, P)
    grid = (group.numel(), triton.cdiv(N, BLOCK_N))
    _grouped_kernel[grid](a, w, c, group, first, end, N, K, G, *a.stride(), *w.stride(), *c.stride(),
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=a.dtype == torch.float32,
                          num_warps=NUM_WARPS)
    return c
