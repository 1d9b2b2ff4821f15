"""Host copies of a step's small metadata tensors (slots, cu_seqlens, positions, block tables),
read once per forward instead of once per layer.

Inside :func:`step_host_cache` (the model's forward), :func:`host_list` returns the ``tolist()`` of a
tensor read earlier in the same step by the same tensor object; the cache holds the tensors, so an
id is never reused while it lives. Only the metadata that no kernel writes may go through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_step_lists: ContextVar[dict[int, tuple[torch.Tensor, list]] | None] = ContextVar("_step_lists", default=None)


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
