"""Causal depthwise short convolution (+ SiLU) used for the KDA q/k/v projections.

Shapes: D channels, kernel width W; the conv state holds the last W-1 inputs, oldest first.
    prefill: x [T, D], weight [D, W] (or checkpoint [D, 1, W]), conv_state [N, D, W-1] or None,
             cu_seqlens [N+1] int64 or None -> (y [T, D] in x.dtype, new_conv_state [N, D, W-1])
    step:    x [B, D], conv_pool [S, D, W-1] updated in place at slot_ids [B] -> y [B, D]
    y_t = act(sum_j weight[:, j] * x_{t-W+1+j}), inputs before a sequence start come from its state.
Computation in fp32; new states take conv_state's dtype (x.dtype when conv_state is None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helixserve.kernels._checks import (
    as_f32, check_activation, check_cu_seqlens, check_ndim, check_shape, check_slot_ids,
)
from helixserve.kernels._slots import slot_rows
from helixserve.kernels.triton_common import gpu_check_slot_ids, gpu_num_seqs, has_triton, use_triton

_ACTIVATIONS = ("silu", None)

if has_triton():
    from helixserve.kernels.short_conv import triton_conv


def short_conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over each sequence of a varlen batch, continuing from ``conv_state``.

    Sequences shorter than W-1 keep the older state columns they do not overwrite.
    """
    check_ndim("x", x, 2)
    T, D = x.shape
    weight = _as_2d_weight(weight, D)
    W = weight.shape[1]
    on_gpu = use_triton(x)
    if on_gpu:
        num_seqs = gpu_num_seqs("cu_seqlens", cu_seqlens, T)
    else:
        cu = check_cu_seqlens("cu_seqlens", cu_seqlens, T)
        num_seqs = cu.numel() - 1
    if conv_state is not None:
        check_shape("conv_state", conv_state, (num_seqs, D, W - 1))
    check_activation(activation, _ACTIVATIONS)
    if on_gpu:
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, T], dtype=torch.int64)
        return triton_conv.short_conv_prefill(x, weight, conv_state, cu_seqlens.to(x.device), activation)
    return _short_conv_prefill_torch(x, weight, conv_state, cu, activation)


def short_conv_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per sequence; shifts each slot's window by one column in place."""
    check_ndim("x", x, 2)
    B, D = x.shape
    weight = _as_2d_weight(weight, D)
    check_ndim("conv_pool", conv_pool, 3)
    if tuple(conv_pool.shape[1:]) != (D, weight.shape[1] - 1):
        raise ValueError(f"conv_pool must be [S, {D}, {weight.shape[1] - 1}], got {tuple(conv_pool.shape)}")
    check_activation(activation, _ACTIVATIONS)
    if use_triton(x) and weight.shape[1] >= 2 and conv_pool.stride(2) == 1:  # in place at the slots
        gpu_check_slot_ids("slot_ids", slot_ids, B, conv_pool.shape[0])
        return triton_conv.short_conv_step(x, weight, conv_pool, slot_ids, activation)
    return _short_conv_step_torch(x, weight, conv_pool, slot_ids, activation)


def _as_2d_weight(weight: torch.Tensor, num_channels: int) -> torch.Tensor:
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    check_ndim("weight", weight, 2)
    if weight.shape[0] != num_channels or weight.shape[1] < 1:
        raise ValueError(f"weight must be [{num_channels}, W] or [{num_channels}, 1, W], got {tuple(weight.shape)}")
    return weight


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def _short_conv_prefill_torch(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, cu: torch.Tensor,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, D = x.shape
    W = weight.shape[1]
    num_seqs = cu.numel() - 1
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    if conv_state is None:
        conv_state = x.new_zeros(num_seqs, D, W - 1)
    # rows [0, T) = x, rows T + n*(W-1) + m = column m of sequence n's state
    rows = torch.cat([x.float(), conv_state.float().transpose(1, 2).reshape(-1, D)])
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), cu[1:] - cu[:-1])
    local_pos = torch.arange(T) - cu[seq_ids]
    window_idx = _extended_row_index(cu, seq_ids, local_pos[:, None] + torch.arange(W) - (W - 1), W)
    y = (rows[window_idx.to(x.device)] * weight.float().t()).sum(1)

    seq_all = torch.arange(num_seqs)
    lens = cu[1:] - cu[:-1]
    state_pos = lens[:, None] - (W - 1) + torch.arange(W - 1)
    state_idx = _extended_row_index(cu, seq_all, state_pos, W)
    new_state = rows[state_idx.to(x.device)].transpose(1, 2).to(state_dtype)
    return _activate(y, activation).to(x.dtype), new_state


def _extended_row_index(
    cu: torch.Tensor, seq_ids: torch.Tensor, local_pos: torch.Tensor, W: int
) -> torch.Tensor:
    """Row in [x; states] of position local_pos (may be negative: read the state) of seq_ids."""
    T = int(cu[-1])
    from_x = cu[seq_ids, None] + local_pos
    from_state = T + seq_ids[:, None] * (W - 1) + (W - 1) + local_pos
    return torch.where(local_pos >= 0, from_x, from_state)


def _short_conv_step_torch(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slot_ids: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    check_slot_ids("slot_ids", slot_ids, x.shape[0], conv_pool.shape[0])
    states, write_back = slot_rows(conv_pool, slot_ids)
    # window [B, W, D] (taps outer): the tap sum runs over contiguous rows, not a size-W inner dim
    window = torch.cat([as_f32(states).transpose(1, 2), as_f32(x).unsqueeze(1)], dim=1)
    y = (window * as_f32(weight).t()).sum(1)
    new_states = window[:, 1:].transpose(1, 2)
    if write_back is None:
        states.copy_(new_states)
    else:
        conv_pool.index_copy_(0, write_back, new_states.to(conv_pool.dtype))
    y = _activate(y, activation)
    return y if y.dtype == x.dtype else y.to(x.dtype)
