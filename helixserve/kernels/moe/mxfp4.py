"""Routed-expert stacks kept packed as MXFP4 (OCP microscaling FP4), and their reference decode.

:class:`MXFP4Weight` is one expert stack as the checkpoint stores it (compressed-tensors
``weight_packed`` / ``weight_scale`` of each expert, stacked over experts, same byte order):

- ``packed``: ``[E, N, K/2]`` uint8, two e2m1 codes per byte, low nibble first (element ``2j`` is
  ``byte_j & 0xF``, element ``2j + 1`` is ``byte_j >> 4``); code bit 3 is the sign, bits 0..2
  index ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``;
- ``scale``: ``[E, N, K/32]`` uint8 e8m0, one per 32 consecutive inputs: byte ``s`` is
  ``2 ** (s - 127)`` (``255``: NaN).

Logically it is the ``[E, N, K]`` stack ``w13`` / ``w2`` of :func:`helixserve.kernels.moe_experts`,
which takes either form: dense stacks, or two :class:`MXFP4Weight` (the CUDA path dequantizes
inside the grouped GEMM, :mod:`.triton_mxfp4`; elsewhere :func:`dequantize_mxfp4` then the dense
paths, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MXFP4_GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales as their uint8 bytes (``float8_e8m0fnu`` is viewed, never converted)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    raise ValueError(f"MXFP4 weight_scale must be uint8 or float8_e8m0fnu (e8m0), got {scale.dtype}")


def check_mxfp4_pair(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Raise ValueError unless ``packed [..., K/2]`` uint8 and ``scale [..., K/32]`` agree; returns the
    scale bytes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed must be uint8, got {packed.dtype}")
    scale = scale_bytes(scale)
    k = packed.shape[-1] * 2 if packed.dim() else 0
    if k % MXFP4_GROUP_SIZE or tuple(scale.shape) != (*packed.shape[:-1], k // MXFP4_GROUP_SIZE):
        raise ValueError(
            f"MXFP4 weight_scale shape {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)} (expected {(*packed.shape[:-1], k // MXFP4_GROUP_SIZE)})"
        )
    return scale


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., K/2]`` uint8 codes + ``[..., K/32]`` e8m0 scales -> ``[..., K]`` in ``dtype``."""
    scale = check_mxfp4_pair(packed, scale)
    k = packed.shape[-1] * 2
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()]
    factor = torch.pow(2.0, (scale.to(torch.int32) - 127).to(torch.float32))
    factor = torch.where(scale == 255, torch.full_like(factor, float("nan")), factor)
    grouped = values.unflatten(-1, (k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)) * factor.unsqueeze(-1)
    return grouped.flatten(-2).to(dtype)


@dataclass(frozen=True, slots=True)
class MXFP4Weight:
    """An ``[E, N, K]`` expert stack held as MXFP4 bytes (see the module docstring)."""

    packed: torch.Tensor  # [E, N, K/2] uint8
    scale: torch.Tensor  # [E, N, K/32] uint8 (e8m0)

    def __post_init__(self) -> None:
        if self.packed.dim() != 3:
            raise ValueError(f"MXFP4 expert weight_packed must be [E, N, K/2], got {tuple(self.packed.shape)}")
        object.__setattr__(self, "scale", check_mxfp4_pair(self.packed, self.scale))
        if self.packed.device != self.scale.device:
            raise ValueError(f"MXFP4 weight_packed on {self.packed.device} but weight_scale on {self.scale.device}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical (dequantized) shape ``(E, N, K)``."""
        E, N, half_k = self.packed.shape
        return E, N, 2 * half_k

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[E, N, K]`` stack in ``dtype``."""
        return dequantize_mxfp4(self.packed, self.scale, dtype)
