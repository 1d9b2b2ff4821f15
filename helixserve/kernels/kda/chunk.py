"""KDA prefill over a varlen batch, chunked (UT/WY) form.

Shapes (flat varlen layout, N sequences, T rows in total):
    q, k          [T, H, K]
    v             [T, H, V]
    g             [T, H, K]   float32 log-decay (<= 0), from :func:`kda_gate`
    beta          [T, H]      post-sigmoid
    cu_seqlens    [N + 1]     int64, None = one sequence
    initial_state [N, H, K, V] float32, None = zeros
Returns o [T, H, V] in v.dtype and final_state [N, H, K, V] float32.

Per chunk of C rows with in-chunk cumulative decay G = cumsum(g):
    L[r, c]  = beta_r * sum_d k_r[d] k_c[d] exp(G_r[d] - G_c[d])      (c < r)
    A        = (I + L)^-1 diag(beta);  w = A (exp(G) * k);  u = A v
    v'       = u - w S
    o        = (q * exp(G)) S + Aqk v',  Aqk[r, c] = sum_d q_r k_c exp(G_r - G_c)  (c <= r)
    S       <- exp(G_last) * S + (exp(G_last - G) * k)^T v'
Every exponent is <= 0, so nothing overflows whatever the chunk's total decay.
Each sequence is padded on its own to a multiple of C with rows (q=k=v=g=beta=0) that leave the
state untouched.
"""

from __future__ import annotations

import torch

from helixserve.kernels._checks import check_cu_seqlens, check_ndim, check_shape
from helixserve.kernels.kda import gpu as kda_gpu
from helixserve.kernels.kda.naive import l2norm_fp32
from helixserve.kernels.triton_common import gpu_num_seqs, use_fla

# bound on the [chunks, H, C, C, K] pairwise-decay intermediate (elements)
_MAX_PAIRWISE_ELEMENTS = 1 << 24
# rows per diagonal sub-block inside a chunk (see _intra_chunk_block)
_SUB_BLOCK = 16


def kda_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over every sequence of a varlen batch; any length per sequence.

    ``use_qk_l2norm`` normalizes q and k per head in fp32 (``x * rsqrt(sum x^2 + 1e-6)``) first;
    ``scale`` (default ``K ** -0.5``) multiplies q. See the module docstring for shapes.
    """
    T, H, K, V = check_kda_shapes(q, k, v, g, beta)
    # fla's chunk kernel is built for bf16/fp16 operands; fp32 callers keep the exact PyTorch path
    on_gpu = use_fla(q) and q.dtype in (torch.bfloat16, torch.float16)
    if on_gpu:
        num_seqs = gpu_num_seqs("cu_seqlens", cu_seqlens, T)
    else:
        cu = check_cu_seqlens("cu_seqlens", cu_seqlens, T)
        num_seqs = cu.numel() - 1
    if initial_state is not None:
        check_shape("initial_state", initial_state, (num_seqs, H, K, V))
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    scale = K ** -0.5 if scale is None else float(scale)
    if on_gpu:  # fla chunk_kda; its chunk size is its own (the result does not depend on it)
        return kda_gpu.chunk_prefill(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)
    return _chunk_kda_torch(q, k, v, g, beta, scale, initial_state, cu, chunk_size, use_qk_l2norm)


def check_kda_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[int, int, int, int]:
    """Check q, k [R, H, K]; v [R, H, V]; g [R, H, K]; beta [R, H]; returns (R, H, K, V)."""
    check_ndim("q", q, 3)
    R, H, K = q.shape
    check_shape("k", k, (R, H, K))
    check_ndim("v", v, 3)
    if v.shape[:2] != (R, H):
        raise ValueError(f"v must be [{R}, {H}, V], got {tuple(v.shape)}")
    check_shape("g", g, (R, H, K))
    check_shape("beta", beta, (R, H))
    return R, H, K, v.shape[2]


def _chunk_kda_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: torch.Tensor | None, cu: torch.Tensor, chunk_size: int,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, K = q.shape
    V = v.shape[-1]
    device = q.device
    num_seqs = cu.numel() - 1
    q, k = (l2norm_fp32(q), l2norm_fp32(k)) if use_qk_l2norm else (q.float(), k.float())
    q = q * scale

    num_chunks = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
    chunk_offsets = torch.cumsum(num_chunks, 0) - num_chunks
    token_idx = _chunk_token_index(cu, num_chunks, chunk_offsets, chunk_size).to(device)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [T, H, ...] -> [NC, H, C, ...]; pad rows read the appended zero row
        padded = torch.cat([x.float(), x.new_zeros((1, *x.shape[1:]), dtype=torch.float32)])
        return padded[token_idx].movedim(1, 2)

    qc, kc, vc, bc = to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(beta)
    G = to_chunks(g).cumsum(-2)
    w, u, Aqk = _intra_chunk(qc, kc, vc, G, bc)
    G_last = G[..., -1:, :]
    k_to_end = (G_last - G).exp() * kc
    state = torch.zeros(num_seqs, H, K, V, dtype=torch.float32, device=device)
    if initial_state is not None:
        state.copy_(initial_state)
    o_chunks = _inter_chunk(qc * G.exp(), Aqk, w, u, k_to_end, G_last.squeeze(-2).exp(), state,
                            num_chunks, chunk_offsets)

    o = torch.zeros(T + 1, H, V, dtype=torch.float32, device=device)
    o[token_idx.flatten()] = o_chunks.movedim(2, 1).reshape(-1, H, V)
    return o[:T].to(v.dtype), state


def _chunk_token_index(
    cu: torch.Tensor, num_chunks: torch.Tensor, chunk_offsets: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """[NC, C] row index of every chunk slot; slots past a sequence's end point at row T."""
    total = int(num_chunks.sum())
    seq_of_chunk = torch.repeat_interleave(torch.arange(num_chunks.numel()), num_chunks)
    local_chunk = torch.arange(total) - chunk_offsets[seq_of_chunk]
    rows = cu[seq_of_chunk, None] + local_chunk[:, None] * chunk_size + torch.arange(chunk_size)
    return torch.where(rows < cu[seq_of_chunk + 1, None], rows, cu[-1])


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In-chunk terms (w, u, Aqk) for [NC, H, C, *] chunks, in (chunk, head) batches to bound memory."""
    NC, H, C, K = k.shape
    V = v.shape[-1]
    q, k, v, G, beta = (x.flatten(0, 1) for x in (q, k, v, G, beta))
    sub = _sub_block(C)
    step = max(1, _MAX_PAIRWISE_ELEMENTS // max(1, C * max(sub, C // sub) * K))
    if step >= NC * H:
        w, u, Aqk = _intra_chunk_block(q, k, v, G, beta, sub)
        return w.view(NC, H, C, K), u.view(NC, H, C, V), Aqk.view(NC, H, C, C)
    w, u, Aqk = k.new_empty(NC * H, C, K), k.new_empty(NC * H, C, V), k.new_empty(NC * H, C, C)
    for s in range(0, NC * H, step):
        e = s + step
        w[s:e], u[s:e], Aqk[s:e] = _intra_chunk_block(q[s:e], k[s:e], v[s:e], G[s:e], beta[s:e], sub)
    return w.view(NC, H, C, K), u.view(NC, H, C, V), Aqk.view(NC, H, C, C)


def _sub_block(C: int) -> int:
    """Rows per diagonal sub-block of a chunk (the whole chunk when it does not split evenly)."""
    return _SUB_BLOCK if C % _SUB_BLOCK == 0 else C


def _intra_chunk_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, sub: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Akk/Aqk over [B, C, *] chunks split into n = C / sub sub-blocks of rows.

    Pairs inside a diagonal sub-block use the pairwise decay exp(G_r - G_c). A row r of sub-block i
    and a column c of an earlier sub-block factor through the sub-block's first row f:
    exp(G_r - G_c) = exp(G_r - G_f) * exp(G_f - G_c), both exponents <= 0 (G is non-increasing),
    which turns that part into a matmul.
    """
    B, C, K = k.shape
    n = C // sub
    qs, ks, Gs = (x.view(B, n, sub, K) for x in (q, k, G))
    causal = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    # diagonal sub-blocks: decay[r, c, d] = exp(G_r[d] - G_c[d]) for c <= r, else 0
    diff = Gs[..., :, None, :] - Gs[..., None, :, :]
    decay = diff.masked_fill_(~causal[..., None], float("-inf")).exp_()
    k_decayed = decay.mul_(ks[..., None, :, :])
    Akk_diag = (k_decayed * ks[..., :, None, :]).sum(-1)
    Aqk_diag = k_decayed.mul_(qs[..., :, None, :]).sum(-1)
    if n == 1:
        Akk, Aqk = Akk_diag.view(B, C, C), Aqk_diag.view(B, C, C)
    else:
        G_first = Gs[:, :, :1, :]
        to_first = (Gs - G_first).exp_()  # [B, n, sub, K]
        is_earlier = torch.arange(C, device=k.device) < torch.arange(0, C, sub, device=k.device)[:, None]
        from_first = (G_first - G[:, None, :, :]).masked_fill_(~is_earlier[..., None], float("-inf"))
        k_from_first = from_first.exp_().mul_(k[:, None, :, :]).transpose(-1, -2)  # [B, n, K, C]
        Akk = ((ks * to_first) @ k_from_first).view(B, n, sub, n, sub)
        Aqk = ((qs * to_first) @ k_from_first).view(B, n, sub, n, sub)
        Akk.diagonal(dim1=1, dim2=3).add_(Akk_diag.permute(0, 2, 3, 1))
        Aqk.diagonal(dim1=1, dim2=3).add_(Aqk_diag.permute(0, 2, 3, 1))
        Akk, Aqk = Akk.view(B, C, C), Aqk.view(B, C, C)
    L = (Akk * beta[..., :, None]).tril(-1)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    A = inv * beta[..., None, :]
    return A @ (G.exp() * k), A @ v, Aqk


def _inter_chunk(
    q_decayed: torch.Tensor, Aqk: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
    k_to_end: torch.Tensor, chunk_decay: torch.Tensor, state: torch.Tensor,
    num_chunks: torch.Tensor, chunk_offsets: torch.Tensor,
) -> torch.Tensor:
    """Carry the state across chunks (in place in ``state``); returns o [NC, H, C, V]."""
    o = torch.zeros_like(u)
    device = state.device
    max_chunks = int(num_chunks.max()) if num_chunks.numel() else 0
    for j in range(max_chunks):
        seq_ids = torch.nonzero(num_chunks > j).squeeze(1)
        chunk_ids = (chunk_offsets[seq_ids] + j).to(device)
        seq_ids = seq_ids.to(device)
        S = state[seq_ids]
        v_new = u[chunk_ids] - w[chunk_ids] @ S
        o[chunk_ids] = q_decayed[chunk_ids] @ S + Aqk[chunk_ids] @ v_new
        state[seq_ids] = S * chunk_decay[chunk_ids][..., None] + k_to_end[chunk_ids].transpose(-1, -2) @ v_new
    return o
