"""MoE rows of ``bench/kernels.py``: routed-expert GEMMs on the device (see that script's docstring)."""

from __future__ import annotations

import torch
from _common import gpu_timer as timer

from helixserve import kernels
from helixserve.kernels.moe import gpu as moe_gpu
from helixserve.kernels.moe.experts import _device_act


def moe_rows(args, on_gpu: bool, row) -> None:  # noqa: ANN001 (kernels.row)
    """The MoE rows: the grouped GEMM against a dense GEMM of the same FLOPs, the whole expert sum,
    and on a GPU the decode-sized expert sums (:func:`_decode_rows`)."""
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        T, D, I, E, top_k = (4096, 3584, 3072, 64, 8) if not args.quick else (1024, 3584, 3072, 64, 8)
    else:
        T, D, I, E, top_k = 64, 128, 64, 8, 2
    dtype = torch.bfloat16
    x = torch.randn(T, D, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, D, device=device) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, device=device) / I**0.5).to(dtype)
    weights, ids = kernels.moe_route(torch.randn(T, E, device=device), top_k=top_k, correction_bias=None,
                                     renormalize=True, routed_scaling_factor=1.0)
    P = T * top_k
    flops = 2 * P * D * 2 * I + 2 * P * I * D
    if not hasattr(torch, "_grouped_mm"):
        row("moe", "grouped GEMM", None, None, "TFLOP/s", "dense", note="torch._grouped_mm missing")
        return
    order, sorted_ids, _ = moe_gpu._sort_pairs(ids, E, 0)
    counts = torch.zeros(E + 1, dtype=torch.int32, device=device).scatter_add_(
        0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))
    offs = torch.cumsum(counts[:E], 0, dtype=torch.int32)
    xs = x.index_select(0, order // top_k)
    act = torch.randn(P, I, device=device).to(dtype)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    dense_a, dense_b = w13[0].t(), w2[0].t()

    def grouped():
        torch._grouped_mm(xs, w13t, offs=offs)
        torch._grouped_mm(act, w2t, offs=offs)

    def dense():
        xs @ dense_a
        act @ dense_b

    def full():
        return kernels.moe_experts(x, ids, weights, w13, w2, activation="situ")

    reps = args.reps if on_gpu else 2
    t_grouped, t_dense = timer([grouped, dense], 2, reps)
    (t_full,) = timer([full], 2, reps)
    suffix = "" if on_gpu else " (cpu)"
    row("moe", f"grouped GEMM T={T} E={E} top{top_k}{suffix}", flops / t_grouped / 1e12, flops / t_dense / 1e12,
        "TFLOP/s", "dense bf16 GEMM", f"{t_dense / t_grouped:.0%} of dense")
    row("moe", f"moe_experts (sort+GEMMs+act+sum){suffix}", flops / t_full / 1e12, flops / t_dense / 1e12,
        "TFLOP/s", "dense bf16 GEMM", f"{t_dense / t_full:.0%} of dense", f"{t_full * 1e3:.2f} ms")
    if on_gpu:
        _decode_rows(args, row)


def _decode_rows(args, row) -> None:  # noqa: ANN001
    """Decode-sized expert sums at Kimi-Linear-48B's shapes (D 2304, I 1024, 256 experts, top 8):
    the pair matrix-vector kernels against the grouped path (Triton sort + two grouped GEMMs + act +
    combine), same inputs; TB/s over the distinct experts' weight bytes."""
    act = _device_act("situ", 4.0, 25.0)
    D, I, E, top_k = 2304, 1024, 256, 8
    w13 = (torch.randn(E, 2 * I, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, device="cuda") / I**0.5).to(torch.bfloat16)
    for T in (1, 4, 8, 16, 32):
        x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
        weights, ids = kernels.moe_route(torch.randn(T, E, device="cuda"), top_k=top_k, correction_bias=None,
                                         renormalize=True, routed_scaling_factor=1.0)
        nbytes = ids.unique().numel() * 3 * D * I * 2

        def pairs():
            return moe_gpu.pair_experts(x, ids, weights, w13, w2, 0, "situ", 4.0, 25.0)

        def grouped():
            return moe_gpu.grouped_experts(x, ids, weights, w13, w2, 0, act)

        t_pairs, t_grouped = timer([pairs, grouped], 3, args.reps * 4)
        err = (pairs().float() - grouped().float()).abs().max().item()
        row("moe", f"decode experts T={T} (48b shapes) pair GEMV", nbytes / t_pairs / 1e12, nbytes / t_grouped / 1e12,
            "TB/s", "grouped path", f"{t_grouped / t_pairs:.2f}× faster",
            f"{t_pairs * 1e6:.0f} µs vs {t_grouped * 1e6:.0f} µs; max |diff| {err:.2g}",
            tokens=T, pair_us=t_pairs * 1e6, grouped_us=t_grouped * 1e6)
