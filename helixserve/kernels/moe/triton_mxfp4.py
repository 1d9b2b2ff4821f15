"""Grouped expert GEMM over MXFP4 weights, dequantized in registers (Triton; Hopper has no FP4 MMA).

``out[p] = a[rows[p]] @ dequant(W[e(p)]).T`` for rows ``p`` sorted by expert: ``a [M, K]`` (bf16, or
cast to it), ``W`` an :class:`~helixserve.kernels.moe.mxfp4.MXFP4Weight` ``[E, N, K]``, fp32
accumulation, ``out [P, N]`` in ``a.dtype``. Each program owns ``BLOCK_M`` sorted rows of one expert
and ``BLOCK_N`` output columns; per ``BLOCK_K`` step it loads ``[BLOCK_N, BLOCK_K/8]`` words of codes
(8 a word) and ``[BLOCK_N, BLOCK_K/32]`` scale bytes, decodes them to bf16 in registers (exact:
an e2m1 value times a power of two has 2 mantissa bits; :mod:`.mxfp4_decode`, which also says what
each decode costs: at decode sizes the decode, not the MMA, bounds the kernel) and feeds
``tl.dot``. So the weights cross HBM at ~4.25 bits each. No autotuning: one fixed tile config per
row-block size (:func:`_tiles`); ``grouped_gemm_mxfp4(..., decode=, tiles=)`` overrides both (the
H200 sweep, ``bench/mxfp4_sweep.py``). The decode the GPU path takes per row-block size is
:func:`gpu_decode`'s (the sweep's fastest: ``lut`` up to 32 rows a block, ``bf16x2`` above); under
Triton's interpreter only the pure-Triton ``fp32`` one runs (the others are inline PTX).

With ``Tiles.swap`` the kernel computes ``out^T = W a^T``: the decoded weights are the MMA's
first operand, which Hopper's wgmma takes from registers (Triton reshuffles them through shared
memory into its layout), the activations from shared memory, and the instruction's M is
``BLOCK_N``. Unswapped, M is ``BLOCK_M``: ``mma.sync`` below 64 rows, from 64 wgmma with the decoded
tile stored to shared memory (``bench/mxfp4_sass.py`` says which, per config).

At prefill sizes (many rows per expert) the MMA work per weight dominates and the in-register
decode would be paid once per 64-row block: :func:`dequantize_bf16` instead writes the stack as bf16
once per call (a streaming kernel) for the bf16 grouped GEMM; the weights still live packed.

The schedule (:func:`block_schedule`) maps every program row-block to its expert and row range on
the device, without a host read: its length is an upper bound known on the host, and blocks past
the real ones exit at once, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from helixserve.kernels.moe.mxfp4 import MXFP4_GROUP_SIZE, MXFP4Weight
from helixserve.kernels.moe.mxfp4_decode import decode_selected, word_scales
from helixserve.kernels.triton_common import batch_invariant_enabled, is_interpreting

DECODES = {"fp32": 0, "bf16x2": 1, "lut": 2}  # name -> the kernel's DECODE (see .mxfp4_decode)
# what grouped_gemm_mxfp4 runs on a GPU, by the largest row-block size it is the fastest for (H200
# sweep, bench/figures/mxfp4_sweep_h200.json: lut 2.97-3.02x bf16 at 1-8 rows per expert, 1.65x at
# 32; bf16x2 1.12x at 64, where lut was 0.98x)
GPU_DECODES = ((32, "lut"), (1 << 30, "bf16x2"))


class Tiles(NamedTuple):
    """One launch config of the grouped kernel."""

    block_n: int
    block_k: int  # a multiple of 32 (whole scale groups)
    num_warps: int
    num_stages: int
    swap: bool = False  # out^T = W a^T (the weights as the MMA's first operand: wgmma on Hopper)


@dataclass(frozen=True, slots=True)
class BlockSchedule:
    """Row blocks of ``block_m`` sorted rows, each inside one expert's group (device tensors)."""

    block_m: int
    expert: torch.Tensor  # [B] int32, -1 past the last real block
    row_begin: torch.Tensor  # [B] int32, first sorted row of the block
    row_end: torch.Tensor  # [B] int32, end of the block's expert group


def choose_block_m(num_rows: int, num_experts: int) -> int:
    """16 rows per block at decode sizes (a few rows per expert: tl.dot's minimum), up to 64 at
    prefill; batch-invariant mode: 16 always (one tile config, so one K order per row)."""
    if batch_invariant_enabled():
        return 16
    per_expert = num_rows / max(1, num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def block_schedule(sorted_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockSchedule:
    """``sorted_ids [P]``: the local expert of each sorted row (``num_experts`` = not local, last)."""
    P, E = sorted_ids.numel(), num_experts
    device = sorted_ids.device
    counts = torch.zeros(E + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, sorted_ids.to(torch.int64), torch.ones_like(sorted_ids, dtype=torch.int32))
    counts = counts[:E]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0, dtype=torch.int32)
    row_start = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    # sum_e ceil(c_e / block_m) <= (P + (non-empty experts) * (block_m - 1)) / block_m
    num_blocks = max(1, (P + min(E, P) * (block_m - 1)) // block_m)
    b = torch.arange(num_blocks, dtype=torch.int32, device=device)
    expert = torch.searchsorted(block_end, b, right=True).to(torch.int32)
    safe = expert.clamp(max=E - 1).to(torch.int64)
    first_block = block_end[safe] - blocks[safe]
    row_begin = row_start[safe] + (b - first_block) * block_m
    row_end = row_start[safe] + counts[safe]
    return BlockSchedule(block_m, torch.where(expert < E, expert, -1), row_begin, row_end)


@triton.jit
def _grouped_mxfp4_kernel(
    a_ptr, rows_ptr, wq_ptr, ws_ptr, out_ptr,
    blk_expert_ptr, blk_begin_ptr, blk_end_ptr,
    N, K, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DECODE: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(blk_expert_ptr + pid_m)
    if expert < 0:
        return
    row_begin = tl.load(blk_begin_ptr + pid_m)
    row_end = tl.load(blk_end_ptr + pid_m)
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    # rows past the block's end read its last row (in bounds, no load mask): their sums are not stored
    a_rows = tl.minimum(offs_m, row_end - 1)
    if GATHER:
        a_rows = tl.load(rows_ptr + a_rows)
    a_rows = a_rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    wq_base = wq_ptr + expert.to(tl.int64) * stride_qe + offs_n.to(tl.int64)[:, None] * stride_qn
    ws_base = ws_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    a_base = a_ptr + a_rows[:, None] * stride_am
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        # offsets as multiples of the step index: Triton then sees the scale bytes' alignment (4
        # a row at BLOCK_K 128) and copies them with cp.async, pipelined like the rest
        offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_b = i * WORDS + tl.arange(0, WORDS)
        offs_s = i * GROUPS + tl.arange(0, GROUPS)
        if EVEN_K:
            a = tl.load(a_base + offs_k[None, :])
        else:
            a = tl.load(a_base + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        if EVEN_K and EVEN_N:
            q = tl.load(wq_base + offs_b[None, :])
            s = tl.load(ws_base + offs_s[None, :])
        else:
            q = tl.load(wq_base + offs_b[None, :], mask=n_mask[:, None] & (offs_b < K // 8)[None, :], other=0)
            s = tl.load(ws_base + offs_s[None, :], mask=n_mask[:, None] & (offs_s < K // 32)[None, :], other=0)
        s = word_scales(s, GROUPS)
        q = q.to(tl.uint32, bitcast=True)
        w = decode_selected(q, s, DECODE, DOT_DTYPE)  # [BLOCK_N, BLOCK_K]
        if SWAP:
            acc = tl.dot(w, tl.trans(a.to(DOT_DTYPE)), acc)
        else:
            acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w), acc)
    if SWAP:
        out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])
    else:
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _tiles(block_m: int) -> Tiles:
    """One fixed config per row-block size (no autotune): the H200 sweep's fastest for the
    default decode at K3's expert shapes (both GEMMs)."""
    if block_m <= 16:  # decode: weight streaming; long K steps amortize the per-step scale loads
        return Tiles(64, 256, 4, 3)
    if block_m <= 32:
        return Tiles(128, 128, 4, 3)
    return Tiles(128, 64, 8, 3)


def gpu_decode(block_m: int) -> str:
    """The decode a GPU launch with ``block_m``-row blocks takes by default (:data:`GPU_DECODES`)."""
    return next(name for limit, name in GPU_DECODES if block_m <= limit)


def _check_decode(decode: str | None, block_m: int = 16) -> str:
    """``decode`` or the default (:func:`gpu_decode`; ``"fp32"``, the only one interpreted)."""
    interpreted = is_interpreting()
    decode = decode or ("fp32" if interpreted else gpu_decode(block_m))
    if decode not in DECODES or (interpreted and decode != "fp32"):
        raise ValueError(f"decode must be one of {sorted(DECODES)} ('fp32' under the interpreter), got {decode!r}")
    return decode


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    """``[E, N, K/2]`` code bytes as ``[E, N, K/8]`` little-endian uint32 words (int32 storage), a
    view where the strides allow (K is a multiple of 32, so every row holds whole words)."""
    try:
        return packed.view(torch.int32)
    except RuntimeError:  # a row start not 4-byte aligned
        return packed.contiguous().view(torch.int32)


def grouped_gemm_mxfp4(
    a: torch.Tensor, weight: MXFP4Weight, schedule: BlockSchedule, num_rows: int,
    rows: torch.Tensor | None = None, *, decode: str | None = None, tiles: Tiles | None = None,
) -> torch.Tensor:
    """``out [num_rows, N]``: sorted row ``p`` is ``a[rows[p]]`` (``rows=None``: ``a[p]``) times its
    expert's dequantized weight, transposed. Rows outside every block (experts held elsewhere) are
    left unwritten (garbage): mask them. ``decode`` (a key of :data:`DECODES`; default
    :func:`gpu_decode`, ``"fp32"`` when interpreted) and ``tiles`` (default ``_tiles(block_m)``)
    are tuning overrides: every choice computes the same values."""
    return _grouped_launch(a, weight, schedule, num_rows, rows, decode, tiles)


def _grouped_launch(
    a: torch.Tensor, weight: MXFP4Weight, schedule: BlockSchedule, num_rows: int, rows: torch.Tensor | None,
    decode: str | None, tiles: Tiles | None, warmup: bool = False,
) -> torch.Tensor:
    """:func:`grouped_gemm_mxfp4`; ``warmup``: compile only (Triton's ``warmup``, no launch), which
    takes ``meta``-device tensors of the real shapes (a sweep compiles its variants in parallel)."""
    E, N, K = weight.shape
    if a.shape[1] != K or K % MXFP4_GROUP_SIZE:
        raise ValueError(f"a must be [M, {K}] with K a multiple of {MXFP4_GROUP_SIZE}, got {tuple(a.shape)}")
    decode = _check_decode(decode, schedule.block_m)
    tiles = tiles or _tiles(schedule.block_m)
    if tiles.block_k % MXFP4_GROUP_SIZE:
        raise ValueError(f"tiles.block_k must be a multiple of {MXFP4_GROUP_SIZE}, got {tiles}")
    if a.stride(1) != 1:
        a = a.contiguous()
    wq, ws = _as_words(weight.packed), weight.scale
    if ws.stride(2) != 1:
        ws = ws.contiguous()
    out = torch.empty(num_rows, N, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    grid = (schedule.expert.numel(), triton.cdiv(N, tiles.block_n))
    args = (a, rows if rows is not None else schedule.expert, wq, ws, out,
            schedule.expert, schedule.row_begin, schedule.row_end,
            N, K, a.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), out.stride(0))
    meta = dict(
        GATHER=rows is not None, BLOCK_M=schedule.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        # Triton's interpreter multiplies bf16 operands as their raw bits: fp32 there (the same
        # values: the weights are exact in bf16, and the tests pass bf16 activations)
        DOT_DTYPE=tl.float32 if is_interpreting() else tl.bfloat16, DECODE=DECODES[decode], SWAP=tiles.swap,
        EVEN_K=K % tiles.block_k == 0, EVEN_N=N % tiles.block_n == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if warmup:
        _grouped_mxfp4_kernel.warmup(*args, grid=grid, **meta)
    else:
        _grouped_mxfp4_kernel[grid](*args, **meta)
    return out


@triton.jit
def _dequant_kernel(
    wq_ptr, ws_ptr, out_ptr, R, K, stride_qr, stride_sr, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    k0 = tl.program_id(1) * BLOCK_K
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    rows = offs_r.to(tl.int64)[:, None]
    offs_b = k0 // 8 + tl.arange(0, WORDS)
    q = tl.load(wq_ptr + rows * stride_qr + offs_b[None, :], mask=r_mask[:, None] & (offs_b < K // 8)[None, :],
                other=0).to(tl.uint32, bitcast=True)
    offs_s = k0 // 32 + tl.arange(0, GROUPS)
    s = tl.load(ws_ptr + rows * stride_sr + offs_s[None, :], mask=r_mask[:, None] & (offs_s < K // 32)[None, :],
                other=0)
    s = word_scales(s, GROUPS)
    w = decode_selected(q, s, DECODE, tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows * stride_or + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None] & (offs_k < K)[None, :])


def dequantize_bf16(weight: MXFP4Weight, *, decode: str | None = None) -> torch.Tensor:
    """The ``[E, N, K]`` stack in bf16 (contiguous), decoded as the GEMM kernel decodes it (``decode``
    as :func:`grouped_gemm_mxfp4`'s; every decode gives the same values, and this streaming kernel
    keeps ``fp32``, the one the sweep measured for it, unless told)."""
    E, N, K = weight.shape
    decode = _check_decode(decode or "fp32")
    wq, ws = (t if t.stride(0) == t.shape[1] * t.stride(1) and t.stride(2) == 1 else t.contiguous()
              for t in (weight.packed, weight.scale))
    wq = _as_words(wq)
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=wq.device)
    R = E * N
    if R == 0:
        return out
    BLOCK_R, BLOCK_K = 32, 256
    _dequant_kernel[(triton.cdiv(R, BLOCK_R), triton.cdiv(K, BLOCK_K))](
        wq, ws, out, R, K, wq.stride(1), ws.stride(1), K, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
        DECODE=DECODES[decode], num_warps=4,
    )
    return out
