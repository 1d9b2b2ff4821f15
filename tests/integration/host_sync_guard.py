"""A context that fails every host read of tensor data: what a CUDA graph cannot hold.

On CPU there is no device sync to catch, so the guard rejects the operations that would be one on
CUDA: reading values (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor, ``numpy``) and
ops whose output shape depends on values (``nonzero``, ``unique``, ``bincount``, ``masked_select``,
boolean-mask indexing, ``repeat_interleave`` with tensor repeats). Host-to-device copies of host
data are allowed (they are not reads). Checked at both the Python (torch function) level and the
ATen (dispatch) level, so a read inside a library call is caught too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_FUNCTIONS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
_ATEN = {"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive",
         "unique_dim_consecutive", "bincount", "masked_select", "histc", "argwhere"}


class HostReadError(AssertionError):
    """A guarded region read tensor data on the host (or asked for a value-dependent shape)."""


def _is_bool_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


class _FunctionGuard(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _FUNCTIONS:
            raise HostReadError(f"host read: Tensor.{name}")
        return func(*args, **(kwargs or {}))


class _DispatchGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        op = func.__name__.split(".")[0]
        if op in _ATEN:
            raise HostReadError(f"host read: aten.{func.__name__}")
        if op in ("index", "index_put", "index_put_") and any(_is_bool_tensor(i) for i in args[1] if i is not None):
            raise HostReadError(f"host read: boolean-mask aten.{func.__name__}")
        if func.__name__ == "repeat_interleave.Tensor":
            raise HostReadError("host read: repeat_interleave with tensor repeats")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Raise :class:`HostReadError` on any host read of tensor data inside the block."""
    with _FunctionGuard(), _DispatchGuard():
        yield
