"""GPU dispatch helpers shared by the kernels' public functions.

A public kernel function takes its GPU path when its main input lives on a CUDA device and the
optional ``gpu`` extra is installed (Triton; fla-core for KDA). Otherwise it runs the PyTorch
reference, unchanged. On the GPU path the value checks that read tensors on the host (cu_seqlens
order, slot ranges, block-table bounds) are skipped so that a step has no host syncs and can be
captured in a CUDA graph; :func:`set_value_checks` turns them back on for debugging.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

from helixserve.config import kernel_backend
from helixserve.kernels.gemm import set_batch_invariant as set_batch_invariant_gemms
from helixserve.kernels._host import step_value
from helixserve.kernels._checks import check_cu_seqlens, check_integer, check_ndim, check_shape, check_slot_ids

_value_checks = False


def set_value_checks(enabled: bool) -> None:
    """Run the host-side value checks on the GPU path too (syncs; breaks CUDA-graph capture)."""
    global _value_checks
    _value_checks = bool(enabled)


def value_checks_enabled() -> bool:
    return _value_checks


_batch_invariant = False


def set_batch_invariant(enabled: bool) -> None:
    """``model.deterministic``: reductions whose order does not depend on the batch where the
    kernels choose it (MLA decode: a fixed KV split count and the Triton kernel, not FlashMLA,
    whose split plan follows the batch; MXFP4 experts: one row-block size), the fixed-tile Triton
    GEMMs in place of cuBLAS's and ``torch._grouped_mm`` (:mod:`helixserve.kernels.gemm`, CUDA
    with Triton), and PyTorch's deterministic algorithms."""
    global _batch_invariant
    _batch_invariant = bool(enabled)
    torch.use_deterministic_algorithms(_batch_invariant, warn_only=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not _batch_invariant
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = not _batch_invariant
    torch.backends.cudnn.deterministic = _batch_invariant
    set_batch_invariant_gemms(_batch_invariant and fast_kernels_enabled())


def batch_invariant_enabled() -> bool:
    return _batch_invariant


@cache
def fast_kernels_enabled() -> bool:
    """``HELIXSERVE_KERNELS=auto``: GPU fast paths (Triton, fla, FlashMLA) where installed."""
    return kernel_backend() == "auto"


@cache
def has_triton() -> bool:
    return fast_kernels_enabled() and importlib.util.find_spec("triton") is not None


@cache
def has_fla() -> bool:
    return has_triton() and importlib.util.find_spec("fla") is not None


def is_interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``), used by the CPU tests of the kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(x: torch.Tensor) -> bool:
    """``x`` lives on a CUDA device: the kernels take their sync-free, graph-safe branches."""
    return x.is_cuda


def use_triton(x: torch.Tensor) -> bool:
    """Take the Triton path for ``x``: a CUDA tensor and Triton installed."""
    return x.is_cuda and has_triton()


def use_fla(x: torch.Tensor) -> bool:
    """Take the fla path for ``x``: a CUDA tensor and fla-core (with Triton) installed."""
    return x.is_cuda and has_fla()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def seq_ids_of_rows(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows]`` int32 sequence index of each flat row, computed on the device (no sync), once
    per step (:func:`~helixserve.kernels._host.step_value`)."""
    def compute() -> torch.Tensor:
        rows = torch.arange(num_rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
        return torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True).to(torch.int32)

    return step_value(cu_seqlens, f"seq_ids_of_rows:{num_rows}", compute)


def gpu_num_seqs(name: str, cu_seqlens: torch.Tensor | None, num_tokens: int) -> int:
    """Sequences in ``cu_seqlens`` on the GPU path: shape/dtype checks always, values only when enabled."""
    if cu_seqlens is None:
        return 1
    if value_checks_enabled():
        return check_cu_seqlens(name, cu_seqlens, num_tokens).numel() - 1
    check_ndim(name, cu_seqlens, 1)
    check_integer(name, cu_seqlens)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} needs at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens.numel() - 1


def gpu_check_slot_ids(name: str, slot_ids: torch.Tensor, batch: int, num_slots: int) -> None:
    """Slot ids on the GPU path: shape/dtype checks always, range/uniqueness only when enabled."""
    if value_checks_enabled():
        check_slot_ids(name, slot_ids, batch, num_slots)
        return
    check_shape(name, slot_ids, (batch,))
    check_integer(name, slot_ids)
