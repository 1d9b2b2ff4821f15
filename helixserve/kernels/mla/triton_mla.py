"""Triton kernels for MLA over the paged latent cache: write, attention partials (o, lse), LSE combine.

Same contracts and shapes as :mod:`helixserve.kernels.mla.paged` and :mod:`~.combine`; no host
syncs (sequence ids of rows come from ``cu_seqlens`` on the device), so a decode step can be
captured in a CUDA graph.

Attention: one program per (query row, KV split, block of heads, part of the value columns). All heads of a query share the
latent keys (absorbed MLA is MQA-like), so a program scores ``[BLOCK_H, BLOCK_N]`` tiles with two
dots (latent part ``[:v_dim]`` and rope part ``[v_dim:]``) and accumulates ``p @ keys[:, :v_dim]``
with an online softmax. Keys are addressed one token at a time through the block table, so any
block size works and ``-1`` entries (blocks held on another helix rank) are masked out. When the
block size is a multiple of the key tile (``PAGE_TILES``), a tile lies inside one page: one table
read per tile and ``BLOCK_N`` contiguous key rows, which the compiler loads as one wide, coalesced
stream instead of ``BLOCK_N`` gathered rows. Decode
batches split each sequence's keys over ``num_splits`` programs (flash-decoding) and merge the
splits with the LSE-combine kernel, which is also the helix combine. ``dv_parts`` > 1 splits the
value columns (the accumulator) over that many programs: each scores the whole key tile again but
keeps a smaller accumulator, and the programs of one (row, split) are launched side by side, so the
repeated key reads come from L2, not HBM.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import batch_invariant_enabled, is_interpreting, next_pow2, seq_ids_of_rows

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# programs the attention grid should reach before KV splitting stops paying (about 5 waves on H200;
# bench/kernels.py --mla-sweep on one H200: B 64 x kv 4k x H 16 fastest at 10 splits)
_TARGET_PROGRAMS = 640
_MAX_SPLITS = 16


# integer arguments that follow the batch (rows, table width, split count) are not specialized
# (Triton compiles a variant per "== 1" and "% 16 == 0" of each int argument): a prompt length
# or batch first seen after warm-up must not compile a kernel
@triton.jit(do_not_specialize=["stride_table"])
def _write_kv_kernel(
    kv_ptr, table_ptr, seq_ptr, pos_ptr, latent_ptr,
    stride_table, stride_latent, BS, D,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    phys = tl.load(table_ptr + seq * stride_table + pos // BS).to(tl.int64)
    if phys >= 0:
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        vals = tl.load(latent_ptr + row * stride_latent + offs, mask=mask)
        dst = kv_ptr + (phys * BS + pos % BS) * D + offs
        tl.store(dst, vals.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
    positions: torch.Tensor, latent: torch.Tensor,
) -> None:
    """Triton :func:`~helixserve.kernels.mla_write_kv` (kv_cache contiguous)."""
    T, D = latent.shape
    if T == 0:
        return
    assert kv_cache.is_contiguous() and latent.stride(1) == 1
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_ids = seq_ids_of_rows(cu_seqlens, T)
    _write_kv_kernel[(T,)](
        kv_cache, tables, seq_ids, positions, latent,
        tables.stride(0), latent.stride(0), kv_cache.shape[1], D,
        BLOCK_D=next_pow2(D),
    )


@triton.jit(do_not_specialize=["stride_table", "stride_os", "stride_ls", "NUM_SPLITS"])
def _paged_attention_kernel(
    q_ptr, kv_ptr, table_ptr, seq_ptr, pos_ptr, kv_len_ptr, o_ptr, lse_ptr,
    stride_qt, stride_qh, stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    H, BS, sm_scale_log2,
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS, HEAD_PROGRAMS,
    IEEE: tl.constexpr, PAGE_TILES: tl.constexpr, DV_PARTS: tl.constexpr,
):
    # 1-D grid, fastest index first: (head block, value part), then split, then row, so the
    # programs that read the same keys run side by side and share them through L2
    pid = tl.program_id(0)
    head_part = pid % HEAD_PROGRAMS
    rest = pid // HEAD_PROGRAMS
    split = rest % NUM_SPLITS
    row = rest // NUM_SPLITS
    head_block = head_part // DV_PARTS
    part = head_part % DV_PARTS
    D: tl.constexpr = DV + DR
    BLOCK_DVP: tl.constexpr = BLOCK_DV // DV_PARTS
    seq = tl.load(seq_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + seq).to(tl.int64)
    num_keys = tl.maximum(tl.minimum(kv_len, pos + 1), 0)
    keys_per_split = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, num_keys)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dv = offs_dv < DV
    mask_dr = offs_dr < DR
    q_row = q_ptr + row * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_dv[None, :], mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    q_rope = tl.load(q_row + DV + offs_dr[None, :], mask=mask_h[:, None] & mask_dr[None, :], other=0.0)

    offs_dvp = part * BLOCK_DVP + tl.arange(0, BLOCK_DVP)  # this program's output columns
    mask_dvp = offs_dvp < DV
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DVP], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        if PAGE_TILES:
            # the tile lies inside one page: one table read, BLOCK_N contiguous key rows
            page = tl.load(table_ptr + seq * stride_table + start // BS).to(tl.int64)
            valid = in_range & (page >= 0)
            key_row = kv_ptr + (page * BS + start % BS) * D + tl.arange(0, BLOCK_N) * D
        else:
            phys = tl.load(table_ptr + seq * stride_table + offs_n // BS, mask=in_range, other=-1).to(tl.int64)
            valid = in_range & (phys >= 0)
            key_row = kv_ptr + (phys * BS + offs_n % BS) * D
        k_lat = tl.load(key_row[:, None] + offs_dv[None, :], mask=valid[:, None] & mask_dv[None, :], other=0.0)
        k_rope = tl.load(key_row[:, None] + DV + offs_dr[None, :], mask=valid[:, None] & mask_dr[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(k_lat))
            s += tl.dot(q_rope, tl.trans(k_rope))
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DV_PARTS == 1:
            vals = k_lat
        else:  # this part's columns of the tile just read (an L1 hit)
            vals = tl.load(key_row[:, None] + offs_dvp[None, :], mask=valid[:, None] & mask_dvp[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
        m_i = m_new

    has_key = l_i > 0
    o = tl.where(has_key[:, None], acc / tl.where(has_key, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = o_ptr + split * stride_os + row * stride_ot + offs_h[:, None] * stride_oh + offs_dvp[None, :]
    tl.store(o_row, o.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_dvp[None, :])
    if part == 0:
        tl.store(lse_ptr + split * stride_ls + row * stride_lt + offs_h, lse, mask=mask_h)


def choose_num_splits(num_rows: int, num_head_programs: int) -> int:
    """KV splits per (row, head block, value part): enough programs to fill the GPU, at most 16;
    batch-invariant mode: always the most (a row's merge order then ignores the batch)."""
    if batch_invariant_enabled():
        return _MAX_SPLITS
    programs = max(1, num_rows * num_head_programs)
    return max(1, min(_MAX_SPLITS, math.ceil(_TARGET_PROGRAMS / programs)))


def _block_h(num_heads: int) -> int:
    """Heads per program: 16 or 32 (a [64, 512] fp32 accumulator spills; the H200 sweep at H = 64
    ran 32-head blocks 1.3x faster than 64)."""
    return min(32, max(16, next_pow2(num_heads)))


def _tile_defaults(is_fp32: bool, page: int, acc_elems: int) -> tuple[int, int, int]:
    """(block_n, num_stages, num_warps) for a page size. bf16 tiles are whole pages where the page
    allows (one table read, contiguous rows); the H200 runs (bench/figures/kernels_h200.md) chose
    64 x 2 stages on 64-token pages (57-86 % of copy bandwidth) and 16 x 4 stages on 16-token pages,
    with 2 warps for a 16-head block (54-79 %, against 27-38 % for 32-key gathered tiles)."""
    warps = 8 if acc_elems > 16 * 1024 else 4
    if is_fp32:
        return 16, 1, warps
    if page % 64 == 0:
        return 64, 2, warps
    if page % 32 == 0:
        return 32, 3, warps
    if page % 16 == 0:
        return 16, 4, 2 if acc_elems <= 16 * 512 else warps
    return 32, 3, warps  # rows gathered one by one through the table


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    q_positions: torch.Tensor, kv_lens: torch.Tensor, scale: float, v_dim: int,
    *, num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, block_h: int | None = None, dv_parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.mla_paged_attention`; the keyword tuning knobs default to
    a heuristic (the bench sweeps them)."""
    T, H, Dqk = q.shape
    device = q.device
    if q.stride(2) != 1:
        q = q.contiguous()
    assert kv_cache.is_contiguous()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    BLOCK_H = block_h or _block_h(H)
    BLOCK_DV = next_pow2(v_dim)
    if dv_parts is None:
        dv_parts = 1
    if BLOCK_DV % dv_parts:
        raise ValueError(f"dv_parts={dv_parts} must divide the padded value width {BLOCK_DV}")
    head_programs = triton.cdiv(H, BLOCK_H) * dv_parts
    if num_splits is None:
        num_splits = choose_num_splits(T, head_programs)
    is_fp32 = q.dtype == torch.float32 or kv_cache.dtype == torch.float32
    tile_n, stages, warps = _tile_defaults(is_fp32, kv_cache.shape[1], BLOCK_H * BLOCK_DV // dv_parts)
    block_n = block_n or tile_n
    num_warps = num_warps or warps
    num_stages = num_stages or stages
    if is_interpreting():
        num_stages = 1
    lse_parts = torch.empty(num_splits, T, H, dtype=torch.float32, device=device)
    if num_splits == 1:
        o_parts = torch.empty(1, T, H, v_dim, dtype=q.dtype, device=device)
    else:
        o_parts = torch.empty(num_splits, T, H, v_dim, dtype=torch.float32, device=device)
    if T == 0:
        return o_parts[0], lse_parts[0]
    seq_ids = seq_ids_of_rows(cu_seqlens_q, T)
    grid = (T * num_splits * head_programs,)
    _paged_attention_kernel[grid](
        q, kv_cache, tables, seq_ids, q_positions, kv_lens, o_parts, lse_parts,
        q.stride(0), q.stride(1), tables.stride(0),
        o_parts.stride(0), o_parts.stride(1), o_parts.stride(2), lse_parts.stride(0), lse_parts.stride(1),
        H, kv_cache.shape[1], scale * _LOG2E,
        DV=v_dim, DR=Dqk - v_dim, BLOCK_DV=BLOCK_DV, BLOCK_DR=max(16, next_pow2(Dqk - v_dim)),
        BLOCK_H=BLOCK_H, BLOCK_N=block_n, NUM_SPLITS=num_splits, HEAD_PROGRAMS=head_programs, IEEE=is_fp32,
        PAGE_TILES=kv_cache.shape[1] % block_n == 0, DV_PARTS=dv_parts,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits == 1:
        return o_parts[0], lse_parts[0]
    return lse_combine(o_parts, lse_parts, out_dtype=q.dtype)


@triton.jit(do_not_specialize=["P", "stride_op", "stride_lp"])
def _lse_combine_kernel(
    o_parts_ptr, lse_parts_ptr, o_ptr, lse_ptr,
    P, H, D, stride_op, stride_ot, stride_oh, stride_lp, stride_lt, stride_out_t, stride_out_h,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    t = row // H
    h = row % H
    d_block = tl.program_id(1)
    offs = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    m = tl.full([], float("-inf"), dtype=tl.float32)
    for p in range(P):
        m = tl.maximum(m, tl.load(lse_parts_ptr + p * stride_lp + t * stride_lt + h).to(tl.float32))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p in range(P):
        w = tl.exp(tl.load(lse_parts_ptr + p * stride_lp + t * stride_lt + h).to(tl.float32) - m_safe)
        vals = tl.load(o_parts_ptr + p * stride_op + t * stride_ot + h * stride_oh + offs, mask=mask,
                       other=0.0).to(tl.float32)
        acc += tl.where(w > 0, vals * w, 0.0)
        denom += w
    has_any = denom > 0
    o = tl.where(has_any, acc / tl.where(has_any, denom, 1.0), 0.0)
    tl.store(o_ptr + t * stride_out_t + h * stride_out_h + offs, o.to(o_ptr.dtype.element_ty), mask=mask)
    if d_block == 0:
        lse = tl.where(has_any, m_safe + tl.log(tl.where(has_any, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * H + h, lse)


def lse_combine(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.lse_combine` (o_parts may be strided; last dim contiguous)."""
    P, T, H, D = o_parts.shape
    if o_parts.stride(3) != 1:
        o_parts = o_parts.contiguous()
    if lse_parts.stride(2) != 1:
        lse_parts = lse_parts.contiguous()
    o = torch.empty(T, H, D, dtype=out_dtype or o_parts.dtype, device=o_parts.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=o_parts.device)
    if T * H == 0:
        return o, lse
    BLOCK_D = min(1024, next_pow2(D))
    grid = (T * H, triton.cdiv(D, BLOCK_D))
    _lse_combine_kernel[grid](
        o_parts, lse_parts, o, lse,
        P, H, D, o_parts.stride(0), o_parts.stride(1), o_parts.stride(2),
        lse_parts.stride(0), lse_parts.stride(1), o.stride(0), o.stride(1),
        BLOCK_D=BLOCK_D,
    )
    return o, lse
