"""Routed-expert sum on the GPU without a loop over experts or a host sync.

The (token, k) pairs are sorted by local expert on the device; ``torch._grouped_mm`` (bf16, CUTLASS
grouped GEMM on Hopper) runs every expert's gate/up and down projections in one call each over the
sorted rows, with the group ends as a device tensor (a binary search of the sorted ids: no atomic
count). Pairs routed to experts held elsewhere (expert parallelism) sort after the last group, are
left out of both GEMMs and masked to zero. Weighted rows go back to (token, k) order and are summed
per token over k in order (:func:`sum_pairs`): no atomic adds, so a token's sum is the same on
every run and whatever else is in the batch. Other dtypes (fp32 models) gather each pair's
expert weights and use ``bmm`` when that fits in memory, else run every local expert over every
token and weight its output by a ``[T, E_local]`` combine matrix (zero where not routed):
:func:`dense_experts`, static shapes and no host read, so a decode step captures in a CUDA graph,
and a fixed sum order (experts ascending).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helixserve.kernels.gemm import batch_invariant_gemms, grouped_mm
from helixserve.kernels.triton_common import batch_invariant_enabled, use_triton

# the gathered-weights fallback may materialize at most this many elements of w13[ids]
_MAX_GATHERED_ELEMENTS = 1 << 27
# MXFP4 stacks: from this many (token, k) rows per local expert on (prefill), dequantize the stacks
# to bf16 once per call and run the bf16 grouped GEMMs; below (decode), the MXFP4 grouped kernel
MXFP4_DEQUANT_MIN_ROWS_PER_EXPERT = 128
# up to this many (token, k) pairs the sort and the weighted sum are one Triton kernel each
MAX_TRITON_PAIRS = 4096
# up to this many (token, k) pairs (decode batches) the expert sum is the pair matrix-vector kernels
# (measured faster than the grouped path up to 256 pairs over 256 experts; with fewer experts pairs
# share experts, which the pair kernels read once per pair: kept where whole models were measured)
MAX_GEMV_PAIRS = 64


def can_group(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The grouped GEMMs apply: ``torch._grouped_mm``'s bf16 operands and 16-byte aligned rows, or
    any float dtype while the batch-invariant grouped GEMM replaces it (a row's kernel then does
    not depend on the batch's size, as the gathered / dense choice below would)."""
    if batch_invariant_gemms():
        return x.dtype == w13.dtype == w2.dtype and x.dtype.is_floating_point
    return x.dtype == w13.dtype == w2.dtype == torch.bfloat16 and _can_group_shapes(x.shape[1], w13.shape[1])


def can_pair_gemv(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor) -> bool:
    """The few-pairs matrix-vector kernels apply (:mod:`.triton_gemv`): Triton, a decode-sized batch,
    float stacks of x's dtype, and batch invariance off (the grouped path's kernel must not change
    with the batch's size then)."""
    return (use_triton(x) and 0 < topk_ids.numel() <= MAX_GEMV_PAIRS and x.dtype == w13.dtype
            and x.dtype.is_floating_point and not batch_invariant_enabled())


def pair_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    expert_offset: int, activation: str, situ_beta: float, situ_linear_beta: float,
) -> torch.Tensor:
    """``moe_experts`` as matrix-vector kernels over the pairs: no sort, no gathered copy."""
    from helixserve.kernels.moe import triton_gemv

    return triton_gemv.pair_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, activation,
                                    situ_beta, situ_linear_beta)


def _can_group_shapes(D: int, two_I: int) -> bool:
    return hasattr(torch, "_grouped_mm") and D % 8 == 0 and two_I % 16 == 0


def can_gather(topk_ids: torch.Tensor, w13: torch.Tensor) -> bool:
    return topk_ids.numel() * w13.shape[1] * w13.shape[2] <= _MAX_GATHERED_ELEMENTS


def _sort_pairs(topk_ids: torch.Tensor, num_local: int, expert_offset: int):
    """Pairs sorted by local expert: (order [P], local id of each sorted pair [P], is_local [P])."""
    local = topk_ids.flatten().to(torch.int64) - expert_offset
    is_local = (local >= 0) & (local < num_local)
    key = torch.where(is_local, local, num_local)
    order = torch.argsort(key, stable=True)
    return order, key[order], is_local[order]


@dataclass(slots=True)
class SortedPairs:
    """The (token, k) pairs sorted by local expert: ``order`` [P] (pair of each sorted row),
    ``sorted_ids`` [P] (its local expert; ``E`` for experts held elsewhere), ``valid`` [P], ``rows``
    [P] (its token), ``offs`` [E] int32 group ends, ``rank`` [P] (the sorted row of each pair;
    ``None`` on the PyTorch path, which puts rows back with ``order``), ``gathered`` [P, D] (the
    token rows in sorted order, when asked for)."""

    order: torch.Tensor
    sorted_ids: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    offs: torch.Tensor
    rank: torch.Tensor | None = None
    gathered: torch.Tensor | None = None


def sort_pairs(topk_ids: torch.Tensor, num_local: int, expert_offset: int,
               x: torch.Tensor | None = None) -> SortedPairs:
    """The pairs of ``topk_ids [T, k]`` sorted by local expert (and ``x``'s rows gathered in that
    order when given): one Triton kernel for decode-sized batches, else ``argsort``, a binary
    search and ``index_select``."""
    if use_triton(topk_ids) and topk_ids.numel() <= MAX_TRITON_PAIRS:
        from helixserve.kernels.moe import triton_pairs

        order, sorted_ids, valid, rows, rank, offs, gathered = triton_pairs.sort_pairs(
            topk_ids, num_local, expert_offset, x)
        return SortedPairs(order, sorted_ids, valid, rows, offs, rank, gathered)
    order, sorted_ids, valid = _sort_pairs(topk_ids, num_local, expert_offset)
    rows = order // topk_ids.shape[1]
    return SortedPairs(order, sorted_ids, valid, rows, group_ends(sorted_ids, num_local), None,
                       x.index_select(0, rows) if x is not None else None)


def combine_pairs(y: torch.Tensor, pairs: SortedPairs, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_local: int, expert_offset: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, D]``: the expert outputs ``y [P, D]`` (sorted rows) weighted and summed per token over
    ``k = 0, 1, ...`` in fp32 (:func:`sum_pairs`), rows of experts held elsewhere left out."""
    if pairs.rank is not None:
        from helixserve.kernels.moe import triton_pairs

        return triton_pairs.combine_pairs(y, pairs.rank, topk_ids, topk_weights, num_local, expert_offset, out_dtype)
    weights = topk_weights.flatten().index_select(0, pairs.order).float()
    # rows past the last group are not written by the grouped GEMMs: mask, never multiply
    y = torch.where(pairs.valid[:, None], y.float() * weights[:, None], 0.0)
    return sum_pairs(y, pairs.order, topk_ids.shape[1]).to(out_dtype)


def grouped_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    expert_offset: int, act_and_mul,
) -> torch.Tensor:
    """``moe_experts`` through two ``torch._grouped_mm`` calls; ``act_and_mul(gate, up)`` -> a float dtype."""
    T, D = x.shape
    E, two_I, _ = w13.shape
    I = two_I // 2
    pairs = sort_pairs(topk_ids, E, expert_offset, x)
    h = grouped_mm(pairs.gathered, w13.transpose(1, 2), pairs.offs)
    act = act_and_mul(h[:, :I], h[:, I:]).to(x.dtype)
    y = grouped_mm(act, w2.transpose(1, 2), pairs.offs)
    return combine_pairs(y, pairs, topk_ids, topk_weights, E, expert_offset, x.dtype)


def group_ends(sorted_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups]`` int32: the end of each group ``e`` in ascending ``sorted_ids`` (the pairs with
    an id ``<= e``), by binary search: exact, no atomics, no host read."""
    bounds = torch.arange(1, num_groups + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    return torch.searchsorted(sorted_ids, bounds).to(torch.int32)


def sum_pairs(y: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, D]`` fp32: ``y [P, D]`` (rows in ``order``, a permutation of the ``T * top_k`` pairs)
    put back in pair order and summed per token over ``k = 0, 1, ...`` in turn: a fixed order
    that depends on nothing but the token's own rows (``index_add_`` adds with atomics on CUDA)."""
    by_pair = torch.empty_like(y).index_copy_(0, order, y).view(-1, top_k, y.shape[1])
    out = by_pair[:, 0].contiguous()
    for j in range(1, top_k):
        out.add_(by_pair[:, j])
    return out


def gathered_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    expert_offset: int, act_and_mul,
) -> torch.Tensor:
    """Every pair with its own copy of its expert's weights (``bmm``); small models and fp32."""
    T, D = x.shape
    E, two_I, _ = w13.shape
    I = two_I // 2
    local = topk_ids.flatten().to(torch.int64) - expert_offset
    is_local = (local >= 0) & (local < E)
    safe = local.clamp(0, E - 1)
    xs = x.float().repeat_interleave(topk_ids.shape[1], dim=0)
    h = torch.bmm(w13.index_select(0, safe).float(), xs[:, :, None]).squeeze(-1)
    act = act_and_mul(h[:, :I], h[:, I:])
    y = torch.bmm(w2.index_select(0, safe).float(), act[:, :, None]).squeeze(-1)
    weights = torch.where(is_local, topk_weights.flatten().float(), 0.0)
    return (y * weights[:, None]).view(T, topk_ids.shape[1], D).sum(1).to(x.dtype)


def dense_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    expert_offset: int, act_and_mul,
) -> torch.Tensor:
    """``moe_experts`` as every local expert over every token, in fixed order (experts ascending):
    ``y = sum_e c[:, e] * w2[e] act(w13[e] x)`` with ``c [T, E_local]`` the routing weights
    (0 where a token did not pick the expert). Shapes depend on ``T`` only: no sort, no host read.
    Reads each expert's weights once; costs ``E_local / k`` times the routed FLOPs."""
    T, D = x.shape
    E, two_I, _ = w13.shape
    I = two_I // 2
    combine = combine_weights(topk_ids, topk_weights, E, expert_offset)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    for e in range(E):
        h = torch.nn.functional.linear(x, w13[e])
        act = act_and_mul(h[:, :I], h[:, I:]).to(w2.dtype)
        out.addcmul_(torch.nn.functional.linear(act, w2[e]).float(), combine[:, e:e + 1])
    return out.to(x.dtype)


def combine_weights(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_local: int,
                    expert_offset: int) -> torch.Tensor:
    """``[T, num_local]`` fp32: each token's routing weight of each local expert, 0 where it did not
    pick it (a token picks an expert at most once, so each entry is written by one pair at most)."""
    local = topk_ids.to(torch.int64) - expert_offset
    is_local = (local >= 0) & (local < num_local)
    # pairs of experts held elsewhere land in one extra column, dropped
    combine = torch.zeros(topk_ids.shape[0], num_local + 1, dtype=torch.float32, device=topk_ids.device)
    combine.scatter_(1, torch.where(is_local, local, num_local), torch.where(is_local, topk_weights.float(), 0.0))
    return combine[:, :num_local]


def mxfp4_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13, w2, expert_offset: int, act_and_mul,
) -> torch.Tensor:
    """``grouped_experts`` over :class:`~helixserve.kernels.moe.mxfp4.MXFP4Weight` stacks: the same
    sort and sum, the two GEMMs by the Triton MXFP4 grouped kernel (weights dequantized in registers);
    at prefill sizes the stacks dequantized to bf16 for ``grouped_experts`` (not while batch
    invariance is on: which kernel sums a row must not depend on the batch)."""
    from helixserve.kernels.moe import triton_mxfp4

    T, D = x.shape
    E, two_I, _ = w13.shape
    I = two_I // 2
    top_k = topk_ids.shape[1]
    if (T * top_k >= MXFP4_DEQUANT_MIN_ROWS_PER_EXPERT * E and x.dtype == torch.bfloat16
            and _can_group_shapes(D, two_I) and not batch_invariant_enabled()):
        return grouped_experts(x, topk_ids, topk_weights, triton_mxfp4.dequantize_bf16(w13),
                               triton_mxfp4.dequantize_bf16(w2), expert_offset, act_and_mul)
    pairs = sort_pairs(topk_ids, E, expert_offset)
    P = pairs.order.numel()
    schedule = triton_mxfp4.block_schedule(pairs.sorted_ids, E, triton_mxfp4.choose_block_m(P, E))
    h = triton_mxfp4.grouped_gemm_mxfp4(x, w13, schedule, P, rows=pairs.rows)
    act = act_and_mul(h[:, :I], h[:, I:]).to(x.dtype)
    y = triton_mxfp4.grouped_gemm_mxfp4(act, w2, schedule, P)
    return combine_pairs(y, pairs, topk_ids, topk_weights, E, expert_offset, x.dtype)
