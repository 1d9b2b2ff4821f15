"""Token slicing over a CP group: which of the T rows of a step each CP rank owns.

The T rows are padded with zeros to ``c * cp`` rows, ``c = ceil(T / cp)``; CP rank r owns the
padded rows ``[r * c, (r + 1) * c)``, of which ``num_valid`` are real (< T). When T < cp, or
T is not divisible by cp, trailing ranks own fewer (possibly 0) valid rows; T = 0 (an empty step)
gives c = 0 on every rank. Every rank still holds a ``[c, ...]`` tensor so collectives see equal
sizes.

Example, T = 5, cp = 4: c = 2, valid rows per rank [2, 2, 1, 0].
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowSlice(NamedTuple):
    """Rank r's padded row range ``[start, stop)`` (``stop - start == c``) and its valid count."""

    start: int
    stop: int
    num_valid: int


def _check(num_tokens: int, cp: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")


def row_chunk(num_tokens: int, cp: int) -> int:
    """Rows per CP rank after slicing: ``ceil(T / cp)`` (0 when T == 0)."""
    _check(num_tokens, cp)
    return -(-num_tokens // cp)


def rows_for_rank(num_tokens: int, cp: int, cp_rank: int) -> RowSlice:
    """The padded row range of ``cp_rank`` and how many of its rows are real."""
    _check(num_tokens, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp={cp})")
    chunk = row_chunk(num_tokens, cp)
    start, stop = cp_rank * chunk, (cp_rank + 1) * chunk
    return RowSlice(start, stop, max(0, min(stop, num_tokens) - start))


def per_rank_token_counts(num_tokens: int, cp: int) -> list[int]:
    """Valid rows of every CP rank, ``[num_valid(r) for r in range(cp)]``; sums to T."""
    return [rows_for_rank(num_tokens, cp, r).num_valid for r in range(cp)]


def pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``x [n, ...]`` to ``[num_rows, ...]`` (returns ``x`` if n == num_rows)."""
    if x.shape[0] > num_rows:
        raise ValueError(f"cannot pad {x.shape[0]} rows down to num_rows={num_rows}")
    if x.shape[0] == num_rows:
        return x
    out = x.new_zeros((num_rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def split_rows(x: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s padded slice of full rows, as a reduce-scatter would leave it.

    Args:
        x: ``[T, ...]`` full rows (replicated on every CP rank).
    Returns:
        ``[c, ...]``, ``c = ceil(T / cp)``: rows ``[r * c, r * c + num_valid)`` of ``x`` followed by
        ``c - num_valid`` zero rows.
    """
    start, stop, num_valid = rows_for_rank(x.shape[0], cp, cp_rank)
    return pad_rows(x[start : start + num_valid], stop - start)


def valid_rows(x_local: torch.Tensor, num_tokens: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The real rows of a padded local slice: ``x_local [c, ...] -> [num_valid, ...]`` (a view)."""
    start, stop, num_valid = rows_for_rank(num_tokens, cp, cp_rank)
    if x_local.shape[0] != stop - start:
        raise ValueError(
            f"local rows {x_local.shape[0]} != ceil(T={num_tokens} / cp={cp}) = {stop - start}"
        )
    return x_local[:num_valid]
