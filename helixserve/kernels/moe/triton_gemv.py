"""The routed-expert sum of a few (token, k) pairs as matrix-vector kernels (decode batches).

At decode sizes each selected expert meets one or two rows, so the grouped GEMM's work is a
matrix-vector product per pair, and the sort, the gathered copy, the group bookkeeping and the
separate activation and combine kernels around it cost more than the products. Here, three
launches:

gate_up: x [T, D], topk_ids [T, k], w13 [E, 2I, D] -> act [P, I] (P = T k, pairs in (token, k)
    order): per pair, its token's row times its expert's gate and up rows, each rounded to x's dtype
    as the grouped GEMM stores them, the gated activation in fp32, stored in x's dtype; zeros for a
    pair of an expert held elsewhere (its weights are not read).
down: act [P, I], w2 [E, D, I] -> y [P, D] fp32: per pair, ``w2[e] act[p]`` rounded to x's dtype as
    the grouped GEMM stores it; zeros for a pair of an expert held elsewhere.
sum: y, topk_weights [T, k] -> [T, D]: per token, ``sum_j w[t, j] * y[t k + j]`` in order
    j = 0, 1, ... in fp32, stored in x's dtype: the grouped path's combine kernel
    (:func:`~helixserve.kernels.moe.triton_pairs.combine_pairs`, rows in pair order).

No atomics and no host reads: a row's result depends on its own pairs only (the same on every run
and whatever else is batched), and the launches capture in a CUDA graph. That holds although the
tile's width ``BLOCK_N`` follows the batch: each program keeps one fp32 partial sum per column of
its K tile and adds them up at the end in a fixed tree (``_row_sums``), so a product's additions
come in one order at every width (a decode step, a padded graph replay and a verify step agree). Each program reads a
``[BLOCK_N, D]`` or ``[BLOCK_N, I]`` slice of one pair's expert; ``BLOCK_N`` shrinks with the batch
so that a batch of one still spreads over every SM (on an H200 a token's 8 experts of Kimi-Linear-48B
stream at 2.8 TB/s, about twice the grouped path's rate; splitting the down projection per pair and
summing in a third launch measured faster than one program per token looping over its pairs).
Strides are taken as given, so row-major and column-major stacks both work. No maintained library ships this for ``torch``'s stack layout
with Kimi's activations (vLLM's and SGLang's fused-MoE kernels live inside their engines).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.moe import triton_pairs
from helixserve.kernels.moe.triton_act import _ACTIVATION_IDS, _tanh
from helixserve.kernels.triton_common import next_pow2

_BLOCK_K = 128  # _row_sums' tree is written for this width
_TARGET_PROGRAMS = 2048  # about 16 programs per SM of an H200 (measured best of 512 / 2048)
_NUM_WARPS = 8


def block_n(rows: int, width: int) -> int:
    """Output columns per program: ``rows * width / BLOCK_N`` programs near ``_TARGET_PROGRAMS``."""
    return max(8, min(64, next_pow2(max(1, rows * width // _TARGET_PROGRAMS))))


@triton.jit
def _halve(a, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """``a [BLOCK_N, WIDTH]`` -> ``[BLOCK_N, WIDTH / 2]``: each even column plus the column after it."""
    even, odd = tl.split(tl.reshape(a, (BLOCK_N, WIDTH // 2, 2)))
    return even + odd


@triton.jit
def _row_sums(a, BLOCK_N: tl.constexpr):
    """``a [BLOCK_N, 128]`` -> its row sums as a fixed tree of adjacent pairs: the same additions in
    the same order whatever ``BLOCK_N`` (``tl.sum``'s order follows the register layout, which
    changes with the tile's shape)."""
    a = _halve(a, BLOCK_N, 128)
    a = _halve(a, BLOCK_N, 64)
    a = _halve(a, BLOCK_N, 32)
    a = _halve(a, BLOCK_N, 16)
    a = _halve(a, BLOCK_N, 8)
    a = _halve(a, BLOCK_N, 4)
    a = _halve(a, BLOCK_N, 2)
    return tl.reshape(a, (BLOCK_N,))


@triton.jit
def _activate(gate, up, situ_beta, situ_linear_beta, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # situ
        soft_gate = situ_beta * _tanh(gate / situ_beta) * tl.sigmoid(gate)
        return soft_gate * (situ_linear_beta * _tanh(up / situ_linear_beta))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit(do_not_specialize=["stride_x"])
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, act_ptr, D, I, E, expert_offset, stride_x, stride_we, stride_wn, stride_wk,
    situ_beta, situ_linear_beta, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    local = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
    is_local = (local >= 0) & (local < E)
    expert = tl.where(is_local, local, 0)
    token = pair // TOP_K
    gate_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # per column of the K tile: summed at the end
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        x = tl.load(x_ptr + token * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        both = (mask_n[:, None] & mask_k[None, :]) & is_local
        w_gate = tl.load(gate_rows + offs_k[None, :] * stride_wk, mask=both, other=0.0).to(tl.float32)
        w_up = tl.load(up_rows + offs_k[None, :] * stride_wk, mask=both, other=0.0).to(tl.float32)
        acc_gate += w_gate * x[None, :]
        acc_up += w_up * x[None, :]
    # the grouped GEMM stores gate and up in the activations' dtype before the activation reads them
    gate = _row_sums(acc_gate, BLOCK_N).to(act_ptr.dtype.element_ty).to(tl.float32)
    up = _row_sums(acc_up, BLOCK_N).to(act_ptr.dtype.element_ty).to(tl.float32)
    out = tl.where(is_local, _activate(gate, up, situ_beta, situ_linear_beta, ACTIVATION), 0.0)
    tl.store(act_ptr + pair * I + offs_n, out.to(act_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_pairs_kernel(
    act_ptr, ids_ptr, w_ptr, y_ptr, D, I, E, expert_offset, stride_we, stride_wn, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    local = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
    is_local = (local >= 0) & (local < E)
    rows = w_ptr + tl.where(is_local, local, 0) * stride_we + offs_n[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < I
        a = tl.load(act_ptr + pair * I + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :] * stride_wk, mask=(mask_n[:, None] & mask_k[None, :]) & is_local,
                    other=0.0).to(tl.float32)
        acc += w * a[None, :]
    acc = _row_sums(acc, BLOCK_N)
    # rounded as the grouped GEMM stores it; a pair of an expert held elsewhere read no weight: 0
    tl.store(y_ptr + pair * D + offs_n, acc.to(act_ptr.dtype.element_ty).to(tl.float32), mask=mask_n)


def pair_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    expert_offset: int, activation: str, situ_beta: float, situ_linear_beta: float,
) -> torch.Tensor:
    """``moe_experts`` by the module docstring's three launches -> ``[T, D]`` in x's dtype."""
    T, D = x.shape
    E, two_I, _ = w13.shape
    I = two_I // 2
    top_k = topk_ids.shape[1]
    P = T * top_k
    if T == 0:
        return torch.empty(0, D, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1)
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    n_up = block_n(P, I)
    _gate_up_kernel[(P, triton.cdiv(I, n_up))](
        x, ids, w13, act, D, I, E, int(expert_offset), x.stride(0), *w13.stride(), float(situ_beta),
        float(situ_linear_beta), TOP_K=top_k, ACTIVATION=_ACTIVATION_IDS[activation], BLOCK_N=n_up,
        BLOCK_K=_BLOCK_K, num_warps=_NUM_WARPS,
    )
    y = torch.empty(P, D, dtype=torch.float32, device=x.device)
    n_down = block_n(P, D)
    _down_pairs_kernel[(P, triton.cdiv(D, n_down))](
        act, ids, w2, y, D, I, E, int(expert_offset), *w2.stride(), BLOCK_N=n_down, BLOCK_K=_BLOCK_K,
        num_warps=_NUM_WARPS,
    )
    # the grouped path's weighted sum, its rows already in pair order
    return triton_pairs.combine_pairs(y, None, topk_ids, topk_weights, E, expert_offset, x.dtype)
