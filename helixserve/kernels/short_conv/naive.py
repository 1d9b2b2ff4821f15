"""Loop-form fp32 reference of the causal short convolution (not exported).

x [T, D]; weight [D, W]; conv_state [N, D, W-1] or None; returns (y [T, D] fp32, state [N, D, W-1] fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_short_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    T, D = x.shape
    weight = weight.reshape(D, -1).float()
    W = weight.shape[1]
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    y = torch.zeros(T, D)
    states = torch.zeros(len(cu) - 1, D, W - 1)
    for n in range(len(cu) - 1):
        history = [torch.zeros(D) if conv_state is None else conv_state[n, :, m].float() for m in range(W - 1)]
        for t in range(cu[n], cu[n + 1]):
            window = history[len(history) - (W - 1):] + [x[t].float()]
            acc = torch.zeros(D)
            for j in range(W):
                acc += weight[:, j] * window[j]
            y[t] = F.silu(acc) if activation == "silu" else acc
            history.append(x[t].float())
        for m in range(W - 1):
            states[n, :, m] = history[len(history) - (W - 1) + m]
    return y, states
