"""Cache tensor pools for one rank: MLA latent pages and KDA state/conv slots.

Layouts (see :mod:`helixserve.cache_layout`), per layer id:

- ``mla_kv[l]``:     ``[num_blocks, tokens_per_block, kv_lora_rank + qk_rope_head_dim]``, ``dtype``
- ``kda_state[l]``:  ``[num_slots, kda_num_heads, kda_head_dim, kda_head_dim]`` float32 ([K, V])
- ``conv_state[l]``: ``[num_slots, 3 * kda_num_heads * kda_head_dim, conv_kernel_size - 1]``, ``dtype``

``kda_num_heads`` is the *local* head count (``H / cp`` under helix CP). All pools start zeroed.

On the host, all pools are views into one arena backed by transparent huge pages (:func:`host_zeros`):
the transceiver's UCX copies between processes run about 3x faster from 2 MiB pages than from the
4 KiB pages torch's CPU allocator gets where THP is in ``madvise`` mode (the usual default).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helixserve.cache_layout import CacheSpec, ModelCaches
from helixserve.dtypes import dtype_name, itemsize
from helixserve.host_copy import to_device
from helixserve.kvcache.sizing import kda_slot_bytes, mla_block_bytes, pools_from_budget

_HUGE_PAGE_MIN_BYTES = 4 << 20


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def host_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor; from 4 MiB on, in memory advised for transparent huge pages.

    numpy's allocator asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) on large
    buffers and torch's does not, so large pools are numpy buffers viewed as torch tensors.
    """
    nbytes = _nbytes(shape, dtype)
    if nbytes < _HUGE_PAGE_MIN_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    import numpy as np

    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(tuple(shape))


_ARENA_ALIGN = 4096


def _allocate(
    pools: list[tuple[dict[int, torch.Tensor], int, tuple[int, ...], torch.dtype]], device: torch.device | str
) -> None:
    """Fill ``pools`` [(target dict, layer id, shape, dtype)] with zeroed tensors. On the host they
    are page-aligned views into one :func:`host_zeros` arena, so small per-layer pools (a KDA
    state pool of a few slots is ~2 MiB) share its huge pages too."""
    if torch.device(device).type != "cpu":
        for target, layer_id, shape, dtype in pools:
            target[layer_id] = torch.zeros(shape, dtype=dtype, device=device)
        return
    sizes = [_nbytes(shape, dtype) for _, _, shape, dtype in pools]
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN
    arena = host_zeros((total,), torch.uint8)
    for (target, layer_id, shape, dtype), offset, nbytes in zip(pools, offsets, sizes, strict=True):
        target[layer_id] = arena[offset : offset + nbytes].view(dtype).view(shape)


def bytes_per_block(spec: CacheSpec) -> int:
    """Bytes one physical block costs over all MLA layers (:func:`.sizing.mla_block_bytes`)."""
    return mla_block_bytes(len(spec.mla_layer_ids), spec.tokens_per_block, spec.mla_entry_dim, itemsize(dtype_name(spec.dtype)))


def bytes_per_slot(spec: CacheSpec) -> int:
    """Bytes one state slot costs over all KDA layers, fp32 state + conv state (:func:`.sizing.kda_slot_bytes`)."""
    return kda_slot_bytes(len(spec.kda_layer_ids), spec.kda_num_heads, spec.kda_head_dim, spec.conv_kernel_size,
                          itemsize(dtype_name(spec.dtype)))


def size_from_budget(spec: CacheSpec, budget_bytes: int, max_num_seqs: int) -> tuple[int, int]:
    """``(num_blocks, num_slots)`` for a memory budget: ``max_num_seqs`` slots, the rest blocks
    (:func:`.sizing.pools_from_budget`; ``ValueError`` when the budget cannot hold the slots plus
    one block per sequence; a model without MLA layers gets ``num_blocks = 0``)."""
    return pools_from_budget(bytes_per_block(spec), bytes_per_slot(spec), budget_bytes, max_num_seqs)


def allocate_model_caches(
    spec: CacheSpec, num_blocks: int, num_slots: int, device: torch.device | str = "cpu"
) -> ModelCaches:
    """Zero-filled pools with the layouts in the module docstring."""
    if num_blocks < 0 or num_slots < 0:
        raise ValueError(f"num_blocks and num_slots must be >= 0, got {num_blocks}, {num_slots}")
    caches = ModelCaches(tokens_per_block=spec.tokens_per_block)
    pools = []
    for layer_id in spec.mla_layer_ids:
        pools.append((caches.mla_kv, layer_id, (num_blocks, spec.tokens_per_block, spec.mla_entry_dim), spec.dtype))
    for layer_id in spec.kda_layer_ids:
        state_shape = (num_slots, spec.kda_num_heads, spec.kda_head_dim, spec.kda_head_dim)
        pools.append((caches.kda_state, layer_id, state_shape, torch.float32))
        pools.append((caches.conv_state, layer_id, (num_slots, spec.conv_channels, spec.conv_kernel_size - 1), spec.dtype))
    _allocate(pools, device)
    return caches


def reset_slots(caches: ModelCaches, slot_ids: Sequence[int] | torch.Tensor) -> None:
    """Zero the KDA recurrent and conv state of ``slot_ids`` (call before a slot's first prefill).

    The index goes to the device once for all pools and without blocking the host
    (:func:`~helixserve.host_copy.to_device`): a pageable copy per pool waited for the queued GPU
    work at every prefill step, i.e. the host could not run ahead of the device."""
    pools = [*caches.kda_state.values(), *caches.conv_state.values()]
    if not pools or len(slot_ids) == 0:
        return
    device = pools[0].device
    index = to_device(torch.as_tensor(slot_ids, dtype=torch.long), device)
    for pool in pools:
        pool.index_fill_(0, index if pool.device == device else index.to(pool.device), 0)


def copy_states(src: ModelCaches, dst: ModelCaches, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy the KDA recurrent and conv state of slot ``i`` of ``src`` into slot ``j`` of ``dst``
    for each ``(i, j)`` of ``pairs`` (state checkpoints: saved after a prefill chunk, restored
    before a prefill resumes from a cached prefix). Bit-exact: the same dtypes on both sides."""
    if not pairs:
        return
    pools = [(src.kda_state, dst.kda_state), (src.conv_state, dst.conv_state)]
    first = next(iter(dst.kda_state.values()), None)
    if first is None:
        return
    src_index = to_device(torch.tensor([i for i, _ in pairs], dtype=torch.long), first.device)
    dst_index = to_device(torch.tensor([j for _, j in pairs], dtype=torch.long), first.device)
    for src_pools, dst_pools in pools:
        for layer_id, target in dst_pools.items():
            target.index_copy_(0, dst_index, src_pools[layer_id].index_select(0, src_index))
