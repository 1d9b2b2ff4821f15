"""Triton gated activation: ``act(gate) * up`` in fp32 in one pass, stored in gate's dtype.

Same contract as :func:`helixserve.kernels.act_and_mul` (``gate``, ``up`` [..., I], rows with a unit
last stride, e.g. the two halves of one ``[M, 2I]`` projection; "sigmoid" computed in fp32 too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_ACTIVATION_IDS = {"silu": 0, "situ": 1, "sigmoid": 2}


@triton.jit
def _tanh(x):
    # exp overflows to inf for large x (tanh -> 1) and underflows to 0 for very negative x (-> -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit(do_not_specialize=["stride_gate", "stride_up"])
def _act_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr, I, stride_gate, stride_up, situ_beta, situ_linear_beta,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + offs, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 2:  # sigmoid
        out = tl.sigmoid(gate) * up
    elif ACTIVATION == 1:  # situ
        soft_gate = situ_beta * _tanh(gate / situ_beta) * tl.sigmoid(gate)
        out = soft_gate * (situ_linear_beta * _tanh(up / situ_linear_beta))
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * I + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, situ_beta: float,
                situ_linear_beta: float) -> torch.Tensor:
    """Triton :func:`~helixserve.kernels.act_and_mul` (``activation`` "silu", "situ" or "sigmoid")."""
    I = gate.shape[-1]
    gate_rows, up_rows = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    M = gate_rows.shape[0]
    if M == 0 or I == 0:
        return out
    _act_and_mul_kernel[(M, triton.cdiv(I, _BLOCK))](
        gate_rows, up_rows, out, I, gate_rows.stride(0), up_rows.stride(0), float(situ_beta),
        float(situ_linear_beta), ACTIVATION=_ACTIVATION_IDS[activation], BLOCK=_BLOCK, num_warps=4,
    )
    return out
