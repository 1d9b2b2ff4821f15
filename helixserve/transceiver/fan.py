"""Fan-in: which ranks of a ctx world hold a gen rank's shard, and where (pure, torch-free).

A ctx world of ``tp N`` is laid out as the helix layout dp 1 x cp N: ctx rank ``s`` holds the MLA
blocks ``b`` with ``b % N == s`` (its k-th local block is global block ``s + k*N``) and the KDA heads
``[s*H/N, (s+1)*H/N)`` of every KDA layer's recurrent and conv state. A gen rank with
``(cp_rank r, cp_size c)`` needs the blocks ``b % c == r`` (its k-th local block is ``r + k*c``)
and the heads ``[r*H/c, (r+1)*H/c)``. Its shard therefore comes from the ctx ranks ``s`` that hold
part of it (:func:`sources`), each one a :class:`Source`:

- blocks ``b`` with ``b % c == r`` and ``b % N == s``: none when ``r`` and ``s`` differ modulo
  ``gcd(c, N)``, else every ``lcm(c, N)``-th block from the first such ``b`` -- at ctx local index
  ``b // N`` and gen local index ``b // c``;
- heads ``[max(r*H/c, s*H/N), min((r+1)*H/c, (s+1)*H/N))`` (possibly empty): a whole ctx slice, part
  of one, or one of several slices that make up the gen rank's, at ctx local head
  ``h - s*H/N`` and gen local head ``h - r*H/c``.

Every (block, head) a gen rank needs comes from exactly one source. At ``N == 1`` the one source
is ctx rank 0 and the shard is the plain one (every block ``b % c == r``, heads ``r*H/c..``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check(name: str, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{name} rank {rank} of {size}: need 0 <= rank < size")


def first_common_block(ctx_rank: int, ctx_size: int, cp_rank: int, cp_size: int) -> int | None:
    """The smallest block ``b >= 0`` with ``b % cp_size == cp_rank`` and ``b % ctx_size == ctx_rank``
    (None when there is none: the two ranks differ modulo ``gcd(cp_size, ctx_size)``)."""
    _check("ctx", ctx_rank, ctx_size)
    _check("cp", cp_rank, cp_size)
    if (cp_rank - ctx_rank) % math.gcd(cp_size, ctx_size):
        return None
    return next(b for b in range(cp_rank, math.lcm(cp_size, ctx_size), cp_size) if b % ctx_size == ctx_rank)


def head_overlap(num_heads: int, ctx_rank: int, ctx_size: int, cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Global heads ``[lo, hi)`` that ctx rank ``ctx_rank`` holds and gen rank ``cp_rank`` needs
    (``(0, 0)`` when none). ValueError when `num_heads` does not split over either side."""
    _check("ctx", ctx_rank, ctx_size)
    _check("cp", cp_rank, cp_size)
    for name, size in (("ctx_tp_size", ctx_size), ("cp_size", cp_size)):
        if num_heads % size:
            raise ValueError(f"{num_heads} KDA heads cannot be split over {name}={size}")
    ctx_h, gen_h = num_heads // ctx_size, num_heads // cp_size
    lo = max(cp_rank * gen_h, ctx_rank * ctx_h)
    hi = min((cp_rank + 1) * gen_h, (ctx_rank + 1) * ctx_h)
    return (lo, hi) if lo < hi else (0, 0)


@dataclass(frozen=True, slots=True)
class Source:
    """What one ctx rank sends one gen rank of a `num_blocks_total`-block request."""

    ctx_rank: int
    ctx_size: int
    cp_rank: int
    cp_size: int
    blocks: tuple[int, ...]  # global logical block ids, ascending
    heads: tuple[int, int]  # global KDA heads [lo, hi); (0, 0) when none
    num_heads_total: int

    @property
    def ctx_blocks(self) -> list[int]:
        """Each block's index in the ctx rank's local block list."""
        return [b // self.ctx_size for b in self.blocks]

    @property
    def gen_blocks(self) -> list[int]:
        """Each block's index in the gen rank's local block list."""
        return [b // self.cp_size for b in self.blocks]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def ctx_head0(self) -> int:
        """The first head in the ctx rank's local head coordinates (0 when there is none)."""
        if not self.num_heads:
            return 0
        return self.heads[0] - self.ctx_rank * (self.num_heads_total // self.ctx_size)

    @property
    def gen_head0(self) -> int:
        """The first head in the gen rank's local head coordinates (0 when there is none)."""
        if not self.num_heads:
            return 0
        return self.heads[0] - self.cp_rank * (self.num_heads_total // self.cp_size)


def source_blocks(num_blocks_total: int, ctx_rank: int, ctx_size: int, cp_rank: int, cp_size: int) -> list[int]:
    """Global blocks ``< num_blocks_total`` that ctx rank `ctx_rank` holds and gen rank `cp_rank` needs."""
    if num_blocks_total < 0:
        raise ValueError(f"num_blocks_total must be >= 0, got {num_blocks_total}")
    first = first_common_block(ctx_rank, ctx_size, cp_rank, cp_size)
    if first is None:
        return []
    return list(range(first, num_blocks_total, math.lcm(cp_size, ctx_size)))


def source(num_blocks_total: int, num_heads: int, ctx_rank: int, ctx_size: int, cp_rank: int,
           cp_size: int) -> Source:
    """Ctx rank `ctx_rank`'s part of gen rank `cp_rank`'s shard (possibly empty)."""
    heads = head_overlap(num_heads, ctx_rank, ctx_size, cp_rank, cp_size)
    blocks = source_blocks(num_blocks_total, ctx_rank, ctx_size, cp_rank, cp_size)
    return Source(ctx_rank, ctx_size, cp_rank, cp_size, tuple(blocks), heads, num_heads)


def sources(num_blocks_total: int, num_heads: int, ctx_size: int, cp_rank: int, cp_size: int) -> list[Source]:
    """The ctx ranks a gen rank receives from, ascending: each one holding some of its heads or
    (for this request's `num_blocks_total` blocks) some of its blocks."""
    out = [source(num_blocks_total, num_heads, s, ctx_size, cp_rank, cp_size) for s in range(ctx_size)]
    return [src for src in out if src.blocks or src.num_heads]



def targets(num_blocks_total: int, num_heads: int, ctx_rank: int, ctx_size: int, cp_size: int) -> list[int]:
    """The gen ranks of a `cp_size` group that ctx rank `ctx_rank` sends part of their shard to
    (the acknowledgements its hold waits for), ascending: every rank at ``ctx_size`` 1."""
    out = [source(num_blocks_total, num_heads, ctx_rank, ctx_size, r, cp_size) for r in range(cp_size)]
    return [src.cp_rank for src in out if src.blocks or src.num_heads]
