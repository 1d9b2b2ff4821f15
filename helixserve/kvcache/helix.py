"""Helix context-parallel ownership of MLA cache blocks (torch-free).

A request's KV is cut into global logical blocks of ``tokens_per_block`` tokens; block ``b``
lives on CP rank ``b % cp_size``, for prompt and decoded tokens alike. Rank ``r`` therefore holds
logical blocks ``r, r + cp, r + 2 cp, ...``; its k-th local block is logical block ``r + k * cp``.
"""

from __future__ import annotations


def _check(tokens_per_block: int, cp_rank: int, cp_size: int) -> None:
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")


def num_logical_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """Global logical blocks needed for ``num_tokens`` tokens (all ranks together)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // tokens_per_block)


def block_owner(block: int, cp_size: int) -> int:
    """CP rank that holds global logical block ``block``."""
    if block < 0 or cp_size < 1:
        raise ValueError(f"need block >= 0 and cp_size >= 1, got block={block} cp_size={cp_size}")
    return block % cp_size


def token_owner(position: int, tokens_per_block: int, cp_size: int) -> int:
    """CP rank that stores the KV of the token at absolute ``position``."""
    return block_owner(position // tokens_per_block, cp_size)


def num_local_blocks(num_tokens: int, tokens_per_block: int, cp_rank: int, cp_size: int) -> int:
    """Logical blocks of a ``num_tokens``-token sequence that ``cp_rank`` holds."""
    _check(tokens_per_block, cp_rank, cp_size)
    total = num_logical_blocks(num_tokens, tokens_per_block)
    return max(0, -(-(total - cp_rank) // cp_size))


def local_logical_blocks(
    num_tokens: int, tokens_per_block: int, cp_rank: int, cp_size: int
) -> list[int]:
    """Global logical block ids held by ``cp_rank``, ascending (local order)."""
    _check(tokens_per_block, cp_rank, cp_size)
    return list(range(cp_rank, num_logical_blocks(num_tokens, tokens_per_block), cp_size))


def arrange_by_source(block_ids: list[int], cp_rank: int, cp_size: int, num_sources: int) -> list[int]:
    """The same physical blocks, reassigned (local order kept) so that the local blocks of each of
    ``num_sources`` ctx ranks (global block ``b`` on ctx rank ``b % num_sources``) take ascending,
    consecutive ids of the sorted set: where ``block_ids`` is one run, each ctx rank's part of this
    rank's blocks is one run too, which a transfer receives in place instead of scattering it.
    Unchanged where one ctx rank holds them all (``num_sources`` divides ``cp_size``)."""
    _check(1, cp_rank, cp_size)
    if num_sources < 1:
        raise ValueError(f"num_sources must be >= 1, got {num_sources}")
    if cp_size % num_sources == 0:
        return list(block_ids)
    ids = sorted(block_ids)
    order = sorted(range(len(block_ids)), key=lambda k: ((cp_rank + k * cp_size) % num_sources, k))
    arranged = [0] * len(block_ids)
    for position, k in enumerate(order):
        arranged[k] = ids[position]
    return arranged


def full_row_table(rank_tables: list[list[int]], num_blocks: int) -> list[int]:
    """One request's blocks over its whole CP group, named in a pool of ``cp * num_blocks`` pages
    (a draft model's full-row cache on the group's leader): global block ``b``, at physical block
    ``p`` of CP rank ``b % cp``, is page ``(b % cp) * num_blocks + p``. ``rank_tables[r]`` is rank
    ``r``'s block table (``-1`` where not held there). Distinct (rank, block) pairs get distinct
    pages, so the pages of live requests never collide and are free when the ranks' blocks are."""
    cp = len(rank_tables)
    length = max((len(t) for t in rank_tables), default=0)
    table = [-1] * length
    for b in range(length):
        rank_table = rank_tables[b % cp]
        if b < len(rank_table) and rank_table[b] >= 0:
            table[b] = (b % cp) * num_blocks + rank_table[b]
    return table
