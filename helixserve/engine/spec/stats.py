"""Speculative decoding counters of one engine (torch-free), as vLLM counts them: verify rows
(``num_drafts``: speculating sequences verified), draft tokens proposed, draft tokens accepted,
and accepted tokens per draft position (position ``j`` counts the runs that accepted at least
``j + 1`` drafts). Acceptance rate = accepted / drafted; per position = ``per_position[j] /
num_drafts``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, verified: Iterable[tuple[int, int]]) -> None:
        """Count one step's ``(drafts, accepted)`` per speculating sequence."""
        for drafted, accepted in verified:
            if not 0 <= accepted <= drafted:
                raise ValueError(f"accepted {accepted} of {drafted} drafts")
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_position) < drafted:
                self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_per_position(self) -> list[float]:
        """The share of verified runs that accepted draft ``j`` (and every one before it)."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    @classmethod
    def total(cls, parts: Iterable[SpecDecodeStats]) -> SpecDecodeStats:
        """The counts of several engines (a world's CP groups) summed."""
        parts = list(parts)
        return cls(sum(p.num_drafts for p in parts), sum(p.num_draft_tokens for p in parts),
                   sum(p.num_accepted_tokens for p in parts),
                   [sum(c) for c in zip_longest(*(p.accepted_per_position for p in parts), fillvalue=0)])
