"""MXFP4 (OCP microscaling FP4) weights as stored by compressed-tensors.

Layout (``weight_packed`` / ``weight_scale`` of one linear weight ``[out, in]``):

- ``weight_packed``: ``[out, in / 2]`` uint8, two e2m1 codes per byte, **low nibble first**: element
  ``2j`` is ``byte_j & 0xF``, element ``2j + 1`` is ``byte_j >> 4``. This is compressed-tensors'
  ``pack_fp4_to_uint8`` (``indices[:, 0] | indices[:, 1] << 4``) and its ``unpack_fp4_from_uint8``
  (``stack((low, high))``), which vLLM's compressed-tensors MXFP4 path also reads.
- e2m1 code ``c``: bit 3 is the sign, bits 0..2 index ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
- ``weight_scale``: ``[out, in / 32]`` e8m0 (uint8 byte or ``float8_e8m0fnu``), one per group of 32
  consecutive input elements; byte ``s`` means ``2 ** (s - 127)`` (``255`` = NaN).
"""

from __future__ import annotations

import torch

# the layout's constants and its decode live with the kernels that read it (one dequantize)
from helixserve.kernels.moe.mxfp4 import E2M1_VALUES, MXFP4_GROUP_SIZE, dequantize_mxfp4  # noqa: E402, F401


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``[..., N]`` to MXFP4 (OCP rule: shared exponent ``floor(log2(amax)) - 2``, nearest e2m1).

    Returns ``(weight_packed [..., N/2] uint8, weight_scale [..., N/32] uint8)``.
    """
    n = weight.shape[-1]
    if n % MXFP4_GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {MXFP4_GROUP_SIZE}, got {n}")
    w = weight.float().unflatten(-1, (n // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE))
    amax = w.abs().amax(-1).clamp_min(2.0**-120)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = (w / torch.pow(2.0, exp).unsqueeze(-1)).clamp(-6.0, 6.0)
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    idx = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = (idx + (scaled < 0).long() * 8).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)
