"""Attention-residual selection site (K3): a softmax over depth of the block bank and the prefix.

``AttnRes(prefix [M, D], bank [K, M, D])``: sources ``[bank_0 .. bank_{K-1}, prefix]``; each
source's logit is ``sum_d rmsnorm(V_i)[d] * norm.w[d] * proj.w[d]`` (fp32); output is the
softmax-weighted sum of the sources. Parameters use the checkpoint names ``*_res_norm.weight``
``[D]`` and ``*_res_proj.weight`` ``[1, D]``.
"""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels
from helixserve.models.norm import RMSNorm


class AttnResProj(nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))


def attn_res_mix(
    norm: RMSNorm, proj: AttnResProj, prefix: torch.Tensor, bank: torch.Tensor | None
) -> torch.Tensor:
    """Mix ``prefix [M, D]`` with ``bank [K, M, D]`` (``None`` or ``K == 0``: the prefix alone)."""
    if bank is None or bank.shape[0] == 0:
        return prefix
    return kernels.attn_res_mix(prefix, bank, norm.weight, proj.weight, norm.eps)


def attn_res_norm(
    norm: RMSNorm, proj: AttnResProj, prefix: torch.Tensor, bank: torch.Tensor | None, out_norm: RMSNorm,
    addend: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None = None,
    prefix_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection site and the norm after it: ``p = prefix + addend`` (``addend`` a pair:
    ``addend[0] + addend[1]`` first; stored in ``prefix_out`` when given), ``(out_norm(AttnRes(p, bank)), p)``
    (one kernel on a GPU)."""
    addend, addend2 = addend if isinstance(addend, tuple) else (addend, None)
    return kernels.attn_res_mix_norm(prefix, bank, norm.weight, proj.weight, norm.eps, out_norm.weight, out_norm.eps,
                                     addend=addend, prefix_out=prefix_out, addend2=addend2)
