"""Loop-form fp32 references for KDA (not exported; tests compare the fast paths against these).

Shapes as in :mod:`helixserve.kernels.kda.chunk`: q, k [T, H, K]; v [T, H, V]; g [T, H, K];
beta [T, H]; states [N, H, K, V] float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def naive_kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int, head_dim: int,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Per-element loop over heads of the gate formula; returns [T, H, K] fp32."""
    out = torch.empty(f.shape[0], num_heads, head_dim, dtype=torch.float32)
    a = A_log.float().flatten()
    for h in range(num_heads):
        x = f[:, h * head_dim:(h + 1) * head_dim].float() + dt_bias.float()[h * head_dim:(h + 1) * head_dim]
        rate = math.exp(float(a[h]))
        if lower_bound is None:
            out[:, h] = -rate * F.softplus(x)
        else:
            out[:, h] = lower_bound * torch.sigmoid(rate * x)
    return out


def l2norm_fp32(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule per sequence; returns (o [T, H, V] in v.dtype, state [N, H, K, V] fp32)."""
    T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    out_dtype = v.dtype
    q, k = (l2norm_fp32(q), l2norm_fp32(k)) if use_qk_l2norm else (q.float(), k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    o = torch.zeros(T, H, V, dtype=torch.float32)
    states = torch.zeros(len(cu) - 1, H, K, V, dtype=torch.float32)
    for n in range(len(cu) - 1):
        S = torch.zeros(H, K, V) if initial_state is None else initial_state[n].float().clone()
        for t in range(cu[n], cu[n + 1]):
            S = S * g[t].exp()[..., None]
            residual = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
            S = S + torch.einsum("hk,hv->hkv", beta[t][:, None] * k[t], residual)
            o[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
        states[n] = S
    return o.to(out_dtype), states
