"""Host copies of a step's small metadata tensors (slots, cu_seqlens, positions, block tables),
read once per forward instead of once per layer, and values derived from them computed once.

Inside :func:`step_host_cache` (the model's forward), :func:`host_list` returns the ``tolist()`` of a
tensor read earlier in the same step by the same tensor object, and :func:`step_value` a value
derived from a metadata tensor (row -> sequence ids, kv lengths) computed earlier in the step; the
cache holds the tensors, so an id is never reused while it lives. Only the metadata that no kernel
writes may go through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

_step_lists: ContextVar[dict[Any, tuple[torch.Tensor, Any]] | None] = ContextVar("_step_lists", default=None)
V = TypeVar("V")


@contextmanager
def step_host_cache() -> Iterator[None]:
    """Share :func:`host_list` reads until the block exits (nested blocks share the outer cache)."""
    if _step_lists.get() is not None:
        yield
        return
    token = _step_lists.set({})
    try:
        yield
    finally:
        _step_lists.reset(token)


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``, remembered for the current step."""
    cache = _step_lists.get()
    if cache is None:
        return t.tolist()
    hit = cache.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    values = t.tolist()
    cache[id(t)] = (t, values)
    return values


def step_value(t: torch.Tensor, name: str, compute: Callable[[], V]) -> V:
    """``compute()``, a value derived from the metadata tensor ``t``, remembered for the current step
    under ``name`` (a step's layers share one computation, one kernel in a CUDA graph)."""
    cache = _step_lists.get()
    if cache is None:
        return compute()
    key = (id(t), name)
    hit = cache.get(key)
    if hit is not None and hit[0] is t:
        return hit[1]
    value = compute()
    cache[key] = (t, value)
    return value
