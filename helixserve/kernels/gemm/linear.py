"""``linear``: the model's bias-free projections, ``x @ weight.T``.

One row (batch-1 decode) on a CUDA device with Triton, a weight up to :data:`MAX_GEMV_WEIGHT_BYTES`
and batch invariance off: the Triton matrix-vector kernel (:mod:`.triton_gemv`); cuBLAS gives a
one-row GEMM a handful of tiles, which leaves most of the GPU idle on a weight of a few MiB. Larger
weights (the LM head) and every other shape: ``F.linear``. Under batch invariance a row's kernel
must not depend on how many rows there are, so the Triton GEMM of :mod:`helixserve.kernels.gemm`
takes every shape. :func:`set_decode_gemv` turns the kernel off (the benchmarks' same-run baseline).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helixserve.kernels.triton_common import batch_invariant_enabled, use_triton

MAX_GEMV_WEIGHT_BYTES = 64 << 20
_decode_gemv = True


def set_decode_gemv(enabled: bool) -> None:
    """Take the one-row matrix-vector kernel where it applies (default on)."""
    global _decode_gemv
    _decode_gemv = bool(enabled)


def decode_gemv_enabled() -> bool:
    return _decode_gemv


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T`` -> ``[..., N]`` in ``out_dtype`` (default x's dtype),
    products summed in fp32 (``F.linear`` of both operands in ``out_dtype`` where the dtypes differ)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if _takes_gemv(x, weight):
        from helixserve.kernels.gemm import triton_gemv

        return triton_gemv.gemv(x, weight, out_dtype)
    if x.dtype == weight.dtype == out_dtype:
        return F.linear(x, weight)
    return F.linear(x.to(out_dtype), weight.to(out_dtype))


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_decode_gemv and use_triton(x) and x.numel() == x.shape[-1] and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1]
            and weight.numel() * weight.element_size() <= MAX_GEMV_WEIGHT_BYTES
            and x.dtype.is_floating_point and weight.dtype.is_floating_point and not batch_invariant_enabled())
