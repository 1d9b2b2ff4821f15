"""GEMMs whose result for a row does not depend on the batch (``model.deterministic``).

cuBLAS and CUTLASS choose tiles, split-K and stream-K plans from the problem's shape, so the
same row can be summed in a different order when the batch grows, and a request's tokens change
with what it was batched with. With batch invariance on (:func:`set_batch_invariant`) on a CUDA
device with Triton:

- ``aten::mm``, ``aten::addmm`` and ``aten::bmm`` on CUDA are replaced by the fixed-tile Triton
  GEMM of :mod:`.triton_gemm` (every ``nn.Linear``, ``@``, ``torch.bmm`` and ``einsum`` of the
  model goes through them), as vLLM's and SGLang's batch-invariant modes do;
- :func:`grouped_mm` (the MoE's grouped expert GEMMs) runs the grouped Triton GEMM instead of
  ``torch._grouped_mm``.

Off (the default), or without CUDA or Triton, nothing is replaced. The replacement is our own:
no maintained library packages these kernels for pip (the published batch-invariant kernels live
inside serving engines), and the grouped GEMM needs ``torch._grouped_mm``'s contract.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_library: torch.library.Library | None = None


def _triton_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


if _triton_available():
    from helixserve.kernels.gemm import triton_gemm as _kernels
else:  # CPU: nothing is replaced, the Triton module is never imported
    _kernels = None


def _slow_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Other dtypes (float64, integers): an elementwise product and a sum, batch-invariant too."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        return _slow_mm(a, b)
    return _kernels.bmm_nt(a.unsqueeze(0), b.unsqueeze(0))[0]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        return _slow_mm(a, b)
    return _kernels.bmm_nt(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    product = _mm(a, b)
    if alpha != 1:
        product = product * alpha
    return product + (bias if beta == 1 else bias * beta)


def set_batch_invariant(enabled: bool) -> bool:
    """Replace (or restore) the CUDA GEMMs; returns whether the replacement is in place."""
    global _library
    if enabled and _library is None and _kernels is not None:
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("mm", _mm, "CUDA")
        _library.impl("addmm", _addmm, "CUDA")
        _library.impl("bmm", _bmm, "CUDA")
        logger.info("batch-invariant GEMMs: aten mm / addmm / bmm on CUDA run the fixed-tile Triton GEMM")
    elif not enabled and _library is not None:
        _library._destroy()
        _library = None
    return _library is not None


def batch_invariant_gemms() -> bool:
    return _library is not None


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, w, offs=offs)``, batch-invariant while the GEMMs are replaced."""
    if _library is not None and a.is_cuda:
        return _kernels.grouped_mm(a, w, offs)
    return torch._grouped_mm(a, w, offs=offs)
