"""Triton KDA gates: the per-channel log-decay and beta of one step in one kernel, one program per
(row, head).

Same contract as :func:`helixserve.kernels.kda_gate_beta` (f [T, H*K], b [T, H], rows with a unit
last stride; A_log [H], dt_bias [H*K] -> g [T, H, K] float32, beta [T, H] float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helixserve.kernels.triton_common import next_pow2


@triton.jit(do_not_specialize=["stride_f", "stride_b"])
def _gate_beta_kernel(
    f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, H, K, stride_f, stride_b, lower_bound,
    HAS_LOWER_BOUND: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(f_ptr + row * stride_f + head * K + offs, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(dt_bias_ptr + head * K + offs, mask=mask, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    if HAS_LOWER_BOUND:  # K3: lower_bound * sigmoid(rate * x)
        g = lower_bound * tl.sigmoid(rate * x)
    else:  # Kimi Linear: -(softplus(x) * rate), softplus linear above 20 as PyTorch's
        g = -(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))) * rate)
    tl.store(g_ptr + (row * H + head) * K + offs, g, mask=mask)
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_b + head).to(tl.float32))
    tl.store(beta_ptr + row * H + head, beta)


def kda_gate_beta(
    f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int, head_dim: int,
    lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~helixserve.kernels.kda_gate_beta`."""
    T = f.shape[0]
    f = f if f.stride(1) == 1 else f.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    g = torch.empty(T, num_heads, head_dim, dtype=torch.float32, device=f.device)
    beta = torch.empty(T, num_heads, dtype=torch.float32, device=f.device)
    if T == 0:
        return g, beta
    a_log = A_log if A_log.shape == (num_heads,) and A_log.is_contiguous() else A_log.flatten()[:num_heads].contiguous()
    _gate_beta_kernel[(T, num_heads)](
        f, b, a_log, dt_bias.contiguous(), g, beta, num_heads, head_dim, f.stride(0), b.stride(0),
        float(lower_bound) if lower_bound is not None else 0.0,
        HAS_LOWER_BOUND=lower_bound is not None, BLOCK_K=next_pow2(head_dim), num_warps=1 if head_dim <= 128 else 4,
    )
    return g, beta
