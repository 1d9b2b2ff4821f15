"""Token-sliced MoE over the EP group (the whole world): all-to-all dispatch and combine.

Each rank routes only its own c rows (its token slice; 0 rows on an idle rank or an empty step).
Experts are partitioned contiguously: expert e lives on rank ``e // (num_experts // ep)`` as local
expert ``e % (num_experts // ep)``. Flow of one layer::

    dispatch: each row once to every rank that owns one of its experts, with its k slots of
              (local expert id, weight) for that rank    (counts a2a + rows a2a + slots a2a)
    expert_fn: y_i = weight_i * expert_{id_i}(x_i) over the received (row, expert) assignments
    combine:  per received row, its assignments' outputs summed (fp32, slot by slot) on the expert
              side, one row back to the origin rank (a2a), summed over ranks per origin row (fp32,
              rank by rank)

Both sums run in a fixed order (slot 0, 1, ...; rank 0, 1, ...) with no atomic adds: each
accumulation step writes every destination row at most once, so a row's sum is the same run
after run on CUDA as on the CPU.

A row whose k experts live on fewer than k ranks travels once per rank, not once per expert: with
top-8 over 4 ranks about 3.6 copies instead of 8 go out and come back.

Every rank must call :func:`moe_a2a` (or dispatch + combine) once per MoE layer per step, even
with 0 rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from helixserve.parallel.collectives import Group, all_to_all_rows, exchange_split_sizes, group_size
from helixserve.parallel.moe_padded import experts_per_rank, moe_combine_padded, moe_dispatch_padded

logger = logging.getLogger(__name__)

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class MoeDispatch:
    """What one rank received for its experts, and the bookkeeping to send results back.

    Attributes:
        x: ``[A, D]`` received (row, expert) assignments, grouped by source rank (rank 0's first).
        local_expert_ids: ``[A]`` int64, expert of each assignment as an index into this rank's experts.
        weights: ``[A]`` routing weight of each assignment (dtype of ``topk_weights``).
        recv_row_of: ``[A]`` int64, the received row each assignment came with.
        recv_slot_of: ``[A]`` int64, its slot (position in the row's top-k).
        recv_counts: ``[ep]`` rows received from each rank (sums to the received rows).
        send_counts: ``[ep]`` rows this rank sent to each rank.
        origin_rows: ``[S]`` int64, local row index of each sent row, in send order.
        num_rows: c, this rank's row count (the combine output has c rows).
        top_k: k, the slots per row.
    """

    x: torch.Tensor
    local_expert_ids: torch.Tensor
    weights: torch.Tensor
    recv_row_of: torch.Tensor
    recv_slot_of: torch.Tensor
    recv_counts: list[int]
    send_counts: list[int]
    origin_rows: torch.Tensor
    num_rows: int
    top_k: int = 1


def moe_dispatch(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group: Group
) -> MoeDispatch:
    """Send each row once to every rank that owns one of its experts.

    Args:
        x: ``[c, D]`` this rank's rows (c may be 0).
        topk_ids: ``[c, k]`` global expert ids; negative ids are dropped assignments.
        topk_weights: ``[c, k]`` routing weights.
        num_experts: total experts E, ``E % ep == 0``.
        group: the EP group (world).
    """
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected x [c, D], topk_ids and topk_weights [c, k]; got {tuple(x.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    ep = group_size(group)
    per_rank = experts_per_rank(num_experts, ep)
    num_rows, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    if flat_ids.numel() and int(flat_ids.max()) >= num_experts:
        raise ValueError(f"topk_ids holds expert {int(flat_ids.max())} >= num_experts={num_experts}")
    kept = (flat_ids >= 0).nonzero().squeeze(1)  # kept assignment positions (row * k + slot)
    rows = max(num_rows, 1)
    # one (destination, row) pair per row and rank it goes to, sorted by destination, then row
    pair_keys, pair_of_kept = torch.unique(
        torch.div(flat_ids[kept], per_rank, rounding_mode="floor") * rows
        + torch.div(kept, max(top_k, 1), rounding_mode="floor"),
        sorted=True, return_inverse=True,
    )
    origin_rows = pair_keys % rows
    send_counts = torch.bincount(torch.div(pair_keys, rows, rounding_mode="floor"), minlength=ep).tolist()

    # per sent row, its k slots: local expert id (-1: empty) and weight, as float64 (exact for ids
    # and fp32/bf16 weights); a slot is the assignment's position in the row's top-k
    slots = torch.full((pair_keys.numel(), 2 * top_k), -1.0, dtype=torch.float64, device=x.device)
    slot_of_kept = kept % max(top_k, 1)
    slots[pair_of_kept, slot_of_kept] = (flat_ids[kept] % per_rank).double()
    slots[pair_of_kept, top_k + slot_of_kept] = topk_weights.reshape(-1)[kept].double()

    recv_counts = exchange_split_sizes(send_counts, group, device=x.device)
    recv_x = all_to_all_rows(x[origin_rows], send_counts, group, recv_counts)
    recv_slots = all_to_all_rows(slots, send_counts, group, recv_counts)
    recv_row_of, slot = (recv_slots[:, :top_k] >= 0).nonzero(as_tuple=True)
    return MoeDispatch(
        x=recv_x.index_select(0, recv_row_of),
        local_expert_ids=recv_slots[recv_row_of, slot].long(),
        weights=recv_slots[recv_row_of, top_k + slot].to(topk_weights.dtype),
        recv_row_of=recv_row_of,
        recv_slot_of=slot,
        recv_counts=recv_counts,
        send_counts=send_counts,
        origin_rows=origin_rows,
        num_rows=num_rows,
        top_k=max(top_k, 1),
    )


def moe_combine(y: torch.Tensor, dispatch: MoeDispatch, group: Group) -> torch.Tensor:
    """Return expert outputs to their origin rows and sum them over k.

    Args:
        y: ``[A, D_out]`` weighted expert outputs for ``dispatch.x``, same assignment order.
    Returns:
        ``[c, D_out]`` in ``y.dtype``: per origin row, the sum of its assignments' outputs
        (accumulated in fp32); rows with no kept assignment are 0.
    """
    if y.shape[0] != dispatch.x.shape[0]:
        raise ValueError(f"expert output has {y.shape[0]} rows, dispatch delivered {dispatch.x.shape[0]}")
    acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    num_recv = sum(dispatch.recv_counts)
    top_k = dispatch.top_k
    by_slot = torch.zeros((top_k, num_recv, *y.shape[1:]), dtype=acc_dtype, device=y.device)
    by_slot[dispatch.recv_slot_of, dispatch.recv_row_of] = y.to(acc_dtype)  # (slot, row) pairs are unique
    per_row = by_slot[0].clone()
    for j in range(1, top_k):
        per_row.add_(by_slot[j])
    back = all_to_all_rows(per_row.to(y.dtype), dispatch.recv_counts, group, dispatch.send_counts)
    out = torch.zeros((dispatch.num_rows, *y.shape[1:]), dtype=acc_dtype, device=y.device)
    start = 0
    for count in dispatch.send_counts:  # rank by rank: a row comes back at most once from each
        end = start + count
        if count:
            out.index_add_(0, dispatch.origin_rows[start:end], back[start:end].to(acc_dtype))
        start = end
    return out.to(y.dtype)


def moe_a2a(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_fn: ExpertFn,
    *,
    num_experts: int,
    group: Group,
    capacity: int | None = None,
    overflow: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output of this rank's rows, experts spread over the EP group.

    ``expert_fn(x_recv [R, D], local_expert_ids [R], weights [R]) -> y [R, D_out]`` runs this
    rank's experts and must apply the weights: ``y_i = weights_i * expert_{local_expert_ids_i}(x_i)``.
    It is called on every rank, also with R == 0. With the kernels' grouped experts, e.g.
    ``lambda x, ids, w: moe_experts(x, ids[:, None], w[:, None], w13_local, w2_local)``
    (ids are already local, so no expert offset).

    Args:
        x: ``[c, D]`` this rank's (token-sliced) rows; c may be 0.
        topk_ids: ``[c, k]`` global expert ids (negative = dropped).
        topk_weights: ``[c, k]`` routing weights.
        capacity: None: the host-split path (split sizes read on the host, one sync per layer).
            An int: the padded device path of :mod:`.moe_padded` (no host read, static shapes, a
            CUDA graph can hold it), ``capacity`` row slots per destination, the same on every
            rank; ``max rows per rank`` is exact and never overflows. ``expert_fn`` then gets
            ``ep * capacity * S`` slots, masked ones with weight 0 and the out-of-range id
            ``experts_per_rank`` (``moe_experts`` skips it; a custom ``expert_fn`` must too), and
            their outputs are dropped.
        overflow: padded path only: a 0-dim bool device flag ORed with this layer's overflow
            (allows capacity < rows); check it after the step with ``raise_if_overflow``.
    Returns:
        ``[c, D_out]`` sum over k of the weighted expert outputs (the same bits on both paths).
    """
    if capacity is not None:
        padded = moe_dispatch_padded(x, topk_ids, topk_weights, num_experts, group, capacity=capacity,
                                     overflow=overflow)
        y = expert_fn(padded.x, padded.local_expert_ids, padded.weights)
        return moe_combine_padded(y, padded, group)
    if overflow is not None:
        raise ValueError("overflow is a flag of the padded path: pass capacity too")
    dispatch = moe_dispatch(x, topk_ids, topk_weights, num_experts, group)
    y = expert_fn(dispatch.x, dispatch.local_expert_ids, dispatch.weights)
    return moe_combine(y, dispatch, group)
