"""A side's cache pools checked against a KV layout: every layer present, of the layout's dtype
and shape (`layout` names the shapes; the ctx checks its pools once, a receiver on every request,
so a pass is remembered per pool tensor)."""

from __future__ import annotations

import threading
import weakref

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.protocol.disagg import KVLayout
from helixserve.dtypes import torch_dtype

_LOCK = threading.Lock()  # the engine and the sender's threads check
# (layout id, caches id, heads) -> (the layout, the caches' identity, weak references whose
# death drops the entry, their device): never keeps a pool alive, and while an entry exists its
# tensors live, so an equal identity means the very same tensors
_CHECKED_CACHES: dict[tuple[int, int, int], tuple[KVLayout, tuple[int, ...], tuple[weakref.ref, ...],
                                                   torch.device | None]] = {}
MAX_CHECKED_CACHES = 8


def caches_device(caches: ModelCaches) -> torch.device | None:
    """The one device every cache tensor lives on (None when there is none or several)."""
    devices = {t.device for t in caches.tensors()}
    return devices.pop() if len(devices) == 1 else None


def check_caches(layout: KVLayout, caches: ModelCaches, num_heads: int, remember: bool = False) -> torch.device | None:
    """ValueError unless `caches` hold every layer of `layout` (with `num_heads` KDA heads);
    else their device (`caches_device`). A receiver checks its own caches on every request
    (`remember`): a pass is remembered for these pool tensors (weak references: a dropped cache
    set, e.g. a restarted world's, is not kept alive), so the next call only compares the
    tensors' identity (one tuple)."""
    if not remember:
        _check_caches(layout, caches, num_heads)
        return caches_device(caches)
    key = (id(layout), id(caches), num_heads)
    identity = caches.identity()
    seen = _CHECKED_CACHES.get(key)
    if seen is not None and seen[0] is layout and seen[1] == identity:
        return seen[3]
    _check_caches(layout, caches, num_heads)
    device = caches_device(caches)

    def forget(_: weakref.ref) -> None:  # a tensor of the entry died: its ids may be reused
        _CHECKED_CACHES.pop(key, None)
    refs = tuple(weakref.ref(t, forget) for t in caches.tensors())
    with _LOCK:
        if len(_CHECKED_CACHES) >= MAX_CHECKED_CACHES:
            _CHECKED_CACHES.pop(next(iter(_CHECKED_CACHES)), None)
        _CHECKED_CACHES[key] = (layout, identity, refs, device)
    return device


def _check_caches(layout: KVLayout, caches: ModelCaches, num_heads: int) -> None:
    k = layout.kda_head_dim
    for i in layout.mla_layers:
        _checked(caches.mla_kv, i, layout.kv_dtype, (layout.tokens_per_block, layout.kv_lora_rank + layout.qk_rope_head_dim))
    for i in layout.kda_layers:
        _checked(caches.kda_state, i, layout.state_dtype, (num_heads, k, k))
        _checked(caches.conv_state, i, layout.conv_dtype, (3 * num_heads * k, layout.conv_kernel_size - 1))


def _checked(pools: dict[int, torch.Tensor], layer_id: int, dtype: str, inner: tuple[int, ...]) -> torch.Tensor:
    pool = pools.get(layer_id)
    if pool is None:
        raise ValueError(f"no cache tensor for layer {layer_id}")
    if pool.dtype != torch_dtype(dtype) or tuple(pool.shape[1:]) != inner:
        raise ValueError(f"layer {layer_id} cache is {pool.dtype} {tuple(pool.shape)}, the layout "
                         f"says {dtype} [*, {', '.join(map(str, inner))}]")
    return pool
