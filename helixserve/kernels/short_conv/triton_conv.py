"""Triton causal depthwise short convolution (+ SiLU) over the ``[S, D, W-1]`` conv-state layout.

Same contracts as :func:`helixserve.kernels.short_conv_prefill` / :func:`~.short_conv_step`. fla's
causal-conv kernels keep a full ``[N, D, W]`` window, so these small kernels work on our layout
directly: the decode step reads and shifts each slot's window in place (no gather or scatter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2, seq_ids_of_rows

_BLOCK_D = 256


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, pool_ptr, slot_ptr, y_ptr,
    D, stride_x, stride_w, stride_ps, stride_pd, stride_y,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, SILU: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    cols = tl.arange(0, BLOCK_W)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    tile = pool_ptr + slot * stride_ps + offs[:, None] * stride_pd + cols[None, :]
    in_tile = mask[:, None] & (cols[None, :] < W - 1)
    state = tl.load(tile, mask=in_tile, other=0.0).to(tl.float32)
    shifted = tl.load(tile + 1, mask=mask[:, None] & (cols[None, :] < W - 2), other=0.0)
    taps = tl.load(w_ptr + offs[:, None] * stride_w + cols[None, :], mask=in_tile, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + offs * stride_w + (W - 1), mask=mask, other=0.0).to(tl.float32)
    y = tl.sum(state * taps, 1) + x * w_last
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + b * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    new_state = tl.where(cols[None, :] == W - 2, x[:, None].to(shifted.dtype), shifted)
    tl.store(tile, new_state.to(pool_ptr.dtype.element_ty), mask=in_tile)


def short_conv_step(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slot_ids: torch.Tensor, activation: str | None
) -> torch.Tensor:
    """Triton :func:`~helixserve.kernels.short_conv_step` (weight [D, W], pool updated in place)."""
    B, D = x.shape
    W = weight.shape[1]
    assert conv_pool.stride(2) == 1 and W >= 2
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(B, D, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    grid = (B, triton.cdiv(D, _BLOCK_D))
    _conv_step_kernel[grid](
        x, weight, conv_pool, slot_ids, y,
        D, x.stride(0), weight.stride(0), conv_pool.stride(0), conv_pool.stride(1), y.stride(0),
        W=W, BLOCK_W=max(2, next_pow2(W - 1)), BLOCK_D=_BLOCK_D, SILU=activation == "silu",
    )
    return y


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, state_ptr, seq_ptr, cu_ptr, y_ptr,
    D, stride_x, stride_w, stride_sn, stride_sd, stride_y,
    W: tl.constexpr, BLOCK_D: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    seq = tl.load(seq_ptr + t).to(tl.int64)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    local = t - start
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(W):
        p = local - (W - 1) + j
        v = tl.load(x_ptr + (start + p) * stride_x + offs, mask=mask & (p >= 0), other=0.0).to(tl.float32)
        if HAS_STATE:
            v += tl.load(state_ptr + seq * stride_sn + offs * stride_sd + (W - 1) + p,
                         mask=mask & (p < 0), other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + offs * stride_w + j, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t * stride_y + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_final_state_kernel(
    x_ptr, state_ptr, cu_ptr, new_ptr,
    D, stride_x, stride_sn, stride_sd, stride_nn, stride_nd,
    W: tl.constexpr, BLOCK_D: tl.constexpr, HAS_STATE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    for m in tl.static_range(W - 1):
        p = length - (W - 1) + m
        v = tl.load(x_ptr + (start + p) * stride_x + offs, mask=mask & (p >= 0), other=0.0).to(tl.float32)
        if HAS_STATE:
            v += tl.load(state_ptr + n * stride_sn + offs * stride_sd + (W - 1) + p,
                         mask=mask & (p < 0), other=0.0).to(tl.float32)
        tl.store(new_ptr + n * stride_nn + offs * stride_nd + m, v.to(new_ptr.dtype.element_ty), mask=mask)


def short_conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, cu_seqlens: torch.Tensor,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.short_conv_prefill` (weight [D, W], cu_seqlens on x's device)."""
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.numel() - 1
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    has_state = conv_state is not None
    if has_state and conv_state.stride(2) != 1:
        conv_state = conv_state.contiguous()
    state = conv_state if has_state else x
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    new_state = torch.empty(N, D, W - 1, dtype=conv_state.dtype if has_state else x.dtype, device=x.device)
    s_n, s_d = (conv_state.stride(0), conv_state.stride(1)) if has_state else (0, 0)
    if T > 0:
        seq_ids = seq_ids_of_rows(cu_seqlens, T)
        _conv_prefill_kernel[(T, triton.cdiv(D, _BLOCK_D))](
            x, weight, state, seq_ids, cu_seqlens, y,
            D, x.stride(0), weight.stride(0), s_n, s_d, y.stride(0),
            W=W, BLOCK_D=_BLOCK_D, HAS_STATE=has_state, SILU=activation == "silu",
        )
    if N > 0 and W > 1:
        _conv_final_state_kernel[(N, triton.cdiv(D, _BLOCK_D))](
            x, state, cu_seqlens, new_state,
            D, x.stride(0), s_n, s_d, new_state.stride(0), new_state.stride(1),
            W=W, BLOCK_D=_BLOCK_D, HAS_STATE=has_state,
        )
    return y, new_state
