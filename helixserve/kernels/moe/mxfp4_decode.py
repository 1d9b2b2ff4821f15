"""In-register decodes of MXFP4 code words for the grouped expert GEMM (:mod:`.triton_mxfp4`).

A word is a little-endian uint32 of 8 e2m1 codes, ``c0`` in bits 0..3 (low nibble first): code bit
3 the sign, bits 0..2 the magnitude ``e1 e0 m`` (``2^(e-1) * (1 + m/2)``; ``e = 0``: ``m/2``), so
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. A word's scale byte ``s`` (e8m0, one per 4 words) is ``2^(s-127)``.
Each decode maps ``q [R, C]`` words and ``s [R, C]`` their scale bytes to ``[R, 8 C]`` values in
code order (the GEMM's K order is the weights'), all exactly (an e2m1 value times a power of two
has 2 mantissa bits: exact in bf16 wherever it does not overflow). SASS counts below: sm_90, the
16-row default tiles, the main loop less the same loop with a bare unpack for the decode (the whole
loop per config: ``bench/mxfp4_sass.py``):

- ``fp32`` (:func:`decode_fp32`, pure Triton, the only one the interpreter runs): each magnitude
  under fp16's exponent/mantissa boundary and the sign on fp16's sign bit (value ``e2m1 * 2^-14``,
  0.5 a subnormal the fp16 -> fp32 conversion keeps), two codes per mask-and-shift, then fp32 times
  ``2^(s - 127) * 2^14`` and a round to bf16. ~39 instructions a word (conversions, fp32
  multiplies, packing), ~4.8 a weight: at decode sizes it bounds the GEMM.
- ``bf16x2`` (:func:`decode_bf16x2`, PTX, sm_80+): bf16 pairs straight from the word. Codes ``k``
  and ``k + 4`` sit at the same nibble of the two 16-bit halves, so one shift of the word puts
  both magnitudes on bits 6..8 of their halves and one ``lop3`` bit-select takes those bits from
  it and bits 15 / 31 from a shifted copy of the word's sign bits (masked once a word: the other
  signs it carries land on bits 6..8, which the select ignores): a bf16 pair of value
  ``e2m1 * 2^-126`` (0.5: the bf16 subnormal ``0x0040``), 3 instructions a pair. Two ``prmt``
  regroup ``(ck, ck+4)`` into the pairs of consecutive codes the MMA operand holds, then two bf16x2
  multiplies: by ``2^126`` (the e2m1 value, exact and normal) and by the scale. ~25 a word (3.1 a
  weight), half of them on the integer pipe.
- ``lut`` (:func:`decode_lut`, PTX): ``prmt`` as a byte table. One ``prmt`` looks the low (high)
  bytes of four codes' bf16 magnitudes up in an 8-byte table held in 2 registers, the magnitudes
  as byte selectors; the signs are or-ed into the high bytes, a ``prmt`` interleaves low and high
  bytes into bf16 pairs, one multiply by the scale (no subnormal anywhere). ~23 a word (2.9 a
  weight), but most of them ``prmt``, on the integer pipe (which issues at half the rate of the
  bf16x2 multiplies), and ptxas copies the table register before each lookup.

Scales (both PTX decodes): the bf16x2 factor is ``s << 7`` in each half, ``2^(s - 127)`` for ``s``
in 1..254, ``+0`` for ``s = 0`` and ``+inf`` for ``s = 255``, so a weight is ``±0`` at ``s = 0``
and ``±inf`` at ``s = 255`` (NaN for the two zero codes), exactly what ``fp32`` gives (its fp32
scale is ``0`` / ``inf`` there). The reference (:func:`~helixserve.kernels.moe.mxfp4.dequantize_mxfp4`)
reads ``s = 0`` as ``2^-127`` (weights below 1e-38) and ``s = 255`` as NaN. ``fp32`` also overflows
to ``inf`` from ``s = 241`` (``2^(s - 113)`` in fp32), where the PTX decodes match the reference
(overflow included: ``6 * 2^127`` is ``inf`` in both).

bf16 ``fma``/``mul`` have no flush-to-zero mode in PTX (subnormal inputs and results are kept: the
``bf16x2`` decode's 0.5 and products below ``2^-126`` need it). ``fma.rn.bf16x2 d, a, b, -0.0`` is
the multiply on sm_80 (``mul.bf16x2`` is sm_90+; ptxas emits ``HMUL2.BF16_V2`` for it on sm_90),
equal to it: a product is exact or rounded once, and the ``-0.0`` addend keeps every product,
zeros' signs included.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _halves_to_f32(h):
    """Two fp16 bit patterns in a uint32 -> (low half, high half) as fp32 (exact, subnormals kept)."""
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight ``[R, C]`` tensors, ``ci`` the code ``i`` of each word -> ``[R, 8 C]`` in code order.

    Each join appends the minor-most dim, so the first join is the major one: ``[.., i, j, k]``
    is code ``4i + 2j + k``."""
    w = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(w, (c0.shape[0], c0.shape[1] * 8))


@triton.jit
def decode_words_f32(q):
    """``q [R, C]`` uint32 words -> ``[R, 8 C]`` fp32 values times 2^-14, in order, exactly.

    Two codes of the same nibble position in bytes 0 and 2 (or 1 and 3) move with one
    mask-and-shift, so a word of 8 codes costs 4 such pairs, not 8 extractions."""
    c0, c4 = _halves_to_f32(((q & 0x00070007) << 9) | ((q & 0x00080008) << 12))
    c1, c5 = _halves_to_f32(((q & 0x00700070) << 5) | ((q & 0x00800080) << 8))
    c2, c6 = _halves_to_f32(((q & 0x07000700) << 1) | ((q & 0x08000800) << 4))
    c3, c7 = _halves_to_f32(((q & 0x70007000) >> 3) | (q & 0x80008000))
    return _join8(c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def word_scales(s, GROUPS: tl.constexpr):
    """``s [R, GROUPS]`` scale bytes -> ``[R, 4 GROUPS]``, each code word's (4 words a group)."""
    R: tl.constexpr = s.shape[0]
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, GROUPS, 4)), (R, GROUPS * 4))


@triton.jit
def decode_fp32(q, s, OUT_DTYPE: tl.constexpr):
    """``q [R, C]`` uint32 words, ``s [R, C]`` their scale bytes -> ``[R, 8 C]`` in ``OUT_DTYPE``."""
    R: tl.constexpr = q.shape[0]
    C: tl.constexpr = q.shape[1]
    w = decode_words_f32(q)
    # 2^(s - 127) * 2^14 (undoing the decode's 2^-14); byte 0 reads as 0, bytes > 240 overflow
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0
    w = tl.reshape(tl.reshape(w, (R, C, 8)) * scale[:, :, None], (R, C * 8))
    return w.to(OUT_DTYPE)


# Inline PTX, one instance a word: $0..$7 the bf16 codes 0..7 (16-bit), $8 the word, $9 the bf16x2
# scale factor. d = a * b is "fma.rn.bf16x2 d, a, b, neg0" (sm_80; bf16x2 takes no immediates).
_BF16X2_ASM = tl.constexpr("""{
.reg .b32 s0, s1, x, y, r0, r1, r2, r3, p, c126, neg0;
mov.b32 c126, 0x7E807E80;
mov.b32 neg0, 0x80008000;
and.b32 s0, $8, 0x08080808;
and.b32 s1, $8, 0x80808080;
shl.b32 x, $8, 6;
shl.b32 y, s0, 12;
lop3.b32 r0, x, y, 0x01C001C0, 0xE4;
shl.b32 x, $8, 2;
shl.b32 y, s1, 8;
lop3.b32 r1, x, y, 0x01C001C0, 0xE4;
shr.u32 x, $8, 2;
shl.b32 y, s0, 4;
lop3.b32 r2, x, y, 0x01C001C0, 0xE4;
shr.u32 x, $8, 6;
lop3.b32 r3, x, s1, 0x01C001C0, 0xE4;
prmt.b32 p, r0, r1, 0x5410;
fma.rn.bf16x2 p, p, c126, neg0;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$0, $1}, p;
prmt.b32 p, r2, r3, 0x5410;
fma.rn.bf16x2 p, p, c126, neg0;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$2, $3}, p;
prmt.b32 p, r0, r1, 0x7632;
fma.rn.bf16x2 p, p, c126, neg0;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$4, $5}, p;
prmt.b32 p, r2, r3, 0x7632;
fma.rn.bf16x2 p, p, c126, neg0;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$6, $7}, p;
}""")
# r_k = (c_k, c_k+4) as bf16 * 2^-126: lop3 0xE4 is (x & mask) | (y & ~mask), mask = bits 6..8 of
# each half; y = the word's sign bits shifted onto bits 15 / 31 (s0: even codes', s1: odd codes')

# Byte tables (magnitude 0..7 -> byte of its bf16): low bytes 00 00 80 C0 00 40 80 C0 (la: 0..3,
# lb: 4..7), high bytes 00 3F 3F 3F 40 40 40 40; g: the codes' signs on their bytes' bit 7
# (z = word << 4 holds the even codes' sign bits there, the word itself the odd codes').
_LUT_ASM = tl.constexpr("""{
.reg .b32 qm, qh, la, lb, ha, hb, l0, h0, l1, h1, z, g, p, neg0;
mov.b32 neg0, 0x80008000;
mov.b32 la, 0xC0800000;
mov.b32 lb, 0xC0804000;
mov.b32 ha, 0x3F3F3F00;
mov.b32 hb, 0x40404040;
and.b32 qm, $8, 0x77777777;
shr.u32 qh, qm, 16;
prmt.b32 l0, la, lb, qm;
prmt.b32 h0, ha, hb, qm;
prmt.b32 l1, la, lb, qh;
prmt.b32 h1, ha, hb, qh;
shl.b32 z, $8, 4;
prmt.b32 g, z, $8, 0x5140;
lop3.b32 h0, h0, g, 0x80808080, 0xF8;
prmt.b32 g, z, $8, 0x7362;
lop3.b32 h1, h1, g, 0x80808080, 0xF8;
prmt.b32 p, l0, h0, 0x5140;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$0, $1}, p;
prmt.b32 p, l0, h0, 0x7362;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$2, $3}, p;
prmt.b32 p, l1, h1, 0x5140;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$4, $5}, p;
prmt.b32 p, l1, h1, 0x7362;
fma.rn.bf16x2 p, p, $9, neg0;
mov.b32 {$6, $7}, p;
}""")
_OUT8 = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r")


@triton.jit
def _decode_ptx(q, s, ASM: tl.constexpr):
    # s << 7 in both halves (s <= 255: no carry across): the bf16x2 factor 2^(s - 127)
    c = tl.inline_asm_elementwise(ASM, _OUT8, [q, s.to(tl.int32) * 0x00800080],
                                  dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                                         tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                  is_pure=True, pack=1)
    return _join8(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7])


@triton.jit
def decode_bf16x2(q, s):
    """As :func:`decode_fp32`, bf16 out: the bit-select decode (inline PTX)."""
    return _decode_ptx(q, s, _BF16X2_ASM)


@triton.jit
def decode_lut(q, s):
    """As :func:`decode_fp32`, bf16 out: the byte-table decode (inline PTX)."""
    return _decode_ptx(q, s, _LUT_ASM)


@triton.jit
def decode_selected(q, s, DECODE: tl.constexpr, FP32_OUT_DTYPE: tl.constexpr):
    """The decode numbered ``DECODE`` (0 :func:`decode_fp32`, to ``FP32_OUT_DTYPE``; 1
    :func:`decode_bf16x2`; 2 :func:`decode_lut`): what both MXFP4 kernels call."""
    if DECODE == 1:
        w = decode_bf16x2(q, s)
    elif DECODE == 2:
        w = decode_lut(q, s)
    else:
        w = decode_fp32(q, s, FP32_OUT_DTYPE)
    return w
