"""Argument checks shared by the kernel dispatchers; every failure raises ValueError naming the value.
(Also :func:`as_f32`, the fp32 view the torch paths compute in.)"""

from __future__ import annotations

import torch

from helixserve.kernels._host import host_list


def as_f32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()`` without the dispatch when ``t`` already is float32."""
    return t if t.dtype == torch.float32 else t.float()


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    if isinstance(t, torch.Tensor) and t.dim() == ndim:  # the common case first: one call, no raise path
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if isinstance(t, torch.Tensor) and t.shape == tuple(shape):  # torch.Size compares with a tuple
        return
    check_ndim(name, t, len(shape))
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_integer(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """Validate ``cu_seqlens`` [N+1] (0, non-decreasing, ends at num_tokens); returns it as int64.

    ``None`` means one sequence covering all ``num_tokens`` rows.
    """
    if cu_seqlens is None:
        return torch.tensor([0, num_tokens], dtype=torch.int64)
    check_ndim(name, cu_seqlens, 1)
    check_integer(name, cu_seqlens)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} needs at least 2 entries, got {cu_seqlens.tolist()}")
    is_host_int64 = cu_seqlens.device.type == "cpu" and cu_seqlens.dtype == torch.int64
    cu = cu_seqlens if is_host_int64 and not cu_seqlens.requires_grad else cu_seqlens.detach().to("cpu", torch.int64)
    values = host_list(cu)  # one host read per step; the checks below are plain Python
    if values[0] != 0 or values[-1] != num_tokens or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at {num_tokens}, got {values}"
        )
    return cu


def check_slot_ids(name: str, slot_ids: torch.Tensor, batch: int, num_slots: int) -> None:
    check_shape(name, slot_ids, (batch,))
    check_integer(name, slot_ids)
    if batch == 0:
        return
    ids = host_list(slot_ids)  # one host read per step; the checks below are plain Python
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"{name} must lie in [0, {num_slots}), got min {lo} max {hi}")
    if len(set(ids)) != batch:
        raise ValueError(f"{name} must not repeat a slot, got {ids}")


def check_activation(activation: str | None, allowed: tuple[str | None, ...]) -> None:
    if activation not in allowed:
        raise ValueError(f"activation must be one of {allowed}, got {activation!r}")
