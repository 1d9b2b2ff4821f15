"""A Triton kernel for tests that must see one compilation happen (imported only where Triton is)."""

import itertools

import triton
import triton.language as tl


@triton.jit
def fill_kernel(out_ptr, value, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.full((BLOCK,), value, tl.float32))


_exponents = itertools.count(4)


def fresh_block() -> int:
    """A block size no earlier call in this process used: its launch compiles a new variant."""
    return 1 << next(_exponents)
