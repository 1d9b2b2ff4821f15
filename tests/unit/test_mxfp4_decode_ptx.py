"""The inline-PTX MXFP4 decodes (:mod:`helixserve.kernels.moe.mxfp4_decode`), run on the CPU by a
small emulator of the PTX instructions they use (``mov and shl shr lop3 prmt fma.rn.bf16x2``): the
asm text as shipped, on every code at every nibble and every scale byte, against the e2m1 table.
What it cannot check is the hardware (subnormal bf16 arithmetic, ptxas): tests/unit/test_gpu_mxfp4.py
does, on a GPU."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

from helixserve.models.mxfp4 import E2M1_VALUES
from tests._testing import run_under_triton_interpreter

_HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not _HAS_TRITON, reason="runs in the child pytest that has Triton")


def test_ptx_decodes_in_a_child_with_triton():
    """The asm strings live in a Triton module: without Triton here, the tests below run in a child
    pytest with Triton on its path (``HELIXSERVE_TRITON_INTERP``), as the interpreter tests do."""
    if _HAS_TRITON:
        pytest.skip("Triton importable here: the tests below run in this process")
    run_under_triton_interpreter(__file__)

U = np.uint64
M32 = U(0xFFFFFFFF)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bit patterns (uint64), round to nearest even, subnormals kept, NaN canonical."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32).view(np.uint32).astype(np.uint64)  # exact here: products of bf16 pairs
    nan = np.isnan(x)
    r = (f + np.uint64(0x7FFF) + ((f >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.where(nan, np.uint64(0x7FC0), r & np.uint64(0xFFFF))


def _bf16_value(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _bits(x: np.ndarray, lo: int, n: int) -> np.ndarray:
    return (x >> U(lo)) & U((1 << n) - 1)


def _prmt(a, b, c):
    """prmt.b32 (default mode): output byte i is byte ``c[4i+2:4i]`` of ``{b, a}``, or its sign
    bit replicated when ``c[4i+3]`` is set."""
    pool = a | (b << U(32))
    out = np.zeros_like(a)
    for i in range(4):
        sel = _bits(c, 4 * i, 4)
        byte = (pool >> (U(8) * (sel & U(7)))) & U(0xFF)
        byte = np.where(sel & U(8), np.where(byte & U(0x80), U(0xFF), U(0)), byte)
        out |= byte << U(8 * i)
    return out


def _lop3(a, b, c, lut: int):
    """lop3.b32: bit ``(a << 2) | (b << 1) | c`` of ``lut`` (``0xF0`` is ``a``, ``0xCC`` ``b``, ``0xAA`` ``c``)."""
    out = np.zeros_like(a)
    for bit in range(32):
        idx = (_bits(a, bit, 1) << U(2)) | (_bits(b, bit, 1) << U(1)) | _bits(c, bit, 1)
        out |= ((U(lut) >> idx) & U(1)) << U(bit)
    return out


def _fma_bf16x2(a, b, c):
    halves = []
    for sh in (np.uint64(0), np.uint64(16)):
        va, vb, vc = (_bf16_value((t >> sh) & np.uint64(0xFFFF)) for t in (a, b, c))
        with np.errstate(invalid="ignore", over="ignore"):
            halves.append(_bf16_round(va * vb + vc))
    return halves[0] | (halves[1] << np.uint64(16))


def run_ptx(asm: str, inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Emulate ``asm`` (one instance, 32-bit operands as uint64 arrays); returns the ``$n`` outputs
    (16-bit outputs of ``mov.b32 {$a, $b}`` as their halves)."""
    regs: dict[str, np.ndarray] = {f"${k}": v.astype(np.uint64) for k, v in inputs.items()}
    shape = next(iter(inputs.values())).shape

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0), dtype=np.uint64)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if m := re.fullmatch(r"\{(\$\d+),\s*(\$\d+)\}, (\w+)", rest):
            regs[m[1]], regs[m[2]] = regs[m[3]] & np.uint64(0xFFFF), regs[m[3]] >> np.uint64(16)
            continue
        d, *src = (t.strip() for t in rest.split(","))
        v = [val(t) for t in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & M32
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "lop3.b32":
            r = _lop3(v[0], v[1], v[2], int(src[3], 0))
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        elif op == "fma.rn.bf16x2":
            r = _fma_bf16x2(v[0], v[1], v[2])
        else:
            raise AssertionError(f"unemulated PTX: {line}")
        regs[d] = r
    return {int(k[1:]): v for k, v in regs.items() if k[1:].isdigit() and int(k[1:]) < 8}


def expected(codes: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The kernels' semantics: e2m1 * 2^(s-127) in bf16 (overflow: inf), s = 0 -> ±0, s = 255 -> ±inf (NaN at ±0)."""
    v = np.array(E2M1_VALUES)[codes]
    with np.errstate(invalid="ignore", over="ignore"):
        factor = np.where(s == 0, 0.0, np.where(s == 255, np.inf, np.ldexp(1.0, s.astype(np.int64) - 127)))
        return _bf16_value(_bf16_round(v * factor))


@needs_triton
@pytest.mark.parametrize("name", ["_BF16X2_ASM", "_LUT_ASM"])
def test_ptx_decode_every_code_at_every_nibble_and_every_scale(name):
    from helixserve.kernels.moe import mxfp4_decode

    asm = getattr(mxfp4_decode, name).value
    rng = np.random.default_rng(0)
    # every code at every nibble (the others random), each code at all 8, random words; x 256 scales
    codes = rng.integers(0, 16, size=(16 * 8 + 16 + 512, 8))
    codes[np.arange(128), np.arange(128) // 16] = np.arange(128) % 16
    codes[128:144] = np.arange(16)[:, None]
    codes = np.repeat(codes, 256, axis=0)
    s = np.tile(np.arange(256), len(codes) // 256)
    q = np.zeros(len(codes), dtype=np.uint64)
    for n in range(8):
        q |= codes[:, n].astype(np.uint64) << np.uint64(4 * n)
    scale_word = s.astype(np.uint64) * np.uint64(0x00800080)  # as the kernel builds it
    out = run_ptx(asm, {8: q, 9: scale_word})
    for n in range(8):
        got, want = _bf16_value(out[n]), expected(codes[:, n], s)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        zeros_signed = np.signbit(got[want == 0]) == np.signbit(want[want == 0])
        assert same.all() and zeros_signed.all(), (
            f"{name} code {n}: {int((~same).sum())} mismatches, e.g. word {int(q[~same][0]):#010x} "
            f"s={int(s[~same][0])}: {got[~same][0]} != {want[~same][0]}")
