"""Loop-form fp32 references for MLA paged attention and the lse combine (not exported).

naive_mla_dense: per-query softmax over a dense key list [L, Dqk] (value = key[:v_dim]).
"""

from __future__ import annotations

import torch


def naive_mla_dense(
    q: torch.Tensor, keys: list[torch.Tensor], cu_seqlens_q: torch.Tensor, q_positions: torch.Tensor,
    scale: float, v_dim: int, key_positions: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys[i] [L_i, Dqk] dense keys of sequence i (positions 0..L_i-1 unless key_positions given).

    Returns (o [T, H, v_dim] fp32, lse [T, H] fp32); no visible key -> 0, -inf.
    """
    T, H, _ = q.shape
    o = torch.zeros(T, H, v_dim)
    lse = torch.full((T, H), float("-inf"))
    cu = [int(c) for c in cu_seqlens_q]
    for i in range(len(cu) - 1):
        K_i = keys[i].float()
        pos = torch.arange(K_i.shape[0]) if key_positions is None else key_positions[i]
        for t in range(cu[i], cu[i + 1]):
            visible = pos <= int(q_positions[t])
            if not bool(visible.any()):
                continue
            kv = K_i[visible]
            for h in range(H):
                scores = kv @ q[t, h].float() * scale
                lse[t, h] = torch.logsumexp(scores, 0)
                o[t, h] = torch.softmax(scores, 0) @ kv[:, :v_dim]
    return o, lse


def naive_lse_combine(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loop; returns (o [T, H, D] fp32, lse [T, H])."""
    P, T, H, D = o_parts.shape
    o = torch.zeros(T, H, D)
    lse = torch.full((T, H), float("-inf"))
    for t in range(T):
        for h in range(H):
            finite = [p for p in range(P) if torch.isfinite(lse_parts[p, t, h])]
            if not finite:
                continue
            ls = torch.stack([lse_parts[p, t, h].float() for p in finite])
            lse[t, h] = torch.logsumexp(ls, 0)
            w = torch.softmax(ls, 0)
            o[t, h] = sum(w[j] * o_parts[p, t, h].float() for j, p in enumerate(finite))
    return o, lse
