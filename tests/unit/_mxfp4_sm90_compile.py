"""Compile the MXFP4 Triton kernels for Hopper (sm_90) without a GPU, through Triton's ahead-of-time
path (its own ptxas): what the interpreter accepts but the hardware compiler rejects fails here.
Run as a script (not interpreted); prints one line per kernel (every decode of
:mod:`helixserve.kernels.moe.mxfp4_decode` at each default tile config) with ptxas' registers and
local (spill) bytes from the cuobjdump that Triton carries. Used by test_kernels_mxfp4.py."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from helixserve.kernels.moe import triton_mxfp4 as tm

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _compile(fn, signature: dict[str, str], constexprs: dict, divisible: list[str], **options):
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                    attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def _decoded_via_smem(kernel) -> int:
    """1 when the decoded bf16 tile goes through shared memory before the MMA (wgmma's second
    operand, or Triton not finding a register layout for the decode: a regression at 16/32 rows)."""
    return int(bool(re.search(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+xbf16", kernel.asm["ttgir"])))


def _usage(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, local = re.search(r"REG:(\d+)", out), re.search(r"LOCAL:(\d+)", out)
    return f"regs={regs.group(1) if regs else '?'} local={local.group(1) if local else '?'}"


def main() -> None:
    sig = {"a_ptr": "*bf16", "rows_ptr": "*i64", "wq_ptr": "*i32", "ws_ptr": "*u8", "out_ptr": "*bf16",
           "blk_expert_ptr": "*i32", "blk_begin_ptr": "*i32", "blk_end_ptr": "*i32", "N": "i32", "K": "i32",
           "stride_am": "i32", "stride_qe": "i32", "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32",
           "stride_om": "i32"}
    # the JIT specializes pointers and multiple-of-16 ints, as at K3's sizes (D 3584, I 3072)
    divisible = [n for n in sig if n.endswith("_ptr")] + ["N", "K", "stride_am", "stride_qe", "stride_qn",
                                                         "stride_se", "stride_sn", "stride_om"]
    for block_m in (16, 32, 64):
        t = tm._tiles(block_m)
        for decode, code in tm.DECODES.items():
            for gather in (True, False):
                # sizes that are multiples of 16 and of the tiles (K3's), and odd ones (masked loads)
                for hints in (divisible, [n for n in divisible if n.endswith("_ptr")]):
                    even = hints is divisible
                    k = _compile(tm._grouped_mxfp4_kernel, sig, {
                        "GATHER": gather, "BLOCK_M": block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
                        "DOT_DTYPE": tl.bfloat16, "DECODE": code, "SWAP": t.swap, "EVEN_K": even, "EVEN_N": even,
                    }, hints, num_warps=t.num_warps, num_stages=t.num_stages)
                    print(f"grouped block_m={block_m} decode={decode} gather={gather} hints={len(hints)}: "
                          f"{_usage(k)} smem_tile={_decoded_via_smem(k)}", flush=True)
    fp32 = {**sig, "a_ptr": "*fp32", "out_ptr": "*fp32"}  # an fp32 model holding packed experts
    k = _compile(tm._grouped_mxfp4_kernel, fp32, {"GATHER": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
                                                 "DOT_DTYPE": tl.bfloat16, "DECODE": 1, "SWAP": False,
                                                 "EVEN_K": True, "EVEN_N": True}, divisible, num_warps=4, num_stages=4)
    print(f"grouped fp32 activations: {_usage(k)}", flush=True)
    sig = {"wq_ptr": "*i32", "ws_ptr": "*u8", "out_ptr": "*bf16", "R": "i32", "K": "i32", "stride_qr": "i32",
           "stride_sr": "i32", "stride_or": "i32"}
    for decode, code in tm.DECODES.items():
        k = _compile(tm._dequant_kernel, sig, {"BLOCK_R": 32, "BLOCK_K": 256, "DECODE": code},
                     [n for n in sig if n.endswith("_ptr")] + ["R", "K", "stride_qr", "stride_or"], num_warps=4)
        print(f"dequant decode={decode}: {_usage(k)}", flush=True)


if __name__ == "__main__":
    main()
