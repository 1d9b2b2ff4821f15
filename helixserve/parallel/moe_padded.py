"""Token-sliced MoE with static shapes: a padded all-to-all with a per-destination capacity.

The host-split path (:mod:`.moe_a2a`) exchanges split sizes and reads them on the host, one sync
per MoE layer and no CUDA graph. This path reads nothing on the host: every rank sends exactly
``capacity`` row slots to every rank, so each ``all_to_all_single`` has equal splits known before
the step, and every tensor's shape depends only on (rows, capacity, top_k, ep). Flow of one layer::

    dispatch: row t goes to rank r (at most once, as in the host path) into slot pos[t, r] of r's
              ``capacity`` slots, with its assignments on r compacted into S slots of
              (local expert id, weight); unused slots carry id -1 (masked); one extra slot row per
              destination carries the true send count and the sender's overflow flag
              (rows a2a + slots a2a, both equal splits)
    expert_fn: over ``ep * capacity * S`` assignment slots; masked slots have id
              ``experts_per_rank`` (outside the local range: ``moe_experts`` skips them, so its
              grouped GEMM does no work for them) and weight 0, and their outputs never reach a
              sum (an inf/nan there cannot leak)
    combine:  per slot row, its S outputs summed in fp32 (slot order), sent back (equal splits),
              then added to the origin rows in rank order with device-side indices

The sums run in the host path's order, so on CPU in fp32 the result equals it bit for bit.

Capacity (rows per destination, the same on every rank): a row travels at most once to each rank,
so a rank sends at most c rows (its row count) to any one rank; ``capacity = max rows per rank``
(``ceil(T_max / cp)``) is exact: it never overflows and all rows routed to one rank fill it. The
expert side then sees ``ep * capacity * S`` assignment slots, ``S = min(top_k, experts_per_rank)``
(the distinct experts of one row on one rank; ``top_k`` without an overflow flag, see below):
``capacity * S`` is the exact bound on the (row, expert) assignments one rank receives from one
rank. The price of static shapes: at balanced routing about 1/ep of the slots hold an assignment
(masked slots cost the grouped GEMM nothing, but they are copied and summed).

Overflow is impossible by construction or flagged on the device, never silently dropped:

- without an ``overflow`` flag: ``capacity >= rows`` is required (checked on host-known shapes)
  and ``S = top_k``, so nothing can overflow, even a row listing one expert twice (expert ids
  >= num_experts, a caller bug the host path rejects with a host read, are dropped like
  negative ids: pass a flag to catch them);
- with ``overflow`` (a 0-dim bool tensor on the device, ORed in place): ``capacity < rows`` is
  allowed (balanced routing, less traffic) and ``S = min(top_k, experts_per_rank)``; rows or
  assignments that do not fit, and expert ids >= num_experts, set the flag on every rank (flags
  travel with the counts). The caller checks it after the step's one host sync with
  :func:`raise_if_overflow`; the step's output is then wrong and must be discarded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from helixserve.parallel.collectives import Group, all_to_all_equal, group_size

logger = logging.getLogger(__name__)


class MoeCapacityError(RuntimeError):
    """A padded MoE dispatch had more rows or assignments for a rank than its capacity."""


@dataclass(slots=True)
class PaddedMoeDispatch:
    """What one rank received, padded to static shapes, and the indices to send results back.

    Attributes:
        x: ``[ep * capacity * S, D]`` assignment slots: each received row slot repeated S times
            (source rank 0's slots first); unused slots are zero rows.
        local_expert_ids: ``[ep * capacity * S]`` int64, ``experts_per_rank`` (out of the local
            range) on masked slots.
        weights: ``[ep * capacity * S]`` (dtype of ``topk_weights``), 0 on masked slots.
        valid: ``[ep * capacity * S]`` bool, the slots that hold an assignment.
        recv_counts: ``[ep]`` int64 (device), rows each rank sent here (> capacity: overflow).
        send_counts: ``[ep]`` int64 (device), rows this rank sent to each rank.
        overflow: ``[]`` bool (device), some rank's dispatch did not fit (same on every rank).
        origin_rows: ``[ep * capacity]`` int64, the local row each sent slot carried (c for an
            unused slot), in send order: where the combine adds each returned slot.
        num_rows: c, this rank's row count.
        capacity: row slots per destination.
        slots_per_row: S.
    """

    x: torch.Tensor
    local_expert_ids: torch.Tensor
    weights: torch.Tensor
    valid: torch.Tensor
    recv_counts: torch.Tensor
    send_counts: torch.Tensor
    overflow: torch.Tensor
    origin_rows: torch.Tensor
    num_rows: int
    capacity: int
    slots_per_row: int


def experts_per_rank(num_experts: int, ep: int) -> int:
    if num_experts < 1 or num_experts % ep != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep} (world size)")
    return num_experts // ep


def slots_per_row(top_k: int, experts_per_rank: int, *, compact: bool) -> int:
    """S: ``min(top_k, experts_per_rank)`` when compacting (needs an overflow flag), else top_k."""
    return max(1, min(top_k, experts_per_rank) if compact else top_k)


def raise_if_overflow(overflow: torch.Tensor) -> None:
    """Read an overflow flag (one host sync: call it after the step's own) and raise if set."""
    if bool(overflow):
        raise MoeCapacityError("a padded MoE dispatch overflowed its capacity (or got expert ids >= "
                               "num_experts); raise capacity to the max rows per rank")


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, capacity: int,
           overflow: torch.Tensor | None) -> None:
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected x [c, D], topk_ids and topk_weights [c, k]; got {tuple(x.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    if overflow is None and capacity < x.shape[0]:
        raise ValueError(f"capacity={capacity} < {x.shape[0]} rows can overflow: pass capacity >= the max "
                         f"rows per rank, or an overflow flag to check after the step")
    if overflow is not None and (overflow.dim() != 0 or overflow.dtype != torch.bool):
        raise ValueError(f"overflow must be a 0-dim bool tensor, got {overflow.dtype} {tuple(overflow.shape)}")


def moe_dispatch_padded(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group: Group,
    *, capacity: int, overflow: torch.Tensor | None = None,
) -> PaddedMoeDispatch:
    """Send each row once to every rank that owns one of its experts, into static slots.

    Args:
        x: ``[c, D]`` this rank's rows (c may be 0).
        topk_ids: ``[c, k]`` global expert ids; negative ids are dropped assignments.
        topk_weights: ``[c, k]`` routing weights.
        num_experts: total experts E, ``E % ep == 0``.
        capacity: row slots per destination, the same on every rank (see the module docstring).
        overflow: optional 0-dim bool device flag, ORed with this dispatch's overflow.
    """
    _check(x, topk_ids, topk_weights, capacity, overflow)
    ep = group_size(group)
    per_rank = experts_per_rank(num_experts, ep)
    num_rows, top_k = topk_ids.shape
    num_slots = slots_per_row(top_k, per_rank, compact=overflow is not None)
    dev, cap = x.device, capacity
    ranks = torch.arange(ep, device=dev)

    ids = topk_ids.long()
    kept = (ids >= 0) & (ids < num_experts)
    dest = torch.where(kept, torch.div(ids, per_rank, rounding_mode="floor"), ep)  # ep: nowhere
    on_rank = dest[..., None] == ranks  # [c, k, ep]
    goes = on_rank.any(1)  # [c, ep]: row t goes to rank r
    pos = goes.long().cumsum(0) - 1  # [c, ep]: its slot among r's rows (row order, as the host path)
    send_counts = goes.long().sum(0)  # [ep]
    dest_c = dest.clamp(max=ep - 1)
    slot_in_row = (on_rank.long().cumsum(1) - 1).gather(2, dest_c[..., None]).squeeze(2)  # [c, k]
    pos_of = pos.gather(1, dest_c)  # [c, k]
    fits = kept & (pos_of < cap) & (slot_in_row < num_slots)
    local_overflow = (send_counts > cap).any() | (kept & (slot_in_row >= num_slots)).any() | (ids >= num_experts).any()

    # rows: slot r * cap + pos of every sent row, all others to a trash slot (index ep * cap)
    row_fits = goes & (pos < cap)
    row_slot = torch.where(row_fits, ranks * cap + pos, ep * cap)  # [c, ep]
    src_row = torch.full((ep * cap + 1,), num_rows, dtype=torch.long, device=dev)  # num_rows: the zero row
    src_row.scatter_(0, row_slot.reshape(-1), torch.arange(num_rows, device=dev).repeat_interleave(ep))
    x_ext = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    recv_x = all_to_all_equal(x_ext.index_select(0, src_row[: ep * cap]), group)

    # slots: [ep, cap + 1, 2S] float64 (exact for ids and fp32/bf16 weights); ids -1 = masked;
    # row cap of each destination: (true send count, sender's overflow flag)
    width = 2 * num_slots
    slots = torch.zeros((ep * (cap + 1) * width + 1,), dtype=torch.float64, device=dev)  # + trash
    table = slots[:-1].view(ep, cap + 1, width)
    table[:, :cap, :num_slots] = -1.0
    base = torch.where(fits, (dest_c * (cap + 1) + pos_of) * width + slot_in_row, slots.numel() - 1)
    slots.scatter_(0, base.reshape(-1), (ids % per_rank).double().reshape(-1))
    slots.scatter_(0, (base + torch.where(fits, num_slots, 0)).reshape(-1), topk_weights.double().reshape(-1))
    table[:, cap, 0] = send_counts.double()
    table[:, cap, 1] = local_overflow.double()
    recv = all_to_all_equal(table.reshape(ep * (cap + 1), width), group).view(ep, cap + 1, width)

    recv_counts = recv[:, cap, 0].long()
    any_overflow = local_overflow | (recv[:, cap, 1] > 0).any()
    if overflow is not None:
        overflow.logical_or_(any_overflow)
    recv_ids = recv[:, :cap, :num_slots].reshape(-1)
    valid = recv_ids >= 0
    weights = torch.where(valid, recv[:, :cap, num_slots:].reshape(-1), 0.0).to(topk_weights.dtype)
    expanded = recv_x[:, None].expand(ep * cap, num_slots, *recv_x.shape[1:])
    return PaddedMoeDispatch(
        x=expanded.reshape(ep * cap * num_slots, *recv_x.shape[1:]),
        local_expert_ids=torch.where(valid, recv_ids, float(per_rank)).long(),
        weights=weights,
        valid=valid,
        recv_counts=recv_counts,
        send_counts=send_counts,
        overflow=any_overflow,
        origin_rows=src_row[: ep * cap],
        num_rows=num_rows,
        capacity=cap,
        slots_per_row=num_slots,
    )


def moe_combine_padded(y: torch.Tensor, dispatch: PaddedMoeDispatch, group: Group) -> torch.Tensor:
    """Return expert outputs to their origin rows and sum them over k (static shapes).

    Args:
        y: ``[ep * capacity * S, D_out]`` weighted expert outputs for ``dispatch.x``.
    Returns:
        ``[c, D_out]`` in ``y.dtype``: per origin row, the sum of its assignments' outputs
        (accumulated in fp32, in the host path's order); rows with no kept assignment are 0.
    """
    if y.shape[0] != dispatch.x.shape[0]:
        raise ValueError(f"expert output has {y.shape[0]} rows, dispatch delivered {dispatch.x.shape[0]}")
    acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    S = dispatch.slots_per_row
    num_slot_rows = y.shape[0] // S
    # per slot row, its assignments' outputs summed slot by slot; a masked slot is selected away
    # (an inf/nan from a masked slot never reaches a sum)
    by_slot = torch.where(dispatch.valid.view(num_slot_rows, S, *([1] * (y.dim() - 1))),
                          y.to(acc_dtype).view(num_slot_rows, S, *y.shape[1:]), 0.0)
    per_row = by_slot[:, 0].contiguous()
    for j in range(1, S):
        per_row.add_(by_slot[:, j])
    back = all_to_all_equal(per_row.to(y.dtype), group)
    # returned slots in send order (destination rank, then row): each origin row's sum runs over
    # ranks in rank order, as the host path's, one rank's block at a time (a row comes back at
    # most once from each rank, so no destination is added twice in one step); unused slots go
    # to the trash row c
    out = torch.zeros((dispatch.num_rows + 1, *y.shape[1:]), dtype=acc_dtype, device=y.device)
    cap = dispatch.capacity
    for r in range(back.shape[0] // max(cap, 1)):
        out.index_add_(0, dispatch.origin_rows[r * cap:(r + 1) * cap], back[r * cap:(r + 1) * cap].to(acc_dtype))
    return out[:-1].to(y.dtype)
