"""One-shot H200 sweep of the MXFP4 grouped expert GEMM: decodes x tile configs vs bf16.

K3's expert shapes (D 3584, I 3072), 64 local experts, top-8 routing, T = 8, 64, 256, 512 tokens
(1, 8, 32, 64 rows per expert: decode sizes) and T = 4096 (512: prefill), cases built as
``bench/moe_mxfp4.py`` builds them (its ``random_packed`` / ``dequantized``, random routing, the
library's ``block_schedule``). Per case, each of the two grouped GEMMs alone (rows already sorted):
gate/up (``N = 2 I, K = D``, the kernel gathering the token rows) and down (``N = D, K = I``):

- ``bf16``: ``torch._grouped_mm`` over the dequantized stacks, exactly as bench/moe_mxfp4.py;
- every decode of :mod:`helixserve.kernels.moe.mxfp4_decode` (``fp32`` the old one, ``bf16x2``,
  ``lut``) over ~8 tile configs for the case's row-block size (``*``: the library default, ``swap``:
  the transposed product, wgmma on Hopper), via ``grouped_gemm_mxfp4(..., decode=, tiles=)``;
- ``dequant+bf16``: the stack decoded to bf16 by ``dequantize_bf16``, then the bf16 GEMM (the
  library's prefill path).

Each output is checked against the bf16 GEMM's (same bf16 weights, fp32 accumulation, bf16 out):
relative RMS error below 1e-2 and no NaN, else ``ok`` is False (two bf16 roundings of the same
sums differ by ~2e-3; a wrong code or scale, by far more). Times: CUDA events, median over
``--reps`` alternating calls (bench/_common.py's gpu_timer). TB/s: the bytes of the experts that got
rows (4.25 bits a weight packed, 16 in bf16) plus the activations read and written. Every kernel is
compiled first, in parallel worker processes (``--jobs``; Triton's on-disk cache hands them to this
process). The JSON (``--out``) is rewritten after every GEMM, so a killed run keeps what it measured;
past ``--budget`` seconds the remaining variants are skipped (recorded as such).

    python bench/mxfp4_sweep.py --out FILE [--reps 10] [--jobs 12] [--budget 220] [--cases 8,64]
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench helpers; the repo when not pip-installed
from _common import base_parser, gpu_timer, machine_info, markdown_table, write_json  # noqa: E402

D, I, E, TOP_K = 3584, 3072, 64, 8
DEVICE = "cuda"
CASES = (8, 64, 256, 512, 4096)
DECODES = ("fp32", "bf16x2", "lut")
# (block_n, block_k, num_warps, num_stages, swap) per row-block size; the first is the library default
CONFIGS: dict[int, list[tuple[int, int, int, int, bool]]] = {
    16: [(64, 128, 4, 4, False), (128, 128, 4, 4, False), (64, 256, 4, 3, False), (128, 256, 8, 3, False),
         (32, 256, 4, 4, False), (128, 128, 8, 3, False), (64, 128, 4, 3, True), (128, 128, 4, 3, True)],
    32: [(64, 128, 4, 3, False), (128, 128, 4, 3, False), (128, 64, 4, 3, False), (128, 128, 8, 3, False),
         (64, 128, 4, 3, True), (128, 128, 4, 3, True), (128, 64, 4, 4, True), (64, 256, 4, 2, True)],
    64: [(128, 64, 8, 3, False), (128, 128, 8, 3, False), (64, 128, 4, 3, False), (128, 64, 4, 4, False),
         (128, 64, 8, 3, True), (128, 128, 8, 3, True), (64, 128, 4, 3, True), (128, 64, 4, 4, True)],
}
GEMMS = {"gate_up": (2 * I, D, True), "down": (D, I, False)}  # name -> (N, K, gathers its rows)


def block_m_of(T: int) -> int:
    from helixserve.kernels.moe.triton_mxfp4 import choose_block_m

    return choose_block_m(T * TOP_K, E)


class _CompileOnlyDriver:
    """Triton driver for a compile-only worker: reports the GPU's target and touches no device, so
    workers need no CUDA context (nor may a compute mode refuse them one); the binaries and their
    cache keys are what the JIT builds on the GPU for the same target."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_device_interface(self) -> Any:
        return torch.cuda

    def get_benchmarker(self) -> Any:
        return None

    def get_empty_cache_for_benchmark(self) -> Any:
        return None


def _compile_worker(target: tuple[str, int, int], specs: list[tuple[str, int, str, tuple]]) -> list[str]:
    """In a spawned process: compile (Triton ``warmup``, no launch) each (gemm, block_m, decode,
    tiles) on meta tensors of the real shapes; the binaries land in Triton's on-disk cache."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from helixserve.kernels import MXFP4Weight
    from helixserve.kernels.moe import triton_mxfp4 as tm

    driver.set_active(_CompileOnlyDriver(GPUTarget(*target)))

    def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    def compile_one(gemm: str, block_m: int, decode: str, cfg: tuple) -> None:
        N, K, gather = GEMMS[gemm]
        P = 64 * block_m  # any: only the strides and dtypes reach the kernel's specialization
        w = MXFP4Weight(meta(E, N, K // 2, dtype=torch.uint8), meta(E, N, K // 32, dtype=torch.uint8))
        sched = tm.BlockSchedule(block_m, *(meta(64, dtype=torch.int32) for _ in range(3)))
        a = meta(P // TOP_K if gather else P, K, dtype=torch.bfloat16)
        rows = meta(P, dtype=torch.int64) if gather else None
        tm._grouped_launch(a, w, sched, P, rows, decode, tm.Tiles(*cfg), warmup=True)

    errors = []
    for n, spec in enumerate(specs):
        try:
            try:
                compile_one(*spec)
            except Exception:
                if n:
                    raise
                driver.reset_active()  # this Triton's driver API differs: compile through the real one
                compile_one(*spec)
        except Exception as exc:  # the main process compiles it on first use (and reports a real error)
            errors.append(f"{spec}: {type(exc).__name__}: {exc}"[:300])
    return errors


def precompile(block_ms: list[int], jobs: int) -> tuple[float, list[str]]:
    from triton.runtime.driver import driver

    t = driver.active.get_current_target()
    target = (t.backend, t.arch, t.warp_size)
    specs = [(g, bm, d, c) for bm in block_ms for c in CONFIGS[bm] for d in DECODES for g in GEMMS]
    t0 = time.perf_counter()
    chunks = [c for c in (specs[i::jobs] for i in range(jobs)) if c]
    errors: list[str] = []
    try:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=len(chunks), mp_context=mp.get_context("spawn")) as pool:
            for errs in pool.map(_compile_worker, [target] * len(chunks), chunks):
                errors += errs
    except Exception as exc:  # the JIT compiles them on first use instead
        errors.append(f"parallel compile failed ({type(exc).__name__}: {exc}); compiling on first use")
    return time.perf_counter() - t0, errors


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def run_case(T: int, w: dict, reps: int, deadline: float, rows_out: list[dict], errors: list[dict]) -> None:
    from helixserve import kernels
    from helixserve.kernels.moe import gpu as moe_gpu
    from helixserve.kernels.moe import triton_mxfp4 as tm

    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, D, generator=gen, device=dev).bfloat16()
    _, ids = kernels.moe_route(torch.randn(T, E, generator=gen, device=dev), top_k=TOP_K, correction_bias=None,
                               renormalize=True, routed_scaling_factor=1.0)
    P = T * TOP_K
    order, sorted_ids, _ = moe_gpu._sort_pairs(ids, E, 0)
    counts = torch.zeros(E + 1, dtype=torch.int32, device=dev).scatter_add_(
        0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))[:E]
    hit = int((counts > 0).sum())
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = order // TOP_K
    xs = x.index_select(0, rows)
    act = (torch.randn(P, I, generator=gen, device=dev) * 0.1).bfloat16()
    block_m = block_m_of(T)
    schedule = tm.block_schedule(sorted_ids, E, block_m)
    case = f"T={T} ({P / E:.0f} rows/expert)"
    for gemm, (N, K, gather) in GEMMS.items():
        packed, dense = w[gemm]
        a_in, a_dense = (x, xs) if gather else (act, act)
        bf16_fn = lambda a_dense=a_dense, dense_t=dense.transpose(1, 2): torch._grouped_mm(a_dense, dense_t, offs=offs)
        ref = bf16_fn()
        act_bytes = 2 * P * (K + N)
        bytes_mx, bytes_bf16 = hit * N * K * 17 // 32 + act_bytes, hit * N * K * 2 + act_bytes
        variants: list[tuple[str, str, bool, Any]] = []
        for i, cfg in enumerate(CONFIGS[block_m]):
            for decode in DECODES:
                def fn(a=a_in, wt=packed, r=rows if gather else None, d=decode, t=tm.Tiles(*cfg)):
                    return tm.grouped_gemm_mxfp4(a, wt, schedule, P, rows=r, decode=d, tiles=t)
                variants.append((decode, "{}x{} w{} s{}{}".format(*cfg[:4], " swap" if cfg[4] else ""), i == 0, fn))

        def dequant_fn(a=a_dense, wt=packed):
            return torch._grouped_mm(a, tm.dequantize_bf16(wt).transpose(1, 2), offs=offs)
        variants.append(("dequant+bf16", "-", False, dequant_fn))
        timed, results = [], []
        for decode, cfg_name, default, fn in variants:
            row = {"case": case, "T": T, "gemm": gemm, "N": N, "K": K, "block_m": block_m, "decode": decode,
                   "config": cfg_name, "default": default, "hit_experts": hit}
            if time.perf_counter() > deadline:
                row["skipped"] = "budget"
                rows_out.append(row)
                continue
            out = None
            try:
                t0 = time.perf_counter()
                out = fn()
                if dev == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - t0  # compile or cache load included
                err = rel_rms(ref, out)
                row["rel_rms"], row["ok"] = err, bool(err < 1e-2)
                timed.append(fn)
                results.append(row)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                errors.append({"case": case, "gemm": gemm, "variant": f"{decode} {cfg_name}", "error": row["error"]})
                traceback.print_exc()
            rows_out.append(row)
            del out
        if timed:
            times = gpu_timer([bf16_fn] + timed, 2, reps)
            for row, t in zip(results, times[1:]):
                mx = row["decode"] != "dequant+bf16"
                row.update(us=t * 1e6, bf16_us=times[0] * 1e6, speedup=times[0] / t,
                           tb_s=(bytes_mx if mx else bytes_bf16) / t / 1e12, bf16_tb_s=bytes_bf16 / times[0] / 1e12)
            best = min(results, key=lambda r: r["us"] if r["ok"] else float("inf"))
            print(f"  {case:<24} {gemm:<7} bf16 {times[0] * 1e6:8.1f} us | best {best['decode']} {best['config']}: "
                  f"{best['us']:8.1f} us ({best['speedup']:.2f}x, {best['tb_s']:.2f} TB/s)", flush=True)
        del ref


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--budget", type=float, default=220.0, help="seconds; later variants are skipped")
    parser.add_argument("--cases", default=",".join(map(str, CASES)), help="token counts, comma-separated")
    args = parser.parse_args()
    started = time.perf_counter()
    if not torch.cuda.is_available():  # what it measures (PTX decodes, tile configs) exists only there
        reason = "needs a CUDA GPU (the PTX decodes and tile configs are what it measures)"
        print(markdown_table(["sweep", "status"], [["mxfp4 decodes x tiles", f"skipped: {reason}"]]))
        write_json(args.out, {"machine": machine_info(), "skipped": reason, "rows": []})
        return
    from moe_mxfp4 import dequantized, random_packed

    cases = [int(t) for t in args.cases.split(",")]
    if args.quick:
        cases, args.reps = cases[:2], 5
    info = machine_info()
    import triton

    info.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    compile_s, compile_errors = precompile(sorted({block_m_of(T) for T in cases}), args.jobs)
    print(f"compiled {sum(len(CONFIGS[b]) for b in {block_m_of(T) for T in cases}) * 6} kernels in {compile_s:.0f} s "
          f"({args.jobs} processes); {len(compile_errors)} errors", flush=True)
    for e in compile_errors:
        print("  compile:", e, flush=True)
    w13, w2 = random_packed(E, 2 * I, D, DEVICE, 1), random_packed(E, D, I, DEVICE, 2)
    weights = {"gate_up": (w13, dequantized(w13)), "down": (w2, dequantized(w2))}
    rows: list[dict] = []
    errors: list[dict] = []
    deadline = started + args.budget
    payload = {"machine": info, "compile_s": compile_s, "compile_errors": compile_errors, "rows": rows,
               "errors": errors, "partial": True}
    for T in cases:
        try:
            run_case(T, weights, args.reps, deadline, rows, errors)
        except Exception as exc:
            traceback.print_exc()
            errors.append({"case": f"T={T}", "error": f"{type(exc).__name__}: {exc}"[:500]})
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        write_json(args.out, payload)
    timed = [r for r in rows if "us" in r]
    headers = ["case", "gemm", "decode", "config", "µs", "TB/s", "vs bf16", "ok", "bf16 µs"]
    table = markdown_table(headers, [[r["case"], r["gemm"], r["decode"], r["config"] + (" *" if r["default"] else ""),
                                      r["us"], r["tb_s"], f"{r['speedup']:.2f}×", "ok" if r["ok"] else "MISMATCH",
                                      r["bf16_us"]] for r in timed])
    best: list[dict] = []
    for T in cases:  # one config per row-block size serves both GEMMs: the best pair (summed times)
        mine = [r for r in timed if r["T"] == T]
        pairs: dict[tuple[str, str], list[dict]] = {}
        for r in mine:
            if r["ok"] and r["decode"] != "dequant+bf16":
                pairs.setdefault((r["decode"], r["config"]), []).append(r)
        pairs = {k: v for k, v in pairs.items() if len(v) == len(GEMMS)}
        if pairs:
            (dec, cfg), rs = min(pairs.items(), key=lambda kv: sum(r["us"] for r in kv[1]))
            us, bf16 = sum(r["us"] for r in rs), sum(r["bf16_us"] for r in rs)
            best.append({"T": T, "block_m": block_m_of(T), "decode": dec, "config": cfg, "us": us, "bf16_us": bf16,
                         "speedup": bf16 / us})
    print(f"\n{info['gpu']}, torch {info['torch']}, triton {info['triton']}, {time.perf_counter() - started:.0f} s\n")
    print(table)
    print("\nbest decode+config per case (both GEMMs, one config):")
    for b in best:
        print(f"  T={b['T']:<5} block_m={b['block_m']:<3} {b['decode']:<7} {b['config']:<20} {b['us']:9.1f} us "
              f"vs bf16 {b['bf16_us']:9.1f} us: {b['speedup']:.2f}x", flush=True)
    bad = [r for r in rows if r.get("ok") is False]
    for r in bad:
        print(f"MISMATCH {r['case']} {r['gemm']} {r['decode']} {r['config']}: rel-rms {r['rel_rms']}", flush=True)
    payload.update(partial=False, table=table, best=best, seconds=time.perf_counter() - started)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
