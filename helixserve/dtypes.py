"""The one dtype table (torch-free): every dtype name the software knows, its bytes per value,
and which of them a model computes in.

The names are torch's own (``torch.<name>`` is the dtype), so the table needs no torch to import:
``helixserve plan`` and the pool byte arithmetic (:mod:`helixserve.kvcache.sizing`) read it
torch-free, and the torch side (:func:`torch_dtype`, :func:`dtype_name`) maps a name to the
dtype object and back.

==================  ======  =====================================================
name                bytes   used for
==================  ======  =====================================================
``float32``         4       model weights/activations on CPU, KDA recurrent state
``bfloat16``        2       model weights/activations on GPU, KV blocks
``float16``         2       model weights/activations
``float8_e4m3fn``   1       KV blocks on the wire (a :class:`~helixserve.protocol.disagg.KVLayout` dtype)
``float8_e5m2``     1       KV blocks on the wire
==================  ======  =====================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # what a model computes in


def check_dtype(name: str, allowed: tuple[str, ...] | dict[str, int] = ITEMSIZE) -> str:
    """``name`` itself when it is one of ``allowed``; ``ValueError`` naming it otherwise."""
    if name not in allowed:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(allowed)}")
    return name


def itemsize(name: str) -> int:
    """Bytes per value of the dtype ``name`` (``ValueError`` for a name not in the table)."""
    return ITEMSIZE[check_dtype(name)]


def torch_dtype(name: str, allowed: tuple[str, ...] | dict[str, int] = ITEMSIZE) -> torch.dtype:
    """The torch dtype of ``name`` (``ValueError`` unless it is one of ``allowed``)."""
    import torch  # torch: the table itself imports without it (planning, pool sizing)

    return getattr(torch, check_dtype(name, allowed))


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name of a torch dtype (``ValueError`` for one the table does not hold)."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not one of {sorted(ITEMSIZE)}")
    return name
