"""One side's memory map of a shard (`layout.ShardPlan.memory`): every segment's runs in its pool.

Both sides of a tagged stream build one (the ctx over its pools, the receiver over its own; a
pulled shard needs none: `pull` copies unit groups), so it is kept to a few dict lookups per
segment:

- **Per-pool constants** (the flat uint8 view, shape, strides, dtype) are computed once per pool
  tensor and kept while that tensor lives (:func:`pool_info`). The key is the tensor object: a
  tensor put in a pool's place (another shape, strided) is looked at anew; the entry goes with
  its tensor (a weak reference), so an opened ctx pool that is dropped is not kept mapped.
- **One pattern per pool shape.** Every MLA layer of a request reads one block table and every
  KDA layer one slot and head slice, in pools of one shape: the unit offsets are the same for
  all of them. The runs are computed and bounds-checked once per (kind, shape, strides) and the
  segments share the ``runs`` / ``starts`` lists.

The result is the map the per-segment code (:meth:`SegmentMemory.of` for each segment) gives,
run for run; ``tests/unit/test_transceiver_memory_map.py`` holds that reference.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from helixserve.cache_layout import DraftCaches, ModelCaches
from helixserve.dtypes import torch_dtype
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.segments import Segment, SegmentMemory, ShardSpec


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """What the memory map reads of a pool tensor, once."""

    ref: weakref.ref  # the pool tensor
    data_ptr: int
    flat: torch.Tensor | None  # uint8 view of the whole pool; None when it is not contiguous
    dtype: torch.dtype
    shape: tuple[int, ...]
    inner: tuple[int, ...]  # shape[1:]
    strides: tuple[int, ...]  # in elements
    itemsize: int
    geometry: int  # one number per (shape, strides, itemsize): pools of one geometry have the same unit offsets


_POOLS: dict[int, PoolInfo] = {}  # id(pool tensor) -> its constants, while it lives
_GEOMETRIES: dict[tuple, int] = {}  # (shape, strides, itemsize) -> PoolInfo.geometry (a few per process)
_NEXT_GEOMETRY = itertools.count()  # next() is atomic: two threads never give two geometries one number


def pool_info(pool: torch.Tensor) -> PoolInfo:
    """The constants of `pool`, computed on its first use (and again if its storage moved)."""
    info = _POOLS.get(id(pool))
    if info is not None and info.ref() is pool and info.data_ptr == pool.data_ptr():
        return info
    key, registry = id(pool), _POOLS  # (the dict itself: still there while the interpreter exits)

    def forget(ref: weakref.ref) -> None:  # the tensor is gone: so is its entry (and flat view)
        if (entry := registry.get(key)) is not None and entry.ref is ref:
            registry.pop(key, None)

    flat = pool.reshape(-1).view(torch.uint8) if pool.is_contiguous() else None
    shape, strides, itemsize = tuple(pool.shape), tuple(pool.stride()), pool.element_size()
    geometry = _GEOMETRIES.setdefault((shape, strides, itemsize), next(_NEXT_GEOMETRY))
    info = PoolInfo(weakref.ref(pool, forget), pool.data_ptr(), flat, pool.dtype, shape, shape[1:], strides,
                    itemsize, geometry)
    _POOLS[key] = info
    return info


def _checked(pools: dict[int, torch.Tensor], layer_id: int, dtype: str, want: torch.dtype,
             inner: tuple[int, ...]) -> PoolInfo:
    """`cache_check._checked` over the pool's constants (same refusals, same messages); `want` is
    the torch dtype named `dtype`."""
    pool = pools.get(layer_id)
    if pool is None:
        raise ValueError(f"no cache tensor for layer {layer_id}")
    info = _POOLS.get(id(pool))  # pool_info(pool), inlined: once per segment of every plan
    if info is None or info.ref() is not pool or info.data_ptr != pool.data_ptr():
        info = pool_info(pool)
    if info.dtype != want or info.inner != inner:
        raise ValueError(f"layer {layer_id} cache is {info.dtype} {info.shape}, the layout "
                         f"says {dtype} [*, {', '.join(map(str, inner))}]")
    return info


def _unit_offsets(kind: PayloadKind, info: PoolInfo, physical_blocks: Sequence[int], slot: int,
                  num_heads: int, head0: int, head_dim: int) -> Sequence[int] | np.ndarray:
    """Byte offsets, in stream order, of a segment's units in a pool of `info`'s shape."""
    strides, size = info.strides, info.itemsize
    if kind is PayloadKind.KV_BLOCKS:
        return np.asarray(physical_blocks, dtype=np.int64) * (strides[0] * size)
    if kind is PayloadKind.KDA_STATE:
        return [(slot * strides[0] + head0 * strides[1]) * size]
    return [(slot * strides[0] + (s * num_heads * head_dim + head0 * head_dim) * strides[1]) * size
            for s in range(3)]


def map_memory(spec: ShardSpec, segments: Sequence[Segment], caches: ModelCaches, aux: torch.Tensor,
               physical_blocks: Sequence[int], slot: int | None, num_heads: int, head0: int,
               draft_blocks: Sequence[int] = ()) -> list[SegmentMemory]:
    """Each segment's memory: AUX in `aux`; a layer's blocks ``physical_blocks`` of its MLA pool;
    its state and conv sections at `slot`, heads ``[head0, head0 + H)`` of pools of `num_heads`
    heads (H the shard's head count); a drafter's blocks ``draft_blocks`` of its pools
    (``caches.draft``) and its feature row at `slot`. ValueError for a missing or misshapen pool,
    a strided one, or a unit outside its pool (a block id or slot out of range)."""
    lay = spec.layout
    k = lay.kda_head_dim
    out: list[SegmentMemory] = []
    patterns: dict[tuple, SegmentMemory] = {}  # (kind, geometry, unit bytes, units) -> the first such segment
    kind = code = pools = dtype = want = inner = None
    for seg in segments:
        if seg.kind is PayloadKind.DRAFT:  # (the stream's last segments)
            out.append(_draft_memory(seg, caches.draft, draft_blocks, slot, lay.draft.kv_dtype if lay.draft else ""))
            continue
        if seg.kind is not kind:  # the stream holds each kind's segments together
            kind = seg.kind
            if kind is PayloadKind.AUX:
                out.append(SegmentMemory.of(aux, [0], seg.unit_bytes))
                kind = None
                continue
            if kind is PayloadKind.KV_BLOCKS:
                code, pools, dtype = 0, caches.mla_kv, lay.kv_dtype
                inner = (lay.tokens_per_block, lay.kv_lora_rank + lay.qk_rope_head_dim)
            elif slot is None:
                raise ValueError(f"KDA layer {seg.layer_id} needs a state slot")
            elif kind is PayloadKind.KDA_STATE:
                code, pools, dtype, inner = 1, caches.kda_state, lay.state_dtype, (num_heads, k, k)
            else:
                code, pools, dtype = 2, caches.conv_state, lay.conv_dtype
                inner = (3 * num_heads * k, lay.conv_kernel_size - 1)
            want = torch_dtype(dtype)
        info = _checked(pools, seg.layer_id, dtype, want, inner)
        key = (code, info.geometry, seg.unit_bytes, seg.num_units)
        pattern = patterns.get(key)
        if pattern is None:
            if info.flat is None:
                raise ValueError(f"cache tensor {info.shape} must be contiguous")
            offsets = _unit_offsets(kind, info, physical_blocks, slot, num_heads, head0, k)
            pattern = patterns[key] = SegmentMemory.of(info.flat, offsets, seg.unit_bytes)
            if pattern.runs and pattern.starts[-1] + pattern.runs[-1][1] != seg.nbytes:  # the pull relies on it
                raise AssertionError(f"the runs of {seg} do not cover it")
        out.append(SegmentMemory(info.flat, pattern.runs, pattern.starts, pattern.unit_bytes, pattern.unit_rows))
    return out


def _draft_memory(seg: Segment, draft: DraftCaches | None, draft_blocks: Sequence[int], slot: int | None,
                  dtype: str) -> SegmentMemory:
    """A drafter segment's memory: blocks ``draft_blocks`` of its layer's pool, or (layer id -1)
    its feature row at `slot`."""
    if draft is None:
        raise ValueError("this rank holds no drafter prompt cache (caches.draft)")
    if seg.layer_id < 0:
        if slot is None:
            raise ValueError("a drafter's feature row needs a state slot")
        pool, units = draft.features, [slot]
    else:
        pool = draft.mla_kv.get(seg.layer_id)
        if pool is None:
            raise ValueError(f"no drafter cache tensor for layer {seg.layer_id}")
        if len(draft_blocks) < seg.num_units:
            raise ValueError(f"the drafter's block table holds {len(draft_blocks)} blocks, the shard {seg.num_units}")
        units = list(draft_blocks[:seg.num_units])
    row_bytes = pool.stride(0) * pool.element_size()
    if pool.dtype != torch_dtype(dtype) or row_bytes != seg.unit_bytes:
        raise ValueError(f"drafter cache {pool.dtype} {tuple(pool.shape)} does not hold units of {seg.unit_bytes} "
                         f"bytes of {dtype}")
    return SegmentMemory.of(pool, [u * row_bytes for u in units], seg.unit_bytes)
