"""Grouped expert GEMM over MXFP4 weights, dequantized in registers (Triton; Hopper has no FP4 MMA).

``out[p] = a[rows[p]] @ dequant(W[e(p)]).T`` for rows ``p`` sorted by expert: ``a [M, K]`` (bf16, or
cast to it), ``W`` an :class:`~helixserve.kernels.moe.mxfp4.MXFP4Weight` ``[E, N, K]``, fp32
accumulation, ``out [P, N]`` in ``a.dtype``. Each program owns ``BLOCK_M`` sorted rows of one expert
and ``BLOCK_N`` output columns; per ``BLOCK_K`` step it loads ``[BLOCK_N, BLOCK_K/8]`` words of codes
(8 a word) and ``[BLOCK_N, BLOCK_K/32]`` scale bytes, turns the e2m1 codes into fp32 through their
fp16 bits (exact; about 8 SASS instructions a weight on sm_90, all told: at decode sizes this
decode, not the MMA, bounds the kernel), applies the power-of-two scales, rounds to bf16 (exact: an
e2m1 value times a power of two has 2 mantissa bits) and feeds ``tl.dot``. So the weights cross HBM
at ~4.25 bits each. No autotuning: one fixed tile config per row-block size (:func:`_tiles`).

At prefill sizes (many rows per expert) the MMA work per weight dominates and the in-register
decode would be paid once per 64-row block: :func:`dequantize_bf16` instead writes the stack as bf16
once per call (a streaming kernel) for the bf16 grouped GEMM; the weights still live packed.

The schedule (:func:`block_schedule`) maps every program row-block to its expert and row range on
the device, without a host read: its length is an upper bound known on the host, and blocks past
the real ones exit at once, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from helixserve.kernels.moe.mxfp4 import MXFP4_GROUP_SIZE, MXFP4Weight
from helixserve.kernels.triton_common import is_interpreting


@dataclass(frozen=True, slots=True)
class BlockSchedule:
    """Row blocks of ``block_m`` sorted rows, each inside one expert's group (device tensors)."""

    block_m: int
    expert: torch.Tensor  # [B] int32, -1 past the last real block
    row_begin: torch.Tensor  # [B] int32, first sorted row of the block
    row_end: torch.Tensor  # [B] int32, end of the block's expert group


def choose_block_m(num_rows: int, num_experts: int) -> int:
    """16 rows per block at decode sizes (a few rows per expert: tl.dot's minimum), up to 64 at prefill."""
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
def _halves_to_f32(h):
    """Two fp16 bit patterns in a uint32 -> (low half, high half) as fp32 (exact, subnormals kept)."""
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _decode_words(q):
    """``q [R, C]`` uint32 words of packed codes (4 bytes, 8 e2m1 codes, low nibble first) ->
    ``[R, 8 * C]`` fp32 values times 2^-14, in order, exactly.

    Each code's 3 magnitude bits go under fp16's exponent/mantissa boundary and its sign on fp16's
    sign bit: an fp16 of value e2m1 * 2^-14 (0.5 lands on a subnormal, which the fp16 -> fp32
    conversion keeps). Two codes of the same nibble position in bytes 0 and 2 (or 1 and 3) move
    with one mask-and-shift, so a word of 8 codes costs 4 such pairs, not 8 extractions."""
    a_lo, a_hi = _halves_to_f32(((q & 0x00070007) << 9) | ((q & 0x00080008) << 12))  # codes 0, 4
    b_lo, b_hi = _halves_to_f32(((q & 0x00700070) << 5) | ((q & 0x00800080) << 8))  # codes 1, 5
    c_lo, c_hi = _halves_to_f32(((q & 0x07000700) << 1) | ((q & 0x08000800) << 4))  # codes 2, 6
    d_lo, d_hi = _halves_to_f32(((q & 0x70007000) >> 3) | (q & 0x80008000))  # codes 3, 7
    # each join appends the minor-most dim, so the first join is the major one: [.., i, j, k] is
    # code 4i + 2j + k with i the half (lo: 0..3), j bytes 1/3 (codes 2, 3, 6, 7), k high nibbles
    w = tl.join(tl.join(tl.join(a_lo, a_hi), tl.join(c_lo, c_hi)), tl.join(tl.join(b_lo, b_hi), tl.join(d_lo, d_hi)))
    return tl.reshape(w, (q.shape[0], q.shape[1] * 8))


@triton.jit
def _grouped_mxfp4_kernel(
    a_ptr, rows_ptr, wq_ptr, ws_ptr, out_ptr,
    blk_expert_ptr, blk_begin_ptr, blk_end_ptr,
    N, K, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
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
    if GATHER:
        a_rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    wq_base = wq_ptr + expert.to(tl.int64) * stride_qe + offs_n.to(tl.int64)[:, None] * stride_qn
    ws_base = ws_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    a_base = a_ptr + a_rows[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        offs_b = k0 // 8 + tl.arange(0, WORDS)
        q = tl.load(wq_base + offs_b[None, :], mask=n_mask[:, None] & (offs_b < K // 8)[None, :], other=0)
        offs_s = k0 // 32 + tl.arange(0, GROUPS)
        s = tl.load(ws_base + offs_s[None, :], mask=n_mask[:, None] & (offs_s < K // 32)[None, :], other=0)
        w = _decode_words(q.to(tl.uint32, bitcast=True))  # [BLOCK_N, BLOCK_K]
        # 2^(s - 127) * 2^14 (undoing the decode's 2^-14); byte 0 reads as 0, bytes > 240 overflow
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0
        w = tl.reshape(tl.reshape(w, (BLOCK_N, GROUPS, 32)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _tiles(block_m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): one fixed config per row-block size (no autotune)."""
    if block_m <= 16:  # decode: weight streaming; many column blocks keep every SM busy
        return 64, 128, 4, 4
    if block_m <= 32:
        return 64, 128, 4, 3
    return 128, 64, 8, 3


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    """``[E, N, K/2]`` code bytes as ``[E, N, K/8]`` little-endian uint32 words (int32 storage), a
    view where the strides allow (K is a multiple of 32, so every row holds whole words)."""
    try:
        return packed.view(torch.int32)
    except RuntimeError:  # a row start not 4-byte aligned
        return packed.contiguous().view(torch.int32)


def grouped_gemm_mxfp4(
    a: torch.Tensor, weight: MXFP4Weight, schedule: BlockSchedule, num_rows: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [num_rows, N]``: sorted row ``p`` is ``a[rows[p]]`` (``rows=None``: ``a[p]``) times its
    expert's dequantized weight, transposed. Rows outside every block (experts held elsewhere) are
    left unwritten (garbage): mask them."""
    E, N, K = weight.shape
    if a.shape[1] != K or K % MXFP4_GROUP_SIZE:
        raise ValueError(f"a must be [M, {K}] with K a multiple of {MXFP4_GROUP_SIZE}, got {tuple(a.shape)}")
    if a.stride(1) != 1:
        a = a.contiguous()
    wq, ws = _as_words(weight.packed), weight.scale
    if ws.stride(2) != 1:
        ws = ws.contiguous()
    out = torch.empty(num_rows, N, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    BLOCK_N, BLOCK_K, num_warps, num_stages = _tiles(schedule.block_m)
    grid = (schedule.expert.numel(), triton.cdiv(N, BLOCK_N))
    _grouped_mxfp4_kernel[grid](
        a, rows if rows is not None else schedule.expert, wq, ws, out,
        schedule.expert, schedule.row_begin, schedule.row_end,
        N, K, a.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
        GATHER=rows is not None, BLOCK_M=schedule.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        # Triton's interpreter multiplies bf16 operands as their raw bits: fp32 there (the same
        # values: the weights are exact in bf16, and the tests pass bf16 activations)
        DOT_DTYPE=tl.float32 if is_interpreting() else tl.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


@triton.jit
def _dequant_kernel(
    wq_ptr, ws_ptr, out_ptr, R, K, stride_qr, stride_sr, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
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
    w = _decode_words(q)
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0
    w = tl.reshape(tl.reshape(w, (BLOCK_R, GROUPS, 32)) * scale[:, :, None], (BLOCK_R, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows * stride_or + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None] & (offs_k < K)[None, :])


def dequantize_bf16(weight: MXFP4Weight) -> torch.Tensor:
    """The ``[E, N, K]`` stack in bf16 (contiguous), decoded as the GEMM kernel decodes it."""
    E, N, K = weight.shape
    wq, ws = (t if t.stride(0) == t.shape[1] * t.stride(1) and t.stride(2) == 1 else t.contiguous()
              for t in (weight.packed, weight.scale))
    wq = _as_words(wq)
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=wq.device)
    R = E * N
    if R == 0:
        return out
    BLOCK_R, BLOCK_K = 32, 256
    _dequant_kernel[(triton.cdiv(R, BLOCK_R), triton.cdiv(K, BLOCK_K))](
        wq, ws, out, R, K, wq.stride(1), ws.stride(1), K, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, num_warps=4,
    )
    return out
