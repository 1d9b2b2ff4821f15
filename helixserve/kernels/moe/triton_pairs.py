"""Triton glue of the grouped expert sum: the (token, k) pairs sorted by local expert, and the
weighted per-token sum of the expert outputs, one kernel each (the PyTorch forms are
:func:`helixserve.kernels.moe.gpu.sort_pairs_torch` / :func:`~helixserve.kernels.moe.gpu.combine_pairs_torch`).

sort_pairs: topk_ids [T, k] -> order [P] int64 (stable sort of the pairs by local expert, pairs of
    experts held elsewhere last), sorted_ids [P] int64 (their local ids; E for those held elsewhere),
    valid [P] bool, rows [P] int64 (the token of each sorted pair), rank [P] int64 (where each pair
    went: ``order[rank[p]] == p``), offs [E] int32 (group ends: pairs with a local id <= e), and,
    given ``x [T, D]``, gathered [P, D] (``x[rows]``, the grouped GEMM's input).
combine_pairs: y [P, D] (sorted rows; without ``rank``, rows in pair order), weights [T, k] -> [T, D]:
    ``sum_j w[t, j] * y[rank[t k + j]]`` over the pairs of local experts, in order j = 0, 1, ... in
    fp32, stored in the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2

MAX_PAIRS = 4096  # larger (prefill) batches sort with torch.argsort
_BLOCK_I, _BLOCK_J, _BLOCK_E = 64, 64, 128


@triton.jit
def _keys(ids_ptr, offs, P, E, expert_offset):
    local = tl.load(ids_ptr + offs, mask=offs < P, other=0).to(tl.int64) - expert_offset
    return tl.where((local >= 0) & (local < E), local, E)


@triton.jit(do_not_specialize=["P", "expert_offset", "stride_x", "NUM_I_BLOCKS"])  # sizes follow the batch
def _sort_pairs_kernel(
    ids_ptr, order_ptr, sorted_ptr, valid_ptr, rows_ptr, rank_ptr, offs_ptr, x_ptr, gathered_ptr, P, E,
    expert_offset, D, stride_x, TOP_K: tl.constexpr, NUM_I_BLOCKS, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr, HAS_X: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < NUM_I_BLOCKS:  # the sorted position of each pair i: keys before it, and equal keys of lower index
        offs_i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        key_i = _keys(ids_ptr, offs_i, P, E, expert_offset)
        pos = tl.zeros([BLOCK_I], dtype=tl.int64)
        for start in range(0, P, BLOCK_J):
            offs_j = start + tl.arange(0, BLOCK_J)
            key_j = _keys(ids_ptr, offs_j, P, E, expert_offset)
            before = (key_j[None, :] < key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (offs_j[None, :] < offs_i[:, None]))
            pos += tl.sum((before & (offs_j[None, :] < P)).to(tl.int64), 1)
        mask = offs_i < P
        tl.store(order_ptr + pos, offs_i.to(tl.int64), mask=mask)
        tl.store(sorted_ptr + pos, key_i, mask=mask)
        tl.store(valid_ptr + pos, (key_i < E).to(tl.int8), mask=mask)
        tl.store(rows_ptr + pos, (offs_i // TOP_K).to(tl.int64), mask=mask)
        tl.store(rank_ptr + offs_i, pos, mask=mask)
        if HAS_X:  # each pair's token row to its sorted row
            tokens = (offs_i // TOP_K).to(tl.int64)
            for d in range(0, D, BLOCK_D):
                offs_d = d + tl.arange(0, BLOCK_D)
                both = mask[:, None] & (offs_d[None, :] < D)
                row = tl.load(x_ptr + tokens[:, None] * stride_x + offs_d[None, :], mask=both, other=0.0)
                tl.store(gathered_ptr + pos[:, None] * D + offs_d[None, :], row, mask=both)
    else:  # group ends: pairs with a key <= e
        offs_e = (pid - NUM_I_BLOCKS) * BLOCK_E + tl.arange(0, BLOCK_E)
        count = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, P, BLOCK_J):
            offs_j = start + tl.arange(0, BLOCK_J)
            key_j = _keys(ids_ptr, offs_j, P, E, expert_offset)
            hit = (key_j[None, :] <= offs_e[:, None]) & (offs_j[None, :] < P)
            count += tl.sum(hit.to(tl.int32), 1)
        tl.store(offs_ptr + offs_e, count, mask=offs_e < E)


def sort_pairs(topk_ids: torch.Tensor, num_local: int, expert_offset: int, x: torch.Tensor | None = None):
    """``(order, sorted_ids, valid, rows, rank, offs, gathered)`` of the module docstring (``gathered``
    ``None`` without ``x``), one launch."""
    P = topk_ids.numel()
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    device = ids.device
    order, sorted_ids, rows, rank = (torch.empty(P, dtype=torch.int64, device=device) for _ in range(4))
    valid = torch.empty(P, dtype=torch.bool, device=device)
    offs = torch.empty(num_local, dtype=torch.int32, device=device)
    gathered = None
    if x is not None:
        x = x if x.stride(1) == 1 else x.contiguous()
        gathered = torch.empty(P, x.shape[1], dtype=x.dtype, device=device)
    num_i = triton.cdiv(P, _BLOCK_I)
    grid = (num_i + triton.cdiv(num_local, _BLOCK_E),)
    D = x.shape[1] if x is not None else 1
    _sort_pairs_kernel[grid](
        ids, order, sorted_ids, valid.view(torch.int8), rows, rank, offs,
        x if x is not None else ids, gathered if gathered is not None else ids, P, num_local, int(expert_offset),
        D, x.stride(0) if x is not None else 0, TOP_K=top_k, NUM_I_BLOCKS=num_i, BLOCK_I=_BLOCK_I,
        BLOCK_J=_BLOCK_J, BLOCK_E=_BLOCK_E, HAS_X=x is not None, BLOCK_D=min(256, next_pow2(D)), num_warps=4,
    )
    return order, sorted_ids, valid, rows, rank, offs, gathered


@triton.jit(do_not_specialize=["stride_y", "stride_out"])
def _combine_pairs_kernel(
    y_ptr, rank_ptr, ids_ptr, weights_ptr, out_ptr, D, E, expert_offset, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RANK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        local = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
        pos = tl.load(rank_ptr + pair) if HAS_RANK else pair
        w = tl.load(weights_ptr + pair).to(tl.float32)
        row = tl.load(y_ptr + pos * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        # rows of experts held elsewhere were never written: select, never multiply
        acc += tl.where((local >= 0) & (local < E), row * w, 0.0)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_pairs(y: torch.Tensor, rank: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_local: int, expert_offset: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, D]`` in ``out_dtype``: the weighted per-token sum of the module docstring, one launch
    (``rank`` ``None``: ``y``'s rows are in pair order already)."""
    T, top_k = topk_ids.shape
    D = y.shape[1]
    out = torch.empty(T, D, dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    y = y if y.stride(1) == 1 else y.contiguous()
    BLOCK_D = min(1024, next_pow2(D))
    _combine_pairs_kernel[(T, triton.cdiv(D, BLOCK_D))](
        y, y if rank is None else rank, topk_ids.reshape(-1), topk_weights.reshape(-1), out, D, num_local,
        int(expert_offset), y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_D=BLOCK_D, HAS_RANK=rank is not None,
        num_warps=4,
    )
    return out
