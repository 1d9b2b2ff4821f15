"""MLA (absorbed form) over a paged latent cache, with helix partial outputs.

Shapes (Dqk = kv_lora_rank + rope_dim, 576 for Kimi; v_dim = kv_lora_rank, 512):
    kv_cache      [NB, BS, Dqk]   physical blocks of BS tokens
    block_tables  [B, MB] int     global logical block -> physical block; -1 = not held on this rank
    write:     cu_seqlens [B+1], positions [T], latent [T, Dqk]
    attention: q [T, H, Dqk], cu_seqlens_q [B+1], q_positions [T], kv_lens [B]
               -> o [T, H, v_dim] in q.dtype, lse [T, H] float32
Key j of sequence i is kv_cache[block_tables[i, j // BS], j % BS]; its value is key[:v_dim].
Query at position p sees key j iff j <= p and j < kv_lens[i] and the block is held locally.
A query seeing no local key returns o = 0, lse = -inf (combine with :func:`lse_combine`).

Attention backends: decode calls (``is_decode=True``) take DeepSeek's FlashMLA where it is built and
fits (:mod:`~helixserve.kernels.mla.flashmla`: CUDA sm90, bf16, 576 / 512 dims, 64-token pages;
``HELIXSERVE_MLA_BACKEND``); other CUDA calls take the Triton kernel (:mod:`.triton_mla`), and the rest
(CPU, ``HELIXSERVE_KERNELS=reference``, value checks on) the PyTorch reference below.
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import check_cu_seqlens, check_integer, check_ndim, check_shape
from helixserve.kernels._host import host_list
from helixserve.kernels.mla import flashmla
from helixserve.kernels.triton_common import (batch_invariant_enabled, fast_kernels_enabled, gpu_num_seqs, has_triton,
                                              use_triton, value_checks_enabled)

if has_triton():
    from helixserve.kernels.mla import triton_mla

# keys processed per online-softmax step; bounds the [Tq, H, keys] score tile
_KEYS_PER_STEP = 2048
# a batch of one query per sequence attends in one shot when it gathers at most this many keys
_SINGLE_QUERY_BATCH_KEYS = 16 * _KEYS_PER_STEP
# cache writes of at most this many rows (decode steps) find their rows on the host
_HOST_WRITE_ROWS = 64


def mla_write_kv(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    latent: torch.Tensor,
) -> None:
    """Store ``latent`` rows at their positions; rows whose block entry is -1 are skipped."""
    check_ndim("kv_cache", kv_cache, 3)
    NB, BS, Dqk = kv_cache.shape
    check_ndim("block_tables", block_tables, 2)
    check_integer("block_tables", block_tables)
    check_ndim("latent", latent, 2)
    T = latent.shape[0]
    check_shape("latent", latent, (T, Dqk))
    check_shape("positions", positions, (T,))
    check_integer("positions", positions)
    if use_triton(kv_cache) and kv_cache.is_contiguous() and not value_checks_enabled():
        if gpu_num_seqs("cu_seqlens", cu_seqlens, T) != block_tables.shape[0]:
            raise ValueError(f"cu_seqlens has {cu_seqlens.numel() - 1} sequences, block_tables {block_tables.shape[0]}")
        triton_mla.write_kv(kv_cache, block_tables, cu_seqlens, positions, latent)
        return
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, T)
    if cu.numel() - 1 != block_tables.shape[0]:
        raise ValueError(f"cu_seqlens has {cu.numel() - 1} sequences, block_tables {block_tables.shape[0]}")
    _write_kv_torch(kv_cache, block_tables, cu, positions, latent)


def _write_kv_torch(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    latent: torch.Tensor,
) -> None:
    NB, BS, Dqk = kv_cache.shape
    device = kv_cache.device
    if latent.shape[0] == 0:
        return
    if latent.shape[0] <= _HOST_WRITE_ROWS:
        _write_few_rows(kv_cache, block_tables, cu, positions, latent)
        return
    seq_ids = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1]).to(device)
    positions = positions.to(device, torch.int64)
    logical = positions // BS
    if int(positions.min()) < 0 or int(logical.max()) >= block_tables.shape[1]:
        raise ValueError(
            f"positions must lie in [0, {block_tables.shape[1] * BS}), got "
            f"min {int(positions.min())} max {int(positions.max())}"
        )
    physical = block_tables.to(device, torch.int64)[seq_ids, logical]
    if int(physical.max()) >= NB:
        raise ValueError(f"block_tables entries must be < {NB} (num blocks), got {int(physical.max())}")
    is_local = physical >= 0
    flat_rows = (physical * BS + positions % BS)[is_local]
    kv_cache.view(NB * BS, Dqk)[flat_rows] = latent[is_local].to(kv_cache.dtype)


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    q_positions: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    is_decode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each query over its sequence's locally held keys (partial for helix).

    ``is_decode``: the caller's promise (not checked: that would read the tensors on the host) that
    there is one query per sequence (``cu_seqlens_q == arange(B + 1)``) at ``q_positions ==
    kv_lens - 1``; it lets a decode-only backend (FlashMLA) take the call."""
    flashmla.require_if_forced(q.device)
    check_ndim("q", q, 3)
    T, H, Dqk = q.shape
    check_ndim("kv_cache", kv_cache, 3)
    if kv_cache.shape[2] != Dqk:
        raise ValueError(f"kv_cache last dim must equal q's {Dqk}, got {tuple(kv_cache.shape)}")
    if not 0 < v_dim <= Dqk:
        raise ValueError(f"v_dim must lie in (0, {Dqk}], got {v_dim}")
    check_ndim("block_tables", block_tables, 2)
    check_integer("block_tables", block_tables)
    is_fast = q.is_cuda and _fast_path(kv_cache)  # GPU kernels: no host reads
    if is_fast:
        B = gpu_num_seqs("cu_seqlens_q", cu_seqlens_q, T)
    else:
        cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T)
        B = cu.numel() - 1
    if block_tables.shape[0] != B:
        raise ValueError(f"block_tables must have {B} rows (sequences), got {tuple(block_tables.shape)}")
    check_shape("q_positions", q_positions, (T,))
    check_integer("q_positions", q_positions)
    check_shape("kv_lens", kv_lens, (B,))
    check_integer("kv_lens", kv_lens)
    if is_decode and T != B:
        raise ValueError(f"is_decode: q has {T} rows for {B} sequences (one query per sequence expected)")
    if is_decode and _fast_path(kv_cache) and not batch_invariant_enabled() and flashmla.skip_reason(q, kv_cache, block_tables, kv_lens, v_dim) is None:
        return flashmla.paged_decode(q, kv_cache, block_tables, kv_lens, float(scale), v_dim)
    if is_fast and use_triton(q):  # Triton, no host syncs (the bound checks below read the tables on the host)
        return triton_mla.paged_attention(q, kv_cache, block_tables, cu_seqlens_q, q_positions, kv_lens,
                                          float(scale), v_dim)
    if is_fast:  # CUDA without Triton: the reference reads cu_seqlens_q on the host
        cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T)
    return _paged_attention_torch(q, kv_cache, block_tables, cu, q_positions, kv_lens, float(scale), v_dim)


def _fast_path(kv_cache: torch.Tensor) -> bool:
    """The GPU kernels may run: fast kernels on (``HELIXSERVE_KERNELS``), a contiguous cache, no value checks."""
    return fast_kernels_enabled() and kv_cache.is_contiguous() and not value_checks_enabled()


def _write_few_rows(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    latent: torch.Tensor,
) -> None:
    """:func:`_write_kv_torch` for a few rows (decode): the rows are found on the host."""
    NB, BS, Dqk = kv_cache.shape
    pos, table, bounds = host_list(positions), host_list(block_tables), host_list(cu)
    if min(pos) < 0 or max(pos) // BS >= block_tables.shape[1]:
        raise ValueError(f"positions must lie in [0, {block_tables.shape[1] * BS}), got min {min(pos)} max {max(pos)}")
    physical = [table[i][pos[t] // BS] for i in range(len(bounds) - 1) for t in range(bounds[i], bounds[i + 1])]
    if max(physical) >= NB:
        raise ValueError(f"block_tables entries must be < {NB} (num blocks), got {max(physical)}")
    local = [t for t, b in enumerate(physical) if b >= 0]
    if not local:
        return
    rows = torch.tensor([physical[t] * BS + pos[t] % BS for t in local], device=kv_cache.device)
    values = latent if len(local) == len(pos) else latent[torch.tensor(local, device=latent.device)]
    kv_cache.view(NB * BS, Dqk)[rows] = values.to(kv_cache.dtype)


def _paged_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu: torch.Tensor,
    q_positions: torch.Tensor, kv_lens: torch.Tensor, scale: float, v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    BS = kv_cache.shape[1]
    # one host read of the tables per step (shared with the decode gather and the cache write)
    if block_tables.numel() and max(map(max, host_list(block_tables))) >= kv_cache.shape[0]:
        raise ValueError(f"block_tables entries must be < {kv_cache.shape[0]} (num blocks), got {int(block_tables.max())}")
    if T == cu.numel() - 1 and host_list(cu) == list(range(T + 1)):
        single = _attend_single_queries(q, kv_cache, block_tables, q_positions, kv_lens, scale, v_dim)
        if single is not None:
            return single
    tables = block_tables.detach().to("cpu", torch.int64)
    lens = kv_lens.detach().to("cpu", torch.int64)
    positions = q_positions.detach().to("cpu", torch.int64)
    o = torch.zeros(T, H, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(cu.numel() - 1):
        start, end = int(cu[i]), int(cu[i + 1])
        kv_len = int(lens[i])
        if end == start or kv_len <= 0:
            continue
        _check_blocks_cover(i, kv_len, BS, tables.shape[1])
        # only keys some query of this sequence can see
        num_keys = min(kv_len, int(positions[start:end].max()) + 1)
        if num_keys <= 0:
            continue
        logical = torch.nonzero(tables[i, :-(-num_keys // BS)] >= 0).squeeze(1)
        if logical.numel() == 0:
            continue
        o[start:end], lse[start:end] = _attend_one_sequence(
            q[start:end].float() * scale, q_positions[start:end].to(q.device, torch.int64),
            kv_cache, tables[i, logical], logical * BS, kv_len, v_dim,
        )
    return o.to(q.dtype), lse


def _check_blocks_cover(i: int, kv_len: int, block_size: int, num_table_blocks: int) -> None:
    if -(-kv_len // block_size) > num_table_blocks:
        raise ValueError(f"kv_lens[{i}]={kv_len} needs {-(-kv_len // block_size)} blocks, block_tables has {num_table_blocks}")


def _attend_single_queries(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, q_positions: torch.Tensor,
    lens: torch.Tensor, scale: float, v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One query per sequence (decode): every sequence's visible keys gathered at once, padded to the
    longest; ``None`` when that gather would exceed ``_SINGLE_QUERY_BATCH_KEYS`` keys."""
    B, H, _ = q.shape
    BS = kv_cache.shape[1]
    device = q.device
    kv_lens, q_pos = host_list(lens), host_list(q_positions)
    for i, kv_len in enumerate(kv_lens):
        if kv_len > 0:
            _check_blocks_cover(i, kv_len, BS, block_tables.shape[1])
    num_keys = [max(0, min(kv_len, p + 1)) for kv_len, p in zip(kv_lens, q_pos)]
    longest = max(num_keys)
    max_blocks = -(-longest // BS)
    if B * max_blocks * BS > _SINGLE_QUERY_BATCH_KEYS:
        return None
    if max_blocks == 0:
        lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=device)
        return q.new_zeros(B, H, v_dim), lse
    rows = [row[:max_blocks] for row in host_list(block_tables)]
    table = torch.tensor(rows, dtype=torch.int64)
    is_held = [[b >= 0 for b in row[:-(-n // BS)]] for row, n in zip(rows, num_keys)]
    qf = q.float() * scale
    if all(n == longest for n in num_keys) and all(all(row) for row in is_held):
        # every sequence sees its first `longest` keys, all held here: no padding, no masks
        keys = _gather_blocks(kv_cache, table.to(device))[:, :longest].float()
        scores = torch.bmm(qf, keys.transpose(1, 2))  # [B, H, keys]
        lse = torch.logsumexp(scores, dim=-1)
        acc = torch.bmm(scores.sub_(lse[..., None]).exp_(), keys[..., :v_dim])
        return acc.to(q.dtype), lse
    every_row_sees_a_key = all(any(row) for row in is_held)
    key_pos = torch.arange(max_blocks * BS)
    visible = (key_pos < torch.tensor(num_keys)[:, None]) & (table >= 0).repeat_interleave(BS, dim=1)
    visible = visible.to(device)
    # keys a query cannot see (stale slots, blocks held elsewhere) are zeroed so no NaN/inf leaks
    keys = _gather_blocks(kv_cache, table.clamp_min(0).to(device)).float()
    keys = keys.masked_fill_(~visible[..., None], 0.0)  # the gather made a copy: fill it in place
    scores = torch.bmm(qf, keys.transpose(1, 2))
    scores = scores.masked_fill_(~visible[:, None, :], float("-inf"))
    m = scores.amax(-1)
    if every_row_sees_a_key:  # m is finite and denom >= 1 in every row
        probs = (scores - m[..., None]).exp_()
        denom = probs.sum(-1)
        acc = torch.bmm(probs, keys[..., :v_dim])
        return (acc / denom[..., None]).to(q.dtype), m + denom.log()
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    probs = (scores - m_safe[..., None]).exp_()
    denom = probs.sum(-1)
    acc = torch.bmm(probs, keys[..., :v_dim])
    has_key = denom > 0
    o = torch.where(has_key[..., None], acc / denom.clamp_min(1e-30)[..., None], 0.0)
    lse = torch.where(has_key, m + denom.clamp_min(1e-30).log(), float("-inf"))
    return o.to(q.dtype), lse


def _gather_blocks(kv_cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``kv_cache[table]`` as ``[B, blocks * BS, Dqk]`` (one index_select: cheaper than advanced indexing)."""
    B, num_blocks = table.shape
    rows = kv_cache.index_select(0, table.reshape(-1))
    return rows.view(B, num_blocks * kv_cache.shape[1], kv_cache.shape[2])


def _attend_one_sequence(
    q: torch.Tensor, q_pos: torch.Tensor, kv_cache: torch.Tensor, physical: torch.Tensor,
    block_starts: torch.Tensor, kv_len: int, v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over this sequence's local blocks, a few blocks at a time."""
    Tq, H, _ = q.shape
    BS = kv_cache.shape[1]
    device = q.device
    m = torch.full((Tq, H), float("-inf"), device=device)
    denom = torch.zeros(Tq, H, device=device)
    acc = torch.zeros(Tq, H, v_dim, device=device)
    blocks_per_step = max(1, _KEYS_PER_STEP // BS)
    for s in range(0, physical.numel(), blocks_per_step):
        phys = physical[s:s + blocks_per_step].to(device)
        key_pos = (block_starts[s:s + blocks_per_step, None] + torch.arange(BS)).flatten().to(device)
        in_seq = key_pos < kv_len
        # slots past kv_len may hold stale or garbage rows: zero them so no NaN/inf can leak
        keys = torch.where(in_seq[:, None], kv_cache[phys].flatten(0, 1).float(), 0.0)
        scores = torch.einsum("qhd,kd->qhk", q, keys)
        visible = in_seq[None, :] & (key_pos[None, :] <= q_pos[:, None])
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        probs = (scores - m_safe[..., None]).exp()
        rescale = (m - m_safe).exp()
        denom = denom * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("qhk,kd->qhd", probs, keys[:, :v_dim])
        m = m_new
    has_key = denom > 0
    o = torch.where(has_key[..., None], acc / denom.clamp_min(1e-30)[..., None], 0.0)
    lse = torch.where(has_key, m + denom.clamp_min(1e-30).log(), float("-inf"))
    return o, lse
