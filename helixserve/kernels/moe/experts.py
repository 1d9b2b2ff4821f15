"""Gated MLP activation and the routed-expert sum.

act_and_mul: gate, up [..., I] -> [..., I]
    silu: silu(gate) * up
    sigmoid: sigmoid(gate) * up, in the inputs' dtype (an output gate, e.g. MLA's; not for experts)
    situ: beta * tanh(gate / beta) * sigmoid(gate) * (lin_beta * tanh(up / lin_beta))   (Kimi K3)
moe_experts: x [T, D]; topk_ids, topk_weights [T, k]; w13 [E_local, 2I, D] (gate rows then up rows);
    w2 [E_local, D, I]; local experts are global ids [expert_offset, expert_offset + E_local) and
    other ids contribute nothing (expert parallelism) -> y [T, D] in x.dtype, accumulated in fp32.
    w13 and w2 may both be MXFP4Weight (packed FP4 + e8m0 scales, the checkpoint's bytes): on CUDA
    the grouped GEMMs dequantize in registers (Triton); elsewhere the stacks are dequantized to
    x.dtype per call, then the dense paths run (the reference).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helixserve.kernels._checks import as_f32, check_activation, check_integer, check_ndim, check_shape
from helixserve.kernels.moe import gpu as moe_gpu
from helixserve.kernels.moe.mxfp4 import MXFP4Weight
from helixserve.kernels.triton_common import has_triton, on_device, use_triton

_ACTIVATIONS = ("silu", "situ")
_GATES = (*_ACTIVATIONS, "sigmoid")
# up to this many (token, k) pairs (decode batches) the pairs are grouped by expert on the host
_FEW_PAIRS = 64


def act_and_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    activation: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """Gated activation in fp32 (``sigmoid``: in the inputs' dtype on the CPU), returned in gate.dtype."""
    check_shape("up", up, tuple(gate.shape))
    check_activation(activation, _GATES)
    if activation == "situ" and not (situ_beta > 0 and situ_linear_beta > 0):
        raise ValueError(f"situ betas must be positive, got {situ_beta}, {situ_linear_beta}")
    if use_triton(gate):  # one kernel in place of the casts and the elementwise chain
        return _device_act(activation, situ_beta, situ_linear_beta)(gate, up)
    out = _act_and_mul_torch(gate, up, activation, situ_beta, situ_linear_beta)
    return out if out.dtype == gate.dtype else out.to(gate.dtype)


def _device_act(activation: str, situ_beta: float, situ_linear_beta: float) -> Callable:
    """``act(gate, up)`` of the device paths, in gate's dtype: the Triton kernel where Triton is,
    else the PyTorch chain."""
    if has_triton():
        from helixserve.kernels.moe import triton_act

        return functools.partial(triton_act.act_and_mul, activation=activation, situ_beta=situ_beta,
                                 situ_linear_beta=situ_linear_beta)

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _act_and_mul_torch(gate, up, activation, situ_beta, situ_linear_beta).to(gate.dtype)

    return act


def _act_and_mul_torch(
    gate: torch.Tensor, up: torch.Tensor, activation: str, situ_beta: float, situ_linear_beta: float
) -> torch.Tensor:
    if activation == "sigmoid":
        return up * torch.sigmoid(gate)
    gate, up = as_f32(gate), as_f32(up)
    if activation == "silu":
        return F.silu(gate) * up
    soft_gate = situ_beta * torch.tanh(gate / situ_beta) * torch.sigmoid(gate)
    return soft_gate * (situ_linear_beta * torch.tanh(up / situ_linear_beta))


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor | MXFP4Weight,
    w2: torch.Tensor | MXFP4Weight,
    *,
    expert_offset: int = 0,
    activation: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """``y[t] = sum_k w[t,k] * w2[e] @ act_and_mul(w13[e,:I] x, w13[e,I:] x)`` over local experts."""
    check_ndim("x", x, 2)
    T, D = x.shape
    check_ndim("topk_ids", topk_ids, 2)
    check_integer("topk_ids", topk_ids)
    if topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [{T}, k], got {tuple(topk_ids.shape)}")
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    is_packed = isinstance(w13, MXFP4Weight)
    if is_packed != isinstance(w2, MXFP4Weight):
        raise ValueError(f"w13 and w2 must both be MXFP4Weight or both tensors, got {type(w13).__name__} "
                         f"and {type(w2).__name__}")
    if not is_packed:
        check_ndim("w13", w13, 3)
    E_local, two_I, _ = w13.shape
    if two_I % 2 or w13.shape[2] != D:
        raise ValueError(f"w13 must be [E_local, 2*I, {D}], got {tuple(w13.shape)}")
    if is_packed and tuple(w2.shape) != (E_local, D, two_I // 2):
        raise ValueError(f"w2 must have shape {(E_local, D, two_I // 2)}, got {tuple(w2.shape)}")
    elif not is_packed:
        check_shape("w2", w2, (E_local, D, two_I // 2))
    check_activation(activation, _ACTIVATIONS)
    if is_packed:
        if on_device(x) and T == 0:  # as below: a rank that received no rows
            return x.new_zeros(0, D)
        if use_triton(x):
            return moe_gpu.mxfp4_experts(x, topk_ids, topk_weights, w13, w2, expert_offset,
                                         _device_act(activation, situ_beta, situ_linear_beta))
        w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)  # the reference: dequantize, then matmul
    if on_device(x):  # pair GEMVs (decode), grouped GEMM (bf16), gathered bmm or every expert: no host sync
        if T == 0:  # a rank that received no rows in the token-sliced all-to-all
            return x.new_zeros(0, D)
        if moe_gpu.can_pair_gemv(x, topk_ids, w13):
            return moe_gpu.pair_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, activation,
                                        situ_beta, situ_linear_beta)
        act = _device_act(activation, situ_beta, situ_linear_beta)
        if moe_gpu.can_group(x, w13, w2):
            return moe_gpu.grouped_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, act)
        if moe_gpu.can_gather(topk_ids, w13):
            return moe_gpu.gathered_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, act)
        return moe_gpu.dense_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, act)
    return _moe_experts_torch(x, topk_ids, topk_weights, w13, w2, expert_offset, activation,
                              situ_beta, situ_linear_beta)


def _moe_experts_torch(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, expert_offset: int, activation: str, situ_beta: float, situ_linear_beta: float,
) -> torch.Tensor:
    T, D = x.shape
    E_local = w13.shape[0]
    I = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if 1 < T and T * top_k <= _FEW_PAIRS and _can_bag(x, w13, w2):
        return _bag_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, activation,
                            situ_beta, situ_linear_beta)
    if T * top_k <= _FEW_PAIRS:
        return _few_pairs_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, activation,
                                  situ_beta, situ_linear_beta)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    local_ids = (topk_ids.to(torch.int64) - expert_offset).flatten()
    is_local = (local_ids >= 0) & (local_ids < E_local)
    pair_ids = torch.nonzero(is_local).squeeze(1)
    if pair_ids.numel() == 0:
        return out.to(x.dtype)
    # (token, k) pairs grouped by local expert
    experts_of_pairs, order = torch.sort(local_ids[pair_ids], stable=True)
    pair_ids = pair_ids[order]
    counts = torch.bincount(experts_of_pairs, minlength=E_local).tolist()
    token_ids = pair_ids // top_k
    weights = topk_weights.flatten().float()[pair_ids]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_ids[start:start + count]
        h = x[rows].float() @ w13[e].float().t()
        act = _act_and_mul_torch(h[:, :I], h[:, I:], activation, situ_beta, situ_linear_beta)
        out.index_add_(0, rows, (act @ w2[e].float().t()) * weights[start:start + count, None])
        start += count
    return out.to(x.dtype)


def _few_pairs_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, expert_offset: int, activation: str, situ_beta: float, situ_linear_beta: float,
) -> torch.Tensor:
    """Same sum as the grouped path (experts in ascending order), with the (token, k) pairs sorted by
    expert on the host from one read of the routing: one gather, one scatter, and two grouped GEMMs
    or two bmm over every local expert (fp32 on CPU, see :func:`_prefers_padded_bmm`), else two
    GEMMs per expert."""
    T, D = x.shape
    E_local = w13.shape[0]
    I = w13.shape[1] // 2
    pairs = []  # (local expert, token, weight)
    for t, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.float().tolist())):
        pairs += [(e - expert_offset, t, w) for e, w in zip(ids, weights) if 0 <= e - expert_offset < E_local]
    pairs.sort(key=lambda pair: pair[0])  # stable: tokens stay in order within an expert
    xf = as_f32(x)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = F.linear(rows, as_f32(w13[e]))
        act = _act_and_mul_torch(h[:, :I], h[:, I:], activation, situ_beta, situ_linear_beta)
        return F.linear(act, as_f32(w2[e]))

    if not pairs:
        return torch.zeros(T, D, dtype=x.dtype, device=x.device)
    if T == 1:  # one token: no index tensors; the first product starts the sum (0 + w y == w y)
        out = expert(pairs[0][0], xf) * pairs[0][2]
        for e, _, w in pairs[1:]:
            out.add_(expert(e, xf), alpha=w)
        return out.to(x.dtype)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    tokens = torch.tensor([t for _, t, _ in pairs], device=x.device)
    rows = xf.index_select(0, tokens)
    if _can_group_on_host(x, w13, w2):
        counts = [0] * E_local
        for e, _, _ in pairs:
            counts[e] += 1
        if _prefers_padded_bmm(counts):
            y = _padded_bmm_experts(rows, counts, w13, w2, lambda h: _act_and_mul_torch(
                h[..., :I], h[..., I:], activation, situ_beta, situ_linear_beta))
        else:  # one grouped GEMM per weight stack: the same per-expert products, without a Python loop
            offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
            h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
            act = _act_and_mul_torch(h[:, :I], h[:, I:], activation, situ_beta, situ_linear_beta)
            y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    else:
        ys, start = [], 0
        for e in sorted({e for e, _, _ in pairs}):
            count = sum(1 for pair in pairs if pair[0] == e)
            ys.append(expert(e, rows[start:start + count]))
            start += count
        y = torch.cat(ys)
    weights = torch.tensor([w for _, _, w in pairs], device=x.device)
    out.index_add_(0, tokens, y * weights[:, None])
    return out.to(x.dtype)


def _can_bag(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The embedding-bag form applies: CPU fp32 stacks stored column-major (each expert's ``[D, 2I]``
    and ``[I, D]`` rows contiguous, as :func:`helixserve.models.packing.store_column_major` leaves them), so
    both stacks are tables of rows without a copy."""
    return (x.device.type == "cpu" and w13.dtype == w2.dtype == torch.float32
            and _is_column_major_stack(w13) and _is_column_major_stack(w2))


def _is_column_major_stack(w: torch.Tensor) -> bool:
    E, rows, cols = w.shape
    return w.stride() == (rows * cols, 1, rows)


def _bag_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, expert_offset: int, activation: str, situ_beta: float, situ_linear_beta: float,
) -> torch.Tensor:
    """The expert sum as two weighted embedding bags over the column-major stacks, for a few tokens.

    ``w13[e] x`` is the sum over d of ``x[d]`` times row d of expert e's ``[D, 2I]`` block: one bag of
    D rows per (token, k) pair; then ``sum_k w_k w2[e_k] act_k`` is one bag per token over the
    ``[I, D]`` rows of its k experts, weighted by ``w_k act_k``, so the weighted sum over k needs no
    scatter. Only the chosen experts' rows are read (the padded bmm reads every local expert), on all
    threads (the bags run in parallel), with no host read of the routing and no sort. Pairs routed to
    experts held elsewhere read a clamped local expert and get weight 0.
    """
    T, D = x.shape
    E_local, two_I = w13.shape[0], w13.shape[1]
    I = two_I // 2
    top_k = topk_ids.shape[1]
    local = topk_ids if expert_offset == 0 else topk_ids - expert_offset
    safe = local.clamp(0, E_local - 1)
    weights = as_f32(topk_weights) * (safe == local)  # 0 for experts held elsewhere
    # per (token, k) pair, its token's x as the weights of its D rows
    h = _bag(w13.as_strided((E_local * D, two_I), (two_I, 1)), safe.view(T * top_k, 1), D,
             torch.cat([as_f32(x)] * top_k, dim=1))  # cat: ~1 us, x.repeat: ~6 us
    act = _act_and_mul_torch(h[:, :I], h[:, I:], activation, situ_beta, situ_linear_beta)
    y = _bag(w2.as_strided((E_local * I, D), (D, 1)), safe, I, act.mul_(weights.view(T * top_k, 1)))
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _bag(table: torch.Tensor, experts: torch.Tensor, rows_per_expert: int, weights: torch.Tensor) -> torch.Tensor:
    """``out[b] = sum_{j, r} weights[b, j, r] * table[experts[b, j] * rows_per_expert + r]`` for ``experts
    [B, m]`` and ``weights`` holding ``B * m * rows_per_expert`` values in that order -> ``[B, width]``."""
    B, m = experts.shape
    index = torch.add(_aranged(rows_per_expert, 1, experts.device), experts.unsqueeze(-1), alpha=rows_per_expert)
    offsets = _aranged(B, m * rows_per_expert, experts.device)
    return torch.embedding_bag(table, index.view(-1), offsets, mode=0, per_sample_weights=weights.reshape(-1))[0]


@functools.lru_cache(maxsize=64)
def _aranged(count: int, step: int, device: torch.device) -> torch.Tensor:
    """``arange(0, count * step, step)`` int64, kept: the bag row and offset patterns repeat every step."""
    with torch.inference_mode(False):  # a plain tensor, usable inside and outside inference mode
        return torch.arange(0, count * step, step, device=device)


def _prefers_padded_bmm(counts: list[int]) -> bool:
    """With more than one thread and at least half of the local experts hit, one bmm over every local
    expert (rows padded to the busiest one) streams the weights from memory on all threads; it reads
    the idle experts too, so it is not worth it when few are hit, nor with one thread."""
    return torch.get_num_threads() > 1 and 2 * sum(1 for c in counts if c) >= len(counts)


def _padded_bmm_experts(
    rows: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor, act: Callable,
) -> torch.Tensor:
    """Expert outputs ``[P, D]`` for ``rows [P, D]`` sorted by expert (``counts`` per local expert)."""
    E_local, width = len(counts), max(counts)
    slots = [e * width + j for e, count in enumerate(counts) for j in range(count)]
    index = torch.tensor(slots, device=rows.device)
    padded = rows.new_zeros(E_local * width, rows.shape[1]).index_copy_(0, index, rows)
    h = torch.bmm(padded.view(E_local, width, -1), w13.transpose(1, 2))
    y = torch.bmm(act(h), w2.transpose(1, 2))
    return y.view(E_local * width, -1).index_select(0, index)


def _can_group_on_host(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` on CPU fp32 stacks (other dtypes would convert whole stacks per call);
    it needs 16-byte aligned operands: rows of D and I floats, weight stacks with aligned strides."""
    return (x.device.type == "cpu" and w13.dtype == w2.dtype == torch.float32 and hasattr(torch, "_grouped_mm")
            and x.shape[1] % 4 == 0 and w2.shape[2] % 4 == 0 and _is_aligned(w13) and _is_aligned(w2))


def _is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(
        stride * t.element_size() % 16 == 0 for stride, size in zip(t.stride(), t.shape) if stride != 1 and size > 1
    )
