"""SASS of the MXFP4 grouped GEMM's main loop, without a GPU: instructions a decoded weight.

Compiles ``_grouped_mxfp4_kernel`` for sm_90 through Triton's ahead-of-time path (its own ptxas),
specialized as the JIT specializes it at K3's sizes (pointers and multiple-of-16 ints, tiles that
divide N and K), disassembles it with the nvdisasm that Triton carries, finds the main loop (the
longest backward branch) and counts its instructions per thread, per weight (``loop * 32 *
num_warps / (BLOCK_N * BLOCK_K)``: each thread runs the loop body once a K step), by pipe: ``alu``
(logic, shifts, ``prmt``, integer adds, compares: half the issue rate), ``fma`` (fp32, ``imad``, the
bf16x2/fp16x2 ops), ``mem``, ``mma`` and the rest; plus whether the dot became wgmma (``HGMMA``)
or ``mma.sync`` (``HMMA``), registers and spills.

    PYTHONPATH=.venv/triton-interp:. python bench/mxfp4_sass.py [--quick | --sweep] [--out FILE]

``--sweep``: every config of bench/mxfp4_sweep.py (else the library defaults; ``--quick``: the
16-row ones, ~5 s on the CPU box); ``--out``: JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]
from helixserve.kernels.moe import triton_mxfp4 as tm  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIG = {"a_ptr": "*bf16", "rows_ptr": "*i64", "wq_ptr": "*i32", "ws_ptr": "*u8", "out_ptr": "*bf16",
       "blk_expert_ptr": "*i32", "blk_begin_ptr": "*i32", "blk_end_ptr": "*i32", "N": "i32", "K": "i32",
       "stride_am": "i32", "stride_qe": "i32", "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32",
       "stride_om": "i32"}
PIPES = {
    "alu": ("LOP3", "SHF", "PRMT", "IADD3", "SEL", "ISETP", "PLOP3", "LEA", "VIADD", "VIMNMX", "IMNMX", "F2FP", "MOV"),
    "fma": ("IMAD", "FMUL", "FFMA", "FADD", "HMUL2", "HFMA2", "HADD2"),
    "mem": ("LDS", "LDSM", "LDG", "STS", "LDGSTS", "LDGDEPBAR", "DEPBAR", "STSM"),
    "mma": ("HMMA", "HGMMA", "WARPGROUP"),
}


def compile_variant(block_m: int, tiles: tm.Tiles, decode: str, gather: bool = True):
    names = list(SIG)
    divisible = [n for n in names if n.endswith("_ptr")] + ["N", "K", "stride_am", "stride_qe", "stride_qn",
                                                           "stride_se", "stride_sn", "stride_om"]
    constexprs = {"GATHER": gather, "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
                  "DOT_DTYPE": tl.bfloat16, "DECODE": tm.DECODES[decode], "SWAP": tiles.swap, "EVEN_K": True,
                  "EVEN_N": True}
    src = ASTSource(fn=tm._grouped_mxfp4_kernel, signature={**SIG, **{k: "constexpr" for k in constexprs}},
                    constexprs=constexprs, attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN / name), *flags, f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop: from a backward branch's target label to the branch."""
    ins, labels, pending = [], {}, None
    for line in sass.splitlines():
        if m := re.match(r"\s*\.L_x_(\d+):", line):
            pending = m.group(1)
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            addr = int(m.group(1), 16)
            if pending is not None:
                labels[pending], pending = addr, None
            ins.append((addr, m.group(2).strip()))
    best: list[str] = []
    for addr, text in ins:
        if (m := re.search(r"\bBRA\b.*\(\.L_x_(\d+)\)", text)) and labels.get(m.group(1), addr + 1) <= addr:
            body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if labels[m.group(1)] <= a <= addr]
            best = max(best, body, key=len)
    return best


def analyze(block_m: int, tiles: tm.Tiles, decode: str) -> dict:
    k = compile_variant(block_m, tiles, decode)
    cubin = k.asm["cubin"]
    usage = _tool("cuobjdump", cubin, "--dump-resource-usage")
    regs, local = (int(m.group(1)) if (m := re.search(p, usage)) else -1 for p in (r"REG:(\d+)", r"LOCAL:(\d+)"))
    sass = _tool("nvdisasm", cubin, "-c")
    body = main_loop(sass)
    weights = tiles.block_n * tiles.block_k / (32 * tiles.num_warps)  # a thread's, a K step
    pipes = collections.Counter()
    for op in body:
        pipes[next((p for p, prefixes in PIPES.items() if op.split(".")[0] in prefixes), "other")] += 1
    return {"block_m": block_m, "tiles": tiles._asdict(), "decode": decode, "regs": regs, "local": local,
            "loop": len(body), "per_weight": len(body) / weights,
            **{f"{p}_per_weight": n / weights for p, n in pipes.items()},
            "mma": "HGMMA (wgmma)" if "HGMMA" in sass else "HMMA (mma.sync)" if "HMMA" in sass else "none",
            "top": collections.Counter(body).most_common(8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="bench/mxfp4_sweep.py's configs, not the defaults")
    parser.add_argument("--quick", action="store_true", help="the 16-row (decode) defaults only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        variants = [(16, tm._tiles(16))]
    elif args.sweep:
        from mxfp4_sweep import CONFIGS

        variants = [(bm, tm.Tiles(*c)) for bm, cs in CONFIGS.items() for c in cs]
    else:
        variants = [(bm, tm._tiles(bm)) for bm in (16, 32, 64)]
    rows = []
    print(f"{'block_m':>7} {'tiles':<24} {'decode':<7} {'MMA':<16} {'regs':>4} {'spill':>5} {'loop':>5} "
          f"{'/weight':>7} {'alu':>5} {'fma':>5} {'mem':>5} {'mma':>5}")
    for bm, t in variants:
        for decode in tm.DECODES:
            r = analyze(bm, t, decode)
            rows.append(r)
            name = f"{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}" + (" swap" if t.swap else "")
            print(f"{bm:>7} {name:<24} {decode:<7} {r['mma']:<16} {r['regs']:>4} {r['local']:>5} {r['loop']:>5} "
                  f"{r['per_weight']:>7.2f} " + " ".join(f"{r.get(p + '_per_weight', 0):>5.2f}" for p in PIPES),
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
