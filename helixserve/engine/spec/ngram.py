"""N-gram prompt lookup (torch-free): propose the tokens that followed the most recent earlier
occurrence of the sequence's suffix.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the pattern is the last ``n``
tokens; an occurrence is any earlier start ``i`` with ``tokens[i:i+n] == pattern`` and at least
one token after it (``i + n < len(tokens)``; occurrences may overlap the suffix). The longest ``n``
with an occurrence wins, then its most recent (largest ``i``) occurrence; the proposal is
``tokens[i+n : i+n+k]``, shorter when the sequence ends first. No occurrence: no proposal.
This is vLLM's ngram proposer's choice (longest match, latest occurrence).

Cost: one vectorized scan per ``n`` over candidates that match the pattern's first token, so a
32k-token sequence takes well under a millisecond per ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

TokenArray = npt.NDArray[np.int64]


def _check_window(prompt_lookup_min: int, prompt_lookup_max: int, num_draft_tokens: int) -> None:
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                         f"({prompt_lookup_max})")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")


def _latest_occurrence(tokens: TokenArray, n: int) -> int:
    """Largest ``i`` with ``tokens[i:i+n] == tokens[-n:]`` and ``i + n < len(tokens)``; -1 if none."""
    num_tokens = tokens.shape[0]
    pattern = tokens[num_tokens - n:]
    starts = np.flatnonzero(tokens[: num_tokens - n] == pattern[0])
    for offset in range(1, n):
        if starts.size == 0:
            break
        starts = starts[tokens[starts + offset] == pattern[offset]]
    return int(starts[-1]) if starts.size else -1


def propose_one(tokens: TokenArray | Sequence[int], num_draft_tokens: int,
                prompt_lookup_min: int, prompt_lookup_max: int) -> list[int]:
    """Up to ``num_draft_tokens`` draft tokens for one sequence (prompt + outputs), maybe none."""
    _check_window(prompt_lookup_min, prompt_lookup_max, num_draft_tokens)
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one sequence (1-D), got shape {arr.shape}")
    for n in range(min(prompt_lookup_max, arr.shape[0] - 1), prompt_lookup_min - 1, -1):
        start = _latest_occurrence(arr, n)
        if start >= 0:
            return arr[start + n: start + n + num_draft_tokens].tolist()
    return []


class NgramProposer:
    """Prompt-lookup proposals for a batch of sequences (see the module docstring)."""

    def __init__(self, num_draft_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        _check_window(prompt_lookup_min, prompt_lookup_max, num_draft_tokens)
        self.num_draft_tokens = num_draft_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, sequences: Sequence[TokenArray | Sequence[int]],
                num_draft_tokens: Sequence[int] | None = None) -> list[list[int]]:
        """One proposal per sequence (``[]`` where nothing matched); ``num_draft_tokens`` caps each
        sequence's proposal (e.g. to its remaining ``max_tokens``), default the configured k."""
        if num_draft_tokens is not None and len(num_draft_tokens) != len(sequences):
            raise ValueError(f"num_draft_tokens has {len(num_draft_tokens)} entries for "
                             f"{len(sequences)} sequences")
        caps = num_draft_tokens if num_draft_tokens is not None else [self.num_draft_tokens] * len(sequences)
        if any(cap < 0 for cap in caps):
            raise ValueError(f"num_draft_tokens must be >= 0 per sequence, got {list(caps)}")
        out: list[list[int]] = []
        for tokens, cap in zip(sequences, caps, strict=True):
            k = min(cap, self.num_draft_tokens)
            out.append(propose_one(tokens, k, self.prompt_lookup_min, self.prompt_lookup_max) if k > 0 else [])
        return out
