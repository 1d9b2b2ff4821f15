"""Collectives used by the helix_a2a model: row gather/scatter, uneven all-to-all, LSE exchange,
and the all-reduce of a heads-TP draft model's row-parallel projections.

Every function is SPMD: every rank of ``group`` must call it, in the same order, even with zero
rows (an empty step still enters the collective so no peer waits on it). Failures, timeouts
included, are re-raised as :class:`CollectiveError` naming the collective, the group's ranks and
this rank. Tensors must live on the group's device (CPU for gloo, CUDA for NCCL).

Backend notes:

- gloo (torch 2.13) implements ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
  ``all_to_all_single`` with uneven split sizes on CPU, so every function is one native
  collective on gloo and NCCL alike (``tests/integration/test_parallel_collectives.py``).
  gloo enforces the group timeout itself.
- NCCL runs collectives asynchronously; when a peer never joins, its watchdog notices the
  timeout but the process was seen to stay blocked (> 45 s, torch 2.11, NCCL 2.28) in the next
  synchronize. So by default (:func:`set_nccl_blocking_wait`, set by ``init_parallel``) the host
  waits for each NCCL collective with the group timeout and raises on expiry: bounded, at the
  cost of one host/GPU synchronization per collective (no CPU run-ahead). While a CUDA graph is
  being captured the host wait is skipped (the stream waits instead; NCCL's watchdog remains the
  bound), so a captured step holds no host sync.

Static shapes (CUDA graphs): :func:`all_gather_rows`, :func:`reduce_scatter_rows` and
:func:`lse_all_to_all` take preallocated ``out`` buffers and read nothing on the host;
:func:`all_to_all_equal` is the equal-split all-to-all of the padded MoE path. The uneven
:func:`all_to_all_rows` and :func:`exchange_split_sizes` need host-known counts (host-split path).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helixserve.parallel.row_split import pad_rows, row_chunk

logger = logging.getLogger(__name__)

Group = dist.ProcessGroup | None

_nccl_wait_timeout: datetime.timedelta | None = None


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, skipped it, or called another one)."""


def group_size(group: Group) -> int:
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return dist.get_rank(group)


def group_device(group: Group) -> torch.device:
    """Where this group's tensors live: the current CUDA device for nccl, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_nccl_blocking_wait(timeout: datetime.timedelta | None) -> None:
    """Wait on the host for every NCCL collective, raising after ``timeout`` (None: don't)."""
    global _nccl_wait_timeout
    _nccl_wait_timeout = timeout


def _wait(work: dist.Work | None, group: Group) -> None:
    if work is None:  # this rank is not in the group
        return
    if _nccl_wait_timeout is not None and dist.get_backend(group) == "nccl" and not _capturing():
        work.wait(timeout=_nccl_wait_timeout)
    else:
        work.wait()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_out(name: str, out: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{name} must be {like.dtype} {shape} on {like.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


@contextmanager
def _collective(name: str, group: Group) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        try:
            ranks: object = dist.get_process_group_ranks(group or dist.group.WORLD)
        except Exception:  # noqa: BLE001 - best effort for the message only
            ranks = "?"
        rank = dist.get_rank() if dist.is_initialized() else -1
        logger.error("%s over ranks %s failed on rank %d: %s", name, ranks, rank, exc)
        raise CollectiveError(f"{name} over ranks {ranks} failed on rank {rank}: {exc}") from exc


def all_gather_counts(count: int, group: Group, device: torch.device | None = None) -> list[int]:
    """Every rank's ``count`` (e.g. its local row count), in group-rank order."""
    size = group_size(group)
    device = device or group_device(group)
    send = torch.tensor([count], dtype=torch.int64, device=device)
    recv = torch.empty(size, dtype=torch.int64, device=device)
    with _collective("all_gather_counts", group):
        _wait(dist.all_gather_into_tensor(recv, send, group=group, async_op=True), group)
    return recv.tolist()


def all_gather_rows(
    x_local: torch.Tensor, num_tokens: int, group: Group, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather token-sliced rows back to all T rows on every rank of the CP group.

    Args:
        x_local: ``[c, ...]``, ``c = ceil(T / cp)``, this rank's padded slice (trailing padding
            rows are ignored).
        num_tokens: T, the same on every rank of the group.
        out: optional preallocated ``[cp * c, ...]`` buffer (same dtype/device) to gather into.
    Returns:
        ``[T, ...]``: rows ``[r * c, (r + 1) * c)`` come from CP rank r; the padding is trimmed
        (a view of ``out`` when given).
    """
    cp = group_size(group)
    chunk = row_chunk(num_tokens, cp)
    if x_local.shape[0] != chunk:
        raise ValueError(f"x_local has {x_local.shape[0]} rows, expected ceil(T={num_tokens} / cp={cp}) = {chunk}")
    shape = (cp * chunk, *x_local.shape[1:])
    if out is None:
        out = x_local.new_empty(shape)
    _check_out("all_gather_rows out", out, shape, x_local)
    with _collective("all_gather_rows", group):
        _wait(dist.all_gather_into_tensor(out, x_local.contiguous(), group=group, async_op=True), group)
    return out[:num_tokens]


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (a row-parallel projection's partial sums: every rank gets
    the same full sum). Sums in ``x.dtype``; returns ``x`` (made contiguous first if it was not)."""
    x = x.contiguous()
    with _collective("all_reduce_sum", group):
        _wait(dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=True), group)
    return x


def broadcast_from(x: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """``x`` of global rank ``src`` on every rank of ``group``, in place (``x`` contiguous, of the
    same shape and dtype on every rank: a heads-TP drafter's prompt cache, forwarded by its leader)."""
    if not x.is_contiguous():
        raise ValueError("broadcast_from needs a contiguous tensor (it is written in place)")
    with _collective("broadcast_from", group):
        _wait(dist.broadcast(x, src=src, group=group, async_op=True), group)
    return x


def reduce_scatter_rows(x: torch.Tensor, group: Group, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum partial full-row tensors over the CP group and leave rank r its row slice.

    Used after a head-sharded mixer: each rank holds o_proj partial sums for all T rows.
    Rows are zero-padded to ``c * cp`` first, so padding rows of the result are exactly 0.
    Sums in ``x.dtype`` (pass fp32 partials for fp32 accumulation).

    Args:
        x: ``[T, ...]`` this rank's partial sums for all rows. For static shapes pass them
            already zero-padded to a multiple of cp rows (no copy is made then).
        out: optional preallocated ``[c, ...]`` buffer (same dtype/device) for the result.
    Returns:
        ``[c, ...]``, ``c = ceil(T / cp)``: rows ``[r * c, (r + 1) * c)`` of the sum (``out``).
    """
    cp = group_size(group)
    chunk = row_chunk(x.shape[0], cp)
    padded = pad_rows(x, chunk * cp).contiguous()
    shape = (chunk, *x.shape[1:])
    if out is None:
        out = x.new_empty(shape)
    _check_out("reduce_scatter_rows out", out, shape, x)
    with _collective("reduce_scatter_rows", group):
        _wait(dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM, group=group, async_op=True), group)
    return out


def exchange_split_sizes(send_counts: Sequence[int], group: Group, device: torch.device | None = None) -> list[int]:
    """All-to-all of counts: returns how many rows every rank will send to this rank.

    Args:
        send_counts: ``[group_size]``, rows this rank sends to each rank.
    Returns:
        ``[group_size]``, rows this rank receives from each rank.
    """
    size = group_size(group)
    if len(send_counts) != size:
        raise ValueError(f"send_counts has {len(send_counts)} entries, group size is {size}")
    device = device or group_device(group)
    send = torch.tensor(list(send_counts), dtype=torch.int64, device=device)
    recv = torch.empty(size, dtype=torch.int64, device=device)
    with _collective("exchange_split_sizes", group):
        _wait(dist.all_to_all_single(recv, send, group=group, async_op=True), group)
    return recv.tolist()


def all_to_all_rows(
    x: torch.Tensor,
    send_counts: Sequence[int],
    group: Group,
    recv_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-to-all along dim 0 with uneven splits.

    Args:
        x: ``[sum(send_counts), ...]``, rows for rank 0 first, then rank 1, ...
        send_counts: ``[group_size]`` rows sent to each rank (may be 0).
        recv_counts: ``[group_size]`` rows received from each rank; exchanged with
            :func:`exchange_split_sizes` (one extra tiny all-to-all) when ``None``.
    Returns:
        ``[sum(recv_counts), ...]``, rows from rank 0 first, then rank 1, ...
    """
    if x.shape[0] != sum(send_counts):
        raise ValueError(f"x has {x.shape[0]} rows but send_counts={list(send_counts)} sum to {sum(send_counts)}")
    if recv_counts is None:
        recv_counts = exchange_split_sizes(send_counts, group, device=x.device)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    with _collective("all_to_all_rows", group):
        work = dist.all_to_all_single(
            out, x.contiguous(), list(recv_counts), list(send_counts), group=group, async_op=True
        )
        _wait(work, group)
    return out


def all_to_all_equal(x: torch.Tensor, group: Group, out: torch.Tensor | None = None) -> torch.Tensor:
    """All-to-all along dim 0 with equal splits: no counts, nothing read on the host.

    Args:
        x: ``[size * n, ...]``, n rows for rank 0 first, then rank 1, ...
        out: optional preallocated buffer shaped like ``x``.
    Returns:
        ``[size * n, ...]``, the n rows from rank 0 first, then rank 1, ...
    """
    size = group_size(group)
    if x.shape[0] % size != 0:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of the group size {size}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_out("all_to_all_equal out", out, tuple(x.shape), x)
    with _collective("all_to_all_equal", group):
        _wait(dist.all_to_all_single(out, x.contiguous(), group=group, async_op=True), group)
    return out


@dataclass(slots=True)
class LseBuffers:
    """Preallocated send/receive buffers of :func:`lse_all_to_all` for one (T, H, D, cp, dtypes).

    ``send``/``recv``: ``[cp, T, H / cp, D + 1]`` packed (o and lse share a dtype) or
    ``[cp, T, H / cp, D]`` o only, with ``lse_send``/``lse_recv`` ``[cp, T, H / cp, 1]`` beside.
    """

    send: torch.Tensor
    recv: torch.Tensor
    lse_send: torch.Tensor | None = None
    lse_recv: torch.Tensor | None = None


def lse_buffers(
    num_tokens: int, num_heads: int, head_dim: int, cp: int, o_dtype: torch.dtype, lse_dtype: torch.dtype,
    device: torch.device,
) -> LseBuffers:
    """Buffers for :func:`lse_all_to_all` of ``o [T, H, D]`` and ``lse [T, H]`` over ``cp`` ranks."""
    if cp < 1 or num_heads % cp != 0:
        raise ValueError(f"num_heads={num_heads} is not divisible by cp={cp}")
    shape = (cp, num_tokens, num_heads // cp)
    if o_dtype == lse_dtype:
        packed = (*shape, head_dim + 1)
        return LseBuffers(torch.empty(packed, dtype=o_dtype, device=device),
                          torch.empty(packed, dtype=o_dtype, device=device))
    o_shape, lse_shape = (*shape, head_dim), (*shape, 1)
    return LseBuffers(torch.empty(o_shape, dtype=o_dtype, device=device),
                      torch.empty(o_shape, dtype=o_dtype, device=device),
                      torch.empty(lse_shape, dtype=lse_dtype, device=device),
                      torch.empty(lse_shape, dtype=lse_dtype, device=device))


def lse_all_to_all(
    o: torch.Tensor, lse: torch.Tensor, group: Group, buffers: LseBuffers | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Helix exchange: trade partial attention outputs over heads within the CP group.

    Each rank computed attention for all T rows and all H heads over its local KV only. Rank j
    is sent every rank's partials for head slice j, ``[j * H / cp, (j + 1) * H / cp)``. A rank with
    no local KV sends ``lse = -inf`` and ``o = 0``. Combine the result with
    ``O = sum_i o_i exp(lse_i - m) / sum_i exp(lse_i - m)``, ``m = max_i lse_i``.
    One all-to-all when ``o`` and ``lse`` share a dtype (packed), else two.

    Args:
        o: ``[T, H, D]`` this rank's partial outputs (D = kv_lora_rank for MLA latent combine).
        lse: ``[T, H]`` their log-sum-exp (natural log, of the scaled scores).
        buffers: optional preallocated :func:`lse_buffers` (static shapes: nothing allocated,
            nothing read on the host); the results are views of them.
    Returns:
        o_parts ``[cp, T, H / cp, D]`` and lse_parts ``[cp, T, H / cp]``: index i holds CP rank
        i's partials for this rank's head slice.
    """
    cp = group_size(group)
    if o.dim() != 3 or lse.shape != o.shape[:2]:
        raise ValueError(f"expected o [T, H, D] and lse [T, H], got {tuple(o.shape)} and {tuple(lse.shape)}")
    num_tokens, num_heads, head_dim = o.shape
    if num_heads % cp != 0:
        raise ValueError(f"num_heads={num_heads} is not divisible by cp={cp}")
    local_heads = num_heads // cp
    expected = lse_buffers(0, num_heads, head_dim, cp, o.dtype, lse.dtype, torch.device("meta"))
    if buffers is None:
        buffers = lse_buffers(num_tokens, num_heads, head_dim, cp, o.dtype, lse.dtype, o.device)
    for name, want in (("send", expected.send), ("recv", expected.recv), ("lse_send", expected.lse_send),
                       ("lse_recv", expected.lse_recv)):
        have = getattr(buffers, name)
        if (want is None) != (have is None) or (have is not None and (
                have.shape[0] != cp or have.shape[1] != num_tokens or have.shape[2:] != want.shape[2:]
                or have.dtype != want.dtype or have.device != o.device)):
            raise ValueError(f"lse buffers don't match o {o.dtype} {tuple(o.shape)}, lse {lse.dtype}, cp={cp}: "
                             f"{name} is {None if have is None else (have.dtype, tuple(have.shape))}")
    # [T, H, ...] -> [cp, T, H/cp, ...]: destination rank first
    o_send = o.reshape(num_tokens, cp, local_heads, head_dim).transpose(0, 1)
    lse_send = lse.reshape(num_tokens, cp, local_heads, 1).transpose(0, 1)
    with _collective("lse_all_to_all", group):
        if buffers.lse_send is None:  # packed
            buffers.send[..., :head_dim].copy_(o_send)
            buffers.send[..., head_dim:].copy_(lse_send)
            _wait(dist.all_to_all_single(buffers.recv, buffers.send, group=group, async_op=True), group)
            return buffers.recv[..., :head_dim], buffers.recv[..., head_dim]
        assert buffers.lse_recv is not None
        buffers.send.copy_(o_send)
        buffers.lse_send.copy_(lse_send)
        _wait(dist.all_to_all_single(buffers.recv, buffers.send, group=group, async_op=True), group)
        _wait(dist.all_to_all_single(buffers.lse_recv, buffers.lse_send, group=group, async_op=True), group)
    return buffers.recv, buffers.lse_recv[..., 0]
