"""Packed MXFP4 routed experts vs bf16: the grouped expert GEMMs and the whole ``moe_experts``.

K3's expert shape (3584 -> 2 x 3072 -> 3584), 64 local experts, top-8 routing; decode sizes (1, 8,
32, 64 rows per expert) and prefill sizes (512, 2048 rows per expert). Per case:

- ``gemm``: the two grouped GEMMs alone, rows already sorted by expert: bf16 ``torch._grouped_mm``
  (CUTLASS) vs our Triton kernel over MXFP4 bytes (dequantized in registers; it also gathers the
  input rows itself). Targets: >= 2x the bf16 speed at decode sizes, >= 0.8x at prefill sizes.
- ``dequant+gemm``: the stacks decoded to bf16 by our streaming kernel, then the bf16 grouped GEMMs
  (what ``moe_experts`` runs from ``MXFP4_DEQUANT_MIN_ROWS_PER_EXPERT`` rows per expert on): the
  two rows tell where that threshold belongs.
- ``moe_experts``: the public call (sort, schedule, both GEMMs, SiTU, weighted sum) with
  ``MXFP4Weight`` stacks vs the dequantized bf16 stacks.
- bytes: the weights of the experts that got rows (both formats) plus the activations read and
  written, over the time: the effective bandwidth (roofline: HBM, ~4.8 TB/s on an H200).

Timing: CUDA events, median after warm-up, the two sides alternating (bench/_common.py's gpu_timer).
Without CUDA (or Triton) the packed side is the reference (dequantize per call, then the dense
path) on tiny shapes, so the script runs anywhere; those figures are not the GPU's. A failing case
is recorded with its error and the rest still run; the JSON is rewritten after every case (a killed
run keeps what it measured, marked ``"partial"``).

    python bench/moe_mxfp4.py [--quick] [--out FILE]

On one H200, the GPU tests and this bench in one command (``bench/mxfp4_h200.sh``; through the
device tool: ``run(command="bash bench/mxfp4_h200.sh", carry=[".device"])``, the JSON and the test
log come back from ``$OUT``): ``bench/figures/kernels_mxfp4_h200.json``.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench helpers; the repo when not pip-installed
from _common import base_parser, gpu_timer as timer, machine_info, markdown_table, write_json  # noqa: E402

from helixserve import kernels  # noqa: E402
from helixserve.kernels import MXFP4Weight  # noqa: E402

ROWS: list[dict[str, Any]] = []




def random_packed(E: int, N: int, K: int, device: str, seed: int) -> MXFP4Weight:
    """Random codes and scales near 2^-6 (weights of a few 1e-2, like trained ones)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 256, (E, N, K // 2), generator=gen, device=device, dtype=torch.uint8)
    scales = torch.randint(119, 123, (E, N, K // 32), generator=gen, device=device, dtype=torch.uint8)
    return MXFP4Weight(codes, scales)


def dequantized(w: MXFP4Weight) -> torch.Tensor:
    """bf16 ``[E, N, K]``, one expert at a time (the whole stack at once needs ~10x its size)."""
    return torch.stack([kernels.dequantize_mxfp4(w.packed[e], w.scale[e], torch.bfloat16) for e in range(w.shape[0])])


def bench_case(T: int, D: int, I: int, E: int, top_k: int, kind: str, fast: bool, reps: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from helixserve.kernels.moe import gpu as moe_gpu

    w13, w2 = random_packed(E, 2 * I, D, device, 1), random_packed(E, D, I, device, 2)
    w13_bf16, w2_bf16 = dequantized(w13), dequantized(w2)
    gen = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, D, generator=gen, device=device).bfloat16()
    weights, ids = kernels.moe_route(torch.randn(T, E, generator=gen, device=device), top_k=top_k,
                                     correction_bias=None, renormalize=True, routed_scaling_factor=1.0)
    P = T * top_k
    order, sorted_ids, _ = moe_gpu._sort_pairs(ids, E, 0)
    counts = torch.zeros(E + 1, dtype=torch.int32, device=device).scatter_add_(
        0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))[:E]
    hit = int((counts > 0).sum())
    act = (torch.randn(P, I, generator=gen, device=device) * 0.1).bfloat16()
    per_expert = 3 * I * D
    act_bytes = 2 * P * (D + 2 * I + I + D)
    bytes_bf16 = hit * per_expert * 2 + act_bytes
    bytes_mxfp4 = hit * per_expert * 17 // 32 + act_bytes  # 4 bits + one byte per 32
    label = f"T={T} ({P / E:.0f} rows/expert)"
    if fast:
        from helixserve.kernels.moe import triton_mxfp4

        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = order // top_k
        xs = x.index_select(0, rows)
        w13t, w2t = w13_bf16.transpose(1, 2), w2_bf16.transpose(1, 2)
        schedule = triton_mxfp4.block_schedule(sorted_ids, E, triton_mxfp4.choose_block_m(P, E))

        def gemm_bf16():
            torch._grouped_mm(xs, w13t, offs=offs)
            torch._grouped_mm(act, w2t, offs=offs)

        def gemm_mxfp4():
            triton_mxfp4.grouped_gemm_mxfp4(x, w13, schedule, P, rows=rows)
            triton_mxfp4.grouped_gemm_mxfp4(act, w2, schedule, P)

        def dequant_gemm():
            torch._grouped_mm(xs, triton_mxfp4.dequantize_bf16(w13).transpose(1, 2), offs=offs)
            torch._grouped_mm(act, triton_mxfp4.dequantize_bf16(w2).transpose(1, 2), offs=offs)

        t_bf16, t_mx, t_dq = timer([gemm_bf16, gemm_mxfp4, dequant_gemm], 3, reps)
        record("gemm", kind, label, t_mx, t_bf16, bytes_mxfp4, bytes_bf16, T=T, E=E, top_k=top_k, D=D, I=I,
               block_m=schedule.block_m)
        all_weights = E * per_expert
        record("dequant+gemm", kind, label, t_dq, t_bf16, all_weights * 17 // 32 + 2 * all_weights * 2 + act_bytes,
               bytes_bf16, T=T, E=E, top_k=top_k, D=D, I=I)

    def full_bf16():
        kernels.moe_experts(x, ids, weights, w13_bf16, w2_bf16, activation="situ")

    def full_mxfp4():
        kernels.moe_experts(x, ids, weights, w13, w2, activation="situ")

    t_bf16, t_mx = timer([full_bf16, full_mxfp4], 2 if fast else 1, reps)
    record("moe_experts" if fast else "moe_experts (cpu reference)", kind, label, t_mx, t_bf16,
           bytes_mxfp4, bytes_bf16, T=T, E=E, top_k=top_k, D=D, I=I)


def record(what: str, kind: str, case: str, t_mx: float, t_bf16: float, bytes_mx: int, bytes_bf16: int,
           **extra: Any) -> None:
    speedup = t_bf16 / t_mx
    target = 2.0 if kind == "decode" else 0.8
    ROWS.append({"what": what, "kind": kind, "case": case, "mxfp4_us": t_mx * 1e6, "bf16_us": t_bf16 * 1e6,
                 "speedup": speedup, "target": target, "meets_target": speedup >= target,
                 "mxfp4_bytes": bytes_mx, "bf16_bytes": bytes_bf16,
                 "mxfp4_tb_s": bytes_mx / t_mx / 1e12, "bf16_tb_s": bytes_bf16 / t_bf16 / 1e12, **extra})
    print(f"  {what:<13} {kind:<7} {case:<24} mxfp4 {t_mx * 1e6:9.1f} us ({bytes_mx / t_mx / 1e12:.2f} TB/s) "
          f"| bf16 {t_bf16 * 1e6:9.1f} us ({bytes_bf16 / t_bf16 / 1e12:.2f} TB/s) | {speedup:.2f}x "
          f"(target {target}x)", flush=True)


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    fast = False
    if on_gpu:
        from helixserve.kernels.triton_common import has_triton

        fast = has_triton() and hasattr(torch, "_grouped_mm")
        if not fast:
            print("CUDA but no Triton (the gpu extra) or no torch._grouped_mm: timing moe_experts only", flush=True)
    else:
        print("no CUDA: the packed side is the reference (dequantize, then matmul) on tiny shapes", flush=True)
    reps = args.reps or (5 if args.quick else 20)
    if on_gpu:
        D, I, E, top_k = 3584, 3072, 64, 8
        decode = (64, 512) if args.quick else (8, 64, 256, 512)
        prefill = (4096,) if args.quick else (4096, 16384)
    else:
        D, I, E, top_k = 128, 64, 8, 2
        decode, prefill = (4,), (64,)
    started = time.perf_counter()
    errors = []
    info = machine_info()
    if on_gpu:
        info["gpu"] = torch.cuda.get_device_name()
    for kind, sizes in (("decode", decode), ("prefill", prefill)):
        for T in sizes:
            try:
                bench_case(T, D, I, E, top_k, kind, fast, reps)
            except Exception as exc:  # record it, keep the other cases
                traceback.print_exc()
                errors.append({"kind": kind, "T": T, "error": f"{type(exc).__name__}: {exc}"})
            if on_gpu:
                torch.cuda.empty_cache()
            write_json(args.out, {"machine": info, "rows": ROWS, "errors": errors, "partial": True})  # survives a kill
    headers = ["what", "kind", "case", "mxfp4 µs", "bf16 µs", "speedup", "target", "mxfp4 TB/s", "bf16 TB/s"]
    table = markdown_table(headers, [[r["what"], r["kind"], r["case"], r["mxfp4_us"], r["bf16_us"],
                                      f"{r['speedup']:.2f}×", f"{r['target']}×", r["mxfp4_tb_s"], r["bf16_tb_s"]]
                                     for r in ROWS])
    print(f"\n{info.get('gpu') or info['processor']}, torch {info['torch']}, {time.perf_counter() - started:.0f} s\n")
    print(table)
    for e in errors:
        print(f"FAILED {e['kind']} T={e['T']}: {e['error']}", flush=True)
    write_json(args.out, {"machine": info, "rows": ROWS, "errors": errors, "table": table})
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
